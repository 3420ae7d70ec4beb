"""Registry, public API, determinism, purity and the import ban."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import veritrain.aggregation as aggregation
from veritrain.aggregation import (
    AGGREGATOR_NAMES,
    AggregationInputError,
    Aggregator,
    Bucketing,
    CenteredClip,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    MultiKrum,
    TrimmedMean,
    build_aggregator,
    centered_clip_with_stats,
)
from veritrain.aggregation import attacks as atk

PACKAGE_DIR = Path(aggregation.__file__).resolve().parent

SPECS = {
    "mean": ({}, Mean()),
    "centered_clip": ({"tau": 0.5, "iterations": 3}, CenteredClip(0.5, iterations=3)),
    "krum": ({"f": 1}, Krum(1)),
    "multi_krum": ({"f": 1, "m": 3}, MultiKrum(1, 3)),
    "trimmed_mean": ({"f": 2}, TrimmedMean(2)),
    "median": ({}, CoordinateMedian()),
    "geometric_median": ({"iterations": 7}, GeometricMedian(iterations=7)),
}


def rows(n: int = 9, d: int = 70_000, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(d, generator=gen).to(dtype) + torch.randn(n, d, generator=gen).to(dtype)


def test_registry_names():
    assert AGGREGATOR_NAMES == (
        "mean",
        "centered_clip",
        "krum",
        "multi_krum",
        "trimmed_mean",
        "median",
        "geometric_median",
    )
    assert set(SPECS) == set(AGGREGATOR_NAMES)


@pytest.mark.parametrize("name", AGGREGATOR_NAMES)
def test_build_aggregator(name):
    params, expected = SPECS[name]
    agg = build_aggregator(name, params)
    assert agg == expected
    assert isinstance(agg, Aggregator)
    x = rows(9, 50, torch.float64)
    assert torch.equal(agg(x), expected(x))


def test_build_aggregator_with_buckets():
    agg = build_aggregator("krum", {"f": 1, "bucket_size": 2}, seed=11)
    assert agg == Bucketing(Krum(1), 2, 11)
    assert build_aggregator("krum", {"f": 1, "bucket_size": 1}, seed=11) == Krum(1)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("average", {}, "unknown aggregator"),
        ("krum", {"f": 1, "m": 2}, "unknown parameters"),
        ("mean", {"tau": 1.0}, "unknown parameters"),
        ("centered_clip", {}, "tau"),
        ("krum", {"f": -1}, "f must be"),
        ("krum", {"f": 1, "bucket_size": 0}, "bucket_size"),
        ("krum", {"f": 1, "bucket_size": 2.0}, "bucket_size"),
        ("centered_clip", {"tau": 1.0, "start": "nowhere"}, "start"),
    ],
)
def test_invalid_build_aggregator(name, params, message):
    with pytest.raises(AggregationInputError, match=message):
        build_aggregator(name, params)


def test_invalid_build_aggregator_params_not_a_mapping():
    with pytest.raises(AggregationInputError, match="mapping"):
        build_aggregator("mean", [("f", 1)])  # type: ignore[arg-type]


def test_public_api_is_explicit():
    public = {
        name
        for name in dir(aggregation)
        if not name.startswith("_") and not isinstance(getattr(aggregation, name), ModuleType)
    }
    assert set(aggregation.__all__) == public
    assert len(aggregation.__all__) == len(set(aggregation.__all__))


# --- determinism and purity -------------------------------------------------------------

RULES = [
    Mean(),
    CenteredClip(50.0),
    CenteredClip(50.0, start="zero"),
    CenteredClip(50.0, start="mean"),
    Krum(2),
    MultiKrum(2),
    TrimmedMean(2),
    CoordinateMedian(),
    GeometricMedian(),
    Bucketing(CenteredClip(50.0), 2, 9),
]


@pytest.mark.parametrize("agg", RULES, ids=repr)
@pytest.mark.parametrize("weighted", [False, True])
def test_same_input_same_bytes(agg, weighted):
    x = rows()
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0]) if weighted else None
    before = x.clone()
    first = agg(x, w)
    # another input in between must leave no trace (no hidden state)
    agg(rows(9, 70_000) * 3.0 + 1.0)
    second = agg(x.clone(), None if w is None else w.clone())
    assert first.numpy().tobytes() == second.numpy().tobytes()
    assert torch.equal(x, before)  # inputs are not modified


def test_same_bytes_whatever_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 300_001, generator=gen)
    x[:2] *= 30.0  # clipping and selection both matter
    w = torch.rand(12, generator=gen).double()
    rules = [CenteredClip(200.0), CenteredClip(200.0, start="zero"), MultiKrum(2)]
    rules += [GeometricMedian(), TrimmedMean(2), CoordinateMedian(), Bucketing(Mean(), 3, 1)]
    threads = torch.get_num_threads()
    try:
        digests = []
        for count in (1, 3):
            torch.set_num_threads(count)
            digests.append([agg(x, w).numpy().tobytes() for agg in rules])
            digests[-1] += [agg(x).numpy().tobytes() for agg in rules]
    finally:
        torch.set_num_threads(threads)
    assert digests[0] == digests[1]


def test_no_global_random_state_is_used():
    x = rows(9, 100)
    state = torch.get_rng_state()
    Bucketing(Mean(), 2, 3)(x)
    atk.gaussian_noise(x, 2, generator=torch.Generator().manual_seed(0))
    atk.optimal_alie(x, 2, Bucketing(TrimmedMean(2), 1, 4), evaluations=4)
    assert torch.equal(torch.get_rng_state(), state)


def test_centered_clip_stats_are_deterministic():
    x = rows()
    a = centered_clip_with_stats(x, tau=50.0)
    b = centered_clip_with_stats(x.clone(), tau=50.0)
    assert a[0].numpy().tobytes() == b[0].numpy().tobytes()
    assert a[1].iterations_run == b[1].iterations_run
    assert torch.equal(a[1].clip_factors, b[1].clip_factors)


def test_bucketing_seed_changes_the_result():
    x = rows(9, 100)
    agg = [Bucketing(Krum(1), 2, s)(x) for s in range(6)]
    assert len({a.numpy().tobytes() for a in agg}) > 1


# --- import ban -------------------------------------------------------------------------

BANNED = {
    "aiohttp",
    "alembic",
    "asyncio",
    "http",
    "httpx",
    "psycopg",
    "psycopg2",
    "requests",
    "socket",
    "sqlalchemy",
    "sqlite3",
    "ssl",
    "urllib",
    "urllib3",
}


@pytest.mark.parametrize("path", sorted(PACKAGE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_aggregation_sources_import_no_network_or_database_module(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in BANNED, f"{path.name} imports {name}"


def test_importing_aggregation_loads_no_network_or_database_library():
    code = (
        "import sys, veritrain.aggregation, veritrain.aggregation.attacks\n"
        "bad = {'aiohttp', 'sqlalchemy', 'alembic', 'psycopg', 'psycopg2', 'requests', 'httpx'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
