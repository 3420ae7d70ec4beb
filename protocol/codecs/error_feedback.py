"""Worker-side error feedback: what compression dropped is sent in later rounds.

With residual ``e`` (zero at the start) and decay ``beta`` (1 unless the run
says otherwise)::

    target  = delta + e
    payload = encode(target)
    decoded = decode(payload)          # exactly what the validators will see
    e       = beta * (target - decoded)

With ``beta = 1``, summed over rounds, ``sum(decoded) = sum(delta) - e``: the
aggregate of what was sent tracks the aggregate of the true updates up to the
current residual. ``beta < 1`` forgets old residue geometrically (SparseLoCo
keeps 0.95 of it): stale parts of past updates stop being replayed into a
model that has moved on, at the price of never sending a share of them.
The residual is persisted as a canonical safetensors file (one float32 tensor
named ``residual``) so it survives a restart; parsing it is bounded.
"""

from __future__ import annotations

import torch

from ..tensors import MAX_HEADER_BYTES, decode_flat, encode_flat
from .base import Codec, check_numel, check_update

__all__ = ["ErrorFeedback"]

_NAME = "residual"


class ErrorFeedback:
    """The residual of one worker for one run (a float32 vector of ``numel`` elements)."""

    def __init__(self, numel: int) -> None:
        self.numel = check_numel(numel)
        self.residual = torch.zeros(numel, dtype=torch.float32)

    @classmethod
    def of(cls, residual: torch.Tensor) -> ErrorFeedback:
        """Error feedback holding ``residual`` (not copied)."""
        ef = cls.__new__(cls)
        ef.numel = check_numel(residual.numel())
        ef.residual = residual
        return ef

    def step(
        self, codec: Codec, delta: torch.Tensor, *, seed: int = 0, decay: float = 1.0
    ) -> tuple[bytes, torch.Tensor]:
        """Compress ``delta`` plus the residual; returns (payload, decoded) and keeps
        ``decay`` times what was not sent as the next residual."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in [0, 1], got {decay!r}")
        delta = check_update(delta)
        if delta.numel() != self.numel:
            raise ValueError(
                f"delta has {delta.numel()} elements, error feedback holds {self.numel}"
            )
        target = delta + self.residual
        # The old residual goes before the codec's temporaries arrive, and the new one is
        # the target itself: a model's size less at the peak, twice.
        self.residual = torch.empty(0)
        payload = codec.encode(target, seed=seed)
        decoded = codec.decode(payload, self.numel, seed=seed)
        self.residual = target.sub_(decoded)
        if decay != 1.0:
            self.residual.mul_(decay)
        return payload, decoded

    def norm(self) -> float:
        """L2 norm of the residual (float64 accumulation)."""
        return float(self.residual.double().norm())

    def to_bytes(self) -> bytes:
        """Canonical safetensors bytes of the residual."""
        return encode_flat(self.residual, [(_NAME, (self.numel,))])

    @classmethod
    def from_bytes(cls, data: bytes, numel: int) -> ErrorFeedback:
        """Parse :meth:`to_bytes` output for ``numel`` elements; raises PayloadError subclasses."""
        check_numel(numel)
        limit = 8 + MAX_HEADER_BYTES + 4 * numel
        flat = decode_flat(data, [(_NAME, (numel,))], max_bytes=limit)
        ef = cls(numel)
        ef.residual = flat.contiguous()
        return ef
