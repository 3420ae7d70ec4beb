"""The inner loop: H AdamW steps from the round's base model, in recomputable segments.

A worker starts from the base parameters and a fresh AdamW state, runs
``cfg.steps`` steps on its data assignment and submits the pseudo-gradient
``delta = base - final``. Every ``cfg.trail_every`` (= k) steps it hashes its
:class:`TrainingState` (parameters + AdamW moments + step count): the trail of
S = H / k hashes commits it to one training path, Proof-of-Learning style.

A validator that challenges segment s gets the revealed start state (whose
hash is trail[s-1], or the base for s = 0), runs :func:`train_segment` on
rows ``s*k .. s*k+k-1`` of the assignment and compares its result with the
revealed end state. :func:`local_train` is literally a loop over the same
segment function, with the optimizer rebuilt from the state at every
boundary, so a recompute on the same machine and thread count is bitwise
identical, and elsewhere it differs only by floating-point reassociation.

The format of a state and of the trail is in ``specs/tasks.md``.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .commitments import (
    chunk_count,
    chunk_ranges,
    hash_chunks,
    leaves_of,
    state_commitment,
    vector_root,
)
from .errors import RejectedInput
from .memory import release_free_memory
from .tasks.base import Dataset, Task
from .tensors import all_finite, load_flat_params

# cuBLAS reads this when it creates its workspace; deterministic GEMMs on CUDA
# need it, and it must be set before the first CUDA matmul of the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

#: Largest step count a state may carry: AdamW keeps ``step`` as float32, exact to 2**24.
MAX_STATE_STEP = 1 << 24
#: The three vectors of a state, in the order their roots enter its commitment.
STATE_VECTORS = ("params", "exp_avg", "exp_avg_sq")


class ConfigError(RejectedInput):
    """Inner-loop hyperparameters that do not validate."""

    reason = "bad_config"


class TrainingDivergedError(ArithmeticError):
    """The loss or the parameters became NaN or Inf during training."""


# --- configuration --------------------------------------------------------------------


@dataclass(frozen=True)
class InnerConfig:
    """Hyperparameters of one worker-round of local training."""

    steps: int  # H: inner steps per round
    batch_size: int  # examples per inner step
    lr: float
    betas: tuple[float, float] = (0.9, 0.95)  # beta2 0.95: short runs, adapt to gradient scale fast
    eps: float = 1e-8
    weight_decay: float = 0.0  # the outer optimizer already pulls toward the consensus
    grad_clip: float | None = 1.0  # max global grad norm; None disables clipping
    trail_every: int = 1  # k: one trail hash per k steps; must divide steps

    def __post_init__(self) -> None:
        def ok_int(v: object, lo: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= lo

        def ok_float(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not ok_int(self.steps, 1) or self.steps > MAX_STATE_STEP:
            raise ConfigError(f"steps={self.steps!r} must be an int in [1, {MAX_STATE_STEP}]")
        if not ok_int(self.batch_size, 1):
            raise ConfigError(f"batch_size={self.batch_size!r} must be a positive int")
        if not ok_int(self.trail_every, 1) or self.steps % self.trail_every:
            raise ConfigError(
                f"trail_every={self.trail_every!r} must be a positive divisor of steps={self.steps}"
            )
        if not ok_float(self.lr) or self.lr <= 0:
            raise ConfigError(f"lr={self.lr!r} must be positive and finite")
        if len(self.betas) != 2 or not all(ok_float(b) and 0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if not ok_float(self.eps) or self.eps <= 0:
            raise ConfigError(f"eps={self.eps!r} must be positive and finite")
        if not ok_float(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be non-negative")
        if self.grad_clip is not None and (not ok_float(self.grad_clip) or self.grad_clip <= 0):
            raise ConfigError(f"grad_clip={self.grad_clip!r} must be positive or None")

    @property
    def segments(self) -> int:
        """S = steps / trail_every: the trail's length."""
        return self.steps // self.trail_every

    def as_dict(self) -> dict[str, object]:
        """JSON-able form (betas as a list) for run specs."""
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_mapping(cls, m: Mapping[str, object]) -> InnerConfig:
        """Parse :meth:`as_dict` output (e.g. from a run spec); raises :class:`ConfigError`."""
        known = {f for f in cls.__dataclass_fields__}
        if set(m) - known:
            raise ConfigError(f"unknown inner-config fields {sorted(set(m) - known)}")
        d = dict(m)
        betas = d.get("betas", (0.9, 0.95))
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise ConfigError("betas must be a pair")
        d["betas"] = (betas[0], betas[1])
        try:
            return cls(**d)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc


# --- training state -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TrainingState:
    """Parameters and AdamW state after ``step`` optimizer steps, as flat float32 vectors.

    ``exp_avg``/``exp_avg_sq`` are AdamW's first and second moments laid out like
    the parameters (``model.parameters()`` order, as ``flatten_params``). The
    vectors may be views of a trainer's live buffers: consume them before its next
    step.
    """

    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int

    @classmethod
    def initial(cls, flat: torch.Tensor) -> TrainingState:
        """Start of a round: the base parameters with zero moments and step 0."""
        params = flat.detach().to(torch.float32).cpu().reshape(-1).clone()
        return cls(params, torch.zeros_like(params), torch.zeros_like(params), 0)

    @property
    def numel(self) -> int:
        return self.params.numel()

    def vectors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.params, self.exp_avg, self.exp_avg_sq

    def leaves(self, *, pool: Executor | None = None, parts: int = 1
               ) -> tuple[bytes, bytes, bytes]:
        """The leaf lists of the three vectors (CPU vectors only)."""
        return tuple(leaves_of(vector_bytes(v), pool=pool, parts=parts)  # type: ignore[return-value]
                     for v in self.vectors())

    def commitment(self) -> str:
        """The trail entry of this state (:func:`commitment_of`)."""
        return commitment_of(self.step, self.numel, self.leaves())


@dataclass(frozen=True)
class StoredState:
    """A state kept elsewhere (a worker's disk), read straight into a trainer's buffers, so
    that no second copy sits beside them: ``read(vector, out)`` fills the float32 CPU
    tensor ``out`` with vector 0 (params), 1 (exp_avg) or 2 (exp_avg_sq). At ``step`` 0 only
    the params are read and the moments are zero (a round's start)."""

    step: int
    read: Callable[[int, torch.Tensor], None]


def vector_bytes(vec: torch.Tensor) -> memoryview:
    """The float32 little-endian bytes of a contiguous CPU vector, without a copy."""
    if vec.device.type != "cpu" or vec.dtype != torch.float32 or not vec.is_contiguous():
        raise ValueError("a committed vector is a contiguous float32 CPU tensor")
    return memoryview(vec.numpy()).cast("B")


def leaves_of_vector(vec: torch.Tensor) -> bytes:
    """The leaf list of a CPU float32 vector."""
    return leaves_of(vector_bytes(vec.contiguous()))


def commitment_of(step: int, numel: int, leaves: Sequence[bytes]) -> str:
    """A state's trail entry from the leaf lists of its three vectors."""
    return state_commitment(step, numel, [vector_root(x, numel) for x in leaves])


def state_distance(a: TrainingState, b: TrainingState) -> float:
    """Largest :func:`relative_distance` of the three vectors (``inf`` if steps differ)."""
    if a.step != b.step or a.numel != b.numel:
        return math.inf
    return vectors_distance(a.vectors(), b.vectors())


def vectors_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Largest :func:`relative_distance` of paired vectors (params, exp_avg, exp_avg_sq)."""
    return max(relative_distance(x, y) for x, y in zip(a, b, strict=True))


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, 1e-30)``, accumulated in float64 on CPU."""
    if a.numel() != b.numel():
        raise ValueError(f"cannot compare {a.numel()} with {b.numel()} elements")
    a64 = a.detach().reshape(-1).cpu().double()
    b64 = b.detach().reshape(-1).cpu().double()
    num = float(torch.linalg.vector_norm(a64 - b64))
    return num / max(float(torch.linalg.vector_norm(b64)), 1e-30)


# --- determinism ----------------------------------------------------------------------


_DETERMINISTIC_LOCK = threading.Lock()
#: Blocks inside :func:`deterministic_mode` now, and the settings the first one found.
_deterministic_users = 0
_settings_before: tuple[bool, ...] = ()


def _torch_settings() -> tuple[bool, ...]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def _restore_torch_settings(prev: tuple[bool, ...]) -> None:
    torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    torch.backends.cuda.matmul.allow_tf32 = prev[2]
    torch.backends.cudnn.allow_tf32 = prev[3]
    torch.backends.cudnn.deterministic = prev[4]
    torch.backends.cudnn.benchmark = prev[5]


@contextmanager
def deterministic_mode(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Deterministic kernels (and no TF32 on CUDA) inside the block.

    These are process-wide switches, and nodes sharing a process (workers and validators
    side by side, as the tests run them) enter blocks from several threads at once: blocks
    are counted, the first saves the settings and the last one out restores them, so no
    block leaves another running without them.
    """
    global _deterministic_users, _settings_before
    if not enabled:
        yield
        return
    with _DETERMINISTIC_LOCK:
        before = _torch_settings() if _deterministic_users == 0 else _settings_before
        try:
            torch.use_deterministic_algorithms(True)
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = False  # TF32 rounds inputs to 10 bits
                torch.backends.cudnn.allow_tf32 = False
                torch.backends.cudnn.deterministic = True
                torch.backends.cudnn.benchmark = False  # autotuning may pick other kernels
        except BaseException:
            if _deterministic_users == 0:
                _restore_torch_settings(before)
            raise
        _settings_before = before
        _deterministic_users += 1
    try:
        yield
    finally:
        with _DETERMINISTIC_LOCK:
            _deterministic_users -= 1
            if _deterministic_users == 0:
                _restore_torch_settings(_settings_before)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` inside the block (a validator's recomputation uses the
    run's ``recompute_threads``, so validators on one kind of hardware agree bit for bit)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --- the loop -------------------------------------------------------------------------


#: Called with each committed state (a view of the trainer's buffers, valid only during
#: the call) and its three leaf lists, on a hashing thread, before the next step changes it.
StateSink = Callable[[TrainingState, tuple[bytes, bytes, bytes]], None]


@dataclass
class LocalTrainResult:
    """What one worker-round of local training produced."""

    final_flat: torch.Tensor  # parameters after H steps, float32 CPU
    delta: torch.Tensor  # pseudo-gradient: base_flat - final_flat, float32 CPU
    losses: list[float]  # training loss at each inner step, before that step's update
    samples: int  # steps * batch_size
    trail: list[str]  # commitments of the states after steps k, 2k, ..., H
    final_leaves: tuple[bytes, bytes, bytes] = field(repr=False, default=(b"", b"", b""))


class _Trainer:
    """A model on ``device`` whose parameters and AdamW moments are three flat buffers.

    Built once (model construction is the costly part); :meth:`load` writes a state
    into the buffers and resets the optimizer's step, so what a run of steps
    computes depends only on the state it starts from and its rows.
    """

    def __init__(
        self, task: Task, dataset: Dataset, cfg: InnerConfig, device: torch.device,
        *, moments: bool = True,
    ) -> None:
        self.task, self.dataset, self.cfg, self.device = task, dataset, cfg, device
        self.model = task.make_model().to(device)
        self.model.train()
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.flat = torch.empty(self.numel, dtype=torch.float32, device=device)
        # A trainer that only takes gradients (a validator's one-step checks) needs no
        # moment buffers: 8 bytes per parameter it does not hold.
        self.exp_avg = torch.zeros_like(self.flat) if moments else torch.empty(0)
        self.exp_avg_sq = torch.zeros_like(self.flat) if moments else torch.empty(0)
        self.opt = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,  # the plain per-tensor loop: simplest, same math on every device
            fused=False,
        )
        offset = 0
        #: [start, stop) of each parameter in the flat buffers.
        self.bounds: list[tuple[int, int]] = []
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1).float())
                p.data = self.flat[offset:offset + n].view_as(p)
                if moments:
                    self.opt.state[p] = {
                        # AdamW keeps step as a float32 CPU scalar when not capturable/fused.
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": self.exp_avg[offset:offset + n].view_as(p),
                        "exp_avg_sq": self.exp_avg_sq[offset:offset + n].view_as(p),
                    }
                self.bounds.append((offset, offset + n))
                offset += n
        self.step = 0

    def gradient_at(self, index: torch.Tensor) -> torch.Tensor:
        """The gradients :meth:`gradients` left, at the sorted flat coordinates ``index``
        (gathered parameter by parameter: no whole flat gradient is built)."""
        pieces = []
        lo = 0
        for p, (start, stop) in zip(self.params, self.bounds, strict=True):
            hi = int(torch.searchsorted(index, stop))
            if hi > lo:
                pieces.append(p.grad.reshape(-1)[index[lo:hi] - start])
            lo = hi
        return torch.cat(pieces) if pieces else torch.empty(0, device=self.device)

    def load(self, start: TrainingState) -> None:
        """Make ``start`` the current state (parameters, moments and step)."""
        if start.numel != self.numel:
            raise ValueError(f"state has {start.numel} parameters, model has {self.numel}")
        with torch.no_grad():
            for buf, vec in zip((self.flat, self.exp_avg, self.exp_avg_sq), start.vectors(),
                                strict=True):
                buf.copy_(vec.reshape(-1))
        for p in self.params:
            self.opt.state[p]["step"].fill_(float(start.step))
        self.step = start.step

    def load_stored(self, stored: StoredState) -> None:
        """Make a :class:`StoredState` the current state, read vector by vector into the
        buffers (through one CPU staging vector on another device)."""
        buffers = (self.flat, self.exp_avg, self.exp_avg_sq)
        staging = None if self.device.type == "cpu" else torch.empty(self.numel)
        with torch.no_grad():
            for i, buf in enumerate(buffers):
                if stored.step == 0 and i > 0:
                    buf.zero_()
                elif staging is None:
                    stored.read(i, buf)
                else:
                    stored.read(i, staging)
                    buf.copy_(staging)
        for p in self.params:
            self.opt.state[p]["step"].fill_(float(stored.step))
        self.step = stored.step

    def load_base(self, base_flat: torch.Tensor) -> None:
        """Make the round's start the current state: ``base_flat``, zero moments, step 0
        (what ``load(TrainingState.initial(base_flat))`` does, without its copies)."""
        with torch.no_grad():
            self.flat.copy_(base_flat.detach().reshape(-1))
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
        for p in self.params:
            self.opt.state[p]["step"].fill_(0.0)
        self.step = 0

    def state(self) -> TrainingState:
        """The current state as views of the buffers (no copy)."""
        return TrainingState(self.flat, self.exp_avg, self.exp_avg_sq, self.step)

    def gradients(self, row: torch.Tensor) -> float:
        """Forward and backward on one batch; clipped gradients in ``p.grad``; the loss."""
        batch = self.task.make_batch(self.dataset, row, device=self.device)
        self.opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = self.task.loss(self.model, batch)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise TrainingDivergedError(
                    f"loss is {value} at step {self.step + 1}; lower the learning rate")
            loss.backward()
        for p in self.params:
            if p.grad is None:  # unused parameters count as zero gradient, so all share `step`
                p.grad = torch.zeros_like(p)
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=False)
        return value

    def apply(self) -> None:
        """The optimizer step on the gradients :meth:`gradients` left."""
        self.opt.step()
        self.step += 1


class CommitPool(ThreadPoolExecutor):
    """A worker's hashing threads: each committed vector is hashed in ``width`` parts at once.

    On CPU the cores that hash are the ones that train, so a state is hashed between two
    steps by all of them rather than beside the next step's forward and backward pass
    (which it would only slow down; specs/protocol.md section 10.4). On CUDA they hash
    the state's pinned host copy while the device runs the next step.
    """

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError("a commit pool has at least one thread")
        super().__init__(max_workers=width, thread_name_prefix="commit")
        self.width = width

    @classmethod
    def for_device(cls, device: str | torch.device) -> CommitPool:
        """As many threads as torch computes with on CPU; on a GPU, 4 host threads (at
        about 4 GB/s each, enough for a 1B-parameter step of 7 ns/param: section 10.4)."""
        if torch.device(device).type == "cpu":
            return cls(torch.get_num_threads())
        return cls(max(1, min(4, os.cpu_count() or 1)))


Commit = tuple[str, tuple[bytes, bytes, bytes]]


class _Committer:
    """Commits states on the pool's threads (:class:`CommitPool`).

    CPU: the buffers are hashed in place, by all the pool's threads, before the call
    returns; the sink then runs on the pool while the next step's forward and backward
    pass compute, and the next optimizer step waits for it (:meth:`before_step`).
    CUDA: the buffers are first copied to pinned host memory on a side stream, and
    only that copy must finish before the next step; hashing and sink run behind it.
    """

    def __init__(self, trainer: _Trainer, pool: Executor | None, sink: StateSink | None
                 ) -> None:
        self.trainer, self.pool, self.sink = trainer, pool, sink
        self.parts = getattr(pool, "width", 1) if pool is not None else 1
        self.pending: Future[Commit] | None = None
        self.cuda = trainer.device.type == "cuda"
        if self.cuda:
            self.host = torch.empty((3, trainer.numel), dtype=torch.float32, pin_memory=True)
            self.stream = torch.cuda.Stream(device=trainer.device)
            self.copied = torch.cuda.Event()

    def submit(self) -> None:
        """Start committing the trainer's current state (call right after a step)."""
        t = self.trainer
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                for row, buf in zip(self.host, (t.flat, t.exp_avg, t.exp_avg_sq), strict=True):
                    row.copy_(buf, non_blocking=True)
                self.copied.record(self.stream)
            state = TrainingState(self.host[0], self.host[1], self.host[2], t.step)
        else:
            state = t.state()
        if self.pool is None:
            if self.cuda:
                self.copied.synchronize()
            self.pending = _done(self._finish(state, [[_done(leaves_of_vector(v))]
                                                      for v in state.vectors()]))
            return
        parts = self._hash(state)
        if self.cuda:  # FIFO: every part is taken before _finish, so _finish cannot starve
            self.pending = self.pool.submit(self._finish, state, parts)
            return
        for futures in parts:
            for f in futures:
                f.result()
        self.pending = (self.pool.submit(self._finish, state, parts) if self.sink is not None
                        else _done(self._finish(state, parts)))

    def _hash(self, state: TrainingState) -> list[list[Future[bytes]]]:
        """Futures of each vector's leaf ranges, ``self.parts`` of them per vector."""
        assert self.pool is not None
        ready = self.copied.synchronize if self.cuda else None

        def part(view: memoryview, first: int, last: int) -> bytes:
            if ready is not None:
                ready()
            return hash_chunks(view, first, last)

        ranges = chunk_ranges(chunk_count(state.numel), self.parts)
        return [[self.pool.submit(part, vector_bytes(v), a, b) for a, b in ranges]
                for v in state.vectors()]

    def _finish(self, state: TrainingState, parts: list[list[Future[bytes]]]) -> Commit:
        leaves = tuple(b"".join(f.result() for f in futures) for futures in parts)
        assert len(leaves) == 3
        if self.sink is not None:
            self.sink(state, leaves)
        return commitment_of(state.step, state.numel, leaves), leaves

    def before_step(self) -> None:
        """Block until the buffers may change: the pending state is read (CPU) or copied."""
        if self.pending is None:
            return
        if self.cuda:
            self.copied.synchronize()
        else:
            self.pending.result()

    def wait(self) -> Commit:
        assert self.pending is not None
        out = self.pending.result()
        self.pending = None
        return out


def _done(value: object) -> Future:  # type: ignore[type-arg]
    f: Future = Future()  # type: ignore[type-arg]
    f.set_result(value)
    return f


def run_steps(
    trainer: _Trainer,
    rows: torch.Tensor,
    *,
    losses: list[float],
    commit_every: int,
    pool: Executor | None = None,
    sink: StateSink | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[list[str], tuple[bytes, bytes, bytes]]:
    """Run the steps of ``rows`` (``[n, B]``) from the trainer's state, committing the state
    after every ``commit_every`` steps (counted from step 0); the commitments and the
    last state's leaves."""
    if rows.dim() != 2 or rows.shape[1] != trainer.cfg.batch_size:
        raise ValueError(
            f"batch indices must be [n, {trainer.cfg.batch_size}], got {tuple(rows.shape)}")
    committer = _Committer(trainer, pool, sink)
    trail: list[str] = []
    last: tuple[bytes, bytes, bytes] = (b"", b"", b"")
    for row in rows:
        value = trainer.gradients(row)
        committer.before_step()
        if committer.pending is not None and not committer.cuda:
            entry, last = committer.wait()
            trail.append(entry)
        trainer.apply()
        losses.append(value)
        if progress is not None:
            progress(trainer.step, value)
        if trainer.step % commit_every == 0:
            if committer.pending is not None:  # CUDA: the copy is done, the hashing may run on
                entry, last = committer.wait()
                trail.append(entry)
            committer.submit()
    if committer.pending is not None:
        entry, last = committer.wait()
        trail.append(entry)
    trainer.opt.zero_grad(set_to_none=True)  # the gradients are not needed any more
    if not all_finite(trainer.flat):
        raise TrainingDivergedError(f"parameters are not finite after step {trainer.step}")
    return trail, last


def train_segment(
    task: Task,
    dataset: Dataset,
    start: TrainingState,
    batch_indices: torch.Tensor,
    cfg: InnerConfig,
    *,
    device: str | torch.device = "cpu",
    deterministic: bool = True,
) -> TrainingState:
    """Recompute the steps of ``batch_indices`` (``[k, batch_size]``) from a full state.

    Exactly what :func:`local_train` runs between two trail commitments; returns a
    copy of the end state on the CPU.
    """
    dev = torch.device(device)
    with deterministic_mode(dev, deterministic):
        trainer = _trainer_for(task, dataset, cfg, dev)
        trainer.load(start)
        if batch_indices.dim() != 2 or batch_indices.shape[1] != cfg.batch_size:
            raise ValueError(
                f"batch indices must be [k, {cfg.batch_size}], got {tuple(batch_indices.shape)}")
        for row in batch_indices:
            trainer.gradients(row)
            trainer.apply()
        end = trainer.state()
        return TrainingState(*(v.detach().cpu().clone() for v in end.vectors()), end.step)


def train_step_at(
    task: Task,
    dataset: Dataset,
    start_params: torch.Tensor,
    start_step: int,
    moments: tuple[torch.Tensor, torch.Tensor] | None,
    index: torch.Tensor,
    row: torch.Tensor,
    cfg: InnerConfig,
    *,
    device: str | torch.device = "cpu",
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step from full parameters, the optimizer applied at the coordinates ``index`` only.

    The gradient needs every parameter, but AdamW is elementwise after the (global)
    gradient clipping: given the start moments at ``index`` (``moments``; zero for the
    round's first step, ``None``), the end parameters and moments at ``index`` follow
    exactly as a full step would compute them. Returns them as CPU float32 vectors.
    """
    dev = torch.device(device)
    with deterministic_mode(dev, deterministic):
        trainer = _trainer_for(task, dataset, cfg, dev, moments=False)
        with torch.no_grad():
            trainer.flat.copy_(start_params.reshape(-1))
        trainer.step = start_step
        trainer.gradients(row)
        idx = index.to(dev)
        piece = torch.nn.Parameter(trainer.flat[idx].clone())
        piece.grad = trainer.gradient_at(idx)
        trainer.opt.zero_grad(set_to_none=True)
        m, v = (moments if moments is not None
                else (torch.zeros(idx.numel()), torch.zeros(idx.numel())))
        opt = torch.optim.AdamW([piece], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False, fused=False)
        opt.state[piece] = {"step": torch.tensor(float(start_step), dtype=torch.float32),
                            "exp_avg": m.to(dev, dtype=torch.float32).clone(),
                            "exp_avg_sq": v.to(dev, dtype=torch.float32).clone()}
        opt.step()
        state = opt.state[piece]
        return (piece.detach().cpu(), state["exp_avg"].detach().cpu(),
                state["exp_avg_sq"].detach().cpu())


def replay_steps(
    task: Task,
    dataset: Dataset,
    start: TrainingState | StoredState,
    rows: torch.Tensor,
    cfg: InnerConfig,
    *,
    device: str | torch.device = "cpu",
    deterministic: bool = True,
    sink: StateSink | None = None,
) -> list[str]:
    """Run ``rows`` again from a kept state, as the original run did: the commitments of
    the states after every k-th step (counted from step 0). A worker replays to rebuild
    states it did not keep; on the same device and thread count they are the same bits.

    ``start`` is a state in memory or a :class:`StoredState` read from disk straight into
    the trainer (a worker's replay then holds one state, not two)."""
    dev = torch.device(device)
    with deterministic_mode(dev, deterministic):
        trainer = _Trainer(task, dataset, cfg, dev)
        if isinstance(start, StoredState):
            trainer.load_stored(start)
        else:
            trainer.load(start)
        trail, _ = run_steps(trainer, rows, losses=[], commit_every=cfg.trail_every, sink=sink)
    return trail


_TRAINERS: list[_Trainer] = []
_TRAINERS_LOCK = threading.Lock()


def _trainer_for(task: Task, dataset: Dataset, cfg: InnerConfig,
                 device: torch.device, *, moments: bool = True) -> _Trainer:
    """A validator checks many steps of one run: reuse the last model built for the same
    task, dataset, settings and device (every check loads all the state it uses, so reuse
    cannot change a result). One per thread at a time: checks run in one thread."""
    with _TRAINERS_LOCK:
        for trainer in _TRAINERS:
            if (trainer.task is task and trainer.dataset is dataset and trainer.cfg == cfg
                    and trainer.device == device and (trainer.exp_avg.numel() > 0) == moments):
                return trainer
    trainer = _Trainer(task, dataset, cfg, device, moments=moments)
    with _TRAINERS_LOCK:
        _TRAINERS[:] = [trainer, *_TRAINERS[:1]]
    return trainer


def forget_trainers() -> None:
    """Drop the cached trainers: a validator whose step checks are done does not keep
    their model (its flat parameters, 4 B/param) through the binding check and the
    filters; the next check builds it again (one model construction per worker)."""
    with _TRAINERS_LOCK:
        _TRAINERS.clear()


def local_train(
    task: Task,
    dataset: Dataset,
    base_flat: torch.Tensor,
    assignment: torch.Tensor,
    cfg: InnerConfig,
    *,
    device: str | torch.device = "cpu",
    deterministic: bool = True,
    progress: Callable[[int, float], None] | None = None,
    sink: StateSink | None = None,
    pool: Executor | None = None,
    start: TrainingState | None = None,
) -> LocalTrainResult:
    """Run ``cfg.steps`` AdamW steps from ``base_flat`` on ``assignment`` (``[steps, batch_size]``).

    ``progress(step, loss)`` is called after every step; ``sink`` gets every committed
    state with its leaves (a worker stores what it may have to reveal), on a thread of
    ``pool`` when one is given (the hashing then overlaps the next step). ``start``
    resumes from a stored mid-round state (the rows are then the rest of the round):
    a worker that kept only some states replays the others this way.
    """
    first = 0 if start is None else start.step
    if tuple(assignment.shape) != (cfg.steps - first, cfg.batch_size):
        raise ValueError(
            f"assignment must be [{cfg.steps - first}, {cfg.batch_size}], "
            f"got {tuple(assignment.shape)}")
    dev = torch.device(device)
    losses: list[float] = []
    release_free_memory()  # what the round's set-up freed goes before the trainer comes
    with deterministic_mode(dev, deterministic):
        trainer = _Trainer(task, dataset, cfg, dev)
        if start is None:
            trainer.load_base(base_flat)
        else:
            trainer.load(start)
        trail, leaves = run_steps(trainer, assignment, losses=losses,
                                  commit_every=cfg.trail_every, pool=pool, sink=sink,
                                  progress=progress)
    final = trainer.flat.detach().cpu()
    del trainer  # its moments go now (the sink has seen every state), before the delta
    release_free_memory()  # and the steps' freed gradients and activations with them
    return LocalTrainResult(
        final_flat=final,
        delta=state_base(base_flat) - final,
        losses=losses,
        samples=cfg.steps * cfg.batch_size,
        trail=trail,
        final_leaves=leaves,
    )


def state_base(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as the float32 CPU vector the delta is taken against."""
    return flat.detach().to(torch.float32).cpu().reshape(-1)


def evaluate(
    task: Task,
    dataset: Dataset,
    flat: torch.Tensor,
    *,
    device: str | torch.device = "cpu",
    deterministic: bool = True,
) -> float:
    """Mean loss of the model ``flat`` over the task's fixed eval batches."""
    dev = torch.device(device)
    with deterministic_mode(dev, deterministic), torch.no_grad():
        model = task.make_model()
        load_flat_params(model, state_base(flat))
        model = model.to(dev).eval()
        total, count = 0.0, 0
        for batch in task.eval_batches(dataset, device=dev):
            total += float(task.loss(model, batch).double())
            count += 1
    if count == 0:
        raise ValueError("task has no eval batches")
    mean = total / count
    if not math.isfinite(mean):
        raise TrainingDivergedError(f"eval loss is {mean}")
    return mean
