"""A worker that keeps only every few states still reveals exactly what one keeping all
would (issue #18, item 2: whole states are written every ``keep_every`` steps, the
challenged ones between them replayed), and never reveals a replay that left its trail."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.commitments import CHUNK
from veritrain.protocol.identity import Identity
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset
from veritrain.protocol.reveal import reveal_layout
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.training import CommitPool
from veritrain.workers.evidence import (
    DEFAULT_KEEP_STEPS,
    DirStore,
    EvidenceMissing,
    RoundEvidence,
    default_keep_every,
    reveal_bytes,
)
from veritrain.workers.round import prepare_submission

SEED = bytes(range(32))


@pytest.fixture(scope="module")
def one_step_run() -> RunContext:
    settings = run_preset("tiny")
    settings["inner"].update(steps=6, trail_every=1)
    bundle = build_run(Identity.generate("organiser"), "evidence-run", settings,
                       [Identity.generate("validator").public])
    return RunContext.build(bundle.signed.message, bundle.dataset)


def _with_k(run: RunContext, k: int) -> RunContext:
    inner = dataclasses.replace(run.inner, steps=30, trail_every=k)
    return dataclasses.replace(run, inner=inner)


def test_default_keeps_every_eighth_step_rounded_to_the_trail(one_step_run) -> None:
    assert DEFAULT_KEEP_STEPS == 8
    assert [default_keep_every(_with_k(one_step_run, k)) for k in (1, 2, 3, 5)] == [8, 8, 9, 10]


def test_sparse_evidence_reveals_the_same_bytes_as_keeping_every_state(
        one_step_run: RunContext, tmp_path: Path) -> None:
    run = one_step_run
    worker = Identity.generate("worker")
    base = torch.randn(run.numel, generator=torch.Generator().manual_seed(3)) * 0.02
    prepared = {}
    for keep in (1, 4):
        store = DirStore(tmp_path / f"keep-{keep}")
        evidence = RoundEvidence(store, run, 0, worker.public_key.hex(), keep_every=keep)
        with CommitPool(2) as pool:
            prepared[keep] = prepare_submission(
                run, worker, 0, base, "00" * 32, ErrorFeedback(run.numel),
                evidence=evidence, pool=pool)
    dense, sparse = prepared[1], prepared[4]
    assert dense.signed.message.trail == sparse.signed.message.trail
    assert dense.payload == sparse.payload
    kept = sorted(p.name for p in (tmp_path / "keep-4").glob("state-*.f32"))
    assert kept == ["state-4.f32", "state-6.f32"]  # every 4th and the last: no others
    sub = sparse.signed.message
    for segment in range(run.inner.steps):
        want = reveal_bytes(dense.evidence, SEED, [segment], dense.signed.message)
        got = reveal_bytes(sparse.evidence, SEED, [segment], sub)
        assert want is not None and got == want, segment
    # The replays were kept: a second reveal does not train again.
    assert (tmp_path / "keep-4" / "state-2.f32").exists()


def test_a_replay_that_leaves_the_trail_is_not_revealed(one_step_run: RunContext,
                                                         tmp_path: Path) -> None:
    run = one_step_run
    worker = Identity.generate("worker")
    base = torch.randn(run.numel, generator=torch.Generator().manual_seed(4)) * 0.02
    store = DirStore(tmp_path / "ev")
    evidence = RoundEvidence(store, run, 0, worker.public_key.hex(), keep_every=4)
    with ThreadPoolExecutor(1) as pool:
        prepared = prepare_submission(run, worker, 0, base, "00" * 32,
                                      ErrorFeedback(run.numel), evidence=evidence, pool=pool)
    state4 = tmp_path / "ev" / "state-4.f32"
    data = np.fromfile(state4, dtype="<f4")
    data[:CHUNK] += 1.0  # the kept state is no longer the committed one
    data.tofile(state4)
    with open(tmp_path / "reveal", "wb") as out, pytest.raises(EvidenceMissing,
                                                               match="another commitment"):
        evidence.write_reveal(out, SEED, [4], reveal_layout(run, [4], masked_payload=None),
                              prepared.signed.message.trail)
    assert not (tmp_path / "ev" / "state-5.f32").exists()  # the off-trail replay is gone
    assert reveal_bytes(evidence, SEED, [4], prepared.signed.message) is None

