"""Streamed CenteredClip: the validator's aggregate read from files by column chunks.

``centered_clip_rows`` over a row file must give the very bytes it gives over the same
rows in memory (every validator, the swarm and the benchmarks call this one function),
agree with a straightforward float64 CenteredClip from the geometric median (or the
coordinate median) to rounding, resolve ``tau_rel`` as ``resolve_aggregator_params``
does, keep far Byzantine rows within CenteredClip's bound, and never hold N decoded
updates at once.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from veritrain.aggregation import (
    AggregationInputError,
    CenteredClip,
    CoordinateMedian,
    FileRows,
    GeometricMedian,
    Krum,
    NonFiniteUpdateError,
    RowFile,
    TensorRows,
    aggregate_rows,
    build_aggregator,
    centered_clip_rows,
    clip_radius,
    geometric_median_rows,
    row_distances,
)
from veritrain.aggregation.streamed import ROWS_CHUNK
from veritrain.validators.round import clip_quality, resolve_aggregator_params


def _rows(n: int, d: int, seed: int, outliers: int = 0, scale: float = 50.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen) + 0.5 * torch.randn(n, d, generator=gen)
    x[:outliers] *= scale
    return x


def _file_rows(x: torch.Tensor, directory: str | Path, picked: list[int] | None = None
               ) -> FileRows:
    store = RowFile(Path(directory) / "rows.f32", x.shape[1])
    for row in x:
        store.append(row)
    return store.rows(picked)


def _lower_median(values: torch.Tensor) -> float:
    return float(values.sort().values[(values.numel() - 1) // 2])


def dense_geometric_median(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """The specified start in float64 on the dense rows: Weiszfeld from the weighted mean of
    the half of the rows nearest the medoid (rows of positive weight only)."""
    x = x.double()
    n = x.shape[0]
    w = torch.ones(n, dtype=torch.float64) if w is None else w.double()
    act = torch.nonzero(w > 0).flatten()
    xa, wa = x[act], w[act] / w[act].sum()
    m = act.numel()
    if m == 1:
        return xa[0]
    dist = torch.cdist(xa, xa)
    masked = dist + torch.diag(torch.full((m,), math.inf, dtype=torch.float64))
    best = int(torch.argmin(masked.sort(dim=1).values[:, (m - 2) // 2]))
    near = dist[best].sort(stable=True).indices[: m - (m - 1) // 2]
    v = (wa[near] / wa[near].sum()) @ xa[near]
    d = (xa - v).norm(dim=1)
    eps = max(1e-9 * _lower_median(d), 1e-300)
    for _ in range(100):
        beta = wa / d.clamp(min=eps)
        new = (beta / beta.sum()) @ xa
        step, scale = float((new - v).norm()), _lower_median(d)
        v = new
        d = (xa - v).norm(dim=1)
        if step <= 1e-6 * scale:
            break
    return v


def dense_tau(x: torch.Tensor, tau_rel: float, w: torch.Tensor | None = None) -> float:
    """tau_rel * lower median over the rows of positive weight of ||x_i - GM||."""
    keep = slice(None) if w is None else w > 0
    gm = dense_geometric_median(x, w)
    return max(tau_rel * _lower_median((x.double() - gm).norm(dim=1)[keep]), 1e-12)


def dense_centered_clip(x: torch.Tensor, w: torch.Tensor | None, tau: float,
                        iterations: int = 10, tol: float = 1e-6,
                        start: str = "geometric_median") -> torch.Tensor:
    """CenteredClip in float64 on the dense rows, as specified (aggregation.md 2.2)."""
    x64 = x.double()
    n = x.shape[0]
    wn = torch.full((n,), 1.0 / n, dtype=torch.float64) if w is None else w.double() / w.sum()
    v = CoordinateMedian()(x64, w) if start == "median" else dense_geometric_median(x, w)
    for _ in range(iterations):
        diff = x64 - v
        norm = diff.norm(dim=1)
        clip = torch.where(norm > tau, tau / norm.clamp(min=tau), torch.ones_like(norm))
        step = (wn * clip) @ diff
        v = v + step
        if float(step.norm()) <= tol * tau:
            break
    return v


# --- streamed == in memory, bit for bit ---------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 9),
    d=st.integers(1, 700),
    chunk=st.sampled_from([1, 7, 64, 333, ROWS_CHUNK]),
    seed=st.integers(0, 2**31 - 1),
    outliers=st.integers(0, 3),
    weighted=st.booleans(),
    relative=st.booleans(),
    start=st.sampled_from(["geometric_median", "median"]),
)
def test_file_rows_give_the_same_bytes_as_rows_in_memory(n, d, chunk, seed, outliers, weighted,
                                                         relative, start):
    x = _rows(n, d, seed, min(outliers, (n - 1) // 2))
    weights = None
    if weighted:
        gen = torch.Generator().manual_seed(seed + 1)
        weights = torch.randint(0, 4, (n,), generator=gen).double()
        weights[seed % n] = 1.0  # a positive sum
    kwargs = {"tau_rel": 1.0} if relative else {"tau": float(math.sqrt(d))}
    kwargs["start"] = start
    in_memory = centered_clip_rows(TensorRows(x), weights, chunk=chunk, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        streamed = centered_clip_rows(_file_rows(x, tmp), weights, chunk=chunk, **kwargs)
    assert torch.equal(in_memory[0], streamed[0])
    assert torch.equal(in_memory[1].clip_factors, streamed[1].clip_factors)
    assert in_memory[1].tau == streamed[1].tau
    assert in_memory[1].iterations_run == streamed[1].iterations_run


@pytest.mark.parametrize("n", [2, 5, 8])
def test_default_chunks_over_a_file_subset_match_memory(tmp_path, n):
    d = 2 * ROWS_CHUNK + 12345  # not a multiple of the chunk
    x = _rows(n + 2, d, n, outliers=1)
    picked = [n + 1, *range(1, n)]  # a subset of the file's rows, in another order
    streamed, st_stats = centered_clip_rows(_file_rows(x, tmp_path, picked), tau_rel=1.0)
    in_memory, mem_stats = centered_clip_rows(TensorRows(x[picked]), tau_rel=1.0)
    assert torch.equal(streamed, in_memory)
    assert torch.equal(st_stats.clip_factors, mem_stats.clip_factors)
    assert st_stats.tau == mem_stats.tau


def test_chunked_median_is_the_whole_median():
    x = _rows(6, 100_003, 3, outliers=2)
    rows = TensorRows(x)
    from veritrain.aggregation.streamed import median_gram

    mg = median_gram(rows, chunk=777)
    assert torch.equal(mg.median, CoordinateMedian()(x))


# --- agreement with CenteredClip and the round's tau ---------------------------------


@pytest.mark.parametrize(("n", "outliers", "weighted"),
                         [(1, 0, False), (2, 0, False), (3, 1, False), (4, 1, False),
                          (7, 3, False), (16, 5, False), (16, 7, False), (6, 2, True),
                          (9, 4, True)])
def test_agrees_with_the_dense_definition_and_the_rounds_tau(n, outliers, weighted):
    d = 50_001
    x = _rows(n, d, 10 + n, outliers)
    weights = torch.arange(n, dtype=torch.float64) if weighted else None  # row 0: weight 0
    v, stats = centered_clip_rows(TensorRows(x), weights, tau_rel=1.0)
    assert stats.tau == pytest.approx(dense_tau(x, 1.0, weights), rel=1e-6)
    resolved = resolve_aggregator_params({"tau_rel": 1.0, "iterations": 10}, x)
    assert resolved == {"tau": clip_radius(TensorRows(x), 1.0), "iterations": 10}
    if not weighted:  # the very radius: the same Gram, the same steps
        assert resolved["tau"] == stats.tau
    ref = dense_centered_clip(x, weights, stats.tau)
    spread = float((x.double() - ref).norm(dim=1).median())
    assert float((v.double() - ref).norm()) <= 1e-5 * max(float(ref.norm()), spread)
    factors = clip_quality(x, ref.float(), stats.tau)
    assert stats.clip_factors.tolist() == pytest.approx(factors, rel=1e-5, abs=1e-9)
    if outliers and n > 2:
        assert float(stats.clip_factors[weights is not None:outliers].max()) < 0.2  # clipped
    # the in-memory rule of the registry is this very function (start "geometric_median")
    same, same_stats = CenteredClip(stats.tau).with_stats(x, weights)
    direct = centered_clip_rows(TensorRows(x), weights, tau=stats.tau)
    assert torch.equal(same, direct[0])
    assert torch.equal(same_stats.clip_factors, direct[1].clip_factors)
    # the coordinate-median start: the same radius, CenteredClip's result to rounding
    vm, mstats = centered_clip_rows(TensorRows(x), weights, tau_rel=1.0, start="median")
    assert mstats.tau == pytest.approx(stats.tau, rel=1e-6)  # another Gram's rounding
    ref_m = CenteredClip(mstats.tau, start="median")(x, weights)
    assert float((vm - ref_m).norm()) <= 1e-5 * max(float(ref_m.norm()), spread)


def test_far_byzantine_rows_move_the_result_by_at_most_the_clipping_bound():
    n_honest, f, d, iterations = 9, 7, 20_000, 10
    honest = _rows(n_honest, d, 7)
    mu = honest.mean(0)
    direction = torch.randn(d, generator=torch.Generator().manual_seed(8))
    results = {}
    for magnitude in (1e6, 1e9):
        byzantine = mu + magnitude * direction / direction.norm() * torch.ones(f, 1)
        x = torch.cat([honest, byzantine])
        v, stats = centered_clip_rows(TensorRows(x), tau_rel=1.0, iterations=iterations)
        start = dense_geometric_median(x).float()
        bound = float((start - mu).norm()) + iterations * f / (n_honest + f) * stats.tau
        assert float((v - mu).norm()) <= bound
        assert float((v - mu).norm()) <= stats.tau  # in practice well inside the honest spread
        assert float(x.mean(0).sub(mu).norm()) > 100 * bound  # the mean is dragged away
        results[magnitude] = (v, stats.tau)
    # Clipped rows pull by tau whatever their size: 1e6 or 1e9 away, the same aggregate.
    (v1, tau1), (v2, _) = results[1e6], results[1e9]
    assert float((v1 - v2).norm()) <= 1e-3 * tau1


def test_nonfinite_rows_are_refused_by_name(tmp_path):
    x = _rows(5, 3 * 1000 + 17, 4)
    x[1, 5] = math.nan
    x[3, 2900] = math.inf
    for rows in (TensorRows(x), _file_rows(x, tmp_path)):
        with pytest.raises(NonFiniteUpdateError) as err:
            centered_clip_rows(rows, tau_rel=1.0, chunk=1000)
        assert err.value.rows == (1, 3)


def test_input_checks():
    x = _rows(3, 10, 0)
    with pytest.raises(AggregationInputError, match="exactly one"):
        centered_clip_rows(TensorRows(x))
    with pytest.raises(AggregationInputError, match="exactly one"):
        centered_clip_rows(TensorRows(x), tau=1.0, tau_rel=1.0)
    with pytest.raises(AggregationInputError):
        centered_clip_rows(TensorRows(x), tau=-1.0)
    with pytest.raises(AggregationInputError):
        centered_clip_rows(x, tau=1.0)  # a tensor is not a row source
    with pytest.raises(AggregationInputError):
        TensorRows(x.to(torch.float16))


def test_row_file_checks_its_size(tmp_path):
    path = tmp_path / "rows.f32"
    path.write_bytes(bytes(4 * 10))
    assert FileRows(path, 2, 5).read(1, 4).shape == (2, 3)
    with pytest.raises(AggregationInputError):
        FileRows(path, 3, 5)
    with pytest.raises(AggregationInputError):
        FileRows(path, 2, 5, [2])


# --- the geometric median: the same two passes --------------------------------------


def dense_weiszfeld(x: torch.Tensor, w: torch.Tensor | None, iterations: int = 100,
                    tol: float = 1e-7, eps: float = 1e-8) -> torch.Tensor:
    """``GeometricMedian`` as specified (aggregation.md 2.6), in float64 on the dense rows."""
    x64 = x.double()
    n = x.shape[0]
    wn = torch.full((n,), 1.0 / n, dtype=torch.float64) if w is None else w.double() / w.sum()
    v = wn @ x64
    for _ in range(iterations):
        dist = (x64 - v).norm(dim=1)
        beta = wn / dist.clamp(min=eps)
        new = (beta / beta.sum()) @ x64
        step = float((new - v).norm())
        v = new
        if step <= tol * _lower_median(dist[wn > 0]):
            break
    return v


#: Documented tolerance of the geometric median against the float64 definition
#: (aggregation.md 2.6): 1e-5 of max(||GM||, median distance) for float32 rows.
GM_TOLERANCE = 1e-5


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 9),
    d=st.integers(1, 700),
    chunk=st.sampled_from([1, 7, 64, 333, ROWS_CHUNK]),
    seed=st.integers(0, 2**31 - 1),
    outliers=st.integers(0, 3),
    weighted=st.booleans(),
    scale=st.sampled_from([1e-20, 1.0, 50.0, 1e15]),
)
def test_geometric_median_over_rows_is_the_rule_bit_for_bit(n, d, chunk, seed, outliers,
                                                            weighted, scale):
    x = _rows(n, d, seed, min(outliers, (n - 1) // 2), scale=scale)
    weights = None
    if weighted:
        gen = torch.Generator().manual_seed(seed + 1)
        weights = torch.randint(0, 4, (n,), generator=gen).double()
        weights[seed % n] = 1.0  # a positive sum
    in_memory = geometric_median_rows(TensorRows(x), weights, chunk=chunk)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _file_rows(x, tmp)
        from_file = geometric_median_rows(rows, weights, chunk=chunk)
        production = aggregate_rows("geometric_median", {}, rows, weights)
    assert torch.equal(in_memory, from_file)
    rule = GeometricMedian()(x, weights)  # default chunks
    assert torch.equal(production.aggregate, rule) and production.tau is None
    ref = dense_weiszfeld(x, weights)
    spread = _lower_median((x.double() - ref).norm(dim=1))
    bound = GM_TOLERANCE * max(float(ref.norm()), spread)
    assert float((in_memory.double() - ref).norm()) <= bound
    assert float((rule.double() - ref).norm()) <= bound


def test_geometric_median_streams_and_holds_the_outliers(tmp_path):
    x = _rows(16, 3 * ROWS_CHUNK + 17, 4, outliers=7, scale=1e6)
    honest = dense_weiszfeld(x[7:], None)
    out = aggregate_rows("geometric_median", {"iterations": 100}, _file_rows(x, tmp_path))
    assert torch.equal(out.aggregate, GeometricMedian()(x))
    spread = float((x[7:].double() - honest).norm(dim=1).max())
    assert float((out.aggregate.double() - honest).norm()) <= spread  # 7 of 16 at 1e6x


# --- the run's aggregator over a row source ------------------------------------------


def test_aggregate_rows_streams_centered_clip_and_stacks_the_others(tmp_path):
    x = _rows(7, 5000, 2, outliers=2)
    rows = _file_rows(x, tmp_path)
    out = aggregate_rows("centered_clip", {"tau_rel": 1.0, "iterations": 10}, rows)
    v, stats = centered_clip_rows(TensorRows(x), tau_rel=1.0, iterations=10)
    assert torch.equal(out.aggregate, v) and out.tau == stats.tau
    assert torch.equal(out.clip_factors, stats.clip_factors)
    krum = aggregate_rows("krum", {"f": 2}, rows)  # streamed: the very row
    assert torch.equal(krum.aggregate, Krum(2)(x)) and krum.clip_factors is None
    assert any(torch.equal(krum.aggregate, row) for row in x)
    multi = aggregate_rows("multi_krum", {"f": 2, "m": 4}, rows)
    assert torch.equal(multi.aggregate, build_aggregator("multi_krum", {"f": 2, "m": 4})(x))
    trimmed = aggregate_rows("trimmed_mean", {"f": 2}, rows)  # stacked
    assert torch.equal(trimmed.aggregate, build_aggregator("trimmed_mean", {"f": 2})(x))
    bucketed = aggregate_rows("centered_clip", {"tau_rel": 1.0, "bucket_size": 2}, rows, seed=3)
    expected = build_aggregator("centered_clip", {"tau": stats.tau, "bucket_size": 2}, seed=3)(x)
    assert bucketed.tau == stats.tau and torch.equal(bucketed.aggregate, expected)
    zero_start = aggregate_rows("centered_clip", {"tau": 2.0, "start": "zero"}, rows)
    assert torch.equal(zero_start.aggregate, CenteredClip(2.0, start="zero")(x))


def test_row_distances_match_the_dense_formula(tmp_path):
    x = _rows(6, 70_001, 5, outliers=1)
    v = x.mean(0)
    exact = torch.linalg.vector_norm(x.double() - v.double(), dim=1)
    dense = torch.linalg.vector_norm((x - v).double(), dim=1)  # float32 differences
    for rows in (TensorRows(x), _file_rows(x, tmp_path)):
        got = row_distances(rows, v, chunk=4096).tolist()
        assert got == pytest.approx(exact.tolist(), rel=1e-13)
        assert got == pytest.approx(dense.tolist(), rel=1e-7)


# --- memory: never N updates at once ------------------------------------------------


def test_largest_allocation_does_not_grow_with_n(tmp_path):
    """Every tensor the streamed rule allocates (one thread: the dispatch mode sees all
    ops), for N = 4 and N = 16 rows of D = 2^20 in a file: the largest is the result, a
    [D] vector, never N x D."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
            return out

    d = 1 << 20
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        largest = {}
        for n in (4, 16):
            gen = torch.Generator().manual_seed(n)
            store = RowFile(tmp_path / f"rows-{n}.f32", d)
            for _ in range(n):
                store.append(torch.randn(d, generator=gen))
            with Largest() as mode:
                centered_clip_rows(store.rows(), tau_rel=1.0, chunk=8192)
            largest[n] = mode.nbytes
    finally:
        torch.set_num_threads(threads)
    assert largest[4] == largest[16] == 4 * d


_PEAK = """
import sys, torch
from pathlib import Path
from veritrain.aggregation import RowFile, centered_clip_rows
n, d, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gen = torch.Generator().manual_seed(n)
store = RowFile(Path(path), d)
for _ in range(n):
    store.append(torch.randn(d, generator=gen))
rows = store.rows()
centered_clip_rows(rows, tau_rel=1.0, chunk=8192)  # warm up (thread pool, allocator)
def kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
before = kib("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
centered_clip_rows(rows, tau_rel=1.0, chunk=8192)
print((kib("VmHWM") - before) * 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_resident_memory_does_not_grow_with_n(tmp_path):
    """Peak extra resident memory of one call (fresh process, glibc returning large blocks):
    about the result, 4 B/param, plus O(N x chunk) buffers, for 4 rows as for 16."""
    d = 1 << 21
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    peak = {}
    for n in (4, 16):
        done = subprocess.run([sys.executable, "-c", _PEAK, str(n), str(d),
                               str(tmp_path / f"rows-{n}.f32")],
                              env=env, capture_output=True, text=True, check=True)
        peak[n] = int(done.stdout.split()[-1])
    stack16 = 16 * d * 4
    print(f"peak extra resident memory: {peak} bytes for D = {d}")
    assert peak[16] < 2 * 4 * d < stack16 / 5  # one [D] vector, not two
    assert abs(peak[16] - peak[4]) < 4 * d  # growing with N would add 12 x 4 x D here


@pytest.mark.parametrize("threads", [1, 2])
def test_gram_bytes_do_not_depend_on_the_source_the_chunking_or_the_threads(tmp_path, threads):
    """Aligned rows in memory take one batched product over many units, a row file one
    per unit, an unaligned view a copy per chunk: the Gram (hence every streamed rule)
    has the same bytes from each, with any chunk (a file read in chunks above a unit
    too), on one thread or two."""
    from veritrain.aggregation.gram import UNIT
    from veritrain.aggregation.streamed import gram_rows

    d = 3 * UNIT + 2000  # a multiple of 16: rows in memory are read in place
    x = _rows(6, d, 31, outliers=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = gram_rows(TensorRows(x)).matrix
        files = _file_rows(x, tmp_path)
        unaligned = torch.empty(6, d + 3)[:, 3:]
        unaligned.copy_(x)
        for source, chunk in [(files, ROWS_CHUNK), (files, 2 * UNIT + 5), (files, 1),
                              (TensorRows(unaligned), ROWS_CHUNK), (TensorRows(x), 7)]:
            assert torch.equal(gram_rows(source, chunk=chunk).matrix, reference), chunk
        v, stats = centered_clip_rows(files, tau_rel=1.0, chunk=2 * UNIT)
        w, mem_stats = centered_clip_rows(TensorRows(x), tau_rel=1.0)
        assert torch.equal(v, w) and stats.tau == mem_stats.tau
    finally:
        torch.set_num_threads(before)
