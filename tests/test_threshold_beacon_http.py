"""The threshold beacon of specs/protocol.md 5.4a over HTTP (issue 26): real ValidatorNodes
run the run's DKG on a loopback ledger, a round's beacon is the group signature combined
from any quorum of partials (the same seed whichever quorum signed), a forged partial is
refused with its reason and does not block the round, the round finalizes on that seed,
and ``audit verify`` re-checks the fixed beacon against the group key."""

from __future__ import annotations

import asyncio
import itertools
import stat
from typing import Any

import pytest
from fakes import validator_identities
from ledger_harness import Api, reveal_all, run_api
from test_validator_http import honest, submit_all, synthetic_settings
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient, last_certified_model
from veritrain.protocol import dkg
from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED, beacon_seed_of, sealed_list_digest_of
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.runtime import RunContext
from veritrain.validators.dkg import save_share, share_path
from veritrain.validators.node import ValidatorConfig, ValidatorNode

RUN = "threshold-run"


def threshold_run(run_id: str) -> tuple[Identity, list[Identity], Any, RunContext, list,
                                         dict, dict, dict]:
    """A threshold-beacon run of 3 validators (quorum 2) and two honest workers' prepared
    round-0 submissions: (organiser, validators, bundle, run, workers, preps, prepared,
    settings)."""
    organiser = Identity.generate("organiser")
    validators = validator_identities(3)
    settings = synthetic_settings()
    settings["verification"]["beacon"] = "threshold"
    bundle = build_run(organiser, run_id, settings, [v.public for v in validators], quorum=2)
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(2)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    prepared = {k: (p.signed.message, p.payload) for k, p in preps.items()}
    return organiser, validators, bundle, run, workers, preps, prepared, settings


def test_threshold_beacon_round_over_http(tmp_path):
    _, validators, bundle, run, workers, preps, prepared, _ = threshold_run(RUN)
    spec = bundle.signed.message
    assert spec.threshold_beacon

    async def scenario(api: Api):
        await submit_all(api, bundle, workers, prepared)
        def node(i: int) -> ValidatorNode:
            return ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN,
                                                 poll_seconds=0.05,
                                                 state_dir=tmp_path / f"v{i}"), validators[i])

        nodes = [node(i) for i in range(3)]
        async with LedgerClient(api.url, retry_for=5.0) as client:
            groups = await asyncio.gather(*(n.run_dkg(client, spec) for n in nodes))
            assert len({g.group_key for g in groups}) == 1
            assert all(n.dkg_node.share is not None for n in nodes)
            # Validator 2 restarts: it takes its share back from its state directory (mode
            # 0600) and signs beacons again; a share file that does not match its public
            # share is refused, and that node only verifies.
            kept = share_path(tmp_path / "v2", RUN)
            assert stat.S_IMODE(kept.stat().st_mode) == 0o600
            share2 = nodes[2].dkg_node.share
            nodes[2] = node(2)
            assert (await nodes[2].run_dkg(client, spec)).group_key == groups[0].group_key
            assert nodes[2].dkg_node.share == share2
            tampered = node(1)
            tampered.config.state_dir = tmp_path / "v1-tampered"
            save_share(share_path(tmp_path / "v1-tampered", RUN), spec, 1, share2)
            await tampered.run_dkg(client, spec)
            assert tampered.dkg_node is None
            assert [f["kind"] for f in tampered.faults] == ["dkg_share"]
            assert "does not hold this validator's share" in tampered.faults[0]["detail"]
            view = (await api.get(f"/v1/runs/{RUN}/dkg"))[1]
            assert view["group"]["group_key"] == groups[0].group_key
            # What a waiting validator polls: the same board without its posts.
            light = (await api.get(f"/v1/runs/{RUN}/dkg?posts=none"))[1]
            assert light["posts"] is None and sum(map(len, view["posts"].values())) == 12
            assert {k: light[k] for k in ("phases", "phase", "failed", "group")} == {
                k: view[k] for k in ("phases", "phase", "failed", "group")}
            assert (await api.get(f"/v1/runs/{RUN}/dkg?posts=some"))[0] == 400

            sealed = (await client.get_json(f"/v1/runs/{RUN}/rounds/0/submissions"))[
                "submissions"]
            digest = sealed_list_digest_of(sealed)
            # A partial under a wrong share, properly signed by validator 0: refused with
            # its reason, nothing stored.
            root = dkg.threshold_beacon_root(RUN, 0, digest, EVERY_WORKER_ADMITTED)
            forged = dkg.BeaconPartial(
                run_id=RUN, round=0, validator=validators[0].public_key.hex(), sealed=digest,
                participants=EVERY_WORKER_ADMITTED,
                partial=dkg.partial_sign((nodes[0].dkg_node.share + 1) % dkg.R, root).hex())
            status, body = await api.post_json(f"/v1/runs/{RUN}/rounds/0/partials",
                                               sign(validators[0], forged).to_wire())
            assert status >= 400 and body["reason"] == "bad_signature", body
            assert "public key share" in body["detail"]
            first = asyncio.create_task(nodes[2].beacon_seed(client, spec, 0))
            await asyncio.sleep(0.3)
            assert not first.done()  # one partial is not a quorum
            seeds = [await nodes[0].beacon_seed(client, spec, 0), await first,
                     await nodes[1].beacon_seed(client, spec, 0)]
            partials = (await api.get(f"/v1/runs/{RUN}/rounds/0/partials"))[1]
            # A stored partial copied (it is public) is answered from the store: no pairing.
            paired = []
            real = api.store.partial_verifies
            api.store.partial_verifies = lambda signed: paired.append(1) or real(signed)
            for _ in range(3):
                status, body = await api.post_json(f"/v1/runs/{RUN}/rounds/0/partials",
                                                   partials["partials"][0])
                assert status == 200 and body["beacon"] == partials["beacon"], body
            api.store.partial_verifies = real
            assert paired == []
            await reveal_all(api, run, preps, workers)
            for node in nodes[:2]:
                info = await client.get_json(f"/v1/runs/{RUN}/rounds/0")
                await node.validate_round(client, run, info)
            summary = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]
            results = (await api.get(f"/v1/runs/{RUN}/rounds/0/results"))[1]
            ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            audit = verify_events(await fetch_events(client, RUN), ledger_key)
        return groups[0], seeds, partials, summary, results, audit

    group, seeds, partials, summary, results, audit = run_api(tmp_path, scenario)
    assert len(set(seeds)) == 1 and len(seeds[0]) == 32
    fixed = partials["beacon"]
    assert bytes.fromhex(beacon_seed_of(fixed)) == seeds[0]
    # Every quorum of the stored partials combines to the same signature, hence seed.
    got = {spec_index(w): bytes.fromhex(w["body"]["partial"]) for w in partials["partials"]}
    assert len(got) == 3
    for pair in itertools.combinations(sorted(got), 2):
        sig = dkg.combine({j: got[j] for j in pair}, 2)
        assert sig.hex() == fixed["signature"]
        assert dkg.verify_group_signature(group.group_key, dkg.threshold_beacon_root(
            RUN, 0, partials["partials"][0]["body"]["sealed"],
            partials["partials"][0]["body"]["participants"]), sig)
    assert summary["status"] == "finalized", summary
    assert {r["body"]["beacon_seed"] for r in results["results"]} == {seeds[0].hex()}
    assert audit.ok, audit.problem


def spec_index(wire) -> int:
    keys = [v.public_key.hex() for v in validator_identities(3)]
    return keys.index(wire["body"]["validator"])


def test_a_dkg_short_of_a_quorum_ends_the_run_instead_of_stalling_it(tmp_path):
    """Only one of three validators (quorum 2) comes up: its keys phase closes short at
    its deadline, the ledger ends the run (``run_failed``, chained and audited), the
    validator stops with the board it saw, and a worker's submission is refused."""
    run_id = "dkg-fails"
    validators = validator_identities(3)
    settings = synthetic_settings()
    settings["verification"]["beacon"] = "threshold"
    settings["schedule"]["round_seconds"] = 1.0  # each DKG phase's deadline
    bundle = build_run(Identity.generate("organiser"), run_id, settings,
                       [v.public for v in validators], quorum=2)
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    worker = Identity.generate("worker")
    prep = honest(run, run.decode_model(bundle.genesis), worker)

    async def scenario(api: Api):
        status, _ = await api.post_parts("/v1/runs", [("spec", bundle.signed.encode()),
                                                      ("dataset", bundle.dataset),
                                                      ("genesis", bundle.genesis)])
        assert status == 201
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=run_id,
                                             poll_seconds=0.05, state_dir=tmp_path / "v0"),
                             validators[0])
        await asyncio.wait_for(node.run(), 30.0)  # returns: the run cannot go on
        for _ in range(100):  # the ledger's next tick (0.05 s here) ends the run
            overview = (await api.get(f"/v1/runs/{run_id}"))[1]
            if overview["status"] != "active":
                break
            await asyncio.sleep(0.05)
        current = (await api.get(f"/v1/runs/{run_id}/rounds/current"))[1]
        view = (await api.get(f"/v1/runs/{run_id}/dkg"))[1]
        refused = await api.submit(sign(worker, prep.signed.message), prep.payload)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            with pytest.raises(RejectedInput, match="has no certified model yet"):
                await last_certified_model(client, run_id, max_model_bytes=1 << 30)
            events = await fetch_events(client, run_id)
            ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
        return node.faults, overview, current, view, refused, events, ledger_key

    faults, overview, current, view, refused, events, ledger_key = run_api(tmp_path, scenario)
    assert overview["status"] == "failed" and current["run_status"] == "failed"
    assert view["failed"] and view["group"] is None
    assert [p["short"] for p in view["phases"]] == [True, False, False, False, False]
    assert [p["opened_at"] is None for p in view["phases"]] == [False, True, True, True, True]
    assert [f["kind"] for f in faults] == ["dkg_failed"]
    assert faults[0]["detail"].startswith(
        "the run's DKG failed: the dkg_keys phase closed with fewer posts than the quorum")
    assert "keys 1 posts (closed short of a quorum), deal 0 posts (not opened)" in faults[0][
        "detail"]
    status, body = refused
    assert status == 409 and body["reason"] == "wrong_state" and "failed" in body["detail"]
    failed = [decode_canonical(e.body) for e in events if e.kind == "run_failed"]
    assert len(failed) == 1 and failed[0]["reason"] == "dkg_failed"
    assert failed[0]["detail"] == "the dkg_keys phase closed with fewer posts than the quorum"
    audit = verify_events(events, ledger_key)
    assert audit.ok, audit.problem


def test_the_run_goes_on_when_a_validator_leaves_after_the_dkg(tmp_path):
    """Validator 2 takes part in the DKG, then leaves for good. Validators 0 and 1 restart
    (their shares read back from their state directories) and, a quorum between them,
    fix the round's beacon from their two partials and finalize it (specs/protocol.md
    5.4a, validator-set changes)."""
    run_id = "threshold-leave"
    organiser, validators, bundle, run, workers, preps, prepared, settings = threshold_run(
        run_id)
    spec = bundle.signed.message

    def node(i: int) -> ValidatorNode:
        return ValidatorNode(ValidatorConfig(ledger_url="", run_id=run_id, poll_seconds=0.05,
                                             state_dir=tmp_path / f"v{i}"), validators[i])

    async def scenario(api: Api):
        await submit_all(api, bundle, workers, prepared)
        nodes = [node(i) for i in range(3)]
        for n in nodes:
            n.config.ledger_url = api.url
        async with LedgerClient(api.url, retry_for=5.0) as client:
            groups = await asyncio.gather(*(n.run_dkg(client, spec) for n in nodes))
        stayers = [node(0), node(1)]
        for n in stayers:
            n.config.ledger_url = api.url
        running = [asyncio.create_task(n.run(max_rounds=1)) for n in stayers]
        while not (await api.get(f"/v1/runs/{run_id}/rounds/0/challenges"))[1]["fixed"]:
            await asyncio.sleep(0.05)
        await reveal_all(api, run, preps, workers)
        await asyncio.wait_for(asyncio.gather(*running), 120.0)
        partials = (await api.get(f"/v1/runs/{run_id}/rounds/0/partials"))[1]
        summary = (await api.get(f"/v1/runs/{run_id}/rounds/0"))[1]
        # Validator 2 is replaced: a new run, with its own DKG, starts from the model the
        # old run's validators certified (``run create --from-run``).
        async with LedgerClient(api.url, retry_for=5.0) as client:
            old_spec, model, state = await last_certified_model(client, run_id,
                                                                max_model_bytes=1 << 30)
        replaced = [validators[0], validators[1], Identity.generate("validator")]
        successor = build_run(organiser, "threshold-next", settings,
                              [v.public for v in replaced], quorum=2, genesis=model)
        status, _ = await api.post_parts("/v1/runs", [("spec", successor.signed.encode()),
                                                      ("dataset", successor.dataset),
                                                      ("genesis", successor.genesis)])
        return groups, stayers, partials, summary, (old_spec, state, successor, status)

    groups, stayers, partials, summary, (old_spec, state, successor, status) = run_api(
        tmp_path, scenario)
    assert old_spec == spec and state.round == 1
    assert state.model_hash == summary["certificate"]["certified"]["model_hash"]
    assert status == 201
    assert successor.signed.message.genesis_model_hash == state.model_hash
    assert state.model_hash != spec.genesis_model_hash
    assert len({g.group_key for g in groups}) == 1
    assert all(n.dkg_node is not None and n.dkg_node.share is not None for n in stayers)
    signers = {w["body"]["validator"] for w in partials["partials"]}
    assert signers == {v.public_key.hex() for v in validators[:2]}
    assert partials["beacon"]["signers"] == [0, 1]
    assert summary["status"] == "finalized", summary
    assert sorted(summary["certificate"]["signers"]) == [0, 1]
