"""Sharded aggregation between validators: one shard each, checked by the others.

Three validators judge one round over HTTP against a live ledger, each
aggregating one coordinate shard; one of them shifts its shard by 0.1%. The
other two catch it on their sampled checks, recompute the shard, record the
fault on the ledger, and all three certify the model built from the honest
shards; the audit of the ledger's chain still verifies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from fakes import validator_identities
from ledger_harness import Api, reveal_all, reveals_under, run_api
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from test_validator_http import honest, submit_all, synthetic_settings
from veritrain.aggregation.secure import (
    ShardResult,
    aggregate_shard,
    assemble_shards,
    shard_bounds,
    shard_tau,
)
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.beacon import beacon_seed_of, shard_check_root, shard_checkers
from veritrain.protocol.errors import OversizedError, PayloadError
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import ShardCheckShare, ShardPublication, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.outer import OuterState
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import canonical_safetensors
from veritrain.validators.checks import Candidate
from veritrain.validators.node import ValidatorConfig, ValidatorNode
from veritrain.validators.round import FilteredRound, filter_round, finish_round
from veritrain.validators.sharded import (
    compute_own_shard,
    decode_shard_result,
    encode_shard_result,
    settle_shards,
    shard_aggregate_digest,
)

V = 3


@pytest.fixture(autouse=True)
def _restore_determinism_flag():
    """Three validators share this process here (in a run each is its own process); the
    training loop's scoped deterministic flag is process-wide, so concurrent scopes can
    leave it set: restore it for the tests that follow."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _filtered(rows: torch.Tensor, tau: float) -> FilteredRound:
    return FilteredRound(0, {}, {}, {}, {}, [f"w{i}" for i in range(rows.shape[0])], rows,
                         {"tau": tau, "iterations": 10})


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3000, generator=g)
    x[5] *= 20.0  # one far row, so clipping matters
    return x


def _all_shards(rows: torch.Tensor, tau: float) -> list[ShardResult]:
    return [compute_own_shard(_filtered(rows, tau), V, k) for k in range(V)]


def test_shard_file_round_trip_is_exact(rows):
    result = _all_shards(rows, 8.0)[1]
    back = decode_shard_result(encode_shard_result(result), max_bytes=1 << 20)
    assert back.digest() == result.digest()
    assert torch.equal(back.aggregate, result.aggregate)


_ENCODE_IN_A_FRESH_PROCESS = """
import hashlib, torch
from veritrain.aggregation.secure import ShardResult
from veritrain.validators.sharded import encode_shard_result
result = ShardResult(2, 1, 10, 20, 0.375, torch.arange(10.0), torch.arange(3.0).double(),
                     torch.tensor([4, 7]), 5)
print(hashlib.sha256(encode_shard_result(result)).hexdigest())
"""


def test_shard_file_is_the_same_bytes_in_every_process():
    """safetensors orders metadata differently per process; a validator that restarts
    must still resend exactly what it published (the ledger refuses other bytes)."""
    hashes = {subprocess.run([sys.executable, "-c", _ENCODE_IN_A_FRESH_PROCESS], check=True,
                             capture_output=True, text=True).stdout.strip() for _ in range(3)}
    assert len(hashes) == 1 and len(hashes.pop()) == 64


def test_canonical_header_keeps_the_tensors_and_is_a_fixed_point(rows):
    result = _all_shards(rows, 8.0)[0]
    raw = st_save({"aggregate": result.aggregate, "distances": result.distances,
                   "heavy_blocks": result.heavy_blocks},
                  metadata={"z": "1", "a": "2", "m": "3"})
    canonical = canonical_safetensors(raw)
    assert canonical_safetensors(canonical) == canonical
    header_len = int.from_bytes(canonical[:8], "little")
    assert header_len % 8 == 0
    assert json.loads(canonical[8:8 + header_len]) == json.loads(raw[8:8 + int.from_bytes(
        raw[:8], "little")])
    back = st_load(canonical)
    assert all(torch.equal(back[k], v) for k, v in
               (("aggregate", result.aggregate), ("distances", result.distances),
                ("heavy_blocks", result.heavy_blocks)))


@pytest.mark.parametrize("damage", ["truncated", "oversized", "renamed", "metadata", "dtype"])
def test_bad_shard_files_are_refused_before_use(rows, damage):
    result = _all_shards(rows, 8.0)[0]
    data = encode_shard_result(result)
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "renamed":
        data = data.replace(b'"distances"', b'"distancez"')
    elif damage == "metadata":
        data = data.replace(b'"iterations":"', b'"iterations":"x')
    elif damage == "dtype":
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len])["__metadata__"]
        data = st_save({"aggregate": result.aggregate.double(), "distances": result.distances,
                        "heavy_blocks": result.heavy_blocks}, metadata=meta)
    error = OversizedError if damage == "oversized" else PayloadError
    with pytest.raises(error):
        decode_shard_result(data, max_bytes=len(data) - 1 if damage == "oversized"
                            else 1 << 20)


def test_honest_shards_assemble_without_disputes(rows):
    tau = 8.0
    results = _all_shards(rows, tau)
    settled = settle_shards(_filtered(rows, tau), results[0], {1: results[1], 2: results[2]},
                            num_shards=V, me=0)
    assert settled.disputes == [] and all(c.ok for c in settled.checks)
    assert torch.equal(settled.aggregate, assemble_shards(results, rows.shape[1]))


@pytest.mark.parametrize("corruption", ["shift", "nan", "missing", "undecodable"])
def test_a_bad_shard_is_blamed_and_replaced_by_the_recomputed_one(rows, corruption):
    tau = 8.0
    results = _all_shards(rows, tau)
    bad: ShardResult | str | None
    if corruption == "shift":
        bad = dataclasses.replace(results[2], aggregate=results[2].aggregate * (1 + 1e-3))
    elif corruption == "nan":
        agg = results[2].aggregate.clone()
        agg[7] = float("nan")
        bad = dataclasses.replace(results[2], aggregate=agg)
    else:
        bad = None if corruption == "missing" else "does not parse"
    settled = settle_shards(_filtered(rows, tau), results[0], {1: results[1], 2: bad},
                            num_shards=V, me=0)
    # A result missing from the list or the board may be the ledger's doing: recomputed,
    # its publisher not blamed; a signed file that is unusable is its publisher's fault.
    assert [(d.shard, d.faulty) for d in settled.disputes] == [(2, corruption != "missing")]
    if corruption in ("missing", "undecodable"):
        assert settled.disputes[0].reason.startswith(("missing", "malformed"))
    assert torch.equal(settled.aggregate, assemble_shards(results, rows.shape[1]))


def test_shards_are_the_centered_clip_fixed_point_of_the_whole_vector(rows):
    """Shard j uses tau_j = tau sqrt(n_j / D): each shard is its own fixed point."""
    tau = 8.0
    bounds = shard_bounds(rows.shape[1], V)
    for k, result in enumerate(_all_shards(rows, tau)):
        alone = aggregate_shard(rows[:, bounds[k][0]:bounds[k][1]], shard=0, num_shards=1,
                                tau=shard_tau(tau, rows.shape[1], bounds[k]))
        assert torch.equal(result.aggregate, alone.aggregate)


# --------------------------------------------------------------------------- over HTTP


def _sharded_settings() -> dict:
    settings = synthetic_settings()
    settings["aggregator"] = {"name": "centered_clip", "params": {"tau_rel": 1.0},
                              "shards": V}
    return settings


def test_build_run_refuses_shards_that_do_not_match_the_validators():
    organiser = Identity.generate("organiser")
    settings = _sharded_settings()
    with pytest.raises(ValueError, match="each validator aggregates one shard"):
        build_run(organiser, "bad-shards", settings, [v.public for v in validator_identities(2)])
    for checkers in (0, V):  # at least one checker, at most the other validators
        settings = _sharded_settings()
        settings["aggregator"]["shard_checkers"] = checkers
        with pytest.raises(ValueError, match="checker"):
            build_run(organiser, "bad-shards", settings,
                      [v.public for v in validator_identities(V)])
    settings = _sharded_settings()  # a delegated draw needs a seed nobody can grind
    settings["aggregator"]["shard_checkers"] = 1
    with pytest.raises(ValueError, match="threshold beacon"):
        build_run(organiser, "bad-shards", settings, [v.public for v in validator_identities(V)])
    settings = _sharded_settings()
    settings["aggregator"]["name"] = "median"
    with pytest.raises(ValueError, match="centered_clip"):
        build_run(organiser, "bad-shards", settings, [v.public for v in validator_identities(V)])


@pytest.mark.parametrize("checkers", [None, 1])
def test_three_validators_catch_a_shifted_shard_and_certify_the_honest_model(tmp_path, checkers):
    """Every validator checks every other shard (``shard_checkers`` absent), or one checker
    per shard drawn from the check seed, the others taking its signed ok: either way the
    shifted shard is caught, reported by both honest validators and recomputed."""
    organiser = Identity.generate("organiser")
    validators = validator_identities(V)
    settings = _sharded_settings()
    if checkers is not None:  # drawn from the threshold beacon, which nobody can grind
        settings["aggregator"]["shard_checkers"] = checkers
        settings["verification"]["beacon"] = "threshold"
    bundle = build_run(organiser, "shard-run", settings, [v.public for v in validators])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(4)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    prepared = {k: (p.signed.message, p.payload) for k, p in preps.items()}
    cheat = 2

    async def judge(api: Api, k: int, ident: Identity):
        node = ValidatorNode(ValidatorConfig(
            ledger_url=api.url, run_id="shard-run", poll_seconds=0.05, shard_wait=60.0,
            attack="shard_shift" if k == cheat else None), ident)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            if checkers is not None:
                await node.run_dkg(client, bundle.signed.message)
            info = await client.get_json("/v1/runs/shard-run/rounds/0")
            await node.beacon_seed(client, bundle.signed.message, 0)
            own_run = RunContext.build(bundle.signed.message, bundle.dataset)  # not thread-safe
            return await node.validate_round(client, own_run, info)

    async def reveal_once_challenged(api: Api) -> None:
        while not (await api.get("/v1/runs/shard-run/rounds/0/challenges"))[1]["fixed"]:
            await asyncio.sleep(0.05)
        await reveal_all(api, run, preps, workers)

    async def scenario(api: Api):
        await submit_all(api, bundle, workers, prepared)
        while (await api.get("/v1/runs/shard-run/rounds/0"))[1]["status"] == "open":
            await asyncio.sleep(0.05)
        outcomes, _ = await asyncio.gather(
            asyncio.gather(*(judge(api, k, v) for k, v in enumerate(validators))),
            reveal_once_challenged(api))
        seed = bytes.fromhex(beacon_seed_of(
            (await api.get("/v1/runs/shard-run/rounds/0/beacon"))[1]["beacon"]))
        shards = (await api.get("/v1/runs/shard-run/rounds/0/shards"))[1]
        summary = (await api.get("/v1/runs/shard-run/rounds/0"))[1]
        # Messages after finalization, or from strangers, are refused and change nothing.
        share = ShardCheckShare(run_id="shard-run", round=0,
                                validator=validators[0].public_key.hex(),
                                results=[None] * V,
                                share=validators[0].sign_bls(
                                    shard_check_root("shard-run", 0, [None] * V)).hex())
        late = await api.post_json("/v1/runs/shard-run/rounds/0/shards/check",
                                   sign(validators[0], share).to_wire())
        stranger = await api.post_json("/v1/runs/shard-run/rounds/0/shards/check",
                                       sign(workers[0], share).to_wire())
        async with LedgerClient(api.url) as client:
            key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            audit = verify_events(await fetch_events(client, "shard-run"), key)
        return outcomes, shards, summary, seed, late, stranger, audit

    outcomes, shards, summary, seed, late, stranger, audit = run_api(tmp_path, scenario)
    assert summary["status"] == "finalized"
    assert all(torch.equal(o.new_flat, outcomes[0].new_flat) for o in outcomes)
    # The faulty shard is recorded against its publisher by both honest validators.
    assert shards["faulty_shards"] == [cheat]
    reports = [f["body"] for f in shards["findings"]]
    faulty = [r for r in reports if r["faulty"]]
    assert sorted(r["validator"] for r in faulty) == sorted(
        v.public_key.hex() for k, v in enumerate(validators) if k != cheat)
    assert all(r["shard"] == cheat and r["reason"] == "stationarity"
               and r["publisher"] == validators[cheat].public_key.hex() for r in faulty)
    oks = sorted((r["shard"], r["validator"]) for r in reports if not r["faulty"])
    if checkers is None:
        assert oks == []  # every validator checked every shard itself: nothing to vouch
    else:  # each honest shard vouched for by exactly the checker the seed drew for it
        drawn = shard_checkers(seed, V, checkers)
        assert oks == sorted((k, validators[c].public_key.hex())
                             for k in range(V) if k != cheat for c in drawn[k])
    assert shards["check"] is not None and len(shards["list"]) == V
    # The certified aggregate is the honest one: every shard computed from the same rows.
    only = [Candidate(p.signed, p.payload) for p in preps.values()]
    filtered = filter_round(run, 0, run.spec.genesis_model_hash, base, only,
                            set(preps), set(), seed, reveals=reveals_under(run, preps, seed))
    honest_agg = assemble_shards([compute_own_shard(filtered, V, k) for k in range(V)],
                                 run.numel)
    reference = finish_round(run, filtered, honest_agg, base, OuterState.zeros(run.numel))
    assert torch.equal(outcomes[0].aggregate, honest_agg)
    assert torch.equal(outcomes[0].new_flat, reference.new_flat)
    # The certificate names each shard's source: the listed results of validators 0 and 1,
    # the cheater's shard recomputed (its values the honest ones).
    sources = summary["certificate"]["certified"]["shards"]
    assert [x["result"] for x in sources] == [shards["list"][0], shards["list"][1], None]
    assert [x["aggregate"] for x in sources] == [
        shard_aggregate_digest(compute_own_shard(filtered, V, k)) for k in range(V)]
    assert late[0] == 409 and late[1]["reason"] == "round_finalized"
    assert stranger[0] == 403
    assert audit.ok, audit.problem


class ResentFirst(LedgerClient):
    """A validator's client whose shard publication the ledger already holds in another
    form (as after a restart): it first posts the same result under another inputs digest."""

    def __init__(self, url: str, identity: Identity) -> None:
        super().__init__(url, retry_for=5.0)
        self.identity = identity

    async def post_multipart(self, path, parts, **kwargs):
        if path.endswith("/shards"):
            (_, pub, ctype), result = parts[0], parts[1]
            msg = dataclasses.replace(ShardPublication.from_body(
                json.loads(pub)["body"]), inputs_digest="ab" * 32)
            await super().post_multipart(path, [
                ("publication", sign(self.identity, msg).encode(), ctype), result], **kwargs)
        return await super().post_multipart(path, parts, **kwargs)


def test_a_duplicate_refusal_of_its_own_shard_is_taken_like_a_late_shard(tmp_path, caplog):
    """The ledger refuses validator 0's publication as ``duplicate`` (it holds another of
    the same shard): the validator logs it and finishes the round with the stored one."""
    validators = validator_identities(V)
    bundle = build_run(Identity.generate("organiser"), "dup-run", _sharded_settings(),
                       [v.public for v in validators])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(4)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    prepared = {k: (p.signed.message, p.payload) for k, p in preps.items()}

    async def judge(api: Api, k: int, ident: Identity):
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id="dup-run",
                                             poll_seconds=0.05, shard_wait=60.0), ident)
        client = ResentFirst(api.url, ident) if k == 0 else LedgerClient(api.url, retry_for=5.0)
        async with client:
            info = await client.get_json("/v1/runs/dup-run/rounds/0")
            await node.beacon_seed(client, bundle.signed.message, 0)
            own_run = RunContext.build(bundle.signed.message, bundle.dataset)
            return await node.validate_round(client, own_run, info)

    async def scenario(api: Api):
        await submit_all(api, bundle, workers, prepared)
        while (await api.get("/v1/runs/dup-run/rounds/0"))[1]["status"] == "open":
            await asyncio.sleep(0.05)

        async def reveal_once_challenged() -> None:
            while not (await api.get("/v1/runs/dup-run/rounds/0/challenges"))[1]["fixed"]:
                await asyncio.sleep(0.05)
            await reveal_all(api, run, preps, workers)

        outcomes, _ = await asyncio.gather(
            asyncio.gather(*(judge(api, k, v) for k, v in enumerate(validators))),
            reveal_once_challenged())
        shards = (await api.get("/v1/runs/dup-run/rounds/0/shards"))[1]
        summary = (await api.get("/v1/runs/dup-run/rounds/0"))[1]
        return outcomes, shards, summary

    with caplog.at_level("WARNING", logger="veritrain"):
        outcomes, shards, summary = run_api(tmp_path, scenario)
    assert summary["status"] == "finalized"
    assert any("already holds a publication of shard 0" in r.getMessage()
               and "already published another result" in r.getMessage()
               for r in caplog.records)
    stored = next(w["body"] for w in shards["results"] if w["body"]["shard"] == 0)
    assert stored["inputs_digest"] == "ab" * 32  # the earlier publication is the one listed
    assert shards["faulty_shards"] == []  # its result is the honest shard, so it passes
    assert all(torch.equal(o.new_flat, outcomes[0].new_flat) for o in outcomes)


@pytest.mark.parametrize("misplaced", ["other_shard_number", "copy_of_another_shard"])
def test_a_result_for_another_shard_is_malformed_not_a_crash(rows, misplaced):
    """The file's own shard number and bounds are never taken on trust."""
    tau = 8.0
    results = _all_shards(rows, tau)
    if misplaced == "other_shard_number":
        bad = dataclasses.replace(results[2], shard=99)
    else:
        bad = results[1]  # valid, but for shard 1
    settled = settle_shards(_filtered(rows, tau), results[0], {1: results[1], 2: bad},
                            num_shards=V, me=0)
    assert [(d.shard, d.faulty) for d in settled.disputes] == [(2, True)]
    assert settled.disputes[0].reason.startswith("malformed")
    assert torch.equal(settled.aggregate, assemble_shards(results, rows.shape[1]))


def test_honest_validators_catch_a_sparse_corruption_alike_under_every_view():
    """One corrupted block of 1875: the dense check reads every coordinate, so both honest
    validators catch it, blame its publisher and assemble the same aggregate."""
    g = torch.Generator().manual_seed(9)
    xs = torch.randn(5, 30_000, generator=g)
    tau = 200.0
    results = _all_shards(xs, tau)
    agg = results[2].aggregate.clone()
    agg[4000:4016] += 1.0
    bad = dataclasses.replace(results[2], aggregate=agg)
    views = [settle_shards(_filtered(xs, tau), results[me],
                           {k: (bad if k == 2 else results[k]) for k in range(V) if k != me},
                           num_shards=V, me=me) for me in (0, 1)]
    assert torch.equal(views[0].aggregate, views[1].aggregate)
    assert torch.equal(views[0].aggregate, assemble_shards(results, xs.shape[1]))
    assert all([(d.shard, d.faulty, d.reason) for d in v.disputes] == [(2, True, "stationarity")]
               for v in views)
