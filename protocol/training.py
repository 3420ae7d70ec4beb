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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .challenges import max_reveal_bytes
from .errors import PayloadError, RejectedInput
from .tasks.base import Dataset, Task
from .tensors import decode_flat, encode_flat, load_flat_params, sha256_hex

# cuBLAS reads this when it creates its workspace; deterministic GEMMs on CUDA
# need it, and it must be set before the first CUDA matmul of the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

#: Largest step count a state may carry: AdamW keeps ``step`` as float32, exact to 2**24.
MAX_STATE_STEP = 1 << 24
#: Tensor names of a state file, in the order their values are concatenated.
STATE_NAMES = ("params", "exp_avg", "exp_avg_sq", "step")


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


def state_layout(numel: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes inside a state file for a model of ``numel`` parameters."""
    return [("params", (numel,)), ("exp_avg", (numel,)), ("exp_avg_sq", (numel,)), ("step", (1,))]


def max_state_bytes(numel: int) -> int:
    """Upper bound on a state file's size, for bounded parsing."""
    return max_reveal_bytes(numel)


@dataclass(frozen=True, eq=False)
class TrainingState:
    """Parameters and AdamW state at a segment boundary, as flat float32 CPU vectors.

    ``exp_avg``/``exp_avg_sq`` are AdamW's first and second moments laid out
    like the parameters; ``step`` is how many optimizer steps produced them.
    Canonical bytes: a safetensors file with float32 tensors ``params``,
    ``exp_avg``, ``exp_avg_sq`` (each ``[numel]``) and ``step`` (``[1]``), no
    metadata. Its sha256 is the trail entry.
    """

    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    _cache: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def initial(cls, flat: torch.Tensor) -> TrainingState:
        """Start of a round: the base parameters with zero moments and step 0."""
        params = flat.detach().to(torch.float32).cpu().reshape(-1).clone()
        return cls(params, torch.zeros_like(params), torch.zeros_like(params), 0)

    @property
    def numel(self) -> int:
        return self.params.numel()

    def to_bytes(self) -> bytes:
        """The canonical state file (computed once, then cached)."""
        data = self._cache.get("bytes")
        if data is None:
            flat = torch.cat(
                [self.params, self.exp_avg, self.exp_avg_sq, torch.tensor([float(self.step)])]
            )
            data = encode_flat(flat, state_layout(self.numel))
            self._cache["bytes"] = data
        assert isinstance(data, bytes)
        return data

    def hash(self) -> str:
        """Hex sha256 of :meth:`to_bytes`: the trail entry for this state."""
        h = self._cache.get("hash")
        if h is None:
            h = sha256_hex(self.to_bytes())
            self._cache["hash"] = h
        assert isinstance(h, str)
        return h

    @classmethod
    def from_bytes(cls, data: bytes, *, numel: int) -> TrainingState:
        """Parse a received state file for a model of ``numel`` parameters.

        Bounded: size, names, shapes and dtypes must match exactly; values
        must be finite, ``exp_avg_sq`` non-negative and ``step`` an integer in
        ``[0, 2**24)``. Raises :class:`PayloadError` (or a subclass) otherwise.
        """
        flat = decode_flat(data, state_layout(numel), max_bytes=max_state_bytes(numel))
        params, exp_avg, exp_avg_sq, step_t = flat.split([numel, numel, numel, 1])
        step = float(step_t.item())
        if not (step.is_integer() and 0 <= step < MAX_STATE_STEP):
            raise PayloadError(f"state step {step} is not an integer in [0, {MAX_STATE_STEP})")
        if bool((exp_avg_sq < 0).any()):
            raise PayloadError("state exp_avg_sq holds negative values")
        # Views of the freshly decoded vector (no one else holds it): no copies needed.
        return cls(params, exp_avg, exp_avg_sq, int(step))


def state_distance(a: TrainingState, b: TrainingState) -> float:
    """Largest :func:`relative_distance` of the three vectors (``inf`` if steps differ)."""
    if a.step != b.step or a.numel != b.numel:
        return math.inf
    return max(
        relative_distance(a.params, b.params),
        relative_distance(a.exp_avg, b.exp_avg),
        relative_distance(a.exp_avg_sq, b.exp_avg_sq),
    )


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


# --- the loop -------------------------------------------------------------------------


@dataclass
class LocalTrainResult:
    """What one worker-round of local training produced."""

    final_flat: torch.Tensor  # parameters after H steps, float32 CPU
    delta: torch.Tensor  # pseudo-gradient: base_flat - final_flat, float32 CPU
    losses: list[float]  # training loss at each inner step, before that step's update
    samples: int  # steps * batch_size
    trail: list[str]  # hex sha256 of the state after steps k, 2k, ..., H
    final_state: TrainingState
    states: list[TrainingState] = field(default_factory=list)  # boundaries 0, k, ..., H if kept


class _Segment:
    """A model on ``device`` that runs k-step segments from a :class:`TrainingState`.

    Built once per :func:`local_train` (model construction is the only
    costly part); each segment reloads parameters and rebuilds AdamW from the
    state, so running a segment never depends on anything but its inputs.
    """

    def __init__(
        self, task: Task, dataset: Dataset, cfg: InnerConfig, device: torch.device
    ) -> None:
        self.task, self.dataset, self.cfg, self.device = task, dataset, cfg, device
        self.model = task.make_model().to(device)
        self.model.train()
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)

    def _optimizer(self, start: TrainingState) -> torch.optim.AdamW:
        cfg = self.cfg
        opt = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,  # the plain per-tensor loop: simplest, same math on every device
            fused=False,
        )
        offset = 0
        for p in self.params:
            n = p.numel()
            opt.state[p] = {
                # AdamW keeps step as a float32 CPU scalar when not capturable/fused.
                "step": torch.tensor(float(start.step), dtype=torch.float32),
                "exp_avg": start.exp_avg[offset : offset + n].view_as(p).to(self.device, copy=True),
                "exp_avg_sq": start.exp_avg_sq[offset : offset + n]
                .view_as(p)
                .to(self.device, copy=True),
            }
            offset += n
        return opt

    def _state(self, opt: torch.optim.AdamW, step: int) -> TrainingState:
        def flat(key: str) -> torch.Tensor:
            return torch.cat(
                [opt.state[p][key].detach().reshape(-1).float().cpu() for p in self.params]
            )

        params = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])
        if not bool(torch.isfinite(params).all()):
            raise TrainingDivergedError(f"parameters are not finite after step {step}")
        return TrainingState(params, flat("exp_avg"), flat("exp_avg_sq"), step)

    def run(
        self,
        start: TrainingState,
        batch_indices: torch.Tensor,
        losses: list[float],
        progress: Callable[[int, float], None] | None,
    ) -> TrainingState:
        """Steps ``start.step + 1 ..`` on the rows of ``batch_indices`` (``[k, B]``)."""
        if start.numel != self.numel:
            raise ValueError(f"state has {start.numel} parameters, model has {self.numel}")
        if batch_indices.dim() != 2 or batch_indices.shape[1] != self.cfg.batch_size:
            raise ValueError(
                f"batch indices must be [k, {self.cfg.batch_size}], got {tuple(batch_indices.shape)}"
            )
        load_flat_params(self.model, start.params.to(self.device))
        opt = self._optimizer(start)
        step = start.step
        with torch.enable_grad():
            for row in batch_indices:
                step += 1
                batch = self.task.make_batch(self.dataset, row, device=self.device)
                opt.zero_grad(set_to_none=True)
                loss = self.task.loss(self.model, batch)
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise TrainingDivergedError(
                        f"loss is {value} at step {step}; lower the learning rate"
                    )
                loss.backward()
                for p in self.params:
                    if (
                        p.grad is None
                    ):  # unused parameters count as zero gradient, so all share `step`
                        p.grad = torch.zeros_like(p)
                if self.cfg.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=False)
                opt.step()
                losses.append(value)
                if progress is not None:
                    progress(step, value)
        return self._state(opt, step)


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
    """Recompute the steps of ``batch_indices`` (``[k, batch_size]``) from a revealed state.

    Exactly what :func:`local_train` runs between two trail hashes.
    """
    dev = torch.device(device)
    with deterministic_mode(dev, deterministic):
        return _segment_runner(task, dataset, cfg, dev).run(start, batch_indices, [], None)


_RUNNERS: list[_Segment] = []


def _segment_runner(task: Task, dataset: Dataset, cfg: InnerConfig,
                    device: torch.device) -> _Segment:
    """A validator checks many segments of one run: reuse the last model built for the
    same task, dataset, settings and device (a segment reloads every parameter and the
    optimizer state from its start state, so reuse cannot change a result)."""
    for runner in _RUNNERS:
        if (runner.task is task and runner.dataset is dataset and runner.cfg == cfg
                and runner.device == device):
            return runner
    runner = _Segment(task, dataset, cfg, device)
    _RUNNERS[:] = [runner, *_RUNNERS[:1]]
    return runner


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
    keep_states: bool = False,
) -> LocalTrainResult:
    """Run ``cfg.steps`` AdamW steps from ``base_flat`` on ``assignment`` (``[steps, batch_size]``).

    ``progress(step, loss)`` is called after every step. With
    ``keep_states`` the boundary states (the start and every k-th step) are
    returned, which a worker needs to answer spot-check challenges.
    """
    if tuple(assignment.shape) != (cfg.steps, cfg.batch_size):
        raise ValueError(
            f"assignment must be [{cfg.steps}, {cfg.batch_size}], got {tuple(assignment.shape)}"
        )
    dev = torch.device(device)
    state = TrainingState.initial(base_flat)
    states = [state] if keep_states else []
    losses: list[float] = []
    trail: list[str] = []
    k = cfg.trail_every
    with deterministic_mode(dev, deterministic):
        segment = _Segment(task, dataset, cfg, dev)
        for s in range(cfg.segments):
            state = segment.run(state, assignment[s * k : (s + 1) * k], losses, progress)
            trail.append(state.hash())
            if keep_states:
                states.append(state)
    final = state.params
    return LocalTrainResult(
        final_flat=final,
        delta=state_base(base_flat) - final,
        losses=losses,
        samples=cfg.steps * cfg.batch_size,
        trail=trail,
        final_state=state,
        states=states,
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
