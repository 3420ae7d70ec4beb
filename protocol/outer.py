"""The outer optimizer step: one canonical routine every node reproduces.

Nesterov momentum on the aggregated pseudo-gradient g (DiLoCo):

    m' = mu * m + g
    theta' = theta - lr * (g + mu * m')      (nesterov)
    theta' = theta - lr * m'                  (plain momentum)

All in float32, elementwise, on CPU, so the certified model hash comes out
bit for bit the same on any machine.
"""

from __future__ import annotations

import torch


def outer_step(
    params: torch.Tensor,
    momentum: torch.Tensor,
    update: torch.Tensor,
    *,
    lr: float,
    mu: float,
    nesterov: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (new params, new momentum); inputs are not modified."""
    if not params.shape == momentum.shape == update.shape:
        raise ValueError("params, momentum and update must have the same shape")
    p, m, g = (x.detach().to(torch.float32).cpu() for x in (params, momentum, update))
    new_m = m * mu + g
    step = g + new_m * mu if nesterov else new_m
    return p - step * lr, new_m
