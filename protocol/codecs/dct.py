"""An exactly reproducible DCT-II / DCT-III pair over blocks of ``n`` elements.

Float matrix products sum in an order that depends on the BLAS, the CPU's
vector width and the thread count, so their last bits differ between
machines. Here every product is carried out on integers held in float64 whose
partial sums stay below 2^53: then each addition is exact, any summation
order gives the same result, and the transform is bit-for-bit the same
everywhere (CPU or GPU, 1 or 16 threads).

* Basis: ``Bq[k, j] = rint(2^20 * c_k * cos(pi * (2j + 1) * k / (2n)))`` with
  ``c_0 = sqrt(1/2)``, ``c_k = 1``; the cosine is evaluated by
  :func:`cos_table` using only correctly rounded IEEE operations. The
  real-valued transform is ``T = Bq / (2^20 * sqrt(n / 2))``, orthonormal to
  about 1e-6.
* Forward (encoder): per chunk, ``x`` is scaled by a power of two so that
  ``|x| <= 2^20`` and rounded to integers ``xi``; ``Y = xi @ Bq^T`` is exact
  (``|Y| <= n * 2^40 <= 2^52`` for ``n <= 4096``).
* Inverse (decoder): integer coefficient matrices ``Z`` (small codes) give
  exact ``Z @ Bq``; the caller applies float scales elementwise afterwards.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "BASIS_BITS",
    "INPUT_BITS",
    "MAX_DCT_BLOCK",
    "cos_table",
    "int_basis",
    "to_fixed",
    "transform_norm",
]

BASIS_BITS = 20
INPUT_BITS = 20
#: n * 2^(BASIS_BITS + INPUT_BITS) must stay <= 2^52 for exact float64 sums.
MAX_DCT_BLOCK = 1 << (52 - BASIS_BITS - INPUT_BITS)

# Taylor coefficients 1/k! for k = 0..27 as float64, computed from exact integers.
_INV_FACT = [1.0 / math.factorial(k) for k in range(28)]


def _horner(a2: np.ndarray, *, even: bool) -> np.ndarray:
    """sum_m (-1)^m a2^m / (2m + off)!, off = 0 (cos) or 1 (sin/a), 13 terms."""
    off = 0 if even else 1
    terms = 13
    acc = np.full_like(a2, _INV_FACT[2 * (terms - 1) + off])
    for m in range(terms - 2, -1, -1):
        acc = acc * a2
        acc = np.float64(_INV_FACT[2 * m + off]) - acc
    return acc


def cos_table(n: int) -> np.ndarray:
    """``cos(pi * m / (2n))`` for m = 0 .. 4n-1, float64, reproducible on any IEEE machine."""
    m = np.arange(4 * n, dtype=np.int64)
    quadrant = m // n
    r = (m % n).astype(np.float64)
    a = (r * math.pi) / (2.0 * n)  # in [0, pi/2)
    a2 = a * a
    c, s = _horner(a2, even=True), a * _horner(a2, even=False)
    # cos(q*pi/2 + a) for q = 0, 1, 2, 3
    return np.choose(quadrant, [c, -s, -c, s])


@lru_cache(maxsize=4)
def int_basis(n: int) -> torch.Tensor:
    """The integer DCT-II basis ``Bq`` (k, j) as a float64 (n, n) tensor (cached)."""
    if not 1 <= n <= MAX_DCT_BLOCK:
        raise ValueError(f"DCT block {n} outside [1, {MAX_DCT_BLOCK}]")
    table = cos_table(n)
    k = np.arange(n, dtype=np.int64)[:, None]
    j = np.arange(n, dtype=np.int64)[None, :]
    cos = table[((2 * j + 1) * k) % (4 * n)]
    scale = np.full((n, 1), float(1 << BASIS_BITS))
    scale[0, 0] = float(1 << BASIS_BITS) * math.sqrt(0.5)
    basis = np.rint(cos * scale)
    out = torch.from_numpy(basis)
    out.requires_grad_(False)
    return out


def transform_norm(n: int) -> float:
    """``2^BASIS_BITS * sqrt(n / 2)``: divides an integer transform into the real one."""
    return float(1 << BASIS_BITS) * math.sqrt(n / 2.0)


def to_fixed(rows: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """Scale each row (float32) by a power of two so ``|x| <= 2^INPUT_BITS``, round to integers.

    Returns the float64 integer matrix and each row's exponent ``e`` with
    ``x ~= xi * 2^(e - INPUT_BITS)``; all steps are exact except the final
    round-half-even.
    """
    amax = rows.abs().amax(dim=1).numpy().astype(np.float64)
    _, exps = np.frexp(amax)  # amax < 2^e (e = 0 for zero rows)
    exps = exps.astype(np.int64)
    factor = torch.from_numpy(np.ldexp(1.0, INPUT_BITS - exps))
    xi = torch.round(rows.double() * factor[:, None])
    return xi, exps
