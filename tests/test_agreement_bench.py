"""The pure parts of ``bench/worker_agreement.py`` and ``bench/compression.py --outer``."""

from __future__ import annotations

import math

import pytest
import torch
from bench_scripts import load_bench

A = load_bench("worker_agreement")
C = load_bench("compression")


def test_identical_updates_agree_fully() -> None:
    row = torch.randn(50, generator=torch.Generator().manual_seed(0))
    out = A.round_agreement(row.repeat(4, 1), [1, 2])
    assert math.isclose(out["pair_cos"], 1.0, rel_tol=1e-6)
    assert out["subset_1"] < 1e-6 and out["subset_2"] < 1e-6


def test_agreement_of_known_updates() -> None:
    # Updates e0 + e1 and e0 - e1, alternating: their mean is e0.
    e0, e1 = torch.eye(2)
    updates = torch.stack([e0 + e1, e0 - e1, e0 + e1, e0 - e1])
    out = A.round_agreement(updates, [1, 2])
    # Pairs: (0,1) 0, (0,2) 1, (0,3) 0, (1,2) 0, (1,3) 1, (2,3) 0 -> mean 1/3.
    assert math.isclose(out["pair_cos"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(out["subset_1"], 1.0, rel_tol=1e-6)  # each is e1 away from e0
    assert out["subset_2"] < 1e-6  # every consecutive pair averages to e0


@pytest.mark.parametrize("outer", ['[1]', '{"momentum": 2}', '{"beta": 1}'])
def test_compression_bench_refuses_a_bad_outer_override(outer: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        C.main(["--outer", outer])
    assert exc.value.code == 2
    assert "--outer" in capsys.readouterr().err
