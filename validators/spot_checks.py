"""Spot checks: recompute a challenged step from a worker's reveal, and bind its payload.

For each challenged segment j (steps jk+1 .. (j+1)k) the worker's reveal holds the
segment's start (whole parameters; for k > 1 whole moments too) and the leaf lists of
the end state with the chunks the beacon opens (protocol/reveal.py). The validator

1. hashes the revealed start and checks it against ``trail[j-1]`` (segment 0 starts
   from the base model with zero moments, which it rebuilds itself), and checks the end
   state's leaf lists against ``trail[j]`` and every opened chunk against its leaf;
2. recomputes: for k = 1, one forward and backward pass from the whole start
   parameters and AdamW at the opened coordinates (:func:`train_step_at`, exact:
   AdamW is elementwise after the global gradient clipping); for k > 1 the whole
   segment from the whole start state;
3. accepts when, over the opened coordinates,

    max over (params, exp_avg, exp_avg_sq) of ||recomputed - claimed|| / ||claimed|| <= tolerance.

The binding check ties the payload to the final state (``trail[-1]``) and the committed
error-feedback residual e: the payload must be ``encode(base - final.params + e)``. For a
codec whose encoding splits into independent regions (:meth:`region_unit`), only the
binding chunks are opened and compared exactly: encoding a vector that is zero outside
them gives the payload's own codes inside them. Other codecs reveal both vectors whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from veritrain.protocol.challenges import ChallengePolicy
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.commitments import (
    CHUNK,
    LEAF,
    binding_label,
    chunk_bounds,
    chunk_count,
    chunk_matches,
    opened_label,
    sample_chunks,
    state_commitment,
    vector_root,
)
from veritrain.protocol.errors import PayloadError, RejectedInput
from veritrain.protocol.memory import release_free_memory
from veritrain.protocol.messages import Submission
from veritrain.protocol.reveal import binding_is_local, parse_reveal, reveal_layout
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.training import (
    TrainingState,
    commitment_of,
    forget_trainers,
    leaves_of_vector,
    torch_threads,
    train_segment,
    train_step_at,
    vectors_distance,
)


@dataclass
class CheckResult:
    """One check of one submission: a challenged segment, or the payload binding."""

    kind: str  # "step" (a challenged segment) or "binding"
    segment: int  # the segment; for the binding, the trail's length
    start: str | None
    end: str
    ef: str | None
    distance: float | None
    ok: bool
    note: str
    missing: bool = False  # failed because the worker revealed nothing at all

    def to_json(self) -> dict[str, Any]:
        """The check as a certified verdict carries it: its outcome and a note, never the
        distance. Validators with other thread counts, kernels or devices recompute
        slightly different floats; the outcome and the note are what they agree on
        (specs/protocol.md 7.5). The distance stays in :attr:`distance` for the node."""
        return {"kind": self.kind, "segment": self.segment, "start": self.start,
                "end": self.end, "ef": self.ef, "distance": None, "ok": self.ok,
                "note": self.note[:200]}


def opened_index(chunks: list[int], numel: int) -> torch.Tensor:
    """The coordinates of the opened chunks, in order (the last chunk may be short)."""
    return torch.cat([torch.arange(*chunk_bounds(numel, c)) for c in chunks])


def _unpad(chunks: torch.Tensor, ids: list[int], numel: int) -> torch.Tensor:
    """``[C, CHUNK]`` opened chunks (zero-padded) as the flat values of their coordinates."""
    return torch.cat([chunks[i, :chunk_bounds(numel, c)[1] - chunk_bounds(numel, c)[0]]
                      for i, c in enumerate(ids)])


def _check_chunks(leaves: bytes, ids: list[int], chunks: torch.Tensor, numel: int,
                  what: str) -> None:
    for i, c in enumerate(ids):
        lo, hi = chunk_bounds(numel, c)
        row = chunks[i]
        if hi - lo < CHUNK and bool((row[hi - lo:] != 0).any()):
            raise PayloadError(f"{what}: chunk {c}'s padding is not zero")
        if not chunk_matches(leaves, c, memoryview(row[:hi - lo].contiguous().numpy())
                             .cast("B")):
            raise PayloadError(f"{what}: chunk {c} does not open its commitment")


def _leaf_lists(t: torch.Tensor) -> list[bytes]:
    return [bytes(memoryview(x.contiguous().numpy()).cast("B")) for x in t]


def _commit_from_leaves(step: int, numel: int, leaves: list[bytes]) -> str:
    return state_commitment(step, numel, [vector_root(x, numel) for x in leaves])


def check_step(run: RunContext, base_flat: torch.Tensor, sub: Submission, j: int,
               parts: dict[str, torch.Tensor], seed: bytes, *, device: str = "cpu"
               ) -> CheckResult:
    """Judge challenged segment ``j`` from the parsed reveal; never raises on bad input."""
    k, numel = run.inner.trail_every, run.numel
    start_hash = sub.trail[j - 1] if j > 0 else None
    result = CheckResult("step", j, start_hash, sub.trail[j], None, None, False, "")
    try:
        ids = sample_chunks(seed, opened_label(sub.worker, j), chunk_count(numel),
                            ChallengePolicy.of_run(run.spec).opened_chunks)
        index = opened_index(ids, numel)
        end_leaves = _leaf_lists(parts[f"s{j}.end_leaves"])
        if _commit_from_leaves((j + 1) * k, numel, end_leaves) != sub.trail[j]:
            result.note = "end leaves do not make the committed end state"
            return result
        end = parts[f"s{j}.end_chunks"]
        for v, name in enumerate(("params", "exp_avg", "exp_avg_sq")):
            _check_chunks(end_leaves[v], ids, end[v], numel, f"end {name}")
        claimed = [_unpad(end[v], ids, numel) for v in range(3)]
        rows = run.assignment(sub.round, sub.worker)[j * k:(j + 1) * k]
        if j == 0:
            start_params, start_moments = base_flat.detach().float().reshape(-1), None
        else:
            start_params = parts[f"s{j}.start_params"]
        if k == 1:
            if j > 0:
                start_leaves = _leaf_lists(parts[f"s{j}.start_leaves"])
                if commitment_of(j, numel, [leaves_of_vector(start_params), *start_leaves]
                                 ) != sub.trail[j - 1]:
                    result.note = "revealed start state does not make its commitment"
                    return result
                opened = parts[f"s{j}.start_chunks"]
                for v, name in enumerate(("exp_avg", "exp_avg_sq")):
                    _check_chunks(start_leaves[v], ids, opened[v], numel, f"start {name}")
                start_moments = (_unpad(opened[0], ids, numel), _unpad(opened[1], ids, numel))
            recomputed = list(train_step_at(run.task, run.dataset, start_params, j,
                                            start_moments, index, rows[0], run.inner,
                                            device=device))
        else:
            if j == 0:
                start = TrainingState.initial(start_params)
            else:
                moments = parts[f"s{j}.start_moments"]
                start = TrainingState(start_params, moments[0], moments[1], j * k)
                if start.commitment() != sub.trail[j - 1]:
                    result.note = "revealed start state does not make its commitment"
                    return result
            end_state = train_segment(run.task, run.dataset, start, rows, run.inner,
                                      device=device)
            recomputed = [v[index] for v in end_state.vectors()]
        result.distance = vectors_distance(recomputed, claimed)
        if not result.distance <= run.spec.verification["tolerance"]:
            result.note = "recomputed state differs beyond the tolerance"
            return result
        result.ok = True
    except (RejectedInput, KeyError) as exc:
        result.note = str(exc)
    return result


def check_binding(run: RunContext, base_flat: torch.Tensor, sub: Submission, payload: bytes,
                  parts: dict[str, torch.Tensor], seed: bytes) -> CheckResult:
    """Judge that the payload encodes ``base - final params + e``; never raises."""
    numel, s = run.numel, len(sub.trail)
    result = CheckResult("binding", s, None, sub.trail[-1], sub.ef_hash, None, False, "")
    try:
        final_leaves = _leaf_lists(parts["final.leaves"])
        if _commit_from_leaves(run.inner.steps, numel, final_leaves) != sub.trail[-1]:
            result.note = "final leaves do not make the committed final state"
            return result
        ef_leaves = bytes(memoryview(parts["final.ef_leaves"].contiguous().numpy()).cast("B"))
        if vector_root(ef_leaves, numel).hex() != sub.ef_hash:
            result.note = "residual leaves do not make the committed residual"
            return result
        codec_seed = run.codec_seed(sub.round, sub.worker)
        base = base_flat.detach().float().reshape(-1)
        if "final.chunks" in parts:
            ids = sample_chunks(seed, binding_label(sub.worker), chunk_count(numel),
                                ChallengePolicy.of_run(run.spec).binding_chunks)
            opened = parts["final.chunks"]
            _check_chunks(final_leaves[0], ids, opened[0], numel, "final params")
            _check_chunks(ef_leaves, ids, opened[1], numel, "residual")
            index = opened_index(ids, numel)
            target = torch.zeros(numel)
            target[index] = base[index] - _unpad(opened[0], ids, numel) + _unpad(
                opened[1], ids, numel)
            encoded = run.codec.encode(target, seed=codec_seed)
            del target  # a model's size less while the decode below allocates its own
            expected = run.codec.decode(encoded, numel, seed=codec_seed)[index]
            del encoded
            sent = run.codec.decode(payload, numel, seed=codec_seed)[index]
            if not torch.equal(expected, sent):
                result.note = "payload does not encode the final state at the opened chunks"
                return result
        else:
            params, ef = parts["final.params"], parts["final.ef"]
            if leaves_of_vector(params) != final_leaves[0] or leaves_of_vector(ef) != ef_leaves:
                result.note = "revealed final params or residual differ from their commitments"
                return result
            residual = ErrorFeedback(numel)
            residual.residual = ef.clone()
            expected_payload, _ = residual.step(run.codec, base - params, seed=codec_seed)
            if expected_payload != payload:
                result.note = "payload does not re-derive from the revealed final state"
                return result
        result.ok = True
    except (RejectedInput, KeyError) as exc:
        result.note = str(exc)
    return result


def failure_reason(results: list[CheckResult]) -> str:
    """The verdict reason of failed checks: ``missing_reveal`` when the worker revealed
    nothing, ``spot_check_failed`` otherwise (both proven: specs/scoring.md)."""
    return "missing_reveal" if all(r.missing for r in results if not r.ok) else \
        "spot_check_failed"


def failure_where(result: CheckResult) -> str:
    """Where a failed check failed, for a verdict's detail."""
    return f"segment {result.segment}" if result.kind == "step" else "payload binding"


def revealed_payload(run: RunContext, sub: Submission, segments: list[int],
                     reveal: bytes | None) -> bytes | None:
    """A masked run's payload from a worker's reveal, if the reveal parses and the payload
    is the one its envelope names; else None."""
    if reveal is None:
        return None
    try:
        parts = parse_reveal(reveal, reveal_layout(run, segments,
                                                   masked_payload=sub.payload_bytes))
    except PayloadError:
        return None
    payload = bytes(parts["payload"].numpy())
    return payload if hashlib.sha256(payload).hexdigest() == sub.payload_hash else None


@dataclass(frozen=True)
class RevealToCheck:
    """One submission of a round to check: its envelope, its challenged segments, and how
    to read its payload and its reveal. Both are read when a pass needs them (a round's
    reveals are never all held at once: a validator's memory does not grow with N)."""

    sub: Submission
    segments: list[int]
    reveal: Callable[[], bytes | None]
    payload: Callable[[], bytes | None] = lambda: None  # None in a masked run

    @property
    def worker(self) -> str:
        return self.sub.worker


@dataclass
class _Parsed:
    parts: dict[str, torch.Tensor]
    payload: bytes | None
    failure: str | None  # why every check of this submission fails, if one does
    missing: bool


def _parse(run: RunContext, item: RevealToCheck, masked: bool) -> _Parsed:
    """The reveal's parts, and the payload (a masked run's from the reveal)."""
    sub = item.sub
    reveal = item.reveal()
    if reveal is None:
        return _Parsed({}, None, "the worker revealed nothing", True)
    layout = reveal_layout(run, item.segments,
                           masked_payload=sub.payload_bytes if masked else None)
    try:
        parts = parse_reveal(reveal, layout)
    except PayloadError as exc:
        return _Parsed({}, None, f"reveal does not parse: {exc}", False)
    if not masked:
        return _Parsed(parts, item.payload(), None, False)
    payload = bytes(parts["payload"].numpy())
    if hashlib.sha256(payload).hexdigest() != sub.payload_hash:
        return _Parsed(parts, None, "revealed payload differs from the envelope", False)
    return _Parsed(parts, payload, None, False)


def _step_results(run: RunContext, base_flat: torch.Tensor, item: RevealToCheck,
                  parsed: _Parsed, seed: bytes, device: str) -> list[CheckResult]:
    sub, results = item.sub, []
    for j in sorted(item.segments):
        if parsed.failure is not None:
            results.append(CheckResult("step", j, sub.trail[j - 1] if j > 0 else None,
                                       sub.trail[j], None, None, False, parsed.failure,
                                       parsed.missing))
        else:
            results.append(check_step(run, base_flat, sub, j, parsed.parts, seed,
                                      device=device))
    return results


def _binding_result(run: RunContext, base_flat: torch.Tensor, item: RevealToCheck,
                    parsed: _Parsed, seed: bytes) -> CheckResult:
    sub = item.sub
    if parsed.failure is not None:
        return CheckResult("binding", len(sub.trail), None, sub.trail[-1], sub.ef_hash, None,
                           False, parsed.failure, parsed.missing)
    assert parsed.payload is not None
    return check_binding(run, base_flat, sub, parsed.payload, parsed.parts, seed)


def check_reveals(run: RunContext, base_flat: torch.Tensor, items: Sequence[RevealToCheck],
                  seed: bytes, *, device: str = "cpu", masked: bool = False
                  ) -> dict[str, list[CheckResult]]:
    """Every check of a round's submissions, by worker: its challenged segments, then its
    binding. A reveal that is missing or does not parse fails every check with the reason;
    in a masked run the payload comes in the reveal.

    Two passes over the reveals: every step check first, on one recomputing model kept for
    the whole pass (built once a round, its memory reused from check to check: building
    it per worker, or handing its pages back to the OS between workers, made each check
    fault in a model's and a step's activations afresh, about 40% of a step check at the
    bench preset); then the model goes (4 B/param) and every binding follows. The peak is
    one check's, whatever the number of workers. Recomputation runs with the run's
    ``recompute_threads`` CPU threads."""
    results: dict[str, list[CheckResult]] = {item.worker: [] for item in items}
    binding = ChallengePolicy.of_run(run.spec).binding
    with torch_threads(int(run.spec.verification.get("recompute_threads", 1))):
        stepped = False
        for item in items:
            if item.segments:
                parsed = _parse(run, item, masked)
                results[item.worker] = _step_results(run, base_flat, item, parsed, seed, device)
                stepped = stepped or parsed.failure is None
                del parsed
        if stepped:  # the recomputing model's 4 B/param go before the bindings' codec work
            forget_trainers()
            release_free_memory()
        if binding:
            for item in items:
                parsed = _parse(run, item, masked)
                results[item.worker].append(_binding_result(run, base_flat, item, parsed,
                                                            seed))
                del parsed
    return results


def check_reveal(run: RunContext, base_flat: torch.Tensor, sub: Submission,
                 payload: bytes | None,
                 segments: list[int], reveal: bytes | None, seed: bytes, *,
                 device: str = "cpu", masked: bool = False) -> list[CheckResult]:
    """Every check of one submission (:func:`check_reveals` of a round of one)."""
    item = RevealToCheck(sub, list(segments), lambda: reveal, lambda: payload)
    return check_reveals(run, base_flat, [item], seed, device=device, masked=masked)[sub.worker]


__all__ = ["LEAF", "CheckResult", "RevealToCheck", "binding_is_local", "check_binding",
           "check_reveal", "check_reveals",
           "check_step", "failure_where", "opened_index", "reveal_layout", "revealed_payload"]
