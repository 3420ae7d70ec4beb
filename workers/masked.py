"""A worker's part of a masked round, over HTTP (specs/secure-averaging.md E.2).

After its submission (an envelope without payload) the worker waits for the
round's beacon to deal it into a bucket, then walks the board's phases:

    keys    fresh X25519 keys for share transport and pairwise masks
    deal    Shamir shares of its self-mask seed and mask key, sealed to each member
    masked  its clipped, quantized update plus every mask, and the words file,
            naming the digest of the members and dealers it masked over
    view    its signature on the view it acted on: members, dealers, survivors U
    reveal  once k members signed exactly that view (their signatures go with it):
            seed shares of U, key shares of the dealers that dropped, never both for
            one dealer; and nothing at all when U is below the threshold

Nothing served is taken on trust (protocol/board.py): every post must be signed by
the member it names, for this run, round and bucket; every list the board serves
must be backed by those posts and reach k, the threshold that follows from the
beacon's deal alone; the node signs one dealer view and one survivor view per round
(``SignedOnce``). A board that fails any of this ends the walk with nothing more sent
(``board fault``), so a ledger showing members different views learns no more than
the bucket sum.

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
from veritrain.protocol.board import BoardFault, SignedOnce, open_member_post
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggView,
    Submission,
    open_signed,
    sign,
)
from veritrain.protocol.secagg import bucket_threshold, check_dealt, usable_x25519, view_digest
from veritrain.protocol.secagg_wire import (
    advert_of,
    bucket_context,
    commitments_of,
    deal_message,
    keys_message,
    reveal_message,
    sealed_for,
    view_message,
)

from .beacon import round_inputs, verified_openings, verified_seed

log = logging.getLogger("veritrain.worker")

#: Evaluation only: ``drop_after_deal`` vanishes after dealing its shares (a dropout
#: the bucket must survive); ``forge_reveal`` reveals shares that open no commitment.
SECAGG_ATTACKS = ("drop_after_deal", "forge_reveal")


class MaskedRound:
    """One round's walk through the board for one worker."""

    def __init__(self, client: LedgerClient, spec: RunSpec, identity: Identity, r: int, *,
                 poll_seconds: float = 0.5, attack: str | None = None,
                 signed_once: SignedOnce | None = None) -> None:
        if attack is not None and attack not in SECAGG_ATTACKS:
            raise ValueError(f"unknown board attack {attack!r}; expected one of {SECAGG_ATTACKS}")
        self.client, self.spec, self.identity, self.r = client, spec, identity, r
        self.me = identity.public_key.hex()
        self.poll = poll_seconds
        self.attack = attack
        self.path = f"/v1/runs/{spec.run_id}/rounds/{r}/secagg"
        self.opening: MaskOpening | None = None
        self.bucket: int | None = None
        #: the sealed submitters (set by the deal's check): what the openings are drawn over
        self.workers: list[str] = []
        self.masked_posted = False
        self._opening: asyncio.Task[None] | None = None  # the opening, once the view is fixed
        #: the views this node signed (board.py rule 3); the node may pass its own, kept
        #: on disk; a fresh one is enough while secrets die with the process anyway.
        self.once = signed_once if signed_once is not None else SignedOnce()
        self.faults: list[str] = []  # what the board served that did not check out

    async def _view(self, until: Callable[[dict[str, Any]], bool], *, whole: bool = False
                    ) -> dict[str, Any]:
        """Poll the board (of this worker's bucket once known, unless ``whole``) until
        ``until`` holds."""
        masked = self.spec.masked
        assert masked is not None
        give_up = time.monotonic() + 6 * masked["phase_seconds"] + 600
        query = "" if self.bucket is None or whole else f"?bucket={self.bucket}"
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
        """Take part in the round's bucket with ``update``; returns how it ended.

        A board that does not check out (a post not bound to its member, a list not
        backed by signed posts, fewer than k of anything, a second view) ends the walk
        with nothing more sent: it is logged, never raised."""
        try:
            outcome = await self._walk(update)
            # The openings are drawn once the masked inputs are in: opened beside the
            # reveal once the view is fixed, or here when the walk stopped before it.
            if self._opening is not None:
                await self._opening
            elif self.masked_posted:
                await self.open_if_challenged()
            return outcome
        except BoardFault as exc:
            self.faults.append(str(exc))
            log.error("round %d: the board does not check out, nothing more sent: %s",
                      self.r, exc)
            return f"board fault: {exc}"
        finally:
            if self._opening is not None and not self._opening.done():
                self._opening.cancel()

    async def _walk(self, update: torch.Tensor) -> str:
        spec, r, me = self.spec, self.r, self.me
        masked_spec = spec.masked
        assert masked_spec is not None
        view = await self._view(lambda v: True)
        # The deal's check (BLS pairings, ~0.3 s each) runs while the keys go out: fresh
        # public keys reveal nothing, and no share is dealt before the check passed.
        check = asyncio.create_task(self._check_deal(view))
        try:
            mine = [b for b in view["buckets"] if me in b["assigned"]]
            if not mine:
                return "no bucket" if await self._checked(check) else "invalid board"
            self.bucket = mine[0]["index"]
            assigned = list(mine[0]["assigned"])
            secrets = generate_secrets(bytes.fromhex(me))
            if not await self._post("keys", keys_message(spec, r, self.bucket, secrets)):
                return "keys refused"
            view = await self._view(self._closed("keys"))
            if not await self._checked(check):
                return "invalid board"
        finally:
            check.cancel()  # a no-op once it finished
        k = bucket_threshold(masked_spec["max_dropouts"], len(assigned))
        st = self._bucket_state(view)
        if st["assigned"] != assigned:
            raise BoardFault("the board changed this bucket's assigned members")
        keys = self._posts(view, "keys", SecaggKeys, "worker", set(assigned))
        members = self._listed(st, "members", keys, set(assigned), k)
        if members is None:
            return "bucket did not form"
        for w in members:
            if not (usable_x25519(keys[w].enc_public) and usable_x25519(keys[w].mask_public)):
                raise BoardFault(f"the board lists {w[:12]}, whose advert has a key of low "
                                 "order (an honest ledger refuses it)")
        adverts = {bytes.fromhex(w): advert_of(keys[w]) for w in members}
        ctx = bucket_context(spec, r, self.bucket, members, len(assigned))
        commitments, sealed = deal_shares(ctx, secrets, adverts)
        if not await self._post("deal", deal_message(spec, ctx, commitments, sealed)):
            return "deal refused"
        if self.attack == "drop_after_deal":
            log.warning("round %d: dropping out after dealing (evaluation attack)", r)
            return "dropped out"
        view = await self._view(self._closed("deal"))
        st = self._bucket_state(view)
        deals = self._posts(view, "deal", SecaggDeal, "dealer", set(members))
        dealers = self._listed(st, "dealers", deals, set(members), k)
        if dealers is None:
            return "too few dealers"
        held: dict[bytes, HeldShare] = {}
        for w in dealers:
            box = sealed_for(deals[w], me)
            try:
                if box is None:
                    raise ShareVerificationError(bytes.fromhex(w), "no shares sealed to me")
                held[bytes.fromhex(w)] = open_shares(ctx, secrets, adverts,
                                                     commitments_of(deals[w]), box)
            except ShareVerificationError as exc:
                self.faults.append(f"dealer {w}: {exc}")
                log.warning("round %d: shares from %s do not open: %s", r, w[:12], exc)
        dealt = view_digest(spec.run_id, r, self.bucket, members, dealers)
        self.once.claim("secagg_dealers", spec.run_id, r, dealt)
        masked, self.opening = await asyncio.to_thread(
            mask_update, ctx, secrets, adverts, [bytes.fromhex(w) for w in dealers], update)
        data = np.ascontiguousarray(masked.words, dtype="<u4").tobytes()
        post = SecaggMasked(run_id=spec.run_id, round=r, bucket=self.bucket, worker=me,
                            commitment=masked.commitment.hex(),
                            input_digest=masked.digest().hex(),
                            words_hash=hashlib.sha256(data).hexdigest(), words_bytes=len(data),
                            dealers_digest=dealt)
        try:
            await self.client.post_multipart(f"{self.path}/masked", [
                ("envelope", sign(self.identity, post).encode(), "application/json"),
                ("words", data, "application/octet-stream")])
        except LedgerRefused as exc:
            if exc.reason != "duplicate":
                log.warning("round %d: masked input refused (%s): %s", r, exc.reason, exc.detail)
                return "masked input refused"
        self.masked_posted = True
        view = await self._view(self._closed("masked"))
        st = self._bucket_state(view)
        inputs = self._posts(view, "masked", SecaggMasked, "worker", set(dealers))
        survivors = self._listed(st, "survivors", inputs, set(dealers), k)
        if survivors is None:
            return "too few survivors: nothing revealed"
        for w in survivors:
            if inputs[w].dealers_digest != dealt:
                raise BoardFault(f"survivor {w[:12]} masked over other members or dealers "
                                 "than this worker was shown")
        mine_view = view_message(spec, r, self.bucket, me, members, dealers, survivors)
        self.once.claim("secagg_view", spec.run_id, r, view_digest(
            spec.run_id, r, self.bucket, members, dealers, survivors))
        if not await self._post("view", mine_view):
            return "view refused"
        view = await self._view(self._closed("view"))
        self._opening = asyncio.create_task(self.open_if_challenged())
        signatures = self._view_signatures(view, mine_view, set(survivors), k)
        reveal = reveal_shares(ctx, bytes.fromhex(me), held,
                               [bytes.fromhex(w) for w in survivors])
        message = reveal_message(spec, ctx, reveal, mine_view, signatures)
        if self.attack == "forge_reveal":
            message = _forged(message)
        if not await self._post("reveal", message):
            return "reveal refused"
        return "revealed"

    def _bucket_state(self, view: dict[str, Any]) -> dict[str, Any]:
        states = [b for b in view["buckets"] if b.get("index") == self.bucket]
        if len(states) != 1:
            raise BoardFault(f"the board does not show bucket {self.bucket} once")
        return states[0]

    def _posts(self, view: dict[str, Any], kind: str, cls: type[Any], field: str,
               members: set[str]) -> dict[str, Any]:
        """This bucket's posts of ``kind`` bound to their members (board.py rule 1), by
        member; a post that does not check out is recorded and skipped, a member with two
        different posts is a fault of the board."""
        out: dict[str, Any] = {}
        for wire in view["posts"].get(kind, []):
            try:
                msg = open_member_post(wire, cls, member_field=field, members=members,
                                       run_id=self.spec.run_id, round_index=self.r,
                                       bucket=self.bucket).message
            except BoardFault as exc:
                self.faults.append(str(exc))
                log.warning("round %d: skipped a %s post: %s", self.r, kind, exc)
                continue
            who = getattr(msg, field)
            if who in out and out[who] != msg:
                raise BoardFault(f"the board shows two {kind} posts of {who[:12]}")
            out[who] = msg
        return out

    def _listed(self, st: dict[str, Any], name: str, posts: dict[str, Any], within: set[str],
                k: int) -> list[str] | None:
        """The board's list ``name`` once it checks out: sorted, within the previous
        phase's list, each entry backed by a signed post, this worker in it; None (the
        bucket cannot finish here) when it is not live or shorter than k."""
        listed = st.get(name)
        if not st.get("live") or not isinstance(listed, list) or self.me not in listed:
            return None
        if listed != sorted(set(listed)) or not set(listed) <= within:
            raise BoardFault(f"the board's {name} are not a sorted subset of the last phase's")
        missing = [w for w in listed if w not in posts]
        if missing:
            raise BoardFault(f"the board lists {len(missing)} {name} without their signed post")
        if len(listed) < k:
            log.warning("round %d: %d %s, fewer than k = %d: this worker stops", self.r,
                        len(listed), name, k)
            return None
        return listed

    def _view_signatures(self, view: dict[str, Any], mine: SecaggView, survivors: set[str],
                         k: int) -> list[dict[str, str]]:
        """The survivors' signatures on exactly this worker's view (its own included), at
        least k of them; a signed view that differs is the ledger's equivocation (or a
        member's) and this worker reveals nothing."""
        signatures = []
        for wire in view["posts"].get("view", []):
            try:
                signed = open_member_post(wire, SecaggView, member_field="worker",
                                          members=survivors, run_id=self.spec.run_id,
                                          round_index=self.r, bucket=self.bucket)
            except BoardFault as exc:
                self.faults.append(str(exc))
                continue
            if (signed.message.members, signed.message.dealers, signed.message.survivors) != (
                    mine.members, mine.dealers, mine.survivors):
                raise BoardFault(f"{signed.signer[:12]} signed another view of this bucket: "
                                 "the board shows its members different views")
            if all(s["worker"] != signed.signer for s in signatures):
                signatures.append({"worker": signed.signer, "signature": signed.signature})
        if len(signatures) < k:
            raise BoardFault(f"{len(signatures)} signatures on this worker's view, fewer than "
                             f"k = {k}: nothing revealed")
        return sorted(signatures, key=lambda s: s["worker"])

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
        reply = await self.client.get_json(f"{base}/submissions")
        sealed = reply["submissions"]
        # The beacon signs the list its signers saw before the seed existed: the list
        # served here must be that one, so it was not chosen after the seed.
        seed = await verified_seed(self.client, spec, self.r, beacon,
                                   *round_inputs(reply, self.me))
        workers = [open_signed(wire, Submission).message.worker for wire in sealed]
        if self.me not in workers:  # it holds a receipt for its submission
            raise RejectedInput("this worker's sealed submission is missing from the list",
                                "invalid_board")
        masked = spec.masked
        assert masked is not None
        check_dealt(seed, workers, masked["bucket_size"],
                    [b["assigned"] for b in view["buckets"]])
        self.workers = workers

    async def open_if_challenged(self) -> None:
        """Post the opening if the round's openings seed, checked here over the masked
        inputs this worker verified itself, opens it (protocol/openings.py): drawn only
        after every masked input was committed, so no worker knew while it masked. The
        draw leaves no bucket with exactly one unopened survivor."""
        if self.opening is None or self.bucket is None:
            return
        round_path = f"/v1/runs/{self.spec.run_id}/rounds/{self.r}"

        def drawn_or_over(view: dict[str, Any]) -> bool:
            return view["openings"]["fixed"] is not None

        while not drawn_or_over(await self._view(lambda v: True)):
            if (await self.client.get_json(round_path))["status"] in ("finalized", "voided"):
                return  # settled without this worker's opening
            await asyncio.sleep(self.poll)
        view = await self._view(lambda v: True, whole=True)  # every bucket's inputs, once
        seed, buckets = await verified_openings(self.client, self.spec, self.r, view)
        opened = compute_challenges(seed, self.workers, ChallengePolicy.of_run(self.spec),
                                    buckets=buckets)
        if not opened.get(self.me):
            return
        problem = drawn_over_other_survivors(self.spec, self.r, view, self.bucket, buckets)
        if problem is not None:
            raise BoardFault(problem)
        op = SecaggOpening(run_id=self.spec.run_id, round=self.r, bucket=self.bucket,
                           worker=self.me, self_seed=self.opening.self_seed.hex(),
                           mask_private=self.opening.mask_private.hex())
        if await self._post("opening", op):
            log.info("round %d: spot-checked: opened the masked input", self.r)


def drawn_over_other_survivors(spec: RunSpec, r: int, view: dict[str, Any], bucket: int,
                               drawn: list[list[str]]) -> str | None:
    """Why opening or revealing in ``bucket`` could expose a member, or None: the openings
    were drawn over another survivor set than the view at least k of the bucket's survivors
    signed (``SecaggView`` posts bound to their members). Only such a view's sum can be
    unmasked (a reveal needs k signatures on it), so with none there is nothing to expose;
    with one, the draw must have seen exactly its survivors, or an opening could leave one
    of them the only unopened update in the sum."""
    masked = spec.masked
    assert masked is not None
    states = [b for b in view["buckets"] if b.get("index") == bucket]
    if len(states) != 1:
        return f"the board does not show bucket {bucket} once"
    assigned = list(states[0]["assigned"])
    k = bucket_threshold(masked["max_dropouts"], len(assigned))
    signers: dict[tuple[str, ...], set[str]] = {}
    for wire in view["posts"].get("view", []):
        try:
            msg = open_member_post(wire, SecaggView, member_field="worker",
                                   members=set(assigned), run_id=spec.run_id, round_index=r,
                                   bucket=bucket).message
        except BoardFault:
            continue
        if msg.worker in msg.survivors:
            signers.setdefault(tuple(msg.survivors), set()).add(msg.worker)
    agreed = [list(s) for s, who in signers.items() if len(who) >= k]
    if not agreed:
        return None
    mine = next((b for b in drawn if set(b) & set(assigned)), [])
    if len(agreed) > 1 or sorted(agreed[0]) != sorted(mine):
        return (f"the openings were drawn over {len(mine)} survivors of bucket {bucket}, not "
                "the ones of the view its survivors signed: nothing opened or revealed")
    return None


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
