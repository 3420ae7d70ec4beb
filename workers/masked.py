"""A worker's part of a masked round, over HTTP (specs/secure-averaging.md E.2).

After its submission (an envelope without payload) the worker waits for the
round's beacon to deal it into a bucket, then walks the board's phases:

    keys    fresh X25519 keys for share transport and pairwise masks
    deal    Shamir shares of its self-mask seed and mask key, sealed to each member
    masked  its clipped, quantized update plus every mask, and the words file
    reveal  once the board fixed the survivors U: seed shares of U, key shares of
            the dealers that dropped, never both for one dealer; and nothing at all
            when U is below the threshold (the sum would expose too few inputs)

Before it deals any share it checks the deal itself: the beacon's shares
against the validators' BLS keys, its own submission in the sealed list, and the
buckets against the beacon's deal of the sealed submitters (:func:`check_dealt`),
so a ledger cannot rearrange the buckets to place it with colluding workers.
Then, if the beacon spot-checks it, it posts its opening (self-mask seed and
mask key) so validators can re-mask the update they recompute. The secrets live in
memory only: a worker that restarts mid-round is a dropout, which the bucket
survives up to its t.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from veritrain.aggregation.secure import (
    HeldShare,
    MaskOpening,
    ShareVerificationError,
    deal_shares,
    generate_secrets,
    mask_update,
    open_shares,
    reveal_shares,
)
from veritrain.ledger.client import LedgerClient, LedgerRefused
from veritrain.protocol.beacon import sealed_list_digest_of, verify_fixed_beacon
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    Submission,
    open_signed,
    sign,
)
from veritrain.protocol.secagg import check_dealt
from veritrain.protocol.secagg_wire import (
    advert_of,
    bucket_context,
    commitments_of,
    deal_message,
    keys_message,
    reveal_message,
    sealed_for,
)

log = logging.getLogger("veritrain.worker")

#: Evaluation only: ``drop_after_deal`` vanishes after dealing its shares (a dropout
#: the bucket must survive); ``forge_reveal`` reveals shares that open no commitment.
SECAGG_ATTACKS = ("drop_after_deal", "forge_reveal")


class MaskedRound:
    """One round's walk through the board for one worker."""

    def __init__(self, client: LedgerClient, spec: RunSpec, identity: Identity, r: int, *,
                 poll_seconds: float = 0.5, attack: str | None = None) -> None:
        if attack is not None and attack not in SECAGG_ATTACKS:
            raise ValueError(f"unknown board attack {attack!r}; expected one of {SECAGG_ATTACKS}")
        self.client, self.spec, self.identity, self.r = client, spec, identity, r
        self.me = identity.public_key.hex()
        self.poll = poll_seconds
        self.attack = attack
        self.path = f"/v1/runs/{spec.run_id}/rounds/{r}/secagg"
        self.opening: MaskOpening | None = None
        self.bucket: int | None = None

    async def _view(self, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Poll the board (of this worker's bucket once known) until ``until`` holds."""
        masked = self.spec.masked
        assert masked is not None
        give_up = time.monotonic() + 6 * masked["phase_seconds"] + 600
        query = "" if self.bucket is None else f"?bucket={self.bucket}"
        while True:
            try:
                view = await self.client.get_json(self.path + query)
                if until(view):
                    return view
            except LedgerRefused as exc:
                if exc.reason != "wrong_state":  # buckets not dealt yet: keep waiting
                    raise
            if time.monotonic() > give_up:
                raise TimeoutError(f"round {self.r}: the board did not move in time")
            await asyncio.sleep(self.poll)

    def _closed(self, name: str) -> Callable[[dict[str, Any]], bool]:
        def check(view: dict[str, Any]) -> bool:
            return any(p["name"] == name and p["closed_at"] is not None for p in view["phases"])
        return check

    async def _post(self, kind: str, message: Any) -> bool:
        try:
            await self.client.post_message(f"{self.path}/{kind}",
                                           sign(self.identity, message).to_wire())
            return True
        except LedgerRefused as exc:
            if exc.reason == "duplicate":
                return True
            log.warning("round %d: %s refused (%s): %s", self.r, kind, exc.reason, exc.detail)
            return False

    async def run(self, update: torch.Tensor) -> str:
        """Take part in the round's bucket with ``update``; returns how it ended."""
        spec, r, me = self.spec, self.r, self.me
        view = await self._view(lambda v: True)
        # The deal's check (BLS pairings, ~0.3 s each) runs while the keys go out: fresh
        # public keys reveal nothing, and no share is dealt before the check passed.
        check = asyncio.create_task(self._check_deal(view))
        try:
            mine = [b for b in view["buckets"] if me in b["assigned"]]
            if not mine:
                return "no bucket" if await self._checked(check) else "invalid board"
            self.bucket = mine[0]["index"]
            secrets = generate_secrets(bytes.fromhex(me))
            if not await self._post("keys", keys_message(spec, r, self.bucket, secrets)):
                return "keys refused"
            view = await self._view(self._closed("keys"))
            if not await self._checked(check):
                return "invalid board"
        finally:
            check.cancel()  # a no-op once it finished
        st = view["buckets"][0]
        if not st["live"] or me not in st["members"]:
            return "bucket did not form"
        ctx = bucket_context(spec, r, self.bucket, st["members"])
        adverts = {}
        for wire in view["posts"]["keys"]:
            msg = open_signed(wire, SecaggKeys).message
            if msg.worker in st["members"]:
                adverts[bytes.fromhex(msg.worker)] = advert_of(msg)
        commitments, sealed = deal_shares(ctx, secrets, adverts)
        if not await self._post("deal", deal_message(spec, ctx, commitments, sealed)):
            return "deal refused"
        if self.attack == "drop_after_deal":
            log.warning("round %d: dropping out after dealing (evaluation attack)", r)
            return "dropped out"
        view = await self._view(self._closed("deal"))
        st = view["buckets"][0]
        if not st["live"] or me not in st["dealers"]:
            return "too few dealers"
        held: dict[bytes, HeldShare] = {}
        for wire in view["posts"]["deal"]:
            deal = open_signed(wire, SecaggDeal).message
            box = sealed_for(deal, me)
            if deal.dealer not in st["dealers"] or box is None:
                continue
            try:
                held[bytes.fromhex(deal.dealer)] = open_shares(ctx, secrets, adverts,
                                                              commitments_of(deal), box)
            except ShareVerificationError as exc:
                log.warning("round %d: shares from %s do not open: %s", r, deal.dealer[:12], exc)
        dealers = [bytes.fromhex(w) for w in st["dealers"]]
        masked, self.opening = await asyncio.to_thread(mask_update, ctx, secrets, adverts,
                                                       dealers, update)
        data = np.ascontiguousarray(masked.words, dtype="<u4").tobytes()
        post = SecaggMasked(run_id=spec.run_id, round=r, bucket=self.bucket, worker=me,
                            commitment=masked.commitment.hex(),
                            input_digest=masked.digest().hex(),
                            words_hash=hashlib.sha256(data).hexdigest(), words_bytes=len(data))
        try:
            await self.client.post_multipart(f"{self.path}/masked", [
                ("envelope", sign(self.identity, post).encode(), "application/json"),
                ("words", data, "application/octet-stream")])
        except LedgerRefused as exc:
            if exc.reason != "duplicate":
                log.warning("round %d: masked input refused (%s): %s", r, exc.reason, exc.detail)
                return "masked input refused"
        await self.open_if_challenged()
        view = await self._view(self._closed("masked"))
        st = view["buckets"][0]
        if not st["live"] or me not in st["survivors"]:
            return "too few survivors: nothing revealed"
        reveal = reveal_shares(ctx, bytes.fromhex(me), held, [bytes.fromhex(w)
                                                             for w in st["survivors"]])
        message = reveal_message(spec, ctx, reveal, st["survivors"])
        if self.attack == "forge_reveal":
            message = _forged(message)
        if not await self._post("reveal", message):
            return "reveal refused"
        return "revealed"

    async def _checked(self, check: asyncio.Task[None]) -> bool:
        """Whether the deal's check passed (a failure is logged: this worker stops here)."""
        try:
            await check
            return True
        except RejectedInput as exc:
            log.error("round %d: not taking part in this board: %s", self.r, exc)
            return False

    async def _check_deal(self, view: dict[str, Any]) -> None:
        """The buckets are the deal of the verified beacon over the sealed submitters."""
        spec, base = self.spec, f"/v1/runs/{self.spec.run_id}/rounds/{self.r}"
        beacon = await self.client.get_json(f"{base}/beacon")
        if beacon["beacon"] is None:
            raise RejectedInput("buckets were dealt before the beacon was fixed",
                                "invalid_board")
        sealed = (await self.client.get_json(f"{base}/submissions"))["submissions"]
        # The signers' envelopes name the list they saw before the seed existed: the
        # list served here must be that one, so it was not chosen after the seed.
        seed = await asyncio.to_thread(functools.partial(
            verify_fixed_beacon, spec.validators, spec.quorum, spec.run_id, self.r,
            beacon["beacon"], sealed=sealed_list_digest_of(sealed),
            envelopes=beacon.get("envelopes")))
        workers = [open_signed(wire, Submission).message.worker for wire in sealed]
        if self.me not in workers:  # it holds a receipt for its submission
            raise RejectedInput("this worker's sealed submission is missing from the list",
                                "invalid_board")
        masked = spec.masked
        assert masked is not None
        check_dealt(seed, workers, masked["bucket_size"],
                    [b["assigned"] for b in view["buckets"]])

    async def open_if_challenged(self) -> None:
        """Post the opening if the round's challenges spot-check this worker."""
        if self.opening is None or self.bucket is None:
            return
        view = await self.client.get_json(f"/v1/runs/{self.spec.run_id}/rounds/{self.r}/challenges")
        if not any(c["worker"] == self.me for c in view["challenges"]):
            return
        op = SecaggOpening(run_id=self.spec.run_id, round=self.r, bucket=self.bucket,
                           worker=self.me, self_seed=self.opening.self_seed.hex(),
                           mask_private=self.opening.mask_private.hex())
        if await self._post("opening", op):
            log.info("round %d: spot-checked: opened the masked input", self.r)


def _forged(message: Any) -> Any:
    """The reveal with every share's last byte flipped: it opens no commitment."""
    def flip(rows: list[dict[str, str]]) -> list[dict[str, str]]:
        out = []
        for it in rows:
            raw = bytearray(bytes.fromhex(it["share"]))
            raw[-1] ^= 1
            out.append({**it, "share": raw.hex()})
        return out
    return type(message)(**{**message.to_body(), "seed_shares": flip(message.seed_shares),
                            "key_shares": flip(message.key_shares)})


async def take_part(client: LedgerClient, spec: RunSpec, identity: Identity, r: int,
                    update: torch.Tensor, *, poll_seconds: float, attack: str | None) -> str:
    """Run the masked round; a board failure is logged, not fatal to the worker."""
    try:
        return await MaskedRound(client, spec, identity, r, poll_seconds=poll_seconds,
                                 attack=attack).run(update)
    except (LedgerRefused, RejectedInput, TimeoutError) as exc:
        log.warning("round %d: the masked round failed here: %s", r, exc)
        return f"failed: {exc}"
