"""Checking a published shard result on random coordinate blocks, far below recomputation.

A checker holds the shard's updates X (N x n, n_b = ceil(n / BLOCK) blocks of
16 coordinates) and the published result: v, the distances d, and a set H of
at most ``HEAVY_PER_ROW`` * N *heavy* blocks (each row's largest blocks of
(x_is - v_s)^2, declared by the publisher).  It reads every block of H and m
more blocks drawn uniformly, with replacement, from the other n_b - |H|
(a ChaCha20 stream keyed by the *check seed*, which nobody knows until every
shard result, H included, is fixed).  It projects the fixed-point equations
(V1), (V2) of ``sharding`` onto those coordinates: the projection is the
coordinate-sampling matrix P; dense Gaussian projections would read every
coordinate, which is the cost this check exists to avoid.

* **Stationarity** (V2), exactly, on every coordinate read:
  |v_s - sum_i a_i(d) x_is| <= ETA_V sum_i a_i(d) |x_is| + 2^-149.
  A shift of v by delta that is not a reweighting of the rows violates it on
  every coordinate where |delta_s| exceeds the tolerance.  If q blocks outside
  H hold such a coordinate, one checker misses them all with probability
  (1 - q / (n_b - |H|))^m <= exp(-q m / n_b), V - 1 independent checkers
  with exp(-(V - 1) q m / n_b); blocks in H are never missed.  A dense
  1e-3 relative shift (q ~ n_b) is caught with certainty; a single corrupted
  block with probability about m / n_b per checker.
* **Distances** (V1), statistically, stratified: with Y_ib the sum of
  (x_is - v_s)^2 over block b, T_i = ||x_i - v||^2 is estimated by

      T^_i = sum_(b in H) Y_ib + (n_b - |H|) mean_t Y_(i, b_t)
      se_i = (n_b - |H|) std_t Y_(i, b_t) / sqrt(m)

  and the check fails when the published distance is too small,
  T^_i - d_i^2 > z se_i + FLOOR max(d_i^2, tau^2), or too large,
  d_i^2 - T^_i > z se_i + FLOOR max(d_i^2, tau^2) + LOWER_SLACK d_i^2.
  H takes each row's spikes out of the sampled stratum: without it a row with
  much of its distance in a few coordinates (heavy-tailed updates, or a
  Byzantine row built that way) would make the estimate fall short whenever
  those were not drawn.  The asymmetric slack covers what remains: an
  estimate above the truth needs a large sampled block, which inflates se_i
  with it, while one below the truth comes from unsampled large blocks that
  se_i cannot see.  The only results that pass (V2) are reweightings
  v = X^T a', and a' is pinned by the published distances: pulling v toward a
  far row means understating its distance (caught beyond z standard errors,
  about z sqrt(kurtosis / m) relative), pushing v away from a row means
  overstating its distance (caught beyond a factor 1 / (1 - LOWER_SLACK) in
  d^2), so an undetected reweighting changes no clip factor by more than
  those margins.

When m >= n_b - |H| the checker reads every block once and both tests are exact.

False alarms.  (V2) has none: it is a deterministic bound that honest results
satisfy by construction.  The distance test is a z-score test (about 1e-15 per
row at z = 8 for a Gaussian estimator; measured on Gaussian and Student-t
updates in tests/test_secure_sharding.py and bench/secure_averaging.py).  A
false alarm costs only a recomputation: a finding that blames a publisher
rests on the exact check (``sharding.verify_shard_exact``), never on a sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from .._inputs import Weights, check_updates
from .prg import derive_key, uniform_indices
from .sharding import (
    BLOCK,
    ETA_V,
    TINY,
    ShardResult,
    _weights,
    malformation,
    shard_bounds,
)

__all__ = [
    "BLOCK",
    "DEFAULT_Z",
    "ShardCheck",
    "check_shard_result",
    "default_sample_blocks",
    "sample_blocks",
]

#: Sampled blocks: max(MIN_BLOCKS, ceil(n_b / BLOCK_DIVISOR)).
MIN_BLOCKS = 256
BLOCK_DIVISOR = 256
#: z-score of the distance test.
DEFAULT_Z = 8.0
#: Relative floor of the distance test, times max(d_i^2, tau^2).
FLOOR = 1e-3
#: Extra tolerance, times d_i^2, for estimates *below* the published d_i^2.
LOWER_SLACK = 0.1


def default_sample_blocks(n: int) -> int:
    """m = max(MIN_BLOCKS, ceil(n_b / BLOCK_DIVISOR)) for a shard of n coordinates."""
    n_b = -(-n // BLOCK)
    return max(MIN_BLOCKS, -(-n_b // BLOCK_DIVISOR))


def sample_blocks(
    check_seed: bytes,
    *,
    shard: int,
    checker: int,
    result_digest: bytes,
    n: int,
    count: int,
    exclude: np.ndarray | None = None,
) -> np.ndarray:
    """``count`` block indices of a shard of n coordinates, sorted, for this (shard, checker).

    Uniform with replacement over the blocks not in ``exclude`` (sorted, distinct):
    draw u uniform on [0, n_b - |exclude|), return the u-th non-excluded block.
    """
    key = derive_key(check_seed, "shard-check", shard, checker, result_digest)
    n_b = -(-n // BLOCK)
    ex = np.zeros(0, dtype=np.int64) if exclude is None else np.asarray(exclude, dtype=np.int64)
    u = np.sort(uniform_indices(key, count, n_b - len(ex)))
    # the u-th block not in ex is u + #{j : ex_j - j <= u}  (ex_j - j: non-excluded before ex_j)
    return u + np.searchsorted(ex - np.arange(len(ex)), u, side="right")


@dataclass(frozen=True)
class ShardCheck:
    """Outcome of one checker's sampled check of one shard result.

    ``worst_stationarity``: max over the coordinates read of |v_s - pred_s| / tol_s
    (> 1 fails); ``worst_distance``: max over rows of |T^_i - d_i^2| / tol_i (> 1
    fails).  ``suspect_coordinates``: up to 8 failing absolute coordinates,
    ``suspect_rows`` the rows whose distances failed: evidence anyone can
    recompute from the same check seed.  ``sampled_blocks``: m, besides the
    ``heavy_blocks`` read in full.
    """

    ok: bool
    shard: int
    publisher: int
    checker: int
    reason: str
    sampled_blocks: int
    heavy_blocks: int = 0
    stationarity_violations: int = 0
    worst_stationarity: float = 0.0
    worst_distance: float = 0.0
    suspect_coordinates: tuple[int, ...] = ()
    suspect_rows: tuple[int, ...] = ()


def _gather(
    x: Tensor, v: Tensor, blocks: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Rows and v on ``blocks``: x [N, k, BLOCK] and v [k, BLOCK] as float64 numpy arrays.

    Also a validity mask (None when no partial last block was drawn; its missing
    coordinates read as 0) and the flat coordinate of every entry (clamped to
    n - 1).  Blocks are copied as 64-byte rows of a [N, n_b, BLOCK] view (numpy
    fancy indexing: torch's index_select copies a strided view whole first).
    The arithmetic of the check runs in numpy too: on arrays this small,
    single-threaded numpy beats torch's thread pool.
    """
    rows, full_b = x.shape[0], n // BLOCK
    coords = blocks[:, None] * BLOCK + np.arange(BLOCK)
    flat = np.minimum(coords, n - 1)
    xn, vn = x.detach().cpu().numpy(), v.detach().cpu().numpy()
    if len(blocks) == 0 or blocks.max() < full_b:  # the common case: no partial block drawn
        xg = xn[:, : full_b * BLOCK].reshape(rows, full_b, BLOCK)[:, blocks, :]
        vg = vn[: full_b * BLOCK].reshape(full_b, BLOCK)[blocks, :]
        return xg.astype(np.float64), vg.astype(np.float64), None, flat.reshape(-1)
    valid = (coords < n).astype(np.float64)
    xg = xn[:, flat].astype(np.float64) * valid
    vg = vn[flat].astype(np.float64) * valid
    return xg, vg, valid, flat.reshape(-1)


def check_shard_result(
    result: ShardResult,
    updates: Tensor,
    weights: Weights = None,
    *,
    num_shards: int,
    tau: float,
    check_seed: bytes,
    checker: int,
    blocks: int | None = None,
    z: float = DEFAULT_Z,
    result_digest: bytes | None = None,
) -> ShardCheck:
    """Sampled check of ``result`` (see the module docstring); never raises for a bad result.

    ``updates`` [N, D] as aggregated, ``weights`` as given to the aggregator,
    ``tau`` the shard's agreed radius, ``check_seed`` drawn after all results were
    published, ``checker`` this validator's index, ``blocks`` the sample size m
    (default ``default_sample_blocks``), ``result_digest`` the result's digest if
    already computed (verifying the publisher's signature needs it anyway).
    Cost: reads (m + |H|) * BLOCK coordinates of each row, versus three full
    passes to recompute.  NaN or Inf in v outside the coordinates read is left to
    ``assemble_shards``, which reads all of v.
    """
    x = check_updates(updates)
    n_rows, dim = x.shape
    shard = result.shard if isinstance(result, ShardResult) else -1
    publisher = result.publisher if isinstance(result, ShardResult) else -1
    why = malformation(result, n_rows, shard, num_shards, dim, tau, scan_aggregate=False)
    if why is not None:
        return ShardCheck(False, shard, publisher, checker, f"malformed: {why}", 0)
    start, stop = shard_bounds(dim, num_shards)[shard]
    n = stop - start
    n_b = -(-n // BLOCK)
    heavy = result.heavy_blocks.numpy()
    rest = n_b - len(heavy)
    m = default_sample_blocks(n) if blocks is None else max(2, int(blocks))
    full = m >= rest
    if full:  # read everything once: exact
        sampled = np.setdiff1d(np.arange(n_b, dtype=np.int64), heavy, assume_unique=True)
    else:
        sampled = sample_blocks(
            check_seed,
            shard=shard,
            checker=checker,
            result_digest=result_digest or result.digest(),
            n=n,
            count=m,
            exclude=heavy,
        )
    m_eff = len(sampled)
    idx = np.concatenate([heavy, sampled])
    xg, vg, valid, flat = _gather(x[:, start:stop], result.aggregate, idx, n)

    w = _weights(weights, n_rows).numpy()
    d = result.distances.numpy()
    c = np.where(d > tau, tau / np.maximum(d, tau), 1.0)  # fixed_point_coefficients, in numpy
    a = w * c / (w * c).sum()
    k = len(idx)
    x2, v1 = xg.reshape(n_rows, k * BLOCK), vg.reshape(k * BLOCK)
    pred = a @ x2  # sum_i a_i x_is on every coordinate read
    tol = ETA_V * (a @ np.abs(x2)) + TINY  # a >= 0, so sum_i |a_i x_is| = a . |x_s|
    ratio = np.abs(v1 - pred) / tol
    if valid is not None:
        ratio *= valid.reshape(-1)
    bad = np.flatnonzero(~(ratio <= 1))  # NaN in v counts as a violation
    worst_v = float(ratio.max()) if ratio.size else 0.0
    suspects = tuple(sorted({int(start + flat[i]) for i in bad[:64]}))[:8]

    diff = x2 - v1  # partial-block padding is 0 - 0
    diff *= diff
    y = diff.reshape(n_rows, k, BLOCK).sum(2)  # [N, |H| + m]: Y_ib per block read
    if full:
        est = y.sum(1)
        se = np.zeros(n_rows)
    else:
        y_rest = y[:, len(heavy) :]
        est = y[:, : len(heavy)].sum(1) + rest * y_rest.mean(1)
        se = rest * y_rest.std(1, ddof=1) / math.sqrt(m_eff)
    d2 = d**2
    floor = FLOOR * np.maximum(d2, tau**2)
    gap = est - d2  # > 0: published distance too small; < 0: too large
    tol_d = np.where(gap >= 0, z * se + floor, z * se + floor + LOWER_SLACK * d2)
    ratio_d = np.abs(gap) / tol_d
    worst_d = float(ratio_d.max())
    rows = tuple(int(i) for i in np.flatnonzero(~(ratio_d <= 1)))

    reason = "stationarity" if len(bad) else "distance" if rows else "ok"
    return ShardCheck(
        ok=reason == "ok",
        shard=shard,
        publisher=publisher,
        checker=checker,
        reason=reason,
        sampled_blocks=m_eff,
        heavy_blocks=len(heavy),
        stationarity_violations=len(bad),
        worst_stationarity=worst_v,
        worst_distance=worst_d,
        suspect_coordinates=suspects,
        suspect_rows=rows,
    )
