"""Error types shared by every role.

"Their fault" (a peer sent something invalid) is kept apart from "our fault"
(a bug): every rejection of received input raises a subclass of
:class:`RejectedInput` carrying a stable machine-readable ``reason`` that is
recorded in verdicts and returned by the API; anything else is a bug.
"""

from __future__ import annotations


class RejectedInput(ValueError):
    """A received input was refused; ``reason`` is a stable snake_case code."""

    reason: str = "invalid"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class EncodingError(RejectedInput):
    """Bytes that are not the canonical encoding of a well-formed message."""

    reason = "malformed"


class PayloadError(RejectedInput):
    """A payload or tensor file that cannot be decoded safely."""

    reason = "undecodable"


class SignatureError(RejectedInput):
    """A signature that does not verify under the claimed key and domain."""

    reason = "bad_signature"


class OversizedError(RejectedInput):
    """An input larger than its protocol limit."""

    reason = "oversized"


class NonFiniteError(PayloadError):
    """A tensor holding NaN or Inf."""

    reason = "non_finite"
