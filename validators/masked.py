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
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import (
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    open_signed,
)
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.secagg_wire import advert_of, bucket_context, commitments_of, reveal_of

from .checks import Candidate, admit, admit_envelope, group_by_worker
from .round import FilteredRound, resolve_aggregator_params, round_challenges
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


def parse_board(spec: RunSpec, view: Mapping[str, Any]) -> tuple[list[BucketBoard],
                                                                 dict[str, SecaggOpening]]:
    """The board's buckets and openings, every post's signature checked again.

    A post that does not open (the ledger is not trusted) is left out, as if
    never sent; a bucket whose posts cannot be parsed is marked not live.
    """
    r = view["round"]
    posts: dict[str, list[Any]] = {}
    for kind, cls in (("keys", SecaggKeys), ("deal", SecaggDeal), ("masked", SecaggMasked),
                      ("reveal", SecaggReveal), ("opening", SecaggOpening)):
        posts[kind] = []
        for wire in view["posts"][kind]:
            try:
                signed = open_signed(wire, cls)
            except RejectedInput:
                continue
            if signed.message.run_id == spec.run_id and signed.message.round == r:
                posts[kind].append(signed.message)
    boards = []
    for b in view["buckets"]:
        board = BucketBoard(b["index"], list(b["assigned"]), list(b["members"] or ()),
                            list(b["survivors"] or ()), bool(b["live"]))
        if board.live:
            try:
                board.ctx = bucket_context(spec, r, board.index, board.members)
                member = set(board.members)
                for k in posts["keys"]:
                    if k.bucket == board.index and k.worker in member:
                        board.adverts[bytes.fromhex(k.worker)] = advert_of(k)
                for d in posts["deal"]:
                    if d.bucket == board.index and d.dealer in member:
                        board.commitments[bytes.fromhex(d.dealer)] = commitments_of(d)
                for m in posts["masked"]:
                    if m.bucket == board.index and m.worker in board.survivors:
                        board.masked[m.worker] = m
                for rv in posts["reveal"]:
                    if rv.bucket == board.index and rv.holder in member:
                        try:
                            board.reveals.append(reveal_of(board.ctx, rv))
                        except (SecureAggregationError, ValueError):
                            board.bad_reveals.append(rv.holder)
            except (SecureAggregationError, ValueError):
                board.live = False
        boards.append(board)
    openings = {o.worker: o for o in posts["opening"]}
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
    beacon_seed: bytes,
    view: Mapping[str, Any],
    words: Mapping[str, np.ndarray],
    *,
    reveals: Mapping[str, bytes | None] | None = None,
    device: str = "cpu",
) -> FilteredRound:
    """Verdicts and one row per surviving bucket (its mean) for a masked round.

    ``view`` is the ledger's board (``GET .../secagg``), ``words`` the survivors'
    masked inputs by worker, ``reveals`` the opened workers' reveal files (which carry
    their payloads: the ledger never stored them).
    """
    spec = run.spec
    reveals = reveals or {}
    boards, openings = parse_board(spec, view)
    verdicts: dict[str, dict[str, Any]] = {}
    by_worker, repeated = group_by_worker(candidates)

    def reject(worker: str, reason: str, detail: str, **extra: Any) -> None:
        if worker in verdicts or worker not in by_worker:
            return
        verdicts[worker] = {
            "worker": worker, "submission_digest": by_worker[worker].signed.digest,
            "status": "rejected", "reason": reason, "detail": detail[:500],
            "spot_checked": False, "distance": None, "checks": [], **extra}

    buckets = [_Bucket(b) for b in boards]
    bucket_of = {w: bk for bk in buckets for w in bk.board.assigned}
    for bk in buckets:
        if not bk.board.live:
            bk.dropped = "too few members, dealers or survivors to unmask"
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

    challenges = round_challenges(run, candidates, beacon_seed)
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
                               reveals.get(worker), beacon_seed, device=device, masked=True)
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
            if bk.dropped is not None:
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
                         params, weights=weights or None, rows_of=rows_of)


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
