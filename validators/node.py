"""The validator node: follows a run over HTTP and processes each closed round.

For round r it: verifies the base model against the previous certificate,
posts its beacon share and waits for the round's fixed beacon, fetches the
sealed submissions and their payloads, runs the round's filters, aggregates
(alone, or in a sharded run with the other validators: validators/sharded.py),
takes the outer step (validators/round.py), and posts
its signed result with a BLS attestation and the new model and momentum. It
keeps no state of its own: after a restart it reads where the run stands
from the ledger and carries on.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web
from veritrain.ledger.client import (
    LedgerClient,
    LedgerRefused,
    LedgerUnavailable,
    fetch_base_files,
    fetch_run,
)
from veritrain.protocol import dkg
from veritrain.protocol.beacon import (
    beacon_root,
    participant_exclusions,
    participants_digest,
    sealed_list_digest_of,
    verify_fixed_beacon,
)
from veritrain.protocol.board import BoardFault, SignedOnce
from veritrain.protocol.certificates import CERTIFIED_MARK_FILE, CertifiedMark, base_round
from veritrain.protocol.challenges import (
    ChallengePolicy,
    compute_challenges,
    max_reveal_file_bytes,
)
from veritrain.protocol.errors import NonFiniteError, PayloadError, RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.memory import release_free_memory
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    OpeningsShare,
    RoundResult,
    RunSpec,
    Submission,
    digest_of,
    open_signed,
    sign,
)
from veritrain.protocol.openings import (
    inputs_digest,
    openings_root,
    survivor_buckets,
    verified_inputs,
    verify_openings,
)
from veritrain.protocol.outer import OuterState
from veritrain.protocol.receipts import RevealClaim, open_reveal_claim
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.secagg import PHASES, check_dealt, words_file_bytes
from veritrain.protocol.tensors import ParamShapes, _header, all_finite, sha256_hex, split_flat

from .checks import Candidate
from .dkg import (
    DkgNode,
    ShareFileError,
    dkg_secrets_path,
    load_share,
    save_share,
    share_path,
)
from .inbox import ReceiptInbox, listen_address, start_inbox
from .masked import filter_masked_round, words_of
from .membership import check_close, fetch_participant_view
from .round import (
    BlobFiles,
    FilteredRound,
    OuterStepped,
    RoundOutcome,
    aggregate_locally,
    conclude_round,
    filter_round,
    round_challenges,
    step_round,
)
from .sharded import ShardedRound

log = logging.getLogger("veritrain.validator")

#: Faults on one round after which a validator stops trying to certify it.
MAX_ROUND_FAULTS = 5
#: Seconds after the reveal deadline before the last read of a round's reveals.
REVEAL_SETTLE_SECONDS = 1.0


@dataclass
class ValidatorConfig:
    ledger_url: str
    run_id: str | None = None
    device: str = "cpu"
    poll_seconds: float = 0.5
    retry_for: float = 300.0
    #: How far this node's clock may be from the ledger's: a round the node saw closed
    #: more than this before the close time the ledger states was sealed early, and gets
    #: no beacon share (protocol/schedule.py ``close_problem``).
    clock_slack_seconds: float = 30.0
    #: Sharded runs: seconds to wait for the other validators' shard results
    #: before signing off the list without them (they are then recomputed).
    shard_wait: float = 120.0
    #: Evaluation only: ``shard_shift`` publishes this validator's shard scaled by
    #: 1 + 1e-3, the tiny corruption the other validators' checks must catch.
    attack: str | None = None
    #: Where to write what the node sent and received and how long its rounds took (JSON,
    #: rewritten after every round), or None.
    stats_path: Path | None = None
    #: Where each round's scratch directory goes (payloads, reveals and decoded updates,
    #: removed when the round is done); None: the system's temporary directory.
    scratch_dir: Path | None = None
    #: The JSON file where the node keeps the lists it signed, one per kind and round
    #: (protocol/board.py ``SignedOnce``); None: ``state_dir``'s, or in memory only.
    signed_path: Path | None = None
    #: What a validator keeps across restarts (mode 0700): the lists it signed, its
    #: secret share of each threshold-beacon run's group key and the reveal receipts
    #: workers handed its inbox; None: nothing (tests).
    state_dir: Path | None = None
    #: Where the reveal-receipt inbox listens ("HOST:PORT"), when not at the host and port
    #: of this validator's ``inbox`` URL in the run spec (e.g. behind a proxy).
    inbox_listen: str | None = None


def dkg_board_summary(view: dict[str, Any]) -> str:
    """What the DKG board showed, for the log of a failed DKG: each phase's posts and
    whether it closed, and how many different results were posted."""
    posts = view.get("posts") or {}
    phases = ", ".join(
        f"{p['kind'].removeprefix('dkg_')} {len(posts.get(p['kind'], []))} posts"
        f"{' (closed short of a quorum)' if p.get('short') else ''}"
        f"{' (not opened)' if p.get('opened_at') is None else ''}"
        f"{' (open)' if p.get('opened_at') is not None and p.get('closed_at') is None else ''}"
        for p in view.get("phases", []))
    results = {json.dumps({k: v for k, v in (w.get("body") or {}).items()
                           if k not in ("validator", "created_at")}, sort_keys=True)
               for w in posts.get("dkg_result", []) if isinstance(w, dict)}
    return f"{phases}; {len(results)} different results"


class ValidatorNode:
    def __init__(self, config: ValidatorConfig, identity: Identity) -> None:
        if identity.role != "validator":
            raise ValueError("a validator needs a validator key (veritrain keygen --role validator)")
        self.config = config
        self.identity = identity
        self.me = identity.public_key.hex()
        self.stats: list[dict[str, Any]] = []  # one entry per certified round
        self.faults: list[dict[str, Any]] = []  # what went wrong, by round (never fatal)
        signed_path = config.signed_path or (
            config.state_dir / "signed-once.json" if config.state_dir is not None else None)
        if signed_path is not None:
            signed_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.signed_once = SignedOnce.in_file(signed_path)
        self.skipped_posts: list[dict[str, Any]] = []  # board posts that did not check out
        #: Threshold-beacon runs (specs/protocol.md 5.4a): this node's side of the run's DKG
        #: (its secret share, kept in ``state_dir``; without it, after a restart, the node
        #: verifies beacons and never signs them) and the group result a quorum signed.
        self.dkg_node: DkgNode | None = None
        self.dkg_result: dkg.DkgResult | None = None
        #: The newest certified round this node took a base from, per run, kept in
        #: ``state_dir``: the ledger cannot roll it back to an older one, even across a
        #: restart (``certified_base``).
        self.certified_mark = CertifiedMark.in_file(
            config.state_dir / CERTIFIED_MARK_FILE if config.state_dir is not None else None)
        #: The reveal receipts workers handed this validator (validators/inbox.py); None
        #: until the run is known, and for a validator the spec names no inbox for.
        self.inbox: ReceiptInbox | None = None
        #: The last moment (this node's clock) it asked for each round's beacon and was
        #: told it was not fixed yet: the reveal deadline the ledger states cannot be
        #: earlier than that plus ``reveal_seconds`` (less the clock slack).
        self.beacon_seen: dict[int, float] = {}
        #: Likewise for a masked round's openings seed (``openings_seed``).
        self.openings_unfixed: dict[int, float] = {}

    async def run(self, *, max_rounds: int | None = None) -> None:
        async with LedgerClient(self.config.ledger_url, retry_for=self.config.retry_for) as client:
            self.client = client
            spec = await fetch_run(client, self.config.run_id)
            if spec.validator_index(self.me) is None:
                raise SystemExit("this key is not a validator of the run")
            runner = await self.open_inbox(client, spec)
            try:
                await self._follow(client, spec, max_rounds)
            finally:
                if runner is not None:
                    await runner.cleanup()

    async def open_inbox(self, client: LedgerClient, spec: RunSpec) -> web.AppRunner | None:
        """Start taking workers' reveal receipts, when the run spec names an inbox for this
        validator (validators/inbox.py); the runner to clean up, or None."""
        url = spec.validator_inboxes().get(self.me)
        if url is None:
            return None
        ledger_key = (await client.get_json("/v1/ledger"))["ledger_key"]
        path = (self.config.state_dir / f"reveal-receipts-{spec.run_id}.jsonl"
                if self.config.state_dir is not None else None)
        inbox = ReceiptInbox(spec.run_id, ledger_key, path)
        try:
            runner = await start_inbox(inbox, *listen_address(url, self.config.inbox_listen))
        except OSError as exc:  # validating goes on; workers' claims do not reach this node
            log.error("the reveal-receipt inbox cannot listen for %s: %s", url, exc)
            self.faults.append({"round": None, "kind": "inbox", "detail": str(exc)[:300]})
            return None
        self.inbox = inbox
        return runner

    async def _follow(self, client: LedgerClient, spec: RunSpec,
                      max_rounds: int | None) -> None:
        """Validate each closed round of ``spec``'s run in order until it ends (or
        ``max_rounds`` were certified here)."""
        # bytes: a task's load_dataset takes the blob as bytes (tasks.md)
        dataset = bytes(await client.get_blob(spec.dataset_hash,
                                              max_bytes=spec.dataset_bytes, kind="dataset"))
        run = await asyncio.to_thread(RunContext.build, spec, dataset)
        log.info("validating run %s (%d parameters)", spec.run_id, run.numel)
        if spec.threshold_beacon:
            try:
                await self.run_dkg(client, spec)
            except RejectedInput as exc:
                if exc.reason != "dkg_failed":
                    raise
                # The ledger ends such a run (specs/protocol.md 6): nothing to validate.
                log.error("%s; run %s cannot go on", exc, spec.run_id)
                self.faults.append({"round": None, "kind": "dkg_failed", "detail": str(exc)})
                return
        r = 0
        done = 0
        refused: set[int] = set()  # rounds whose board this validator will not certify
        while max_rounds is None or done < max_rounds:
            try:
                info = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}")
            except LedgerRefused as exc:
                if exc.reason != "not_found":
                    raise
                overview = await client.get_json(f"/v1/runs/{spec.run_id}")
                if overview["status"] != "active":
                    log.info("run %s is %s", spec.run_id, overview["status"])
                    return
                await asyncio.sleep(self.config.poll_seconds)
                continue
            if info["status"] in ("finalized", "voided"):
                r += 1
                if self.inbox is not None:
                    self.inbox.moved_to(r)
                continue
            if info["status"] == "open":
                await asyncio.sleep(min(self.config.poll_seconds,
                                        max(0.05, info["deadline"] - info["now"])))
                continue
            results = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/results")
            if any(x["body"]["validator"] == self.me for x in results["results"]):
                await asyncio.sleep(self.config.poll_seconds)
                continue
            if r in refused:
                await asyncio.sleep(self.config.poll_seconds)
                continue
            try:
                await self.validate_round(client, run, info)
            except LedgerRefused as exc:
                if exc.reason == "round_finalized":
                    log.info("round %d was finalized without this validator: %s", r,
                             exc.detail)
                    continue
                self.fault(r, exc.reason, exc.detail, refused)
                await asyncio.sleep(self.config.poll_seconds)
                continue
            except RejectedInput as exc:
                # Bad input from the ledger or a peer: recorded, never a reason to stop.
                self.fault(r, exc.reason, str(exc), refused, final=exc.reason in (
                    "invalid_board", "invalid_beacon", "board_fault", "early_deadline"))
                await asyncio.sleep(self.config.poll_seconds)
                continue
            except LedgerUnavailable as exc:
                log.warning("round %d: %s; trying again", r, exc)
                await asyncio.sleep(self.config.poll_seconds)
                continue
            done += 1

    def fault(self, r: int, reason: str, detail: str, refused: set[int], *,
              final: bool = False) -> None:
        """Record why round ``r`` could not be processed; after ``MAX_ROUND_FAULTS`` (or a
        final fault: a board or beacon that does not check out) the node stops trying to
        certify it, and keeps following the run."""
        self.faults.append({"round": r, "reason": reason, "detail": detail[:300]})
        attempts = sum(1 for f in self.faults if f["round"] == r)
        if final or attempts >= MAX_ROUND_FAULTS:
            log.error("round %d: not certifying it (%s): %s", r, reason, detail)
            refused.add(r)
        else:
            log.warning("round %d: %s (%s); trying again", r, reason, detail)
        self.write_stats()

    def write_stats(self) -> None:
        """Rewrite the stats file (traffic by kind, each round's timings, faults), if one is
        set."""
        if self.config.stats_path is None:
            return
        self.config.stats_path.write_text(json.dumps({
            "role": "validator", "traffic": self.client.traffic.to_json(), "rounds": self.stats,
            "faults": self.faults}))

    async def beacon_seed(self, client: LedgerClient, spec: RunSpec, r: int,
                          sealed: list[Any] | None = None,
                          participants: str | None = None) -> bytes:
        """Post this validator's share for the sealed list ``sealed`` judged against the
        participant view digest ``participants`` (both read from the ledger now when not
        given), wait for the fixed beacon and check it against the run's validator keys
        (the spec this node started with, not one the ledger serves now);
        ``invalid_beacon`` when it does not verify."""
        run_id = spec.run_id
        base = f"/v1/runs/{run_id}/rounds/{r}"
        if sealed is None:
            sealed = (await client.get_json(f"{base}/submissions"))["submissions"]
        if participants is None:
            view = await fetch_participant_view(client, spec, r)
            participants = participants_digest(participant_exclusions(
                [open_signed(w, Submission).message.worker for w in sealed],
                view.registered, view.banned))
        digest = sealed_list_digest_of(sealed)
        if spec.threshold_beacon:
            return await self.threshold_beacon_seed(client, spec, r, digest, participants)
        # The BLS share signs (run, round) only, so one share would serve any list: this
        # node names one (list, view) per round, remembered across restarts (board.py rule
        # 3), and a ledger that refused it cannot have it name another for the same seed.
        self.signed_once.claim("beacon_share", run_id, r,
                               digest_of({"sealed": digest, "participants": participants}))
        signed_root = await asyncio.to_thread(self.identity.sign_bls, beacon_root(run_id, r))
        share = BeaconShare(run_id=run_id, round=r, validator=self.me, share=signed_root.hex(),
                            sealed=digest, participants=participants)
        reply = await self._until_fixed(
            r, lambda: client.post_message(f"{base}/beacon", sign(self.identity, share).to_wire()),
            lambda: client.get_json(f"{base}/beacon"))
        # The seed picks the spot checks and the masked buckets: checked, not taken on trust.
        try:
            return await asyncio.to_thread(
                functools.partial(verify_fixed_beacon, spec.validators, spec.quorum, run_id, r,
                                  reply["beacon"], sealed=digest, participants=participants,
                                  envelopes=reply.get("envelopes")))
        except RejectedInput as exc:
            raise RejectedInput(f"the ledger's beacon does not verify: {exc}",
                                "invalid_beacon") from exc

    async def _until_fixed(self, r: int, first: Callable[[], Awaitable[dict[str, Any]]],
                           again: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``first()``, then ``again()`` every poll until the reply's beacon is fixed. The
        moment (this node's clock) the last request answered "not fixed" was sent is kept
        in ``beacon_seen``: the beacon was fixed after it, however slow the answers were
        (``gather_reveals``' ``not_before``)."""
        asked = time.time()
        reply = await first()
        while reply["beacon"] is None:
            self.beacon_seen[r] = max(self.beacon_seen.get(r, asked), asked)
            await asyncio.sleep(self.config.poll_seconds)
            asked = time.time()
            reply = await again()
        return reply

    async def run_dkg(self, client: LedgerClient, spec: RunSpec) -> dkg.DkgResult:
        """Take part in the run's DKG over the ledger's board (validators/dkg.py): each
        phase's post once the ledger opens that phase, from the posts it served for the
        one before (each opened and checked again here); then the result a quorum signed.
        A node that finds the group fixed already (a restart) takes its share back from
        ``state_dir`` if it kept one there that matches its public share in the agreed
        result; otherwise it verifies beacons and never signs them. ``dkg_failed`` when
        fewer than a quorum qualified."""
        path = f"/v1/runs/{spec.run_id}/dkg"
        view = await client.get_json(path)
        if view["group"] is None and not view["failed"]:
            node = self.dkg_node = self._dkg_node(spec)
            order = [p["kind"] for p in view["phases"]]
            steps = {
                "dkg_keys": lambda posts: node.keys_post(),
                "dkg_deal": lambda posts: node.deal_post(posts["dkg_keys"]),
                "dkg_complaint": lambda posts: node.complaint_post(posts["dkg_deal"]),
                "dkg_justification": lambda posts: node.justification_post(
                    posts["dkg_complaint"]),
                "dkg_result": lambda posts: node.result_post(posts["dkg_justification"]),
            }
            for kind in order:
                view = await self._dkg_board(client, path, lambda v, kind=kind: (
                    v["failed"] or v["phase"] is None
                    or order.index(v["phase"]) >= order.index(kind)))
                if view["failed"]:
                    break
                try:  # deals and their checks are seconds of py-ecc: off the event loop
                    wire = await asyncio.to_thread(steps[kind], view["posts"])
                except dkg.DkgFault as exc:
                    raise RejectedInput(f"the run's DKG failed: {exc}", "dkg_failed") from exc
                except BoardFault as exc:  # restarted mid-DKG: its first deal stays its only
                    log.warning("not taking part in the rest of the DKG: %s", exc)
                    self.faults.append({"round": None, "kind": "dkg", "detail": str(exc)})
                    break
                if wire is not None and view["phase"] == kind:
                    try:
                        await client.post_message(path, wire)
                    except LedgerRefused as exc:  # too late for this phase: go on without it
                        log.warning("DKG %s not taken: %s", kind, exc.detail)
            view = await self._dkg_board(
                client, path, lambda v: v["group"] is not None or v["failed"])
            self.skipped_posts.extend({"kind": "dkg", "fault": f} for f in node.faults)
        if view["failed"]:
            raise RejectedInput(f"the run's DKG failed: {view.get('failure')} "
                                f"({dkg_board_summary(view)})", "dkg_failed")
        try:
            if self.dkg_node is not None:
                self.dkg_result = await asyncio.to_thread(self.dkg_node.adopt,
                                                          view["posts"]["dkg_result"])
            else:
                self.dkg_result = await asyncio.to_thread(
                    dkg.group_result_of, spec.validators, spec.quorum, spec.run_id,
                    view["posts"]["dkg_result"])
        except dkg.DkgFault as exc:
            raise RejectedInput(f"the run's DKG failed: {exc} ({dkg_board_summary(view)})",
                                "dkg_failed") from exc
        if self.config.state_dir is not None:
            self._keep_or_restore_share(spec, self.dkg_result)
        if self.dkg_node is not None:
            self.dkg_node.forget_secrets()  # the DKG is over; the share file is what stays
        return self.dkg_result

    async def _dkg_board(self, client: LedgerClient, path: str,
                         until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The DKG board once ``until(view)`` holds: polled without its posts (``?posts=
        none``: a poll costs a few hundred bytes, not the whole board, 1.9 MB of deals at
        n = 64), then read whole once."""
        light = path + "?posts=none"
        view = await client.get_json(light)
        while not until(view):
            await asyncio.sleep(self.config.poll_seconds)
            view = await client.get_json(light)
        return await client.get_json(path)

    def _dkg_node(self, spec: RunSpec) -> DkgNode:
        """This node's side of the DKG, resumed from the secrets kept in ``state_dir`` after
        a restart mid-DKG; a secrets file that does not check out is reported and left
        alone (the node then cannot deal again and sits the DKG out)."""
        if self.config.state_dir is None:
            return DkgNode(self.identity, spec, signed_once=self.signed_once)
        path = dkg_secrets_path(self.config.state_dir, spec.run_id)
        try:
            return DkgNode(self.identity, spec, signed_once=self.signed_once, secrets_path=path)
        except ShareFileError as exc:
            log.warning("%s", exc)
            self.faults.append({"round": None, "kind": "dkg_secrets", "detail": str(exc)})
            return DkgNode(self.identity, spec, signed_once=self.signed_once)

    def _keep_or_restore_share(self, spec: RunSpec, result: dkg.DkgResult) -> None:
        """Write a fresh share to ``state_dir``; after a restart, read it back (a share
        file that does not match is reported and left alone: this node then only verifies)."""
        assert self.config.state_dir is not None
        path = share_path(self.config.state_dir, spec.run_id)
        index = spec.validator_index(self.me)
        assert index is not None
        if self.dkg_node is not None and self.dkg_node.share is not None:
            save_share(path, spec, index, self.dkg_node.share)
            return
        if self.dkg_node is not None:
            return  # this node took part and holds no share: nothing to keep or restore
        try:
            share = load_share(path, spec, result, index)
        except ShareFileError as exc:
            log.warning("%s", exc)
            self.faults.append({"round": None, "kind": "dkg_share", "detail": str(exc)})
            return
        if share is not None:
            self.dkg_node = DkgNode.restored(self.identity, spec, result, share,
                                             signed_once=self.signed_once)

    async def threshold_beacon_seed(self, client: LedgerClient, spec: RunSpec, r: int,
                                    sealed: str, participants: str) -> bytes:
        """Post this validator's partial (if it holds a share), wait for the fixed beacon
        and check it against the group key a quorum of validators signed, for the sealed
        list this node was served and the participant view it holds (5.4a);
        ``invalid_beacon`` when it does not verify."""
        base = f"/v1/runs/{spec.run_id}/rounds/{r}"
        if self.dkg_result is None:
            await self.run_dkg(client, spec)
        assert self.dkg_result is not None
        wire = (await asyncio.to_thread(self.dkg_node.partial_post, r, sealed, participants)
                if self.dkg_node is not None else None)
        def poll() -> Awaitable[dict[str, Any]]:
            return client.get_json(f"{base}/partials")

        reply = await self._until_fixed(
            r, poll if wire is None else lambda: client.post_message(f"{base}/partials", wire),
            poll)
        try:
            return await asyncio.to_thread(
                functools.partial(dkg.verify_threshold_beacon, self.dkg_result.group_key,
                                  spec.run_id, r, reply["beacon"], sealed=sealed,
                                  participants=participants))
        except RejectedInput as exc:
            raise RejectedInput(f"the ledger's beacon does not verify: {exc}",
                                "invalid_beacon") from exc

    async def gather_reveals(self, client: LedgerClient, run: RunContext, r: int,
                             submitted: dict[str, str], store: BlobFiles | None = None, *,
                             due: Mapping[str, list[int]], not_before: float | None = None
                             ) -> Mapping[str, bytes]:
        """Wait until every due reveal arrived or the reveal deadline passed; fetch the files.

        ``due``: the workers this node's own draw checks, with their segments (the
        ledger's challenge list is read for its files only). A reveal counts only in its
        worker's signed envelope, for this run and round, naming that worker's sealed
        submission (``submitted``: worker -> its digest), with the ledger's receipt of it
        by the deadline (``open_reveal_claim``); what is missing is simply absent, and the
        checks that need it fail. But a due worker whose reveal the ledger receipted in
        time, on its board or in a claim the worker handed this node's inbox, and whose
        file the ledger does not serve, is no missing reveal: the ledger withholds it, and
        this node certifies nothing for the round (``withheld_reveal``) rather than judge
        it. With ``store`` each file goes to disk as it arrives and the mapping returned
        reads it back when asked for: one reveal in memory at a time.

        The deadline is the ledger's, but the wait ends only once this node's clock has
        passed it too, and ``not_before`` (the last moment the ledger told this node the
        beacon was not fixed, plus ``reveal_seconds``, less the clock slack) bounds it:
        an earlier one is the ledger cutting workers short, ``early_deadline``.
        """
        spec = run.spec
        path = f"/v1/runs/{spec.run_id}/rounds/{r}/challenges"
        expected = set(due) & set(submitted)

        checked: dict[str, bool] = {}  # a listed reveal -> whether it counts

        def counts(c: Any) -> bool:
            if not isinstance(c, dict) or c.get("worker") not in expected:
                return False
            key = json.dumps(c.get("reveal"), sort_keys=True)
            if key not in checked:
                checked[key] = self._counted_claim(
                    spec, r, c["worker"], submitted[c["worker"]], c.get("reveal"),
                    ledger_key, quiet=True) is not None
            return checked[key]

        def complete(view: dict[str, Any]) -> bool:  # by this node's draw and checks
            return expected <= {c["worker"] for c in view["challenges"] if counts(c)}

        def passed(view: dict[str, Any]) -> bool:
            if not view["fixed"]:
                return False
            deadline = float(view["reveal_deadline"])
            if not_before is not None and deadline < not_before:
                raise RejectedInput(
                    f"round {r}: the ledger states the reveal deadline {deadline:.3f}, "
                    f"{not_before - deadline:.1f} s before the beacon this node saw fixed "
                    "allows (reveal_seconds after it, less the clock slack)",
                    "early_deadline")
            return view["now"] >= deadline and time.time() >= deadline

        ledger_key = (await client.get_json("/v1/ledger"))["ledger_key"]
        view = await client.get_json(path)
        while not complete(view) and not passed(view):
            await asyncio.sleep(self.config.poll_seconds)
            view = await client.get_json(path)
        if not complete(view):
            # A reveal receipted at the deadline commits a moment after a read that already
            # saw the deadline pass: wait a moment so no validator misses it.
            await asyncio.sleep(REVEAL_SETTLE_SECONDS)
        # The claims handed in so far, then the board: a ledger commits a reveal before it
        # answers with the receipt, so an honest board read now lists every claim held.
        handed = self.inbox.held(r) if self.inbox is not None else {}
        view = await client.get_json(path)
        policy = ChallengePolicy.of_run(spec)
        listed = {c["worker"]: c["reveal"] for c in view["challenges"]
                  if isinstance(c, dict) and c.get("reveal") is not None}
        reveals: dict[str, bytes] | BlobFiles = {} if store is None else store
        withheld: list[str] = []
        for worker in sorted(set(due) & set(submitted)):
            claim = self._counted_claim(spec, r, worker, submitted[worker], listed.get(worker),
                                        ledger_key)
            on_board = claim is not None
            if claim is None:
                claim = handed.get(worker)
                if claim is None or not _claim_names(claim, spec.run_id, r, submitted[worker]):
                    continue  # no reveal receipted in time: missing
            msg = claim.envelope.message
            bound = max_reveal_file_bytes(
                run.numel, run.inner.trail_every, len(due[worker]) or 1, policy,
                payload_bytes=spec.limits["max_payload_bytes"] if spec.masked else 0)
            if msg.reveal_bytes > bound:  # the worker's own envelope claims too big a file
                log.warning("round %d: reveal of %s claims %d bytes, over the %d its checks "
                            "take", r, worker[:12], msg.reveal_bytes, bound)
                continue
            if not on_board:
                withheld.append(f"{worker[:12]} (receipted at {claim.receipt.message.received_at:.3f}"
                                f", deadline {claim.receipt.message.deadline:.3f}; not listed)")
                continue
            try:
                data = await client.get_blob(msg.reveal_hash, max_bytes=msg.reveal_bytes,
                                             kind="reveals")
            except (RejectedInput, LedgerRefused) as exc:
                withheld.append(f"{worker[:12]} (listed, file not served: {exc})")
                continue
            if isinstance(reveals, BlobFiles):
                reveals.put(worker, data)
            else:
                reveals[worker] = data
            del data
        if withheld:
            raise RejectedInput(
                f"round {r}: the ledger receipted {len(withheld)} due reveal(s) in time and "
                f"does not serve them: {'; '.join(withheld)[:600]}; not judging them missing, "
                "not certifying the round", "withheld_reveal")
        return reveals

    def check_claims_before_signing(self, spec: RunSpec, r: int,
                                    verdicts: list[dict[str, Any]]) -> None:
        """The last look before signing: a worker's claim that reached the inbox while the
        round was being judged still stops a ``missing_reveal`` on that very submission
        (``withheld_reveal``). A claim that arrives after the result is posted is evidence
        for ``veritrain audit receipt`` only."""
        if self.inbox is None:
            return
        held = self.inbox.held(r)
        late = [v["worker"] for v in verdicts
                if v.get("reason") == "missing_reveal" and v["worker"] in held
                and _claim_names(held[v["worker"]], spec.run_id, r, v["submission_digest"])]
        if late:
            raise RejectedInput(
                f"round {r}: the ledger receipted the reveal of {', '.join(w[:12] for w in late)}"
                " in time (its claim reached this node while the round was judged) and the "
                "board never listed it; not certifying it missing", "withheld_reveal")

    def _counted_claim(self, spec: RunSpec, r: int, worker: str, submission: str,
                       listed: Any, ledger_key: str, *, quiet: bool = False
                       ) -> RevealClaim | None:
        """The board's reveal of ``worker`` if it counts (``open_reveal_claim``, naming its
        sealed submission in this round); None otherwise, with why logged unless
        ``quiet``."""
        if listed is None:
            return None
        try:
            claim = open_reveal_claim(listed, spec.run_id, ledger_key)
        except RejectedInput as exc:
            why = f"unusable: {exc}"
        else:
            if claim.worker == worker and _claim_names(claim, spec.run_id, r, submission):
                return claim
            why = "not its worker's for this round's sealed submission"
        if not quiet:
            log.warning("round %d: reveal listed for %s %s", r, worker[:12], why)
        return None

    async def validate_round(self, client: LedgerClient, run: RunContext,
                             info: dict[str, Any]) -> RoundOutcome:
        """Process one closed round; its payloads, reveals and decoded updates live in a
        scratch directory that is removed when the round is done (or failed)."""
        scratch = tempfile.TemporaryDirectory(prefix=f"veritrain-round-{info['round']}-",
                                              dir=self.config.scratch_dir)
        try:
            return await self._validate_round(client, run, info, Path(scratch.name))
        finally:
            await asyncio.to_thread(scratch.cleanup)
            release_free_memory()

    async def _validate_round(self, client: LedgerClient, run: RunContext,
                              info: dict[str, Any], scratch: Path) -> RoundOutcome:
        spec = run.spec
        r = info["round"]
        started = time.monotonic()
        timings: dict[str, float] = {}
        clock = [started]

        def lap(name: str) -> None:
            now = time.monotonic()
            timings[name] = timings.get(name, 0.0) + now - clock[0]
            clock[0] = now

        release_free_memory()  # what building the run and earlier rounds left behind
        model_file, outer_file = await fetch_base_files(
            client, run.spec, info, max_model_bytes=run.max_model_bytes,
            newest_certified=self.certified_mark.of(run.spec.run_id))
        self.certified_mark.raise_to(run.spec.run_id, base_round(info))
        base_flat = run.decode_model(model_file)
        del model_file
        # The outer state is needed only for the outer step: on disk until then.
        outer_path = None if outer_file is None else scratch / "base.outer"
        if outer_path is not None and outer_file is not None:
            outer_path.write_bytes(outer_file)
        del outer_file
        # One sealed list for the share, the candidates and the buckets: the one signed.
        sealed = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/submissions")
        view = await fetch_participant_view(client, spec, r)
        registered, banned = view.registered, view.banned
        opened = []  # the sealed list's submissions that open, each checked once
        for wire in sealed["submissions"]:
            try:
                opened.append(open_signed(wire, Submission))
            except RejectedInput as exc:
                log.warning("ledger served an invalid submission: %s", exc)
        sealed_workers = [signed.message.worker for signed in opened]
        close_problem = check_close(view, info, sealed_workers, seen_closed_at=time.time(),
                                    min_submissions=spec.schedule["min_submissions"],
                                    round_seconds=spec.schedule["round_seconds"],
                                    slack=self.config.clock_slack_seconds)
        if close_problem is not None:  # no share for a list the ledger sealed early
            raise RejectedInput(f"round {r} was not closed as the schedule says: "
                                f"{close_problem}", "early_close")
        participants = participants_digest(
            participant_exclusions(sealed_workers, registered, banned))
        seed = await self.beacon_seed(client, spec, r, sealed["submissions"], participants)
        candidates = []
        payloads = BlobFiles(scratch / "payloads")  # by submission digest, read when checked
        for signed in opened:
            if spec.masked is not None:  # no payload on the ledger; opened ones are revealed
                candidates.append(Candidate(signed, None))
                continue
            try:
                payloads.put(signed.digest, await client.get_blob(
                    signed.message.payload_hash,
                    max_bytes=min(signed.message.payload_bytes,
                                  spec.limits["max_payload_bytes"]), kind="payloads"))
            except (LedgerRefused, RejectedInput) as exc:
                log.warning("payload of %s unavailable: %s", signed.message.worker[:12], exc)
            candidates.append(Candidate(signed, None))
        lap("fetch")
        if spec.masked is not None:
            filtered = await self.masked_filter(client, run, info, base_flat, candidates,
                                                registered, banned, seed, scratch)
        else:
            seen = self.beacon_seen.get(r)
            reveals = await self.gather_reveals(
                client, run, r, {c.worker: c.signed.digest for c in candidates},
                BlobFiles(scratch / "reveals"),
                due=due_reveals(spec, round_challenges(run, candidates, seed)),
                not_before=None if seen is None else (
                    seen + spec.verification["reveal_seconds"]
                    - self.config.clock_slack_seconds))
            lap("reveal_wait")
            filtered = await asyncio.to_thread(functools.partial(
                filter_round, run, r, info["base_model_hash"], base_flat, candidates,
                registered, banned, seed, reveals=reveals, payloads=payloads,
                device=self.config.device, scratch=scratch))
        release_free_memory()
        lap("verification")
        sources = None  # sharded runs: where each shard of the aggregate came from
        if spec.shards and filtered.stacked is not None:
            aggregate, sources = await self.sharded_aggregate(client, run, filtered, seed)
        else:
            aggregate = await asyncio.to_thread(aggregate_locally, run, filtered, seed)
        release_free_memory()
        lap("aggregation")
        stepped = await asyncio.to_thread(step_from_file, run, filtered, aggregate, base_flat,
                                          outer_path)
        del base_flat, aggregate  # the new model and outer state replace them
        release_free_memory()
        outcome = await asyncio.to_thread(conclude_round, run, filtered, stepped)
        del filtered, stepped
        # The new model and outer state go to files, written without a copy, and are
        # streamed from there: never two more copies of the model in memory.
        model_path, outer_out = scratch / "model", scratch / "outer_state"
        model_hash = await asyncio.to_thread(
            write_flat_file, model_path, run.shapes, split_flat(outcome.new_flat, run.shapes))
        outer_hash = await asyncio.to_thread(
            write_flat_file, outer_out, OuterState.layout(run.numel),
            {"momentum": outcome.new_outer.momentum, "residual": outcome.new_outer.residual})
        self.check_claims_before_signing(spec, r, outcome.verdicts)
        certified = CertifiedState(
            run_id=spec.run_id, round=r + 1, model_hash=model_hash,
            outer_state_hash=outer_hash,
            update_hash=sha256_hex(outcome.update_payload),
            verdicts_hash=digest_of(outcome.verdicts),
            scores_hash=digest_of(outcome.scores), eval_loss=outcome.eval_loss, shards=sources)
        result = RoundResult(
            run_id=spec.run_id, round=r, validator=self.me,
            base_model_hash=info["base_model_hash"], beacon_seed=seed.hex(),
            verdicts=outcome.verdicts, scores=outcome.scores, certified=certified.to_body(),
            attestation=(await asyncio.to_thread(self.identity.sign_bls,
                                                 certified.signing_root())).hex())
        reply = await client.post_multipart(
            f"/v1/runs/{spec.run_id}/rounds/{r}/results",
            [("result", sign(self.identity, result).encode(), "application/json"),
             ("model", model_path, "application/octet-stream"),
             ("outer_state", outer_out, "application/octet-stream"),
             ("update", outcome.update_payload, "application/octet-stream")], kind="results")
        lap("certificate")
        rejected = [v for v in outcome.verdicts if v["status"] == "rejected"]
        excluded = sum(v["status"] == "excluded" for v in outcome.verdicts)
        log.info("round %d: %d accepted, %d rejected, %d excluded, eval loss %.4f, %s (%.1fs)",
                 r, len(outcome.accepted), len(rejected), excluded, outcome.eval_loss,
                 reply["status"],
                 time.monotonic() - started)
        self.stats.append({"round": r, "seconds": time.monotonic() - started,
                           **{f"{k}_s": v for k, v in timings.items()}})
        self.write_stats()
        return outcome

    # -------------------------------------------------------------- masked rounds

    async def masked_filter(self, client: LedgerClient, run: RunContext, info: dict[str, Any],
                            base_flat: torch.Tensor, candidates: list[Candidate],
                            registered: set[str], banned: set[str], seed: bytes,
                            scratch: Path | None = None) -> FilteredRound:
        """Wait for the board to close and the opened workers to reveal; unmask the buckets."""
        spec, r = run.spec, info["round"]
        path = f"/v1/runs/{spec.run_id}/rounds/{r}/secagg"
        view = await client.get_json(path)
        masked = spec.masked
        assert masked is not None
        check_dealt(seed, [c.signed.message.worker for c in candidates], masked["bucket_size"],
                    [b["assigned"] for b in view["buckets"]])
        checks_seed, survivor_sets = await self.openings_seed(client, spec, r, path)
        while not view["complete"]:
            await asyncio.sleep(self.config.poll_seconds)
            view = await client.get_json(path)
        check_dealt(seed, [c.signed.message.worker for c in candidates], masked["bucket_size"],
                    [b["assigned"] for b in view["buckets"]])  # the view it unmasks, too
        opened = compute_challenges(checks_seed, sorted(c.worker for c in candidates),
                                    ChallengePolicy.of_run(spec), buckets=survivor_sets)
        unfixed = self.openings_unfixed.get(r)
        board = (len(PHASES) - PHASES.index("masked") - 1) * masked["phase_seconds"]
        reveals = await self.gather_reveals(
            client, run, r, {c.worker: c.signed.digest for c in candidates},
            None if scratch is None else BlobFiles(scratch / "reveals"),
            due=due_reveals(spec, opened),
            not_before=None if unfixed is None else (
                unfixed + board + spec.verification["reveal_seconds"]
                - self.config.clock_slack_seconds))
        challenges = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/challenges")
        survivors = {w for b in view["buckets"] if b["live"] for w in b["survivors"] or ()}
        waiting = {w for w, segments in opened.items() if segments} & survivors
        while (waiting - {o["body"]["worker"] for o in view["posts"]["opening"]}
               and view["now"] < (challenges["reveal_deadline"] or 0)):
            await asyncio.sleep(self.config.poll_seconds)
            view = await client.get_json(path)
        words: dict[str, np.ndarray] = {}
        for wire in view["posts"]["masked"]:
            body = wire["body"]
            if body["worker"] not in survivors:
                continue
            try:
                data = await client.get_blob(body["words_hash"],
                                             max_bytes=words_file_bytes(spec.num_params))
                words[body["worker"]] = words_of(data, spec.num_params)
            except (LedgerRefused, RejectedInput) as exc:
                log.warning("round %d: masked input of %s unavailable: %s", r,
                            body["worker"][:12], exc)
        filtered = await asyncio.to_thread(
            filter_masked_round, run, r, info["base_model_hash"], base_flat, candidates,
            registered, banned, checks_seed, survivor_sets, view, words, reveals=reveals,
            device=self.config.device)
        live = sum(1 for b in view["buckets"] if b["live"])
        log.info("round %d: %d of %d buckets unmasked, %d rows aggregated", r, live,
                 len(view["buckets"]), 0 if filtered.stacked is None else filtered.stacked.shape[0])
        return filtered

    async def openings_seed(self, client: LedgerClient, spec: RunSpec, r: int, path: str
                            ) -> tuple[bytes, list[list[str]]]:
        """The round's openings seed and the survivor sets it is drawn over
        (protocol/openings.py): once the board says the masked inputs are committed,
        sign this node's own digest of the posts that check out (once per round, whatever
        the ledger shows later), post the share, and check the fixed seed against that
        same digest. ``invalid_openings`` when it does not verify; a round finalized or
        voided meanwhile ends the wait (``round_finalized``). The last moment the board
        showed no seed yet is kept (``openings_unfixed``): the reveal deadline the ledger
        fixes with the seed cannot be earlier than that plus the board's later phases and
        ``reveal_seconds``."""

        async def read() -> dict[str, Any]:
            asked = time.time()
            seen = await client.get_json(path)
            if seen["openings"]["fixed"] is None:
                self.openings_unfixed[r] = max(self.openings_unfixed.get(r, asked), asked)
            return seen

        view = await read()
        while view["openings"]["masked"] is None and view["openings"]["fixed"] is None:
            await self._round_still_open(client, spec, r)
            await asyncio.sleep(self.config.poll_seconds)
            view = await read()
        faults: list[str] = []
        inputs = verified_inputs(spec.run_id, r, view, faults)
        self.skipped_posts.extend({"kind": "secagg_masked", "round": r, "fault": f}
                                  for f in faults)
        digest = inputs_digest(inputs)
        root = openings_root(spec.run_id, r, digest)
        group_key = None
        share: bytes | None
        if spec.threshold_beacon:
            if self.dkg_result is None:
                await self.run_dkg(client, spec)
            assert self.dkg_result is not None
            group_key = self.dkg_result.group_key
            held = self.dkg_node.share if self.dkg_node is not None else None
            share = None if held is None else await asyncio.to_thread(dkg.partial_sign, held,
                                                                      root)
        else:
            share = await asyncio.to_thread(self.identity.sign_bls, root)
        if share is not None and view["openings"]["fixed"] is None:
            self.signed_once.claim("openings", spec.run_id, r, digest)
            post = OpeningsShare(run_id=spec.run_id, round=r, validator=self.me,
                                 masked=digest, share=share.hex())
            try:
                await client.post_message(f"{path}/openings", sign(self.identity, post).to_wire())
            except LedgerRefused as exc:
                if exc.reason == "round_finalized":
                    raise
                log.warning("round %d: openings share refused: %s", r, exc)
                self.faults.append({"round": r, "kind": "openings_share",
                                    "detail": str(exc)[:300]})
        while view["openings"]["fixed"] is None:
            await self._round_still_open(client, spec, r)
            await asyncio.sleep(self.config.poll_seconds)
            view = await read()
        try:
            seed = await asyncio.to_thread(
                verify_openings, spec.validators, spec.quorum, group_key, spec.run_id, r,
                view["openings"]["fixed"], digest)
        except RejectedInput as exc:
            raise RejectedInput(f"the ledger's openings seed does not verify over the masked "
                                f"inputs checked here: {exc}", "invalid_openings") from exc
        return seed, survivor_buckets(inputs)

    async def _round_still_open(self, client: LedgerClient, spec: RunSpec, r: int) -> None:
        """Raise ``round_finalized`` when round ``r`` was finalized or voided meanwhile."""
        status = (await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}"))["status"]
        if status in ("finalized", "voided"):
            raise LedgerRefused(409, "round_finalized", f"round {r} is {status}")

    # ------------------------------------------------------------- sharded rounds

    async def sharded_aggregate(self, client: LedgerClient, run: RunContext,
                                filtered: FilteredRound, beacon_seed: bytes
                                ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Publish this validator's shard, sign one verified list, settle the rest
        (validators/sharded.py ``ShardedRound``); the aggregate and its shards' sources."""
        sharded = ShardedRound(client, self.identity, self.signed_once, self.config.poll_seconds,
                               self.config.shard_wait, self.config.attack, self.skipped_posts)
        return await sharded.aggregate(run.spec, filtered, beacon_seed)


def due_reveals(spec: RunSpec, challenges: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The workers whose reveal is due under this node's own draw, with their segments."""
    due = set(ChallengePolicy.of_run(spec).checked_workers(dict(challenges)))
    return {w: list(segs) for w, segs in challenges.items() if w in due}


def _claim_names(claim: RevealClaim, run_id: str, r: int, submission: str) -> bool:
    """Whether ``claim`` reveals for round ``r`` of ``run_id`` on the sealed ``submission``."""
    msg = claim.envelope.message
    return (msg.run_id, msg.round, msg.submission_digest) == (run_id, r, submission)


def step_from_file(run: RunContext, filtered: FilteredRound, aggregate: Any,
                   base_flat: torch.Tensor, outer_path: Path | None) -> OuterStepped:
    """``step_round`` with the base outer state read from its file here (zeros without one,
    round 0): handed over as a temporary, its residual is freed before the outer step
    allocates the new model (4 B/param less at the round's peak)."""
    if outer_path is None:
        return step_round(run, filtered, aggregate, base_flat, OuterState.zeros(run.numel))
    return step_round(run, filtered, aggregate, base_flat, OuterState(
        **read_flat_file(outer_path, OuterState.layout(run.numel))))


def write_flat_file(path: Path, shapes: ParamShapes, tensors: Mapping[str, torch.Tensor]
                    ) -> str:
    """Write ``encode_flat``'s canonical file of the named float32 tensors (laid out by
    ``shapes``) straight from the tensors' memory, and return its sha256: the same bytes
    as ``encode_flat(join_flat(tensors, shapes), shapes)`` without building them (that
    takes two more copies of the model, of the outer state twice the model's size)."""
    header, places = _header(shapes)
    digest = hashlib.sha256(header)
    with path.open("wb") as f:
        f.write(header)
        for name, _, _ in places:
            t = tensors[name].detach().to(torch.float32).cpu().contiguous().reshape(-1)
            data = memoryview(t.numpy()).cast("B")
            f.write(data)
            digest.update(data)
    return digest.hexdigest()


def read_flat_file(path: Path, shapes: ParamShapes) -> dict[str, torch.Tensor]:
    """The named tensors of a canonical tensor file (``write_flat_file``), each read from
    the file into its own tensor: ``decode_flat``'s checks (the exact size, the canonical
    header byte for byte, finite values) without holding the file's bytes, and without
    one storage for all (so each tensor can be freed on its own)."""
    header, places = _header(shapes)
    dims = dict(shapes)
    size = len(header) + 4 * sum(math.prod(shape) for _, shape in shapes)
    if path.stat().st_size != size:
        raise PayloadError(f"tensor file is {path.stat().st_size} bytes, layout needs {size}")
    out: dict[str, torch.Tensor] = {}
    with path.open("rb") as f:
        if f.read(len(header)) != header:
            raise PayloadError("tensor file names, shapes or dtypes differ from the layout")
        for name, _, _ in places:  # in file order
            t = torch.empty(dims[name], dtype=torch.float32)
            view = memoryview(t.reshape(-1).numpy()).cast("B")
            if f.readinto(view) != len(view):
                raise PayloadError("tensor file ended early")
            if not all_finite(t):
                raise NonFiniteError("tensor file holds NaN or Inf")
            out[name] = t
    return out
