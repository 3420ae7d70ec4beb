"""Errors raised by the aggregation rules.

Both derive from ``ValueError``: they describe bad input (a peer's fault or a
misconfigured run spec), never a bug in the aggregator itself.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["AggregationInputError", "NonFiniteUpdateError", "OversizedUpdateError"]


class AggregationInputError(ValueError):
    """The inputs or hyperparameters of an aggregator are malformed.

    Wrong shapes or dtypes, negative weights, too many Byzantine workers for the
    rule's breakdown point, an unknown aggregator name or parameter.
    """


class NonFiniteUpdateError(ValueError):
    """Some update rows contain NaN or +-Inf; they are refused, never averaged in.

    ``rows`` holds the offending row indices (0-based, ascending) so the caller can
    attribute the fault to the workers that sent them.
    """

    def __init__(self, rows: Iterable[int]) -> None:
        self.rows: tuple[int, ...] = tuple(sorted(int(r) for r in rows))
        super().__init__(
            f"update rows {list(self.rows)} contain NaN or Inf values; "
            "refusing to aggregate them (drop or reject those updates first)"
        )


class OversizedUpdateError(AggregationInputError):
    """float64 update rows so large that their squared distances overflow float64.

    Only possible for float64 inputs with values beyond ~1e150 (float32 inputs
    are handled at any magnitude).  Distance-based rules cannot place such rows,
    so they are refused like non-finite ones; ``rows`` names them.
    """

    def __init__(self, rows: Iterable[int]) -> None:
        self.rows: tuple[int, ...] = tuple(sorted(int(r) for r in rows))
        ValueError.__init__(
            self,
            f"update rows {list(self.rows)} are too large for distance-based aggregation "
            "(squared norms overflow float64); reject them like non-finite updates",
        )
