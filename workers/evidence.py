"""What a worker keeps of a round's training, and the reveal it builds from it.

While it trains, a worker's state sink (:meth:`RoundEvidence.sink`) keeps the leaf
lists of every committed state (about 0.002 bytes per parameter each) and the whole
state (12 bytes per parameter) only every ``keep_every`` steps and at the end. Once the
round's beacon fixes its checks, :meth:`RoundEvidence.write_reveal` writes the reveal
file (protocol/reveal.py) straight from what it kept; a challenged step whose states
were not kept is first replayed from the last kept state before it, on the same device
and thread count, which gives the same bits (the replayed commitments are checked
against the trail). ``keep_every`` trades disk (``H / keep_every`` states a round) for
replay (at most ``keep_every`` steps per challenged segment).

Where the vectors live is the store's business: files under the worker's state
directory (:class:`DirStore`), or memory for the in-process swarm (:class:`MemoryStore`).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import torch
from veritrain.protocol.challenges import ChallengePolicy
from veritrain.protocol.commitments import (
    CHUNK,
    binding_label,
    chunk_bounds,
    chunk_count,
    opened_label,
    sample_chunks,
    vector_root,
)
from veritrain.protocol.messages import Submission
from veritrain.protocol.reveal import RevealLayout, reveal_layout, write_reveal
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.training import (
    StoredState,
    TrainingState,
    leaves_of_vector,
    replay_steps,
)

#: One committed state's leaf lists (params, exp_avg, exp_avg_sq).
Leaves = tuple[bytes, bytes, bytes]

#: Steps between the whole states a worker node keeps unless told otherwise. Writing a
#: state is 12 bytes per parameter: every step, that write (about 2 s a step for an
#: 85M-parameter model on this project's reference machine) costs more than the step
#: itself; every 4th, the step still ran at 0.88-0.92 of plain (how much the disk's
#: write-back takes of the CPU varies); every 8th, 0.95, against 0.96 keeping none. A
#: challenged step is then replayed from at most 7 steps back (specs/protocol.md 10.4).
DEFAULT_KEEP_STEPS = 8


def default_keep_every(run: RunContext) -> int:
    """The node's ``keep_every``: :data:`DEFAULT_KEEP_STEPS` rounded up to a multiple of
    the trail's k (only committed states can be kept)."""
    k = run.inner.trail_every
    return k * -(-DEFAULT_KEEP_STEPS // k)


class EvidenceMissing(Exception):
    """What a check opens cannot be produced: not kept, and a replay does not give the
    committed states (another device, thread count or kernels; or nothing was trained)."""


class EvidenceStore(Protocol):
    """Named float32 vectors and byte strings of one round."""

    def put_vector(self, name: str, vectors: tuple[torch.Tensor, ...]) -> None: ...
    def vector(self, name: str, part: int, numel: int) -> np.ndarray: ...
    def has(self, name: str) -> bool: ...
    def read_into(self, name: str, part: int, numel: int, out: torch.Tensor) -> None: ...
    def discard_vector(self, name: str) -> None: ...
    def put_bytes(self, name: str, data: bytes) -> None: ...
    def get_bytes(self, name: str) -> bytes: ...
    def clear(self) -> None: ...
    def durable(self) -> None: ...


class MemoryStore:
    """Evidence in memory (in-process swarms and tests)."""

    def __init__(self) -> None:
        self.vectors: dict[str, tuple[np.ndarray, ...]] = {}
        self.blobs: dict[str, bytes] = {}

    def put_vector(self, name: str, vectors: tuple[torch.Tensor, ...]) -> None:
        self.vectors[name] = tuple(v.detach().cpu().numpy().copy() for v in vectors)

    def vector(self, name: str, part: int, numel: int) -> np.ndarray:
        return self.vectors[name][part]

    def has(self, name: str) -> bool:
        return name in self.vectors or name in self.blobs

    def discard_vector(self, name: str) -> None:
        self.vectors.pop(name, None)

    def read_into(self, name: str, part: int, numel: int, out: torch.Tensor) -> None:
        out.copy_(torch.from_numpy(self.vectors[name][part]))

    def put_bytes(self, name: str, data: bytes) -> None:
        self.blobs[name] = data

    def get_bytes(self, name: str) -> bytes:
        return self.blobs[name]

    def clear(self) -> None:
        self.vectors.clear()
        self.blobs.clear()

    def durable(self) -> None:
        """Nothing to flush: memory does not survive a crash anyway."""


class DirStore:
    """Evidence as files in one directory: a vector group is its float32 vectors back to
    back (``name.f32``), read back through a memory map so that only the chunks a reveal
    opens are read from disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    def put_vector(self, name: str, vectors: tuple[torch.Tensor, ...]) -> None:
        tmp = self.path / f"{name}.f32.tmp"
        with open(tmp, "wb") as fh:
            for v in vectors:
                fh.write(memoryview(v.detach().cpu().contiguous().numpy()).cast("B"))
        os.replace(tmp, self.path / f"{name}.f32")

    def vector(self, name: str, part: int, numel: int) -> np.ndarray:
        return np.memmap(self.path / f"{name}.f32", dtype="<f4", mode="r",
                         offset=4 * numel * part, shape=(numel,))

    def has(self, name: str) -> bool:
        return (self.path / f"{name}.f32").exists() or (self.path / name).exists()

    def discard_vector(self, name: str) -> None:
        (self.path / f"{name}.f32").unlink(missing_ok=True)

    def read_into(self, name: str, part: int, numel: int, out: torch.Tensor) -> None:
        """Read vector ``part`` into ``out`` (a contiguous float32 CPU tensor) with plain
        reads: unlike a memory map, nothing of the file stays resident in this process."""
        view = memoryview(out.numpy()).cast("B")
        if len(view) != 4 * numel:
            raise ValueError(f"{len(view) // 4} values to fill, the vector has {numel}")
        with open(self.path / f"{name}.f32", "rb", buffering=0) as fh:
            fh.seek(4 * numel * part)
            done = 0
            while done < len(view):
                n = fh.readinto(view[done:])
                if not n:
                    raise EvidenceMissing(f"{name}.f32 ends before vector {part}")
                done += n

    def put_bytes(self, name: str, data: bytes) -> None:
        tmp = self.path / f"{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.path / name)

    def get_bytes(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def clear(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def durable(self) -> None:
        """Flush every file to disk: a worker that crashes after its submission is accepted
        must still be able to answer its checks."""
        for path in self.path.iterdir():
            if not path.name.endswith(".tmp"):
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())


@dataclass
class RevealPlan:
    """The checks a round's beacon gave one worker."""

    segments: list[int]
    opened: dict[int, list[int]]  # segment -> opened chunk indices
    binding: list[int]  # binding chunk indices (local codecs)


class RoundEvidence:
    """One worker's evidence of one round (see the module docstring)."""

    def __init__(self, store: EvidenceStore, run: RunContext, round_index: int, worker: str,
                 *, keep_every: int = 1, keep: Callable[[int], bool] | None = None) -> None:
        if keep_every < 1:
            raise ValueError("keep_every must be a positive number of steps")
        self.store, self.run, self.round, self.worker = store, run, round_index, worker
        self.keep_every = keep_every
        #: Which steps' whole states are kept (the last one always is).
        self.keep = keep if keep is not None else (lambda step: step % keep_every == 0)
        self.numel = run.numel
        self._lock = threading.Lock()

    # -- while training

    def begin(self, base_flat: torch.Tensor, residual: torch.Tensor) -> str:
        """Keep the round's base (replays start there) and the residual its payload uses;
        the residual's commitment (the submission's ``ef_hash``)."""
        self.store.put_vector("base", (base_flat.detach().float().reshape(-1),))
        self.store.put_vector("ef", (residual.detach().float().reshape(-1),))
        leaves = leaves_of_vector(residual.detach().float().cpu())
        self.store.put_bytes("ef.leaves", leaves)
        return vector_root(leaves, self.numel).hex()

    def sink(self, state: TrainingState, leaves: Leaves) -> None:
        """The training loop's state sink: every state's leaves, some states whole."""
        self.store.put_bytes(f"leaves-{state.step}", b"".join(leaves))
        if self.keep(state.step) or state.step == self.run.inner.steps:
            self.store.put_vector(f"state-{state.step}", state.vectors())

    def keep_payload(self, payload: bytes) -> None:
        """Masked runs: the payload stays with the worker until a check asks for it."""
        self.store.put_bytes("payload", payload)

    # -- answering the checks

    def plan(self, seed: bytes, segments: list[int]) -> RevealPlan:
        policy = ChallengePolicy.of_run(self.run.spec)
        n = chunk_count(self.numel)
        return RevealPlan(
            sorted(segments),
            {j: sample_chunks(seed, opened_label(self.worker, j), n, policy.opened_chunks)
             for j in segments},
            sample_chunks(seed, binding_label(self.worker), n, policy.binding_chunks))

    def write_reveal(self, out: BinaryIO, seed: bytes, segments: list[int], layout: RevealLayout,
                     trail: list[str], *, device: str = "cpu") -> None:
        """Write the reveal of these challenged segments (replaying unkept states)."""
        plan = self.plan(seed, segments)
        k = self.run.inner.trail_every
        for j in plan.segments:
            for step in ((j * k, (j + 1) * k) if j > 0 else ((j + 1) * k,)):
                self._ensure_state(step, trail, device=device)
        write_reveal(out, layout, self._producers(plan, layout))

    def write_reveal_file(self, path: Path, seed: bytes, segments: list[int],
                          sub: Submission, *, device: str = "cpu") -> None:
        """Write the reveal for ``sub``'s checks to ``path`` (masked runs: with the payload)."""
        layout = reveal_layout(self.run, segments, masked_payload=(
            sub.payload_bytes if self.run.spec.masked is not None else None))
        with open(path, "wb") as fh:
            self.write_reveal(fh, seed, segments, layout, sub.trail, device=device)

    def _ensure_state(self, step: int, trail: list[str], *, device: str) -> None:
        if self.store.has(f"state-{step}"):
            return
        with self._lock:
            start_step = next(s for s in range(step - 1, -1, -1)
                              if s == 0 or self.store.has(f"state-{s}"))
            rows = self.run.assignment(self.round, self.worker)[start_step:step]
            k = self.run.inner.trail_every
            # The start is read straight into the trainer: no second 12 bytes per parameter
            # beside its buffers (issue #18, item 3).
            replayed = replay_steps(self.run.task, self.run.dataset,
                                    self._replay_start(start_step), rows, self.run.inner,
                                    device=device, sink=self._replay_sink(step))
            for entry, at in zip(replayed, range(start_step + k, step + 1, k), strict=True):
                if entry != trail[at // k - 1]:
                    # What the replay kept is not the committed state: never reveal it.
                    self.store.discard_vector(f"state-{step}")
                    raise EvidenceMissing(f"replaying to step {at} gave another commitment "
                                          "than the trail's: this machine does not reproduce "
                                          "its own training (device, threads or kernels "
                                          "changed?)")

    def _replay_start(self, step: int) -> StoredState:
        """The kept state at ``step`` (the round's base at step 0), to be read from the store."""
        name = "base" if step == 0 else f"state-{step}"

        def read(vector: int, out: torch.Tensor) -> None:
            self.store.read_into(name, vector, self.numel, out)
        return StoredState(step, read)

    def _replay_sink(self, want: int) -> Callable[[TrainingState, Leaves], None]:
        def sink(state: TrainingState, leaves: Leaves) -> None:
            if state.step == want:
                self.store.put_vector(f"state-{state.step}", state.vectors())
        return sink

    def _producers(self, plan: RevealPlan, layout: RevealLayout
                   ) -> dict[str, Callable[[BinaryIO], None]]:
        k, numel = self.run.inner.trail_every, self.numel
        out: dict[str, Callable[[BinaryIO], None]] = {}
        names = {name for name, _, _ in layout.entries}

        def whole(name: str, parts: tuple[int, ...]) -> Callable[[BinaryIO], None]:
            def produce(fh: BinaryIO) -> None:
                for part in parts:
                    fh.write(memoryview(np.ascontiguousarray(
                        self.store.vector(name, part, numel))).cast("B"))
            return produce

        def leaves(name: str, parts: tuple[int, ...]) -> Callable[[BinaryIO], None]:
            def produce(fh: BinaryIO) -> None:
                data = self.store.get_bytes(name)
                size = len(data) // 3 if name.startswith("leaves-") else len(data)
                for part in parts:
                    fh.write(data[part * size:(part + 1) * size])
            return produce

        def chunks(name: str, parts: tuple[int, ...], ids: list[int]
                   ) -> Callable[[BinaryIO], None]:
            def produce(fh: BinaryIO) -> None:
                for part in parts:
                    vec = self.store.vector(name, part, numel)
                    for c in ids:
                        lo, hi = chunk_bounds(numel, c)
                        row = np.zeros(CHUNK, dtype="<f4")
                        row[:hi - lo] = vec[lo:hi]
                        fh.write(memoryview(row).cast("B"))
            return produce

        for j in plan.segments:
            start, end = j * k, (j + 1) * k
            ids = plan.opened[j]
            if j > 0:
                out[f"s{j}.start_params"] = whole(f"state-{start}", (0,))
                if k > 1:
                    out[f"s{j}.start_moments"] = whole(f"state-{start}", (1, 2))
                else:
                    out[f"s{j}.start_leaves"] = leaves(f"leaves-{start}", (1, 2))
                    out[f"s{j}.start_chunks"] = chunks(f"state-{start}", (1, 2), ids)
            out[f"s{j}.end_leaves"] = leaves(f"leaves-{end}", (0, 1, 2))
            out[f"s{j}.end_chunks"] = chunks(f"state-{end}", (0, 1, 2), ids)
        final = self.run.inner.steps
        if "final.leaves" in names:
            out["final.leaves"] = leaves(f"leaves-{final}", (0, 1, 2))
            out["final.ef_leaves"] = leaves("ef.leaves", (0,))
        if "final.chunks" in names:
            def final_chunks(fh: BinaryIO) -> None:
                chunks(f"state-{final}", (0,), plan.binding)(fh)
                chunks("ef", (0,), plan.binding)(fh)
            out["final.chunks"] = final_chunks
        elif "final.params" in names:
            out["final.params"] = whole(f"state-{final}", (0,))
            out["final.ef"] = whole("ef", (0,))
        if "payload" in names:
            out["payload"] = lambda fh: fh.write(self.store.get_bytes("payload"))  # type: ignore[func-returns-value]
        return out

    def settle(self) -> None:
        """The round is finalized: nothing of it can be asked for any more."""
        self.store.clear()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(1 << 22):
            h.update(piece)
    return h.hexdigest()


def reveal_bytes(evidence: RoundEvidence, seed: bytes, segments: list[int], sub: Submission,
                 *, device: str = "cpu") -> bytes | None:
    """The reveal of ``sub``'s checks in memory (in-process swarms), or None when the
    worker kept nothing to open (a free rider's invented trail)."""
    layout = reveal_layout(evidence.run, segments, masked_payload=(
        sub.payload_bytes if evidence.run.spec.masked is not None else None))
    buf = io.BytesIO()
    try:
        evidence.write_reveal(buf, seed, segments, layout, sub.trail, device=device)
    except (EvidenceMissing, KeyError):
        return None
    return buf.getvalue()
