"""Validation shared by every aggregation rule (private).

Producers of updates are untrusted peers, so every rule checks its inputs the
same way: a 2-D float32/float64 tensor, optional non-negative weights, no
NaN/Inf rows.  Finiteness is checked cheaply: each rule already computes some
per-row statistic (a Gram diagonal, a row sum) that is non-finite whenever the
row is; only rows flagged by it are scanned exactly, so the common case costs no
extra pass over the data.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from .errors import AggregationInputError, NonFiniteUpdateError

__all__ = [
    "FLOAT_DTYPES",
    "Weights",
    "active_rows",
    "check_count",
    "check_nonneg_real",
    "check_positive_real",
    "check_updates",
    "check_weights",
    "is_finite",
    "nonfinite_rows",
    "raise_if_nonfinite",
]

FLOAT_DTYPES = (torch.float32, torch.float64)

#: Per-row weights as accepted by every aggregator.
Weights = Tensor | Sequence[float] | None


def check_updates(updates: object) -> Tensor:
    """Return ``updates`` (detached) if it is a dense [N, D] float32/float64 tensor, N, D >= 1.

    Aggregation is not differentiated through: a tensor that requires grad is
    used detached.
    """
    if not isinstance(updates, Tensor):
        raise AggregationInputError(
            f"updates must be a torch.Tensor of shape [N, D], got {type(updates).__name__}"
        )
    if updates.layout != torch.strided:
        raise AggregationInputError(f"updates must be a dense tensor, got layout {updates.layout}")
    if updates.ndim != 2:
        raise AggregationInputError(
            f"updates must have shape [N, D] (one row per worker), got shape {tuple(updates.shape)}"
        )
    n, d = updates.shape
    if n < 1 or d < 1:
        raise AggregationInputError(f"updates must be non-empty, got shape {(n, d)}")
    if updates.dtype not in FLOAT_DTYPES:
        raise AggregationInputError(
            f"updates must be float32 or float64, got {updates.dtype}; convert explicitly "
            "(aggregators never change precision behind your back)"
        )
    return updates.detach()


def check_weights(weights: Weights, n: int) -> Tensor | None:
    """Validate optional weights: shape [n], finite, >= 0, positive sum.

    Returns them as a float64 CPU tensor (or None when no weights were given).
    """
    if weights is None:
        return None
    try:
        if isinstance(weights, Tensor):
            w = weights.detach().to(device="cpu", dtype=torch.float64)
        else:
            w = torch.as_tensor(list(weights), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise AggregationInputError(f"weights must be a sequence of numbers: {exc}") from exc
    if w.shape != (n,):
        raise AggregationInputError(
            f"weights must have shape [{n}] (one per update row), got {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()):
        bad = torch.nonzero(~torch.isfinite(w)).flatten().tolist()
        raise AggregationInputError(f"weights must be finite; rows {bad} are not")
    if bool((w < 0).any()):
        bad = torch.nonzero(w < 0).flatten().tolist()
        raise AggregationInputError(f"weights must be non-negative; rows {bad} are negative")
    if float(w.sum()) <= 0.0:
        raise AggregationInputError("weights must have a positive sum")
    return w


def active_rows(weights: Tensor | None, n: int) -> Tensor:
    """Indices (int64, ascending) of the rows that take part: those with positive weight."""
    if weights is None:
        return torch.arange(n)
    return torch.nonzero(weights > 0).flatten()


def is_finite(t: Tensor) -> bool:
    """Whether every element of ``t`` is finite.

    Exact, and about 100x faster on CPU than ``torch.isfinite(t).all()``: a sum
    is finite only if every term is; if the sum is not finite (a NaN/Inf, or an
    overflow of large finite terms), ``t * 0`` sums to exactly 0 unless some
    element is NaN or Inf.
    """
    if bool(torch.isfinite(t.sum())):
        return True
    return bool((t * 0).sum() == 0)


def nonfinite_rows(updates: Tensor, rows: Sequence[int] | Tensor | None = None) -> list[int]:
    """Exact scan: which of ``rows`` (default all) contain a NaN or Inf."""
    candidates = range(updates.shape[0]) if rows is None else [int(r) for r in rows]
    return [r for r in candidates if not is_finite(updates[r])]


def raise_if_nonfinite(updates: Tensor, row_stat: Tensor) -> list[int]:
    """Raise ``NonFiniteUpdateError`` for the rows that really hold NaN/Inf.

    ``row_stat`` [N] is any per-row statistic that is finite whenever the row is
    finite and not too large (a row sum, a squared norm).  Rows where it is not
    finite are scanned exactly.  Returns the flagged rows that turned out to be
    finite (the statistic overflowed), so the caller may fall back to a wider
    accumulator for them.
    """
    flagged = torch.nonzero(~torch.isfinite(row_stat.detach().cpu())).flatten().tolist()
    if not flagged:
        return []
    bad = nonfinite_rows(updates, flagged)
    if bad:
        raise NonFiniteUpdateError(bad)
    return flagged


def check_count(value: object, name: str, *, minimum: int) -> int:
    """An integer hyperparameter (bools refused) that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise AggregationInputError(f"{name} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise AggregationInputError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AggregationInputError(f"{name} must be a real number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise AggregationInputError(f"{name} must be finite, got {value!r}")
    return out


def check_positive_real(value: object, name: str) -> float:
    """A finite real hyperparameter > 0."""
    out = _check_real(value, name)
    if out <= 0.0:
        raise AggregationInputError(f"{name} must be > 0, got {value!r}")
    return out


def check_nonneg_real(value: object, name: str) -> float:
    """A finite real hyperparameter >= 0."""
    out = _check_real(value, name)
    if out < 0.0:
        raise AggregationInputError(f"{name} must be >= 0, got {value!r}")
    return out
