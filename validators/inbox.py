"""A validator's inbox: the reveal receipts workers hand it past the ledger (issue #28).

A worker whose reveal the ledger receipted hands the signed envelope and the receipt to
every validator that names an inbox in the run spec (workers/disputes.py). A validator
holding such a receipt for a challenged worker never judges that worker's reveal missing:
when the ledger's board does not serve the receipted file, it certifies nothing for the
round (``withheld_reveal``, validators/node.py ``gather_reveals``). A ledger that censors
a receipted reveal then gets no certificate (the round is voided after
``certify_seconds``), never an honest worker banned.

The reveal set validators judge stays the board's, one set for all: a held receipt only
decides whether this validator signs at all. A worker that hands its receipt to some
validators only cannot split them, since an honest ledger lists every reveal it receipted.

The inbox holds one claim per (round, worker), the first that checks out
(``open_reveal_claim``: the worker's signature, the ledger's receipt for that envelope,
received by its deadline), keeps the newest ``KEEP_ROUNDS`` rounds, and appends each new
claim to a JSON-lines file when given one, so a restart does not forget a receipt.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from veritrain.ledger.ratelimit import TokenBuckets
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import MAX_WORKERS_PER_ROUND
from veritrain.protocol.receipts import CLAIM_REFUSALS, RevealClaim, open_reveal_claim

log = logging.getLogger("veritrain.validator.inbox")

#: Rounds of claims kept (older ones are forgotten once the node moves past them).
KEEP_ROUNDS = 4
#: A claim is two signed messages: a few hundred bytes each.
MAX_CLAIM_BYTES = 16 << 10
#: HTTP status of each refusal reason the inbox gives.
STATUS_OF = CLAIM_REFUSALS
#: Claims one client address may post per second, and in a burst: a worker posts one per
#: round; the limit keeps a flood from holding up the validator's own round work (the
#: checks run on its event loop).
PER_IP_RATE, PER_IP_BURST = 20.0, 200.0


class ReceiptInbox:
    """The reveal claims this validator holds for one run, by round and worker."""

    def __init__(self, run_id: str, ledger_key: str, path: Path | None = None, *,
                 max_per_round: int = MAX_WORKERS_PER_ROUND) -> None:
        self.run_id, self.ledger_key, self.path = run_id, ledger_key, path
        self.max_per_round = max_per_round
        self.claims: dict[int, dict[str, RevealClaim]] = {}
        self.oldest = 0  # claims for earlier rounds are refused (``stale``)
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        """Read back the claims kept before a restart; each is checked again (a line that
        does not check out, or a file of another ledger's receipts, is skipped)."""
        for line in path.read_text().splitlines():
            try:
                self._hold(open_reveal_claim(json.loads(line), self.run_id, self.ledger_key))
            except (ValueError, RejectedInput) as exc:
                log.warning("inbox file %s: a kept claim does not check out: %s", path, exc)

    def _hold(self, claim: RevealClaim) -> bool:
        r = claim.envelope.message.round
        held = self.claims.setdefault(r, {})
        if claim.worker in held:
            return False  # the first claim that checked out stays
        if len(held) >= self.max_per_round:
            raise RejectedInput(f"round {r} already holds {len(held)} claims", "full")
        held[claim.worker] = claim
        return True

    def offer(self, wire: Any) -> bool:
        """Hold a worker's claim if it checks out; True when it is new, False when this
        worker's claim for the round is already held. Raises ``RejectedInput`` with why."""
        claim = open_reveal_claim(wire, self.run_id, self.ledger_key)
        if claim.envelope.message.round < self.oldest:
            raise RejectedInput(f"round {claim.envelope.message.round} is behind this "
                                f"validator (it keeps rounds from {self.oldest})", "stale")
        new = self._hold(claim)
        if new and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(claim.to_wire(), sort_keys=True) + "\n")
        return new

    def held(self, r: int) -> dict[str, RevealClaim]:
        """The claims held for round ``r``, by worker."""
        return dict(self.claims.get(r, {}))

    def moved_to(self, r: int) -> None:
        """The node now works on round ``r``: forget claims older than ``KEEP_ROUNDS``
        rounds before it (and rewrite the file to what is kept)."""
        oldest = max(0, r - KEEP_ROUNDS + 1)
        if oldest <= self.oldest:
            return
        self.oldest = oldest
        kept = {k: v for k, v in self.claims.items() if k >= oldest}
        dropped = len(kept) < len(self.claims)
        self.claims = kept
        if dropped and self.path is not None:
            lines = [json.dumps(c.to_wire(), sort_keys=True) + "\n"
                     for held in self.claims.values() for c in held.values()]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(lines))
            tmp.replace(self.path)


def inbox_app(inbox: ReceiptInbox) -> web.Application:
    """``POST /v1/runs/{run_id}/reveal-receipts`` takes a claim (201 new, 200 already
    held); ``GET /v1/runs/{run_id}/reveal-receipts/{round}`` lists the workers whose claims
    are held for a round (what an operator or a worker can check)."""
    app = web.Application(client_max_size=MAX_CLAIM_BYTES)
    buckets = TokenBuckets(PER_IP_RATE, PER_IP_BURST, max_keys=10_000)

    def refuse(reason: str, detail: str) -> web.Response:
        return web.json_response({"error": reason, "detail": detail[:300]},
                                 status=STATUS_OF.get(reason, 400))

    async def post_claim(request: web.Request) -> web.Response:
        if buckets.take(request.remote or "?") > 0:
            return refuse("rate_limited", "too many claims from this address")
        if request.match_info["run_id"] != inbox.run_id:
            return refuse("not_found", f"this inbox takes run {inbox.run_id!r} only")
        try:
            wire = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return refuse("oversized", f"a claim is at most {MAX_CLAIM_BYTES} bytes")
        except (ValueError, RecursionError):
            return refuse("malformed", "the body is not JSON a claim can be")
        try:
            new = inbox.offer(wire)
        except RejectedInput as exc:
            return refuse(exc.reason, str(exc))
        except RecursionError:
            return refuse("malformed", "the claim is nested too deeply")
        return web.json_response({"held": True}, status=201 if new else 200)

    async def list_claims(request: web.Request) -> web.Response:
        if request.match_info["run_id"] != inbox.run_id:
            return refuse("not_found", f"this inbox takes run {inbox.run_id!r} only")
        try:
            r = int(request.match_info["round"])
        except ValueError:
            return refuse("malformed", "the round is not a number")
        return web.json_response({"run_id": inbox.run_id, "round": r,
                                  "workers": sorted(inbox.held(r))})

    app.router.add_post("/v1/runs/{run_id}/reveal-receipts", post_claim)
    app.router.add_get("/v1/runs/{run_id}/reveal-receipts/{round}", list_claims)
    return app


def listen_address(url: str, override: str | None = None) -> tuple[str, int]:
    """Where the inbox listens: ``override`` ("HOST:PORT", e.g. behind a proxy), else
    every interface on the port of its URL in the run spec (the URL's host is how workers
    reach it, which behind NAT is no local address)."""
    if override:
        host, _, port = override.rpartition(":")
        return host or "0.0.0.0", int(port)
    parts = urlsplit(url)
    return "0.0.0.0", parts.port or (443 if parts.scheme == "https" else 80)


async def start_inbox(inbox: ReceiptInbox, host: str, port: int) -> web.AppRunner:
    """Serve ``inbox`` on ``host:port``; the caller cleans the runner up (an address that
    cannot be bound raises ``OSError`` with nothing left running)."""
    runner = web.AppRunner(inbox_app(inbox), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("reveal-receipt inbox for run %s on %s:%d", inbox.run_id, host, port)
    return runner


__all__ = ["KEEP_ROUNDS", "ReceiptInbox", "inbox_app", "listen_address", "start_inbox"]
