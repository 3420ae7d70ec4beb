"""Proof costs pay; suspicion does not (issue 24, specs/scoring.md "Excluded updates").

An honest worker whose update a statistical filter keeps out of the aggregate (here the
probe filter, made to flag it as a false positive would) is judged by a real validator
over HTTP against a live ledger on loopback: its verdict is ``excluded``, not
``rejected``; it is paid by its clip quality at the aggregate, as if aggregated; it is
neither banned nor penalized; and the ledger's API, report, audit tables and web page
show it as excluded, apart from rejected.
"""

from __future__ import annotations

import math

import pytest
import torch
from fakes import validator_identities
from ledger_harness import Api, reveals_under, run_api
from test_validator_http import honest, submit_all, synthetic_settings, validate
from veritrain.ledger.audit import fetch_and_verify
from veritrain.ledger.client import LedgerClient
from veritrain.ledger.tables import format_report, format_round, format_worker
from veritrain.protocol.identity import Identity
from veritrain.protocol.organiser import build_run
from veritrain.protocol.outer import OuterState
from veritrain.protocol.runtime import RunContext
from veritrain.validators import round as round_mod
from veritrain.validators.checks import Candidate
from veritrain.validators.round import process_round


def test_an_honest_worker_excluded_by_a_filter_is_paid_and_shown_as_excluded(
        tmp_path, monkeypatch):
    organiser = Identity.generate("organiser")
    validator = validator_identities(1)[0]
    bundle = build_run(organiser, "excl-run", synthetic_settings(), [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    assert run.spec.probe[0] > 0 and run.spec.probe[1] > 0  # the probe filter is on
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(4)]
    keys = [w.public_key.hex() for w in workers]
    victim, peers = keys[0], keys[1:]
    preps = {k: honest(run, base, w) for k, w in zip(keys, workers, strict=True)}
    prepared = {k: (p.signed.message, p.payload) for k, p in preps.items()}

    real = round_mod.loss_regressions

    def false_positive(gains, factor):
        out = dict(real(gains, factor))
        if victim in gains:
            out[victim] = "forced false positive of the probe filter"
        return out

    monkeypatch.setattr(round_mod, "loss_regressions", false_positive)

    async def scenario(api: Api):
        await submit_all(api, bundle, workers, prepared)
        outcome, summary = await validate(api, run, validator, preps, workers)
        run_id = run.spec.run_id
        got = {
            "report": (await api.get(f"/v1/runs/{run_id}/report"))[1],
            "scores": (await api.get(f"/v1/runs/{run_id}/scores"))[1],
            "excluded": (await api.get(f"/v1/runs/{run_id}/verdicts?status=excluded"))[1],
            "rejected": (await api.get(f"/v1/runs/{run_id}/verdicts?status=rejected"))[1],
            "worker": (await api.get(f"/v1/runs/{run_id}/workers/{victim}"))[1],
            "participants": (await api.get(f"/v1/runs/{run_id}/participants"))[1],
        }
        for name, path in (("run_page", f"/runs/{run_id}"),
                           ("round_page", f"/runs/{run_id}/rounds/0"),
                           ("worker_page", f"/runs/{run_id}/workers/{victim}")):
            async with api.session.get(api.url + path) as resp:
                assert resp.status == 200, path
                got[name] = await resp.text()
        async with LedgerClient(api.url) as client:
            got["audit"] = await fetch_and_verify(client, run_id)
        return outcome, summary, got

    outcome, summary, got = run_api(tmp_path, scenario)
    assert summary["status"] == "finalized"
    verdicts = {v["worker"]: v for v in summary["verdicts"]}
    v = verdicts[victim]
    # Excluded, not rejected; its spot checks (if challenged) passed and stay in the verdict.
    assert v["status"] == "excluded" and v["reason"] == "loss_regression", v
    assert all(c["ok"] for c in v["checks"])
    assert all(verdicts[p]["status"] == "accepted" for p in peers)
    assert sorted(x["status"] for x in verdicts.values()) == ["accepted"] * 3 + ["excluded"]

    # Paid as if aggregated: its work counts, its quality is the clip factor at the round's
    # aggregate, and the round's reward is split in proportion to the scores.
    per_round = run.spec.rewards["per_round"]
    assert v["samples"] == verdicts[peers[0]]["samples"] > 0
    assert 0 < v["quality"] <= 1 and v["reward"] > 0
    assert v["score"] == pytest.approx(v["samples"] * v["quality"], rel=1e-6)
    total = sum(x["score"] for x in verdicts.values())
    for x in verdicts.values():
        assert x["reward"] == pytest.approx(per_round * x["score"] / total, rel=1e-9)
    assert math.isclose(sum(x["reward"] for x in verdicts.values()), per_round)
    # ... and its clip factor is min(1, tau / ||x - g||) at the certified aggregate g, with
    # the radius the accepted rows set.
    update = run.codec.decode(preps[victim].payload, run.numel,
                              seed=run.codec_seed(0, victim)).double()
    dist = float((update - outcome.aggregate.double()).norm())
    tau = round_mod.clip_radius(round_mod.TensorRows(torch.stack([
        run.codec.decode(preps[p].payload, run.numel, seed=run.codec_seed(0, p))
        for p in peers])), run.spec.aggregator["params"]["tau_rel"])
    assert v["quality"] == pytest.approx(min(1.0, tau / dist), rel=1e-6)

    # Kept out of the aggregate: the new model is the one the peers alone give.
    reference = process_round(
        run, 0, run.spec.genesis_model_hash, base, OuterState.zeros(run.numel),
        [Candidate(preps[p].signed, preps[p].payload) for p in peers], set(peers), set(),
        bytes(32), reveals=reveals_under(run, {p: preps[p] for p in peers}, bytes(32)))
    assert torch.equal(outcome.aggregate, reference.aggregate)

    # Neither banned nor penalized.
    banned = {p["pubkey"]: p["banned_until_round"] for p in got["participants"]["participants"]}
    assert banned[victim] == -1
    assert got["worker"]["penalties"] == []

    # The API and the report list it apart from the rejections.
    assert [x["worker"] for x in got["excluded"]["verdicts"]] == [victim]
    assert got["rejected"]["verdicts"] == []
    totals = {w["worker"]: w for w in got["scores"]["workers"]}
    assert totals[victim]["excluded"] == 1 and totals[victim]["rejected"] == 0
    assert totals[victim]["samples"] == v["samples"] and totals[victim]["reward"] > 0
    report = got["report"]
    assert report["rounds"][0]["excluded"] == 1 and report["rounds"][0]["rejected"] == 0
    row = {w["worker"]: w for w in report["workers"]}[victim]
    assert row["rejected"] == [] and [x["reason"] for x in row["excluded"]] == [
        "loss_regression"]
    assert got["worker"]["totals"]["excluded"] == 1 and got["worker"]["totals"]["rejected"] == 0

    # The audit tables (`veritrain audit report / round / worker`).
    text = format_report(report)
    assert "excluded, paid: loss_regression" in text and "excluded" in text.splitlines()[2]
    round_text = format_round(summary)
    line = next(x for x in round_text.splitlines() if x.startswith(victim[:12]))
    assert " excluded " in line and "loss_regression" in line
    assert "not rejected" in round_text
    assert "0 rejected, 1 excluded (paid)" in format_worker(got["worker"])

    # The audit recomputes the same totals from the chain, excluded counted apart.
    audit = got["audit"]
    assert audit.ok, audit.problem
    assert audit.totals[victim]["excluded"] == 1 and audit.totals[victim]["rejected"] == 0
    assert audit.totals[victim]["samples"] == totals[victim]["samples"]
    assert math.isclose(audit.totals[victim]["reward"], totals[victim]["reward"])

    # The web pages.
    assert "Excluded from the aggregate, not rejected" in got["run_page"]
    assert 'class="exclude-reason" data-reason="loss_regression"' in got["run_page"]
    assert f'data-worker="{victim}" data-status="excluded"' in got["round_page"]
    assert 'data-status="excluded" data-reason="loss_regression"' in got["worker_page"]
