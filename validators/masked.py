"""A masked round, the validator's side (sans-IO; specs/secure-averaging.md E.2).

In a masked run validators never see a single update: the ledger's board
holds, per bucket, the members' key adverts, deals, masked inputs and
reveals, and :func:`filter_masked_round` turns them into one row per bucket:

    admit envelopes -> spot-check the opened workers (training segments, payload,
                    and their masked input re-masked from the payload)
                 -> unmask every live bucket -> bucket means, weighted by members

A spot-checked cheater whose masked input opens (it masked what it committed)
is subtracted from its bucket's sum; one whose input does not open, or a bucket
whose shares are inconsistent or too few, takes the whole bucket out of the
round (nobody can remove an input that is still masked). The norm and probe
filters cannot run on hidden updates; CenteredClip over bucket means bounds
what a Byzantine member does to the aggregate, and scores are samples times
the bucket's clip quality.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from veritrain.aggregation.secure import (
    BucketContext,
    InconsistentSharesError,
    KeyAdvertisement,
    MaskedInput,
    MaskOpening,
    SecureAggregationError,
    ShareCommitments,
    ShareReveal,
    TooManyDropoutsError,
    open_masked_contribution,
    quantize,
    rounding_key,
    unmask_bucket,
)
from veritrain.protocol.board import BoardFault, open_member_post
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import (
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    SecaggView,
)
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.secagg import bucket_threshold, usable_x25519, view_digest, view_signers
from veritrain.protocol.secagg_wire import advert_of, bucket_context, commitments_of, reveal_of

from .checks import Candidate, admit, admit_envelope, group_by_worker
from .round import FilteredRound, resolve_aggregator_params
from .spot_checks import check_reveal, failure_where, revealed_payload


@dataclass
class BucketBoard:
    """One bucket as the board left it, parsed into the secure-averaging types."""

    index: int
    assigned: list[str]
    members: list[str]
    survivors: list[str]
    live: bool
    ctx: BucketContext | None = None
    adverts: dict[bytes, KeyAdvertisement] = field(default_factory=dict)
    commitments: dict[bytes, ShareCommitments] = field(default_factory=dict)
    masked: dict[str, SecaggMasked] = field(default_factory=dict)
    reveals: list[ShareReveal] = field(default_factory=list)
    bad_reveals: list[str] = field(default_factory=list)  # holders whose shares do not parse
    dealers: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # posts left out, and why
    dropped: str | None = None  # why a listed-live bucket is out (the board did not check out)


def _bucket_posts(spec: RunSpec, r: int, wires: list[Any], cls: type[Any], field: str,
                  members: set[str], bucket: int, faults: list[str]) -> dict[str, Any]:
    """The posts of one bucket bound to their members (protocol/board.py rule 1), by
    member; the others are recorded in ``faults`` and left out, as if never sent."""
    out: dict[str, Any] = {}
    for wire in wires:
        body = wire.get("body") if isinstance(wire, dict) else None
        if not isinstance(body, dict) or body.get("bucket") != bucket:
            continue
        try:
            signed = open_member_post(wire, cls, member_field=field, members=members,
                                      run_id=spec.run_id, round_index=r, bucket=bucket)
        except BoardFault as exc:
            faults.append(str(exc))
            continue
        who = getattr(signed.message, field)
        if who in out and out[who] != signed.message:
            raise BoardFault(f"two different {cls.KIND} posts of {who[:12]}")
        out[who] = signed.message
    return out


def _parse_bucket(spec: RunSpec, r: int, board: BucketBoard, posts: Mapping[str, list[Any]],
                  k: int) -> None:
    """Fill ``board`` from the posts; raise BoardFault when the board's lists are not
    backed by signed posts or two signed views of the bucket differ."""
    faults, b = board.faults, board.index
    if not set(board.members) <= set(board.assigned) or len(board.members) < k:
        raise BoardFault("the members are not k of the assigned workers")
    keys = _bucket_posts(spec, r, posts["keys"], SecaggKeys, "worker", set(board.assigned), b,
                         faults)
    deals = _bucket_posts(spec, r, posts["deal"], SecaggDeal, "dealer", set(board.members), b,
                          faults)
    inputs = _bucket_posts(spec, r, posts["masked"], SecaggMasked, "worker",
                           set(board.dealers), b, faults)
    for name, listed, within, held in (("members", board.members, board.assigned, keys),
                                       ("dealers", board.dealers, board.members, deals),
                                       ("survivors", board.survivors, board.dealers, inputs)):
        if (listed != sorted(set(listed)) or not set(listed) <= set(within)
                or any(w not in held for w in listed)):
            raise BoardFault(f"the board's {name} are not backed by their signed posts")
    if any(not (usable_x25519(keys[w].enc_public) and usable_x25519(keys[w].mask_public))
           for w in board.members):
        raise BoardFault("a member's advert has a key of low order")
    dealt = view_digest(spec.run_id, r, b, board.members, board.dealers)
    if any(inputs[w].dealers_digest != dealt for w in board.survivors):
        raise BoardFault("a survivor masked over other members or dealers than the board's")
    ctx = bucket_context(spec, r, b, board.members, len(board.assigned))
    board.ctx = ctx
    board.adverts = {bytes.fromhex(w): advert_of(keys[w]) for w in board.members}
    board.commitments = {bytes.fromhex(w): commitments_of(deals[w]) for w in board.dealers}
    board.masked = {w: inputs[w] for w in board.survivors}
    view = (board.members, board.dealers, board.survivors)
    signed_views = _bucket_posts(spec, r, posts["view"], SecaggView, "worker",
                                 set(board.survivors), b, faults)
    for w, v in signed_views.items():
        if (v.members, v.dealers, v.survivors) != view:
            raise BoardFault(f"{w[:12]} signed another view of the bucket than the board's")
    reveals = _bucket_posts(spec, r, posts["reveal"], SecaggReveal, "holder",
                            set(board.survivors), b, faults)
    for holder, rv in sorted(reveals.items()):
        signers = view_signers(rv)
        if (rv.members, rv.dealers, rv.survivors) != view:
            if len(signers) >= k:
                raise BoardFault(f"{holder[:12]} revealed on another view that k members "
                                 "signed: the ledger showed members different views")
            faults.append(f"{holder[:12]} revealed on another view")
            continue
        if len(signers) < k:
            faults.append(f"{holder[:12]} revealed with fewer than k signatures on its view")
            continue
        try:
            board.reveals.append(reveal_of(ctx, rv))
        except (SecureAggregationError, ValueError):
            board.bad_reveals.append(holder)


def parse_board(spec: RunSpec, view: Mapping[str, Any]) -> tuple[list[BucketBoard],
                                                                 dict[str, SecaggOpening]]:
    """The board's buckets and openings, every post checked again (protocol/board.py).

    A post not bound to its member, run, round and bucket is left out, as if never sent;
    a bucket whose lists are not backed by signed posts, that has two signed views, or
    that cannot be parsed is marked not live, with the reason in ``dropped``.
    """
    r = view["round"]
    masked = spec.masked
    assert masked is not None
    posts = {kind: list(view["posts"].get(kind, [])) for kind in
             ("keys", "deal", "masked", "view", "reveal", "opening")}
    boards = []
    for b in view["buckets"]:
        board = BucketBoard(b["index"], list(b["assigned"]), list(b["members"] or ()),
                            list(b["survivors"] or ()), bool(b["live"]),
                            dealers=list(b.get("dealers") or ()))
        if board.live:
            k = bucket_threshold(masked["max_dropouts"], len(board.assigned))
            try:
                _parse_bucket(spec, r, board, posts, k)
            except (BoardFault, SecureAggregationError, ValueError) as exc:
                board.live = False
                board.dropped = f"the board does not check out: {exc}"
        boards.append(board)
    openings = {}
    surviving = {w: bd.index for bd in boards for w in bd.survivors}
    for wire in posts["opening"]:
        body = wire.get("body") if isinstance(wire, dict) else None
        worker = body.get("worker") if isinstance(body, dict) else None
        if worker not in surviving:
            continue
        try:
            o = open_member_post(wire, SecaggOpening, member_field="worker",
                                 members={worker}, run_id=spec.run_id, round_index=r,
                                 bucket=surviving[worker]).message
        except BoardFault:
            continue
        openings[o.worker] = o
    return boards, openings


def words_of(data: bytes, dim: int) -> np.ndarray:
    """A masked input's words file: exactly D little-endian uint32 words."""
    if len(data) != 4 * dim:
        raise RejectedInput(f"a words file is {4 * dim} bytes, got {len(data)}", "malformed")
    return np.frombuffer(data, dtype="<u4").astype(np.uint32)


@dataclass
class _Bucket:
    board: BucketBoard
    dropped: str | None = None  # why the whole bucket is out of the round
    removed: dict[str, np.ndarray] = field(default_factory=dict)  # cheaters' q, subtracted


def filter_masked_round(
    run: RunContext,
    round_index: int,
    base_model_hash: str,
    base_flat: torch.Tensor,
    candidates: list[Candidate],
    registered: set[str],
    banned: set[str],
    checks_seed: bytes,
    survivor_sets: list[list[str]],
    view: Mapping[str, Any],
    words: Mapping[str, np.ndarray],
    *,
    reveals: Mapping[str, bytes | None] | None = None,
    device: str = "cpu",
) -> FilteredRound:
    """Verdicts and one row per surviving bucket (its mean) for a masked round.

    ``view`` is the ledger's board (``GET .../secagg``), ``words`` the survivors'
    masked inputs by worker, ``reveals`` the opened workers' reveal files (which carry
    their payloads: the ledger never stored them). ``checks_seed`` is the round's
    verified openings seed and ``survivor_sets`` the survivors it was drawn over
    (protocol/openings.py): the opened workers and their checks follow from them.
    """
    spec = run.spec
    reveals = reveals or {}
    boards, openings = parse_board(spec, view)
    if [sorted(b.survivors) for b in boards if b.survivors] != survivor_sets:
        # Drawn over other survivors than the ones summed: an input the draw could not
        # open, or openings that would leave one survivor's update exposed.
        raise RejectedInput("the openings seed was drawn over other survivor sets than the "
                            "board's", "invalid_board")
    verdicts: dict[str, dict[str, Any]] = {}
    by_worker, repeated = group_by_worker(candidates)

    def reject(worker: str, reason: str, detail: str, **extra: Any) -> None:
        if worker in verdicts or worker not in by_worker:
            return
        verdicts[worker] = {
            "worker": worker, "submission_digest": by_worker[worker].signed.digest,
            "status": "rejected", "reason": reason, "detail": detail[:500],
            "spot_checked": False, "distance": None, "checks": [], **extra}

    excluded: dict[str, float] = {}  # worker -> the quality it is paid at

    def exclude(worker: str, reason: str, detail: str) -> None:
        """A survivor whose bucket another member's fault (or too many dropouts) dropped:
        it did all its part, so it is left out of the aggregate, not blamed, and paid at
        quality 1 (specs/secure-averaging.md E.2, step 4): a cheater cannot choose its
        bucket, so failing its own opening buys its mates nothing it could aim."""
        if worker in verdicts or worker not in by_worker:
            return
        verdicts[worker] = {
            "worker": worker, "submission_digest": by_worker[worker].signed.digest,
            "status": "excluded", "reason": reason, "detail": detail[:500],
            "spot_checked": False, "distance": None, "checks": []}
        excluded[worker] = 1.0

    buckets = [_Bucket(b) for b in boards]
    bucket_of = {w: bk for bk in buckets for w in bk.board.assigned}
    for bk in buckets:
        if not bk.board.live:
            bk.dropped = bk.board.dropped or "too few members, dealers or survivors to unmask"
    for worker, c in by_worker.items():
        if worker in repeated:
            reject(worker, "duplicate", "the sealed list holds more than one submission")
            continue
        try:
            admit_envelope(c, run, round_index, base_model_hash, registered, banned)
        except RejectedInput as exc:
            reject(worker, exc.reason, str(exc))
    for worker in list(verdicts):
        bk = bucket_of.get(worker)
        if bk is not None and worker in bk.board.survivors and bk.dropped is None:
            bk.dropped = f"{worker[:12]} was rejected but its input is masked in the sum"

    challenges = compute_challenges(checks_seed, sorted({c.worker for c in candidates}),
                                    ChallengePolicy.of_run(spec), buckets=survivor_sets)
    checks: dict[str, list[dict[str, Any]]] = {}
    distances: dict[str, float] = {}
    for worker in sorted(w for w, segments in challenges.items() if segments):
        if worker in verdicts or worker not in by_worker:
            continue
        c = by_worker[worker]
        sub = c.signed.message
        bk = bucket_of.get(worker)
        payload = revealed_payload(run, sub, challenges[worker], reveals.get(worker))
        try:
            update = admit(Candidate(c.signed, payload), run, round_index, base_model_hash,
                           registered, banned)
        except RejectedInput as exc:
            reject(worker, "spot_check_failed", f"payload: {exc}", spot_checked=True)
            if bk is not None and worker in bk.board.survivors and bk.dropped is None:
                bk.dropped = f"{worker[:12]}'s masked input cannot be opened"
            continue
        results = check_reveal(run, base_flat, sub, None, challenges[worker],
                               reveals.get(worker), checks_seed, device=device, masked=True)
        checks[worker] = [x.to_json() for x in results]
        finite = [x.distance for x in results if x.distance is not None]
        if finite:
            distances[worker] = min(max(finite), 1e300)
        failed = [x for x in results if not x.ok]
        extra = {"spot_checked": True, "checks": checks[worker]}
        if bk is None or worker not in bk.board.survivors or bk.dropped is not None:
            if failed:
                reject(worker, "spot_check_failed", f"{failure_where(failed[0])}: "
                       f"{failed[0].note}", **extra)
            continue
        q = _open(bk.board, worker, update, openings.get(worker), words.get(worker))
        if q is None:
            reject(worker, "spot_check_failed",
                   "its masked input does not open to its committed payload", **extra)
            bk.dropped = f"{worker[:12]}'s masked input does not open"
        elif failed:
            reject(worker, "spot_check_failed",
                   f"{failure_where(failed[0])}: {failed[0].note}", **extra)
            bk.removed[worker] = q

    rows: list[torch.Tensor] = []
    weights: list[int] = []
    rows_of: dict[str, int] = {}
    for bk in buckets:
        board = bk.board
        if bk.dropped is None:
            assert board.ctx is not None
            try:
                inputs = [MaskedInput(bytes.fromhex(w), board.index,
                                      bytes.fromhex(board.masked[w].commitment), words[w])
                          for w in board.survivors]
                total = unmask_bucket(board.ctx, board.adverts, board.commitments, inputs,
                                      board.reveals)
                for fault in total.faults:
                    reject(fault.culprit.hex(), "forged_share", fault.reason)
                for holder in board.bad_reveals:
                    reject(holder, "forged_share", "revealed shares that are not field elements")
            except InconsistentSharesError as exc:
                reject(exc.culprit.hex(), "inconsistent_shares", str(exc))
                bk.dropped = f"inconsistent shares of {exc.culprit.hex()[:12]}"
            except TooManyDropoutsError as exc:
                bk.dropped = str(exc)
            except (SecureAggregationError, KeyError) as exc:
                bk.dropped = f"cannot unmask: {exc}"
        for w in board.assigned:
            if bk.dropped is not None and w in board.survivors:
                exclude(w, "bucket_dropped", f"bucket {board.index}: {bk.dropped}")
            elif bk.dropped is not None:
                reject(w, "bucket_dropped", f"bucket {board.index}: {bk.dropped}")
            elif w not in board.survivors:
                reject(w, "dropped_out", f"no masked input in bucket {board.index}")
        if bk.dropped is not None:
            continue
        scale = board.ctx.scale  # type: ignore[union-attr]
        summed = total.total.clone()
        for q in bk.removed.values():
            summed -= torch.from_numpy(q.view(np.int32).astype(np.float64)) / scale
        count = len(board.survivors) - len(bk.removed)
        if count < 1:
            continue
        for w in board.survivors:
            if w not in verdicts:
                rows_of[w] = len(rows)
        rows.append((summed / count).to(torch.float32))
        weights.append(count)
    for w in by_worker:
        if w not in bucket_of:
            reject(w, "no_bucket", "a lone worker has no bucket to hide its update in")

    accepted = sorted(rows_of)
    stacked = torch.stack(rows) if rows else None
    params = (resolve_aggregator_params(spec.aggregator["params"], stacked)
              if stacked is not None else dict(spec.aggregator["params"]))
    return FilteredRound(round_index, verdicts, by_worker, checks, distances, accepted, stacked,
                         params, weights=weights or None, rows_of=rows_of,
                         excluded=sorted(excluded), excluded_quality=excluded)


def _open(board: BucketBoard, worker: str, update: torch.Tensor,
          opening: SecaggOpening | None, words: np.ndarray | None) -> np.ndarray | None:
    """q of ``worker`` if its opening re-masks the quantized ``update`` to its masked input."""
    if opening is None or board.ctx is None or worker not in board.masked or words is None:
        return None
    ctx, me = board.ctx, bytes.fromhex(worker)
    try:
        q = quantize(update, clip_norm=ctx.clip_norm, scale=ctx.scale,
                     rounding_key=rounding_key(ctx, me))
    except SecureAggregationError:
        return None
    masked = MaskedInput(me, board.index, bytes.fromhex(board.masked[worker].commitment), words)
    opened = MaskOpening(me, q, bytes.fromhex(opening.self_seed),
                         bytes.fromhex(opening.mask_private))
    ok = open_masked_contribution(ctx, board.adverts, board.commitments, masked, opened)
    return q if ok else None
