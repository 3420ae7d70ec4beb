"""A validator's round with its updates, payloads and reveals in files: the same round.

``filter_round`` writes each decoded update to a row file as soon as it is decoded and
``aggregate_locally`` streams CenteredClip over it; payloads and reveals may come from
files one at a time (``BlobFiles``). None of that may change a byte of the outcome:
rows in files or in memory give the same verdicts, aggregate, scores and model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakes import validator_identities
from ledger_harness import reveals_under
from test_validator_http import honest, synthetic_settings
from veritrain.aggregation import CenteredClip, FileRows, TensorRows
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.errors import NonFiniteError, PayloadError
from veritrain.protocol.identity import Identity
from veritrain.protocol.organiser import build_run
from veritrain.protocol.outer import OuterState
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex, split_flat
from veritrain.validators.checks import Candidate
from veritrain.validators.node import read_flat_file, write_flat_file
from veritrain.validators.round import (
    BlobFiles,
    aggregate_locally,
    filter_round,
    finish_round,
    process_round,
    resolve_aggregator_params,
)
from veritrain.workers.round import prepare_submission

SEED = bytes(32)


@pytest.fixture(scope="module")
def round_inputs():
    organiser = Identity.generate("organiser")
    settings = synthetic_settings()
    settings["verification"]["probe_examples"] = 8  # the probe reads rows back one at a time
    bundle = build_run(organiser, "mem-run", settings, [validator_identities(1)[0].public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(5)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers[:4]}
    cheat = workers[4]
    preps[cheat.public_key.hex()] = prepare_submission(
        run, cheat, 0, base, run.spec.genesis_model_hash, ErrorFeedback(run.numel),
        attack="sign_flip")
    candidates = [Candidate(p.signed, p.payload) for p in preps.values()]
    return run, base, candidates, set(preps), reveals_under(run, preps, SEED), cheat


def _filter(run, base, candidates, registered, reveals, **kwargs):
    return filter_round(run, 0, run.spec.genesis_model_hash, base, candidates, registered,
                        set(), SEED, reveals=reveals, **kwargs)


def test_rows_in_files_or_in_memory_give_the_same_round(round_inputs, tmp_path):
    run, base, candidates, registered, reveals, cheat = round_inputs
    in_files = _filter(run, base, candidates, registered, reveals)
    in_memory = _filter(run, base, candidates, registered, reveals, rows_in_memory=True)
    # payloads and reveals read back from files one at a time, rows in a given directory
    payloads, revealed = BlobFiles(tmp_path / "payloads"), BlobFiles(tmp_path / "reveals")
    for c in candidates:
        payloads.put(c.signed.digest, c.payload)
    for worker, data in reveals.items():
        if data is not None:
            revealed.put(worker, data)
    bare = [Candidate(c.signed, None) for c in candidates]
    from_blobs = _filter(run, base, bare, registered, revealed, payloads=payloads,
                         scratch=tmp_path)

    assert isinstance(in_files.rows, FileRows) and isinstance(from_blobs.rows, FileRows)
    assert isinstance(in_memory.rows, TensorRows)
    assert in_files.stacked is None  # nothing holds the N updates at once
    assert cheat.public_key.hex() not in in_files.accepted and len(in_files.accepted) == 4
    for other in (in_memory, from_blobs):
        assert other.verdicts == in_files.verdicts and other.accepted == in_files.accepted
        assert other.params == in_files.params

    aggregates = [aggregate_locally(run, f, SEED) for f in (in_files, in_memory, from_blobs)]
    outcomes = [finish_round(run, f, a, base, OuterState.zeros(run.numel))
                for f, a in zip((in_files, in_memory, from_blobs), aggregates, strict=True)]
    first = aggregates[0]
    assert first is not None and first.tau is not None
    for agg, out in zip(aggregates[1:], outcomes[1:], strict=True):
        assert torch.equal(agg.aggregate, first.aggregate)
        assert torch.equal(agg.clip_factors, first.clip_factors) and agg.tau == first.tau
        assert torch.equal(out.new_flat, outcomes[0].new_flat)
        assert out.scores == outcomes[0].scores and out.verdicts == outcomes[0].verdicts

    # The same rule as the in-memory CenteredClip from the median, to rounding.
    stacked = in_memory.rows.read(0, run.numel)
    tau = resolve_aggregator_params(run.spec.aggregator["params"], stacked)["tau"]
    assert first.tau == tau
    ref = CenteredClip(tau, iterations=run.spec.aggregator["params"].get("iterations", 10))(
        stacked)
    assert float((first.aggregate - ref).norm()) <= 1e-5 * float(ref.norm())

    scratch = in_files.scratch
    assert scratch is not None and scratch.path.exists()
    in_files.close()
    assert not scratch.path.exists()  # the round's row file is gone
    assert from_blobs.scratch is None  # a given directory belongs to the caller


def test_process_round_in_files_matches_in_memory(round_inputs):
    run, base, candidates, registered, reveals, _ = round_inputs
    args = (run, 0, run.spec.genesis_model_hash, base, OuterState.zeros(run.numel), candidates,
            registered, set(), SEED)
    a = process_round(*args, reveals=reveals)
    b = process_round(*args, reveals=reveals, rows_in_memory=True)
    assert torch.equal(a.aggregate, b.aggregate) and torch.equal(a.new_flat, b.new_flat)
    assert a.verdicts == b.verdicts and a.scores == b.scores


def test_a_missing_payload_file_is_a_missing_payload(round_inputs, tmp_path):
    run, base, candidates, registered, reveals, _ = round_inputs
    payloads = BlobFiles(tmp_path / "payloads")
    for c in candidates[1:]:
        payloads.put(c.signed.digest, c.payload)
    bare = [dataclasses.replace(c, payload=None) for c in candidates]
    filtered = _filter(run, base, bare, registered, reveals, payloads=payloads,
                       scratch=tmp_path)
    assert filtered.verdicts[candidates[0].worker]["reason"] == "missing_payload"


def test_flat_files_are_written_as_encode_flat_builds_them(round_inputs, tmp_path):
    """The node writes the new model and outer state without building their bytes: the
    files (and hashes it certifies) must be exactly the canonical ones."""
    run = round_inputs[0]
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(run.numel, generator=gen)
    digest = write_flat_file(tmp_path / "model", run.shapes, split_flat(flat, run.shapes))
    assert (tmp_path / "model").read_bytes() == run.encode_model(flat)
    assert digest == sha256_hex(run.encode_model(flat))
    outer = OuterState(torch.randn(run.numel, generator=gen), torch.randn(run.numel, generator=gen))
    digest = write_flat_file(tmp_path / "outer", OuterState.layout(run.numel),
                             {"momentum": outer.momentum, "residual": outer.residual})
    assert (tmp_path / "outer").read_bytes() == outer.to_bytes()
    assert digest == sha256_hex(outer.to_bytes())
    back = read_flat_file(tmp_path / "outer", OuterState.layout(run.numel))
    assert torch.equal(back["momentum"], outer.momentum)
    assert torch.equal(back["residual"], outer.residual)
    assert back["momentum"].untyped_storage().data_ptr() != back[
        "residual"].untyped_storage().data_ptr()  # each can be freed on its own
    data = bytearray(outer.to_bytes())
    (tmp_path / "short").write_bytes(data[:-4])
    with pytest.raises(PayloadError):
        read_flat_file(tmp_path / "short", OuterState.layout(run.numel))
    data[-4:] = torch.tensor([float("nan")]).numpy().tobytes()
    (tmp_path / "nan").write_bytes(data)
    with pytest.raises(NonFiniteError):
        read_flat_file(tmp_path / "nan", OuterState.layout(run.numel))
    with pytest.raises(PayloadError):
        read_flat_file(tmp_path / "outer", OuterState.layout(run.numel - 1))
