"""The interface every aggregation rule implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from ._inputs import Weights

__all__ = ["Aggregator"]


@runtime_checkable
class Aggregator(Protocol):
    """A pure rule mapping N update rows to one aggregate row.

    ``agg(updates, weights=None) -> Tensor``

    * ``updates``: [N, D] float32 or float64; the result is [D] with the same
      dtype and device.
    * ``weights``: optional [N], finite, >= 0, positive sum.  Rows of weight 0
      take no part in the rule (they are still checked for NaN/Inf).
    * No state survives between calls and no global random generator is used:
      the same inputs give the same bytes (same build and thread count).
    * Raises ``AggregationInputError`` for malformed inputs or when the rule's
      breakdown condition fails, ``NonFiniteUpdateError`` naming the NaN/Inf rows.
    """

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor: ...
