"""Byzantine-robust aggregation rules for veritrain.

Every rule is a small frozen callable ``agg(updates, weights=None) -> Tensor``
over an [N, D] float32/float64 tensor of update rows (see ``Aggregator``).
They are pure: no state between calls, no global random generator.  Attacks
used to evaluate them live in ``veritrain.aggregation.attacks``.
"""

from .base import Aggregator
from .bucketing import Bucketing
from .centered_clip import CenteredClip, CenteredClipStats, centered_clip_with_stats
from .coordinate import CoordinateMedian, TrimmedMean
from .errors import AggregationInputError, NonFiniteUpdateError, OversizedUpdateError
from .geometric_median import GeometricMedian
from .krum import Krum, MultiKrum
from .mean import Mean
from .registry import AGGREGATOR_NAMES, build_aggregator

__all__ = [
    "AGGREGATOR_NAMES",
    "AggregationInputError",
    "Aggregator",
    "Bucketing",
    "CenteredClip",
    "CenteredClipStats",
    "CoordinateMedian",
    "GeometricMedian",
    "Krum",
    "Mean",
    "MultiKrum",
    "NonFiniteUpdateError",
    "OversizedUpdateError",
    "TrimmedMean",
    "build_aggregator",
    "centered_clip_with_stats",
]
