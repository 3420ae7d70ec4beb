"""The beacon binds what validators judge a round against, and the close they judge it
after (issue #28 item 4).

A real ledger on loopback and real validator code. Validators sign, beside the sealed
list, the digest of their participant view of it (which sealed workers the chain's
registrations, admission and bans exclude) and share only after checking the round was
closed as the schedule says, by their own clock:

* a ledger that shows a validator a participant list without a registered worker gets a
  share for a view it cannot use (its own view differs: ``wrong_participants``);
* a ledger that lies consistently (its list and its view both drop the worker) gets its
  round certified with the worker ``unknown_worker``, and ``audit verify`` names the
  beacon share that signed a view the chain contradicts; the worker, served that view
  with the sealed list, sees that it is excluded before revealing anything;
* a ledger that seals a round early and states the deadline as its close time gets no
  share at all (``early_close``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import validator_identities
from ledger_harness import Api, open_and_submit, run_api
from test_validator_http import honest, synthetic_settings, validate
from veritrain.ledger import queries
from veritrain.ledger import schema as t
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient, LedgerRefused
from veritrain.ledger.store import LedgerStore
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.organiser import build_run
from veritrain.protocol.runtime import RunContext
from veritrain.validators.node import ValidatorConfig, ValidatorNode
from veritrain.workers.beacon import round_inputs

RUN = "inputs-run"


def _run(n_workers: int = 3):
    validator = validator_identities(1)[0]
    bundle = build_run(Identity.generate("organiser"), RUN, synthetic_settings(),
                       [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(n_workers)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    return validator, bundle, run, workers, preps


def _hide(monkeypatch, worker: str) -> None:
    """The ledger's participant list, as served, leaves ``worker`` out."""
    real = queries.participants

    def lying(*args, **kwargs):
        page = real(*args, **kwargs)
        page["participants"] = [p for p in page["participants"] if p["pubkey"] != worker]
        return page

    monkeypatch.setattr(queries, "participants", lying)


def test_a_share_for_a_participant_view_the_ledger_does_not_hold_is_refused(tmp_path,
                                                                           monkeypatch):
    validator, bundle, run, workers, preps = _run()
    hidden = workers[1].public_key.hex()
    _hide(monkeypatch, hidden)

    async def scenario(api: Api):
        await open_and_submit(api, bundle, workers, preps)
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN,
                                             poll_seconds=0.05), validator)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            with pytest.raises(LedgerRefused) as info:
                await node.beacon_seed(client, run.spec, 0)
        return info.value, (await api.get(f"/v1/runs/{RUN}/rounds/0/beacon"))[1]

    refused, beacon = run_api(tmp_path, scenario)
    assert refused.reason == "wrong_participants", refused
    assert beacon["beacon"] is None and not beacon["envelopes"]


def test_a_view_the_chain_contradicts_is_named_by_the_audit_and_seen_by_the_worker(
        tmp_path, monkeypatch):
    validator, bundle, run, workers, preps = _run()
    hidden = workers[1].public_key.hex()
    _hide(monkeypatch, hidden)
    real = LedgerStore.participant_exclusions
    monkeypatch.setattr(LedgerStore, "participant_exclusions", lambda self, s, spec, r: {
        **real(self, s, spec, r), hidden: "unknown_worker"})

    async def scenario(api: Api):
        await open_and_submit(api, bundle, workers, preps)
        outcome, summary = await validate(api, run, validator, preps, workers,
                                          skip=frozenset({hidden}))
        _, sealed = await api.get(f"/v1/runs/{RUN}/rounds/0/submissions")
        async with LedgerClient(api.url, retry_for=5.0) as client:
            ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            audit = verify_events(await fetch_events(client, RUN), ledger_key)
        return summary, sealed, audit

    summary, sealed, audit = run_api(tmp_path, scenario)
    verdicts = {v["worker"]: v for v in summary["verdicts"]}
    assert summary["status"] == "finalized"
    assert verdicts[hidden]["reason"] == "unknown_worker"
    # The worker, served the view the validators signed, knows before revealing.
    with pytest.raises(RejectedInput) as info:
        round_inputs(sealed, hidden)
    assert info.value.reason == "excluded"
    round_inputs(sealed, workers[0].public_key.hex())  # the others are not excluded
    assert not audit.ok
    assert "participant view the chain contradicts" in audit.problem, audit.problem
    assert "beacon_share" in audit.problem, audit.problem


def test_without_the_lie_the_same_round_certifies_and_audits(tmp_path, monkeypatch):
    """The control for the test above: the same round with an honest ledger, whose view
    of the closed round is computed once however many workers read it."""
    validator, bundle, run, workers, preps = _run()
    computed = []
    real = LedgerStore.participant_view
    monkeypatch.setattr(LedgerStore, "participant_view",
                        lambda self, *a: computed.append(a[1:]) or real(self, *a))

    async def scenario(api: Api):
        await open_and_submit(api, bundle, workers, preps)
        for _ in range(5):
            _, sealed = await api.get(f"/v1/runs/{RUN}/rounds/0/submissions")
            assert sealed["excluded"] == {}
        _, summary = await validate(api, run, validator, preps, workers)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            audit = verify_events(await fetch_events(client, RUN), ledger_key)
        return summary, audit

    summary, audit = run_api(tmp_path, scenario)
    assert len(computed) == 1, computed
    assert summary["status"] == "finalized"
    assert all(v["reason"] != "unknown_worker" for v in summary["verdicts"])
    assert audit.ok, audit.problem


def test_a_round_sealed_early_gets_no_share(tmp_path):
    """Two of three registered workers in, the deadline 30 s away: the ledger closes the
    round and states the deadline as its close time. The validator, which saw the round
    closed long before that time by its own clock, shares nothing."""
    validator, bundle, run, workers, preps = _run()

    async def scenario(api: Api):
        await open_and_submit(api, bundle, workers, preps, submitting=workers[:2])
        with api.store.sessions.begin() as s:
            rnd = s.get(t.Round, (RUN, 0))
            assert rnd.status == "open" and rnd.deadline > time.time() + 20
            api.store._close(s, rnd, rnd.deadline)  # sealed now, stamped at the deadline
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN, poll_seconds=0.05,
                                             clock_slack_seconds=5.0), validator)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            info = await client.get_json(f"/v1/runs/{RUN}/rounds/0")
            with pytest.raises(RejectedInput) as caught:
                await node.validate_round(client, run, info)
        return caught.value, (await api.get(f"/v1/runs/{RUN}/rounds/0/beacon"))[1]

    refused, beacon = run_api(tmp_path, scenario)
    assert refused.reason == "early_close", refused
    assert "before the close time the ledger states" in str(refused)
    assert beacon["beacon"] is None and not beacon["envelopes"]


def test_a_validator_names_one_list_a_round_even_across_a_restart(tmp_path, monkeypatch):
    """The BLS beacon share signs (run, round) only. A ledger shows the validator a sealed
    list without one submission; the share it names that list with is refused (it is not
    the ledger's own). After a restart the ledger shows the full list: the validator,
    which remembers on disk the list it named for the round, names no second one and
    shares nothing, so the ledger cannot collect one seed for two lists."""
    validator, bundle, run, workers, preps = _run()
    lying = [True]
    hidden = workers[-1].public_key.hex()
    real_sealed, real_participants = LedgerStore.sealed_submissions, queries.participants

    def sealed(self, run_id, r):  # the hidden worker's submission left out
        envelopes, excluded = real_sealed(self, run_id, r)
        return ([e for e in envelopes if not lying[0] or hidden not in e.decode()],
                excluded)

    def participants(*args, **kwargs):  # and its registration, so the close looks right
        page = real_participants(*args, **kwargs)
        if lying[0]:
            page["participants"] = [p for p in page["participants"] if p["pubkey"] != hidden]
        return page

    monkeypatch.setattr(LedgerStore, "sealed_submissions", sealed)
    monkeypatch.setattr(queries, "participants", participants)
    state_dir = tmp_path / "validator-state"

    async def judge(api: Api) -> tuple[Any, list[dict[str, Any]]]:
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN, poll_seconds=0.05,
                                             state_dir=state_dir), validator)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            info = await client.get_json(f"/v1/runs/{RUN}/rounds/0")
            try:
                return await node.validate_round(client, run, info), node.faults
            except (RejectedInput, LedgerRefused) as exc:
                return exc, node.faults

    async def scenario(api: Api):
        await open_and_submit(api, bundle, workers, preps)
        first = await judge(api)
        lying[0] = False
        after_restart = await judge(api)
        return first, after_restart, (await api.get(f"/v1/runs/{RUN}/rounds/0/beacon"))[1]

    first, after_restart, beacon = run_api(tmp_path, scenario)
    assert "wrong_sealed_list" in str(first), first
    outcome, faults = after_restart
    assert "already signed another beacon_share" in str((outcome, faults)), after_restart
    assert beacon["beacon"] is None and not beacon["envelopes"]
