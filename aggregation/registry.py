"""Build an aggregator from a run spec: ``build_aggregator(name, params, seed=...)``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ._inputs import check_count
from .base import Aggregator
from .bucketing import Bucketing
from .centered_clip import CenteredClip
from .coordinate import CoordinateMedian, TrimmedMean
from .errors import AggregationInputError
from .geometric_median import GeometricMedian
from .krum import Krum, MultiKrum
from .mean import Mean

__all__ = ["AGGREGATOR_NAMES", "build_aggregator"]

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
