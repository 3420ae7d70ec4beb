"""Byzantine-robust aggregation rules for veritrain.

Every rule is a small frozen callable ``agg(updates, weights=None) -> Tensor``
over an [N, D] float32/float64 tensor of update rows (see ``Aggregator``).
``centered_clip_rows`` (what validators run) reads the rows from a ``Rows``
source by column chunks instead, so its memory does not grow with N.
They are pure: no state between calls, no global random generator.  Attacks
used to evaluate them live in ``veritrain.aggregation.attacks``.
"""

from .base import Aggregator
from .bucketing import Bucketing
from .centered_clip import (
    CenteredClip,
    CenteredClipStats,
    RowsClipStats,
    centered_clip_rows,
    centered_clip_with_stats,
    clip_radius,
)
from .coordinate import CoordinateMedian, TrimmedMean
from .errors import AggregationInputError, NonFiniteUpdateError, OversizedUpdateError
from .geometric_median import GeometricMedian, geometric_median_rows
from .krum import Krum, MultiKrum, krum_rows, multi_krum_rows
from .mean import Mean
from .registry import (
    AGGREGATOR_NAMES,
    RowsAggregate,
    aggregate_rows,
    build_aggregator,
    resolve_radius,
)
from .rows import FileRows, RowFile, RowList, Rows, RowStore, TensorRows
from .streamed import row_distances

__all__ = [
    "AGGREGATOR_NAMES",
    "AggregationInputError",
    "Aggregator",
    "Bucketing",
    "CenteredClip",
    "CenteredClipStats",
    "CoordinateMedian",
    "FileRows",
    "GeometricMedian",
    "Krum",
    "Mean",
    "MultiKrum",
    "NonFiniteUpdateError",
    "OversizedUpdateError",
    "RowFile",
    "RowList",
    "RowStore",
    "Rows",
    "RowsAggregate",
    "RowsClipStats",
    "TensorRows",
    "TrimmedMean",
    "aggregate_rows",
    "build_aggregator",
    "centered_clip_rows",
    "centered_clip_with_stats",
    "clip_radius",
    "geometric_median_rows",
    "krum_rows",
    "multi_krum_rows",
    "resolve_radius",
    "row_distances",
]
