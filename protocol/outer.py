"""The outer optimizer step: one canonical routine every node reproduces.

Nesterov momentum on the aggregated pseudo-gradient g (DiLoCo):

    m' = mu * m + g
    theta' = theta - lr * (g + mu * m')      (nesterov)
    theta' = theta - lr * m'                  (plain momentum)

All in float32, elementwise, on CPU, so the certified model hash comes out
bit for bit the same on any machine. The g applied is the *decoded* broadcast
update (see :func:`encode_update`), so a worker holding theta, m and the
round's small update payload computes theta' itself instead of downloading it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import Codec
from .tensors import decode_flat, encode_flat


def outer_step(
    params: torch.Tensor,
    momentum: torch.Tensor,
    update: torch.Tensor,
    *,
    lr: float,
    mu: float,
    nesterov: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (new params, new momentum); inputs are not modified.

    Three vectors are allocated (the new momentum, the step, the new parameters); each
    operation is the formula's, in its order, so the bits are the formula's.
    """
    if not params.shape == momentum.shape == update.shape:
        raise ValueError("params, momentum and update must have the same shape")
    p, m, g = (x.detach().to(torch.float32).cpu() for x in (params, momentum, update))
    new_m = m * mu
    new_m += g
    if nesterov:
        step = new_m * mu
        step += g  # g + new_m * mu: addition is exactly commutative
    else:
        step = new_m.clone()
    step *= lr
    return torch.sub(p, step, out=step), new_m


@dataclass
class OuterState:
    """What the outer step carries between rounds, certified by ``outer_state_hash``.

    ``momentum`` is the Nesterov buffer; ``residual`` is the validators' error
    feedback on the broadcast update: what compression of the aggregate left
    out, added to the next round's aggregate before it is encoded.
    """

    momentum: torch.Tensor
    residual: torch.Tensor

    @classmethod
    def zeros(cls, numel: int) -> OuterState:
        return cls(torch.zeros(numel), torch.zeros(numel))

    @staticmethod
    def layout(numel: int) -> list[tuple[str, tuple[int, ...]]]:
        return [("momentum", (numel,)), ("residual", (numel,))]

    def to_bytes(self) -> bytes:
        return encode_flat(torch.cat([self.momentum, self.residual]),
                           self.layout(self.momentum.numel()))

    @classmethod
    def from_bytes(cls, data: bytes, numel: int) -> OuterState:
        flat = decode_flat(data, cls.layout(numel), max_bytes=8 * numel + (1 << 20))
        momentum, residual = flat.split([numel, numel])
        return cls(momentum.clone(), residual.clone())


def encode_update(codec: Codec, aggregate: torch.Tensor, residual: torch.Tensor, *, seed: int
                  ) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """Compress the round's aggregate for broadcast, with error feedback.

    payload = encode(g + e);  sent = decode(payload);  e' = g + e - sent.
    Returns (payload, sent, e'); the outer step uses ``sent``, so anyone holding
    the payload reproduces the new model exactly.
    """
    target = aggregate.detach().float().cpu() + residual
    payload = codec.encode(target, seed=seed)
    sent = codec.decode(payload, target.numel(), seed=seed)
    return payload, sent, target - sent
