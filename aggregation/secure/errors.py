"""Errors of secure averaging.

All derive from ``AggregationInputError`` (a ``ValueError``): they describe bad
input or a peer's misbehaviour, never a bug.  Those that blame someone carry
the culprit so the caller can record a fault against it.
"""

from __future__ import annotations

from ..errors import AggregationInputError

__all__ = [
    "InconsistentSharesError",
    "NonFiniteShardError",
    "SecureAggregationError",
    "ShareVerificationError",
    "TooManyDropoutsError",
]


class SecureAggregationError(AggregationInputError):
    """Base class: a secure-averaging input or parameter is malformed."""


class TooManyDropoutsError(SecureAggregationError):
    """Fewer than ``threshold`` bucket members took part in the unmasking.

    More than ``max_dropouts`` members dropped (or withheld their shares), so
    some secret cannot be reconstructed and the bucket sum cannot be recovered.
    """

    def __init__(self, bucket: int, needed: int, available: int, what: str) -> None:
        self.bucket = bucket
        self.needed = needed
        self.available = available
        super().__init__(
            f"bucket {bucket}: {what} needs {needed} valid shares but only {available} "
            f"are available; more members dropped than the bucket tolerates "
            f"(max_dropouts = size - {needed}), so its sum cannot be recovered"
        )


class ShareVerificationError(SecureAggregationError):
    """A Shamir share does not match its dealer's public commitment.

    ``culprit`` is the worker id to blame: the holder who revealed a forged
    share, or the dealer whose sealed share does not open to its commitment.
    """

    def __init__(self, culprit: bytes, message: str) -> None:
        self.culprit = culprit
        super().__init__(message)


class InconsistentSharesError(SecureAggregationError):
    """Valid (committed) shares of one dealer do not define its committed secret.

    The shares do not lie on one polynomial of the agreed degree, or they
    interpolate to a value other than the committed secret: the dealer dealt
    inconsistently.  ``culprit`` is the dealer.
    """

    def __init__(self, culprit: bytes, message: str) -> None:
        self.culprit = culprit
        super().__init__(message)


class NonFiniteShardError(SecureAggregationError):
    """Published shard aggregates contain NaN or Inf; ``shards`` names them."""

    def __init__(self, shards: list[int]) -> None:
        self.shards = tuple(shards)
        super().__init__(
            f"shard results {list(self.shards)} contain NaN or Inf: recompute them "
            "(recompute_shard) and record the publishers' faults"
        )
