"""The run spec's aggregator: ``build_aggregator(name, params, seed=...)`` (a rule on an
[N, D] tensor) and ``aggregate_rows(name, params, rows)`` (that rule over a row source,
what ``process_round`` calls)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor

from ._inputs import Weights, check_count
from .base import Aggregator
from .bucketing import Bucketing
from .centered_clip import STREAMED_STARTS, CenteredClip, centered_clip_rows, clip_radius
from .coordinate import CoordinateMedian, TrimmedMean
from .errors import AggregationInputError
from .geometric_median import GeometricMedian, geometric_median_rows
from .krum import Krum, MultiKrum, krum_rows, multi_krum_rows
from .mean import Mean
from .rows import Rows, TensorRows
from .streamed import check_rows

__all__ = [
    "AGGREGATOR_NAMES",
    "RowsAggregate",
    "aggregate_rows",
    "build_aggregator",
    "resolve_radius",
    "streams",
]

# name -> (constructor, accepted parameters)
_REGISTRY: dict[str, tuple[Callable[..., Aggregator], frozenset[str]]] = {
    "mean": (Mean, frozenset()),
    "centered_clip": (CenteredClip, frozenset({"tau", "iterations", "tol", "start"})),
    "krum": (Krum, frozenset({"f"})),
    "multi_krum": (MultiKrum, frozenset({"f", "m"})),
    "trimmed_mean": (TrimmedMean, frozenset({"f"})),
    "median": (CoordinateMedian, frozenset()),
    "geometric_median": (GeometricMedian, frozenset({"iterations", "tol", "eps"})),
}

#: Names accepted by ``build_aggregator``.
AGGREGATOR_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def build_aggregator(name: str, params: Mapping[str, object], *, seed: int = 0) -> Aggregator:
    """The aggregator called ``name`` with hyperparameters ``params``.

    ``params`` holds the rule's constructor arguments plus, for any rule, an
    optional ``bucket_size`` (int >= 1): above 1 the rule is wrapped in
    ``Bucketing(rule, bucket_size, seed)``.  Unknown names, unknown or invalid
    parameters raise ``AggregationInputError``.
    """
    if name not in _REGISTRY:
        raise AggregationInputError(
            f"unknown aggregator {name!r}; expected one of {list(AGGREGATOR_NAMES)}"
        )
    if not isinstance(params, Mapping):
        raise AggregationInputError(f"params must be a mapping, got {type(params).__name__}")
    factory, accepted = _REGISTRY[name]
    kwargs = dict(params)
    bucket_size = kwargs.pop("bucket_size", None)
    unknown = sorted(str(k) for k in kwargs if k not in accepted)
    if unknown:
        raise AggregationInputError(
            f"unknown parameters {unknown} for aggregator {name!r}; "
            f"accepted: {sorted(accepted | {'bucket_size'})}"
        )
    try:
        aggregator = factory(**kwargs)
    except TypeError as exc:  # a required parameter is missing
        raise AggregationInputError(f"aggregator {name!r}: {exc}") from exc
    if bucket_size is None:
        return aggregator
    size = check_count(bucket_size, "bucket_size", minimum=1)
    if size == 1:
        return aggregator
    return Bucketing(aggregator, size, check_count(seed, "seed", minimum=0))


# --- the run's aggregator over a row source ---------------------------------------


@dataclass(frozen=True)
class RowsAggregate:
    """An aggregate over a row source and what scoring needs from it.

    ``tau``: the radius used (None for rules without one); ``clip_factors``:
    [N] float64 min(1, tau / ||x_i - v||) from the rule's own Gram, or None
    (then compute them from the rows if needed).
    """

    aggregate: Tensor
    tau: float | None
    clip_factors: Tensor | None


#: Parameters of the rules ``aggregate_rows`` streams (``bucket_size`` 1 or absent).
_STREAMED_PARAMS: dict[str, frozenset[str]] = {
    "centered_clip": frozenset({"tau", "tau_rel", "iterations", "tol", "start", "bucket_size"}),
    "geometric_median": frozenset({"iterations", "tol", "eps", "bucket_size"}),
    "krum": frozenset({"f", "bucket_size"}),
    "multi_krum": frozenset({"f", "m", "bucket_size"}),
}


def streams(name: str, params: Mapping[str, object]) -> bool:
    """Whether ``aggregate_rows`` runs (name, params) over the row source in two passes,
    without bucketing: CenteredClip from the geometric median (the default start) or
    the coordinate median, the geometric median, Krum and Multi-Krum."""
    if name not in _STREAMED_PARAMS or not set(params) <= _STREAMED_PARAMS[name]:
        return False
    if not _no_buckets(params.get("bucket_size")):
        return False
    return name != "centered_clip" or params.get("start", "geometric_median") in STREAMED_STARTS


def _no_buckets(size: object) -> bool:
    return size is None or (type(size) is int and size == 1)


def resolve_radius(params: Mapping[str, object], rows: Rows) -> dict[str, object]:
    """``params`` with a scale-free ``tau_rel`` turned into this round's ``tau`` (clip_radius)."""
    out = dict(params)
    tau_rel = out.pop("tau_rel", None)
    if tau_rel is not None:
        out["tau"] = clip_radius(rows, tau_rel)  # type: ignore[arg-type]
    return out


def aggregate_rows(
    name: str,
    params: Mapping[str, object],
    rows: Rows,
    weights: Weights = None,
    *,
    seed: int = 0,
) -> RowsAggregate:
    """The run's aggregator ``(name, params)`` over a row source.

    CenteredClip (the run default, any start but "zero", "mean" or a vector), the
    geometric median, Krum and Multi-Krum stream (``centered_clip_rows``,
    ``geometric_median_rows``, ``krum_rows``, ``multi_krum_rows``): two passes over
    the rows, memory independent of N.  Every other rule, bucketing
    included, runs on the in-memory stack ``rows.read(0, D)`` (``build_aggregator``),
    so its memory grows with N; ``tau_rel`` is resolved with ``clip_radius`` first.
    """
    rows = check_rows(rows)
    if streams(name, params) and name == "centered_clip":
        keys = ("tau", "tau_rel", "iterations", "tol", "start")
        kwargs = {k: params[k] for k in keys if k in params}
        v, stats = centered_clip_rows(rows, weights, **kwargs)  # type: ignore[arg-type]
        return RowsAggregate(v, stats.tau, stats.clip_factors)
    if streams(name, params):
        rule = build_aggregator(name, params, seed=seed)  # checks the parameters
        if isinstance(rule, GeometricMedian):
            v = geometric_median_rows(
                rows, weights, iterations=rule.iterations, tol=rule.tol, eps=rule.eps
            )
        elif isinstance(rule, Krum):
            v = krum_rows(rows, weights, f=rule.f)
        else:
            assert isinstance(rule, MultiKrum)
            v = multi_krum_rows(rows, weights, f=rule.f, m=rule.m)
        return RowsAggregate(v, None, None)
    stacked = rows.read(0, rows.numel)
    resolved = resolve_radius(params, TensorRows(stacked))
    agg = build_aggregator(name, resolved, seed=seed)
    tau = resolved.get("tau")
    return RowsAggregate(agg(stacked, weights), None if tau is None else float(tau), None)  # type: ignore[arg-type]
