"""Sharded CenteredClip (BTARD's ButterflyClip): one validator per coordinate shard.

The D coordinates are split into V contiguous shards (``shard_bounds``);
validator j aggregates shard j of the [N, D] updates and publishes a
``ShardResult``: the shard aggregate v (float32), the N distances
d_i = ||x_i - v|| on the shard (float64), and its *heavy blocks*: for each
row the ``HEAVY_PER_ROW`` blocks of ``BLOCK`` coordinates holding most of
(x_is - v_s)^2, which every checker reads in full (``projection`` explains
why).  The others check it cheaply
(``projection.check_shard_result``); after a failed check they adjudicate it
exactly and recompute it (``recompute_shard``).

**The shard result is the CenteredClip fixed point.**  CenteredClip iterates

    v <- v + sum_i w_i c_i (x_i - v) / sum_i w_i,     c_i = min(1, tau / ||x_i - v||)

(``aggregation.CenteredClip``); its fixed points are the v with

    sum_i w_i c_i(v) (x_i - v) = 0   <=>   v = sum_i a_i x_i,   a_i = w_i c_i / sum_j w_j c_j   (1)

i.e. the stationary points of the convex Huber-type loss
sum_i w_i rho_tau(||x_i - v||) (rho(r) = r^2/2 for r <= tau, tau r - tau^2/2
beyond), unique whenever the loss is strictly convex on the affine hull of
the rows (always in practice).  Unlike a fixed number of iterations from a
start, the fixed point does not depend on how it was reached, so it can be
checked (equation (1) coordinate by coordinate) without being recomputed.
A shard result is **valid** iff, for every row i and coordinate s,

    (V1)  | d_i - ||x_i - v|| |  <=  ETA_D (max(||x_i - v||, tau) + max_j ||x_j|| + ||v||)
    (V2)  | v_s - sum_i a_i(d) x_is |  <=  ETA_V sum_i a_i(d) |x_is| + 2^-149

with a(d) from (1) evaluated on the *published* distances.  An honest result
satisfies both by construction: v is rounded once to float32 (relative error
2^-24 = ETA_V / 16), and d comes from a float64 Gram matrix.

Computing it (``aggregate_shard``): one pass builds the float64 Gram matrix
G = X X^T of the shard; iteratively reweighted least squares runs on the
coefficients (O(N^2) per step, distances ||x_i - v||^2 = G_ii - 2 (G a)_i +
a^T G a) until a stops changing; a second pass forms v = X^T a in float64;
a third computes the per-block squared distances that pick the heavy blocks.  IRLS
(a <- w c(a) / sum w c(a)) has the same fixed points as the CenteredClip step
and converges faster.  Robustness: f Byzantine rows pull v with total weight
at most sum_(i in f) w_i tau while the honest rows within tau of v pull
linearly, so as in CenteredClip the fixed point moves by O(f tau / (n - f)).

Shard radius: distances on a shard of n_j of D coordinates are about
sqrt(n_j / D) of the full ones, so ``shard_tau`` scales a full-vector tau
accordingly.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .._inputs import Weights, check_updates, check_weights
from ..errors import AggregationInputError, NonFiniteUpdateError
from .errors import NonFiniteShardError, SecureAggregationError
from .prg import encode_parts

__all__ = [
    "ETA_D",
    "ETA_V",
    "ExactVerdict",
    "ShardFinding",
    "ShardResult",
    "aggregate_shard",
    "assemble_shards",
    "fixed_point_coefficients",
    "recompute_shard",
    "shard_bounds",
    "shard_tau",
    "verify_shard_exact",
]

#: (V2) tolerance relative to sum_i a_i |x_is|: 16 float32 roundings.
ETA_V = 2.0**-20
#: (V1) tolerance: relative distance error of a float64 Gram, with margin.
ETA_D = 1e-6
#: Smallest positive float32 subnormal: the absolute floor of (V2).
TINY = 2.0**-149
#: Columns per step of the streaming passes (N x CHUNK float64 buffers).
CHUNK = 1 << 16
#: IRLS stops when max_i |a_i(t+1) - a_i(t)| <= IRLS_TOL.
IRLS_TOL = 1e-14
#: Coordinates per checked block: 64 bytes of float32, one cache line.
BLOCK = 16
#: Blocks per row a publisher may declare heavy (every checker reads them in full).
HEAVY_PER_ROW = 4


def shard_bounds(dim: int, num_shards: int) -> list[tuple[int, int]]:
    """V contiguous [start, stop) ranges covering 0..D-1; the first D mod V have one more."""
    if (
        not isinstance(dim, int)
        or not isinstance(num_shards, int)
        or num_shards < 1
        or dim < num_shards
    ):
        raise AggregationInputError(
            f"need 1 <= num_shards <= dim, got dim={dim}, num_shards={num_shards}"
        )
    base, extra = divmod(dim, num_shards)
    bounds, start = [], 0
    for j in range(num_shards):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_tau(tau: float, dim: int, bounds: tuple[int, int]) -> float:
    """tau_j = tau * sqrt(n_j / D): the radius for a shard of n_j = stop - start coordinates."""
    start, stop = bounds
    if not (math.isfinite(tau) and tau > 0) or not 0 <= start < stop <= dim:
        raise AggregationInputError("need tau > 0 and 0 <= start < stop <= dim")
    return tau * math.sqrt((stop - start) / dim)


def fixed_point_coefficients(distances: Tensor, weights: Tensor, tau: float) -> Tensor:
    """a_i = w_i c_i / sum_j w_j c_j with c_i = min(1, tau / d_i) (c_i = 1 for d_i <= tau), float64."""
    d = distances.to(torch.float64)
    c = torch.where(d > tau, tau / d.clamp(min=tau), torch.ones_like(d))
    wc = weights.to(torch.float64) * c
    return wc / wc.sum()


@dataclass(frozen=True)
class ShardResult:
    """What validator ``publisher`` publishes for shard ``shard`` = coordinates [start, stop)."""

    shard: int
    publisher: int
    start: int
    stop: int
    tau: float
    aggregate: Tensor = field(repr=False)  # float32 [stop - start]
    distances: Tensor = field(repr=False)  # float64 [N]
    heavy_blocks: Tensor = field(repr=False)  # int64, ascending, <= HEAVY_PER_ROW * N
    iterations: int = 0

    def digest(self) -> bytes:
        """SHA-256 of the canonical encoding: header, v (f32 LE), d (f64 LE), heavy (i64 LE)."""
        h = hashlib.sha256(b"veritrain/v1/secure/shard-result")
        header = (self.shard, self.publisher, self.start, self.stop, self.iterations)
        h.update(encode_parts(*header, float(self.tau).hex()))
        for t, dtype in (
            (self.aggregate, "<f4"),
            (self.distances, "<f8"),
            (self.heavy_blocks, "<i8"),
        ):
            h.update(memoryview(np.ascontiguousarray(t.detach().cpu().numpy(), dtype=dtype)))
        return h.digest()


def _weights(weights: Weights, n: int) -> Tensor:
    w = check_weights(weights, n)
    return torch.ones(n, dtype=torch.float64) if w is None else w


def _shard_view(updates: Tensor, shard: int, num_shards: int) -> tuple[Tensor, int, int]:
    x = check_updates(updates)
    bounds = shard_bounds(x.shape[1], num_shards)
    if not isinstance(shard, int) or not 0 <= shard < num_shards:
        raise AggregationInputError(f"shard must be in [0, {num_shards}), got {shard!r}")
    start, stop = bounds[shard]
    return x[:, start:stop], start, stop


def _gram64(xs: Tensor) -> Tensor:
    """G = X X^T in float64, streaming CHUNK columns at a time."""
    n, m = xs.shape
    g = torch.zeros(n, n, dtype=torch.float64)
    for s in range(0, m, CHUNK):
        c = xs[:, s : s + CHUNK].to(torch.float64)
        g.addmm_(c, c.T)
    return g


def _combine64(xs: Tensor, a: Tensor) -> Tensor:
    """v = X^T a accumulated in float64, rounded once to float32."""
    n, m = xs.shape
    v = torch.empty(m, dtype=torch.float32)
    a64 = a.to(torch.float64).unsqueeze(0)
    for s in range(0, m, CHUNK):
        v[s : s + CHUNK] = (a64 @ xs[:, s : s + CHUNK].to(torch.float64)).squeeze(0)
    return v


def _dists_from_gram(g: np.ndarray, a: np.ndarray) -> np.ndarray:
    ga = g @ a
    return np.sqrt(np.maximum(np.diag(g) - 2 * ga + a @ ga, 0.0))


def aggregate_shard(
    updates: Tensor,
    weights: Weights = None,
    *,
    shard: int,
    num_shards: int,
    tau: float,
    publisher: int | None = None,
    max_iterations: int = 1000,
) -> ShardResult:
    """The valid ``ShardResult`` of ``shard``: the CenteredClip fixed point on its coordinates.

    ``updates`` [N, D] (float32 or float64), ``weights`` [N] >= 0 (default 1),
    ``tau`` the shard's radius (see ``shard_tau``), ``publisher`` the validator
    index recorded in the result (default: ``shard``).  Cost: two passes over
    the shard (Gram, combine) plus O(N^2) per IRLS step.  Raises
    ``SecureAggregationError`` if IRLS has not converged after
    ``max_iterations`` steps.
    """
    xs, start, stop = _shard_view(updates, shard, num_shards)
    if not (isinstance(tau, int | float) and math.isfinite(tau) and tau > 0):
        raise AggregationInputError(f"tau must be positive and finite, got {tau!r}")
    w = _weights(weights, xs.shape[0])
    g_t = _gram64(xs)
    bad = torch.nonzero(~torch.isfinite(g_t.diagonal())).flatten().tolist()
    if bad:
        raise NonFiniteUpdateError(bad)
    g, wn = g_t.numpy(), w.numpy()
    a = wn / wn.sum()
    converged = False
    it = 0
    for it in range(1, max_iterations + 1):  # noqa: B007 (the count is reported)
        d = _dists_from_gram(g, a)
        a_new = fixed_point_coefficients(torch.from_numpy(d), w, tau).numpy()
        step = float(np.abs(a_new - a).max())
        a = a_new
        if step <= IRLS_TOL:
            converged = True
            break
    if not converged:
        raise SecureAggregationError(
            f"CenteredClip fixed point not reached in {max_iterations} IRLS steps"
        )
    v = _combine64(xs, torch.from_numpy(a))
    d_pub = torch.from_numpy(_dists_from_gram(g, a))
    heavy = heavy_blocks_of(block_sq_dists(xs, v))
    publisher = shard if publisher is None else publisher
    return ShardResult(shard, publisher, start, stop, float(tau), v, d_pub, heavy, it)


def block_sq_dists(xs: Tensor, v: Tensor) -> Tensor:
    """Y[i, b] = sum over block b of (x_is - v_s)^2: float32 squares, float64 [N, n_b] result.

    The last block may be partial.  One streaming pass over the shard.
    """
    n, m = xs.shape
    out = torch.zeros(n, -(-m // BLOCK), dtype=torch.float64)
    for s in range(0, m, CHUNK):  # CHUNK is a multiple of BLOCK
        c = xs[:, s : s + CHUNK] - v[s : s + CHUNK].to(xs.dtype)
        width = c.shape[1]
        full = width // BLOCK * BLOCK
        b0 = s // BLOCK
        out[:, b0 : b0 + full // BLOCK] = (c[:, :full] ** 2).view(n, -1, BLOCK).sum(-1).double()
        if full < width:
            out[:, b0 + full // BLOCK] = (c[:, full:].double() ** 2).sum(-1)
    return out


def heavy_blocks_of(y: Tensor, per_row: int = 0) -> Tensor:
    """Union of each row's ``per_row`` (default HEAVY_PER_ROW) largest blocks of Y: int64, sorted."""
    k = min(per_row or HEAVY_PER_ROW, y.shape[1])
    return torch.unique(torch.topk(y, k, dim=1).indices.flatten()).to(torch.int64)


def assemble_shards(results: list[ShardResult], dim: int) -> Tensor:
    """Concatenate checked shard aggregates (in shard order) into the [D] float32 aggregate.

    Scans every value once: a shard with NaN or Inf (which a sampled check can
    miss) raises ``NonFiniteShardError`` naming it; settle it with
    ``recompute_shard``, whose exact check finds it malformed.
    """
    bounds = shard_bounds(dim, len(results))
    ordered = sorted(results, key=lambda r: r.shard)
    if [(r.start, r.stop) for r in ordered] != bounds or [r.shard for r in ordered] != list(
        range(len(bounds))
    ):
        raise AggregationInputError("shard results do not cover the coordinates exactly once")
    out = torch.cat([r.aggregate.to(torch.float32) for r in ordered])
    if not bool(torch.isfinite(out).all()):
        bad = [r.shard for r in ordered if not bool(torch.isfinite(r.aggregate).all())]
        raise NonFiniteShardError(bad)
    return out


def malformation(
    result: object,
    n_rows: int,
    shard: int,
    num_shards: int,
    dim: int,
    tau: float,
    *,
    scan_aggregate: bool = True,
) -> str | None:
    """Why ``result`` is structurally unacceptable for this shard, or None.

    ``scan_aggregate=False`` skips the O(n) finiteness scan of v (the sampled
    check leaves it to ``assemble_shards``, which reads v anyway).
    """
    if not isinstance(result, ShardResult):
        return "not a ShardResult"
    if not (isinstance(shard, int) and 0 <= shard < num_shards):
        return "no such shard"
    start, stop = shard_bounds(dim, num_shards)[shard]
    if (result.shard, result.start, result.stop) != (shard, start, stop):
        return "wrong shard or bounds"
    if result.tau != tau:
        return f"tau {result.tau!r} differs from the agreed {tau!r}"
    v, d = result.aggregate, result.distances
    if not isinstance(v, Tensor) or v.dtype != torch.float32 or v.shape != (stop - start,):
        return "aggregate must be float32 of the shard's length"
    if not isinstance(d, Tensor) or d.dtype != torch.float64 or d.shape != (n_rows,):
        return "distances must be float64, one per update row"
    h = result.heavy_blocks
    n_b = -(-(stop - start) // BLOCK)
    if not isinstance(h, Tensor) or h.dtype != torch.int64 or h.ndim != 1:
        return "heavy blocks must be a 1-D int64 tensor"
    hn, dn = h.numpy(), d.numpy()  # small: numpy is cheaper than torch's dispatch
    if len(hn) > HEAVY_PER_ROW * n_rows or (
        len(hn) and (hn[0] < 0 or hn[-1] >= n_b or bool((np.diff(hn) <= 0).any()))
    ):
        return f"heavy blocks: ascending distinct block indices, at most {HEAVY_PER_ROW} per row"
    if not (np.isfinite(dn).all() and (dn >= 0).all()):
        return "negative or non-finite distances"
    if scan_aggregate and not bool(torch.isfinite(v).all()):
        return "non-finite aggregate"
    return None


@dataclass(frozen=True)
class ExactVerdict:
    """Result of checking (V1) and (V2) on every coordinate of a shard."""

    valid: bool
    reason: str
    stationarity_violations: int = 0
    worst_stationarity: float = 0.0  # max |v_s - pred_s| / tolerance_s
    worst_distance: float = 0.0  # max |d_i - true_i| / tolerance_i


def verify_shard_exact(
    result: ShardResult,
    updates: Tensor,
    weights: Weights = None,
    *,
    num_shards: int,
    tau: float,
) -> ExactVerdict:
    """Check (V1) and (V2) on all coordinates: the ground truth a finding rests on.

    Two passes over the shard (prediction, exact distances), float64 throughout.
    Never raises for a bad ``result``; only for bad ``updates``.
    """
    if not isinstance(result, ShardResult) or not (
        isinstance(result.shard, int) and 0 <= result.shard < num_shards
    ):
        return ExactVerdict(False, "malformed: not a ShardResult for one of the shards")
    xs, _, _ = _shard_view(updates, result.shard, num_shards)
    n = xs.shape[0]
    why = malformation(result, n, result.shard, num_shards, updates.shape[1], tau)
    if why is not None:
        return ExactVerdict(False, f"malformed: {why}")
    w = _weights(weights, n)
    a = fixed_point_coefficients(result.distances, w, tau)
    v = result.aggregate
    a64, abs_a = a.unsqueeze(0), a.abs().unsqueeze(0)
    violations, worst_v = 0, 0.0
    sq = torch.zeros(n, dtype=torch.float64)
    norms = torch.zeros(n, dtype=torch.float64)
    for s in range(0, xs.shape[1], CHUNK):
        c = xs[:, s : s + CHUNK].to(torch.float64)
        vc = v[s : s + CHUNK].to(torch.float64)
        pred = (a64 @ c).squeeze(0)
        tol = ETA_V * (abs_a @ c.abs()).squeeze(0) + TINY
        ratio = (vc - pred).abs() / tol
        violations += int((ratio > 1).sum())
        worst_v = max(worst_v, float(ratio.max()))
        sq += ((c - vc) ** 2).sum(1)
        norms += (c**2).sum(1)
    true_d = sq.sqrt()
    v_norm = float(torch.linalg.vector_norm(v, dtype=torch.float64))
    slack = float(norms.sqrt().max()) + v_norm
    tol_d = ETA_D * (torch.maximum(true_d, torch.full_like(true_d, tau)) + slack)
    worst_d = float(((result.distances - true_d).abs() / tol_d).max())
    if violations:
        return ExactVerdict(False, "stationarity", violations, worst_v, worst_d)
    if worst_d > 1:
        return ExactVerdict(False, "distance", 0, worst_v, worst_d)
    return ExactVerdict(True, "ok", 0, worst_v, worst_d)


@dataclass(frozen=True)
class ShardFinding:
    """The outcome of a disputed shard: whether its publisher is at fault, with the evidence.

    ``faulty`` is decided by ``verify_shard_exact`` alone (deterministic, so every
    honest validator reaches the same verdict); ``replacement`` is the recomputed
    result to use instead when faulty.  ``trigger`` is the failed sampled check
    that started the dispute, if any.
    """

    shard: int
    publisher: int
    faulty: bool
    reason: str
    published_digest: bytes
    replacement_digest: bytes
    stationarity_violations: int
    worst_stationarity: float
    worst_distance: float
    max_abs_deviation: float
    trigger: object | None = None


def _safe_digest(result: ShardResult) -> bytes:
    try:
        return result.digest()
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return b""


def recompute_shard(
    published: ShardResult,
    updates: Tensor,
    weights: Weights = None,
    *,
    num_shards: int,
    tau: float,
    recomputed_by: int,
    trigger: object | None = None,
    max_iterations: int = 1000,
) -> tuple[ShardResult, ShardFinding]:
    """After a failed check: recompute the shard and adjudicate the published result.

    Returns ``(replacement, finding)``.  The finding blames ``published.publisher``
    iff the published result violates (V1) or (V2) somewhere; otherwise the
    check was a false alarm and the published result stands (``faulty`` False).
    """
    shard = published.shard if isinstance(published, ShardResult) else -1
    if not isinstance(published, ShardResult) or not 0 <= shard < num_shards:
        raise AggregationInputError("published must be a ShardResult for one of the shards")
    replacement = aggregate_shard(
        updates,
        weights,
        shard=shard,
        num_shards=num_shards,
        tau=tau,
        publisher=recomputed_by,
        max_iterations=max_iterations,
    )
    verdict = verify_shard_exact(published, updates, weights, num_shards=num_shards, tau=tau)
    dev = math.inf
    if published.aggregate.shape == replacement.aggregate.shape:
        dev = float(
            (published.aggregate.to(torch.float64) - replacement.aggregate.to(torch.float64))
            .abs()
            .max()
        )
    finding = ShardFinding(
        shard=shard,
        publisher=published.publisher,
        faulty=not verdict.valid,
        reason=verdict.reason,
        published_digest=_safe_digest(published),
        replacement_digest=replacement.digest(),
        stationarity_violations=verdict.stationarity_violations,
        worst_stationarity=verdict.worst_stationarity,
        worst_distance=verdict.worst_distance,
        max_abs_deviation=dev,
        trigger=trigger,
    )
    return replacement, finding
