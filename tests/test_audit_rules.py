"""The audit's rules (ledger/audit_rules.py, specs/protocol.md 9.3) on hand-built states,
without the engine: each case is a state before, one row's content, the state after; the
invalid cases name the problem the audit reports for the row."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
from veritrain.ledger import audit_rules as rules
from veritrain.ledger.audit_rules import (
    AuditState,
    Bad,
    BadEarlier,
    RecordedResult,
    ResultFacts,
    ResultView,
    RoundState,
)
from veritrain.ledger.chain import ChainRow
from veritrain.protocol import bls
from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED, compute_beacon_seed, sealed_list_digest
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Receipt,
    Registration,
    RunSpec,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    Submission,
    digest_of,
)
from veritrain.protocol.openings import (
    committed_inputs,
    inputs_digest,
    openings_root,
    seed_of_shares,
)
from veritrain.protocol.secagg import round_buckets

ROOT = Path(__file__).resolve().parents[1]
RUN = "rules-run"
ORGANISER = "0a" * 32
VALIDATORS = [f"{k + 1:02x}" * 32 for k in range(3)]  # their Ed25519 keys (hex)
WORKERS = [f"{k + 0xa0:02x}" * 32 for k in range(4)]
SHARES = [f"{k + 0xb0:02x}" * 96 for k in range(3)]  # each validator's BLS share (hex)
GENESIS = "11" * 32
SUBS = ["d1" * 32, "d2" * 32, "d3" * 32, "d4" * 32]  # submission digests
SEED = "5e" * 32


def make_spec(*, quorum: int = 2, ban_rounds: int = 2, vesting_rounds: int = 2,
              **aggregator: Any) -> RunSpec:
    """A run spec with what the rules read (the other fields are never looked at)."""
    return RunSpec(
        run_id=RUN, round=0, created_at=1, organiser=ORGANISER, seed="00" * 32, task={},
        dataset_hash="00" * 32, dataset_bytes=0, genesis_model_hash=GENESIS, num_params=100,
        inner={}, outer={}, codec={}, aggregator={"name": "centered_clip", "params": {},
                                                  **aggregator},
        schedule={}, verification={"ban_rounds": ban_rounds, "vesting_rounds": vesting_rounds},
        limits={}, rewards={},
        validators=[{"ed25519": v, "bls": "", "bls_pop": ""} for v in VALIDATORS],
        quorum=quorum)


def state_with(*rounds: RoundState, spec: RunSpec | None = None) -> AuditState:
    """The run spec read, ``rounds`` opened (the last one current)."""
    spec = spec or make_spec()
    return AuditState(spec=spec, rounds={r.index: r for r in rounds},
                      current=rounds[-1] if rounds else None,
                      next_base=GENESIS if not rounds else None)


def open_round(r: int = 0, **fields: Any) -> RoundState:
    return RoundState(r, GENESIS if r == 0 else f"{r:02x}" * 32,
                      submissions={d: 10 + k for k, d in enumerate(SUBS)}, **fields)


def closed_round(r: int = 0, **fields: Any) -> RoundState:
    return open_round(r, closed=list(SUBS), sealed=sealed_list_digest(SUBS), **fields)


def beaconed_round(r: int = 0, **fields: Any) -> RoundState:
    return closed_round(r, shares={0: SHARES[0], 1: SHARES[1]}, beacon_seed=SEED, **fields)


def raises(problem: str, fn: Any, *args: Any) -> None:
    with pytest.raises(Bad) as info:
        fn(*args)
    assert str(info.value) == problem


# ----------------------------------------------------------------------------- run spec


def test_run_spec_at_row_0_sets_the_spec_and_the_genesis_base():
    state, spec = AuditState(), make_spec()
    rules.check_first_row(0, "run_spec")
    rules.process_run_spec(state, 0, spec, ORGANISER, RUN)
    assert state.spec is spec and state.next_base == GENESIS and state.rounds == {}


@pytest.mark.parametrize(("index", "signer", "run_id", "problem"), [
    (1, ORGANISER, RUN, "a second run spec"),
    (0, VALIDATORS[0], RUN, "run spec not signed by its organiser"),
    (0, ORGANISER, "other-run", "run spec of another run"),
])
def test_invalid_run_spec(index, signer, run_id, problem):
    state = AuditState()
    raises(problem, rules.process_run_spec, state, index, make_spec(), signer, run_id)
    assert state.spec is None


def test_invalid_first_row_of_another_kind():
    raises("the first row must be the run spec", rules.check_first_row, 0, "round_opened")
    rules.check_first_row(1, "round_opened")
    raises("before the run spec", rules.get_spec, AuditState())


def test_registration_and_submission_envelopes():
    reg = Registration(run_id=RUN, round=0, participant=WORKERS[0], role="worker",
                       created_at=1)
    rules.check_registration(reg, WORKERS[0], RUN)
    raises("registration of another run or signed by another key",
           rules.check_registration, reg, WORKERS[1], RUN)
    raises("registration of another run or signed by another key",
           rules.check_registration, reg, WORKERS[0], "other-run")
    sub = Submission(run_id=RUN, round=2, worker=WORKERS[0], base_model_hash=GENESIS,
                     payload_hash="00" * 32, payload_bytes=1, codec={}, samples=1, trail=[],
                     ef_hash="00" * 32, loss_first=1.0, loss_last=1.0, created_at=1)
    rules.check_submission(sub, WORKERS[0], RUN, 2)
    raises("submission signed by a key other than its worker",
           rules.check_submission, sub, WORKERS[1], RUN, 2)
    raises("submission for round 2 recorded in round 3", rules.check_submission, sub,
           WORKERS[0], RUN, 3)


def test_receipt_names_the_submission_row_before_it():
    body = b'{"a submission":1}'
    before = ChainRow(7, RUN, "submission", body, "00" * 32, "11" * 32, None)
    rec = Receipt(run_id=RUN, round=0, worker=WORKERS[0],
                  submission_digest=hashlib.sha256(body).hexdigest(), received_at=1.0,
                  sequence=7)
    ledger = "1e" * 32
    rules.check_receipt(rec, ledger, ledger, before)
    raises("receipt not signed by this ledger", rules.check_receipt, rec, WORKERS[0], ledger,
           before)
    for wrong in (None, dataclasses.replace(before, kind="receipt"),
                  dataclasses.replace(before, seq=6), dataclasses.replace(before, body=b"{}")):
        raises("receipt does not name the submission row before it", rules.check_receipt, rec,
               ledger, ledger, wrong)


# ----------------------------------------------------------------------------- rounds


def test_round_opened_in_order_on_the_last_certified_model():
    state = state_with()
    rules.process_round_opened(state, 1, {"run_id": RUN, "round": 0, "base_model_hash": GENESIS})
    assert state.current is state.rounds[0] and state.current.base == GENESIS
    assert state.current.submissions == {} and state.current.closed is None


@pytest.mark.parametrize(("pre", "body", "problem"), [
    ("none", {"round": 1, "base_model_hash": GENESIS}, "round 1 opened out of order"),
    ("none", {"round": 0, "base_model_hash": "99" * 32},
     "base model is not the one the last certificate vouches for"),
    ("open", {"round": 1, "base_model_hash": GENESIS},
     "a round opened before the previous one finalized"),
])
def test_invalid_round_opened(pre, body, problem):
    state = state_with() if pre == "none" else state_with(open_round())
    before = dict(state.rounds)
    raises(problem, rules.process_round_opened, state, 5, body)
    assert state.rounds == before


def test_submissions_go_to_the_open_round_and_its_close_lists_exactly_them():
    state = state_with(RoundState(0, GENESIS))
    rnd = rules.process_submissions(state, [3, 5], SUBS[:2])
    rules.process_submissions(state, [7, 9], SUBS[2:])
    assert rnd is state.current and rnd.submissions == dict(zip(SUBS, [3, 5, 7, 9], strict=True))
    rules.process_round_closed(state, 10, {"round": 0, "submissions": SUBS[::-1]})
    assert rnd.closed == SUBS[::-1] and rnd.sealed == sealed_list_digest(SUBS)


def test_invalid_submission_after_its_round_closed():
    raises("no open round to record it in", rules.process_submissions, state_with(),
           [1], SUBS[:1])
    state = state_with(closed_round())
    raises("no open round to record it in", rules.process_submissions, state, [20], ["d5" * 32])
    assert "d5" * 32 not in state.rounds[0].submissions


def test_a_run_failed_by_its_dkg_takes_nothing_after_it():
    spec = make_spec()
    threshold = dataclasses.replace(spec, verification={**spec.verification,
                                                        "beacon": "threshold"})
    failed = {"reason": "dkg_failed", "detail": "the dkg_keys phase closed short"}
    raises("a run failed for another reason than its DKG, or in a quorum-of-shares run",
           rules.check_run_failed, state_with(RoundState(0, GENESIS), spec=spec), 3, failed)
    raises("a run failed for another reason than its DKG, or in a quorum-of-shares run",
           rules.check_run_failed, state_with(RoundState(0, GENESIS), spec=threshold), 3,
           {**failed, "reason": "tired"})
    fixed = state_with(RoundState(0, GENESIS), spec=threshold)
    fixed.dkg_group_key = "ab" * 48
    raises("run failed after its DKG fixed a group key, or twice", rules.check_run_failed,
           fixed, 3, failed)
    state = state_with(RoundState(0, GENESIS), spec=threshold)
    rules.check_run_failed(state, 3, failed)
    assert state.failed
    raises("run failed after its DKG fixed a group key, or twice", rules.check_run_failed,
           state, 4, failed)
    raises("a submission after the run failed", rules.process_submissions, state, [5],
           SUBS[:1])
    raises("closes a round after the run failed", rules.process_round_closed, state, 6,
           {"round": 0, "submissions": []})
    raises("a DKG group in a quorum-of-shares run, fixed twice, or after the run failed",
           rules.process_dkg_group_fixed, state, 7, {"results": []})


@pytest.mark.parametrize("listed", [SUBS[:3], [*SUBS, "d5" * 32], [*SUBS[:3], SUBS[0]]])
def test_invalid_round_closed_with_another_list(listed):
    state = state_with(open_round())
    raises("sealed list differs from the submissions recorded in the round",
           rules.process_round_closed, state, 20, {"round": 0, "submissions": listed})
    assert state.rounds[0].closed is None
    raises("closes a round that is not open", rules.process_round_closed,
           state_with(closed_round()), 20, {"round": 0, "submissions": SUBS})
    raises("round 3 was never opened", rules.process_round_closed, state, 20,
           {"round": 3, "submissions": SUBS})


def test_beacon_shares_after_the_close_then_a_quorum_of_them_fixes_the_seed():
    state = state_with(closed_round())
    for k in (1, 0, 2):
        share = BeaconShare(run_id=RUN, round=0, validator=VALIDATORS[k], share=SHARES[k],
                            sealed=sealed_list_digest(SUBS), participants=EVERY_WORKER_ADMITTED)
        assert rules.process_beacon_share(state, 20 + k, share, VALIDATORS[k]) == k
    rules.process_beacon_fixed(state, 30, {"round": 0, "signers": [0, 1],
                                           "shares": SHARES[:2]})
    want = compute_beacon_seed([bytes.fromhex(x) for x in SHARES[:2]]).hex()
    assert state.rounds[0].beacon_seed == want


@pytest.mark.parametrize(("rnd", "signer", "sealed", "problem"), [
    (open_round(), VALIDATORS[0], sealed_list_digest(SUBS),
     "beacon share before the round closed"),
    (closed_round(), VALIDATORS[0], sealed_list_digest(SUBS[:3]),
     "beacon share names another sealed list than the round's"),
    (closed_round(), VALIDATORS[1], sealed_list_digest(SUBS),
     "not signed by a validator of this run"),
    (closed_round(), WORKERS[0], sealed_list_digest(SUBS),
     "not signed by a validator of this run"),
])
def test_invalid_beacon_share(rnd, signer, sealed, problem):
    share = BeaconShare(run_id=RUN, round=0, validator=VALIDATORS[0], share=SHARES[0],
                        sealed=sealed, participants=EVERY_WORKER_ADMITTED)
    state = state_with(rnd)
    raises(problem, rules.process_beacon_share, state, 20, share, signer)
    assert state.rounds[0].shares == {}


@pytest.mark.parametrize(("signers", "shares", "problem"), [
    ([1, 0], SHARES[1::-1], "beacon signers are not a quorum of the validator set"),
    ([0, 1, 2], SHARES, "beacon signers are not a quorum of the validator set"),  # exactly 2
    ([0, 0], SHARES[:1] * 2, "beacon signers are not a quorum of the validator set"),
    ([0, 3], SHARES[:2], "beacon signers are not a quorum of the validator set"),
    ([0, 2], [SHARES[0], SHARES[2]], "beacon shares are not the signers' logged beacon_share rows"),
    ([0, 1], [SHARES[1], SHARES[0]], "beacon shares are not the signers' logged beacon_share rows"),
])
def test_invalid_beacon_fixed(signers, shares, problem):
    state = state_with(closed_round(shares={0: SHARES[0], 1: SHARES[1]}))
    raises(problem, rules.process_beacon_fixed, state, 30,
           {"round": 0, "signers": signers, "shares": shares})
    assert state.rounds[0].beacon_seed is None


# ----------------------------------------------------------------------------- results


SPOT_FAILED = WORKERS[3]


def certified_result(r: int = 0, *, validator: int = 0, rewards: tuple[float, ...] = (1.0,) * 4
                     ) -> tuple[ResultView, ResultFacts]:
    """Validator ``validator``'s result for round ``r``: every sealed submission accepted but
    the last one's, whose spot check failed; its certified state names its lists' digests."""
    verdicts = [{"worker": w, "submission_digest": d,
                 "reason": "spot_check_failed" if w == SPOT_FAILED else "ok"}
                for w, d in zip(WORKERS, SUBS, strict=True)]
    scores = [{"worker": w, "reward": x} for w, x in zip(WORKERS, rewards, strict=True)]
    cert = CertifiedState(run_id=RUN, round=r + 1, model_hash=f"{0x40 + r:02x}" * 32,
                          outer_state_hash="33" * 32, update_hash="44" * 32,
                          verdicts_hash=digest_of(verdicts), scores_hash=digest_of(scores),
                          eval_loss=1.0)
    base = GENESIS if r == 0 else f"{r:02x}" * 32
    view = ResultView(RUN, r, VALIDATORS[validator], base, SEED, verdicts, scores, cert.to_body())
    facts = ResultFacts(digest_of(verdicts), digest_of(scores), sorted(SUBS), {SPOT_FAILED},
                        dict(zip(WORKERS, SUBS, strict=True)), {}, set())
    return view, facts


def finalized_body(view: ResultView, r: int = 0, signers: tuple[int, ...] = (0, 1)
                   ) -> dict[str, Any]:
    return {"run_id": RUN, "round": r, "certificate": {
        "certified": view.certified, "signers": list(signers), "signature": "ab" * 96}}


def test_result_then_ban_then_certificate_finalizes_the_round():
    state = state_with(beaconed_round())
    view, facts = certified_result()
    rules.process_round_result(state, 40, view, VALIDATORS[0], facts)
    rnd = state.rounds[0]
    assert [(res.index, res.message) for res in rnd.results] == [(40, view)]
    ban = {"run_id": RUN, "round": 0, "worker": SPOT_FAILED, "reason": "spot_check_failed",
           "until_round": 2}
    rules.process_ban(state, 41, ban)
    assert rnd.bans == [(41, ban)]
    assert rules.process_round_finalized(state, 42, finalized_body(view)) is rnd
    assert rnd.certified is rnd.results[0]
    assert state.next_base == CertifiedState.from_body(view.certified).model_hash
    raises("ban outside the finalization of its round", rules.process_ban, state, 43, ban)
    rules.check_run_finished(state, 43, {})


@pytest.mark.parametrize(("change", "signer", "problem"), [
    ({"base_model_hash": "99" * 32}, VALIDATORS[0], "result for another base model or round"),
    ({"beacon_seed": "99" * 32}, VALIDATORS[0], "result uses another beacon than the round's"),
    ({"validator": VALIDATORS[1]}, VALIDATORS[0], "not signed by a validator of this run"),
    ({"round": 1}, VALIDATORS[0], "round 1 was never opened"),
    ("certifies round 2", VALIDATORS[0], "result for another base model or round"),
])
def test_invalid_round_result(change, signer, problem):
    state = state_with(beaconed_round())
    view, facts = certified_result()
    if change == "certifies round 2":
        change = {"certified": view.certified | {"round": 2}}
    raises(problem, rules.process_round_result, state, 40, dataclasses.replace(view, **change),
           signer, facts)
    assert state.rounds[0].results == []


def test_invalid_round_result_whose_lists_are_not_the_certified_ones():
    state = state_with(beaconed_round())
    view, facts = certified_result()
    raises("verdicts or scores differ from the certified digests", rules.process_round_result,
           state, 40, view, VALIDATORS[0], dataclasses.replace(facts, scores_digest="00" * 32))
    raises("a verdict without a worker", rules.process_round_result, state, 40, view,
           VALIDATORS[0], dataclasses.replace(facts, verdicts_digest=rules.Deferred(
               "a verdict without a worker")))


@pytest.mark.parametrize(("case", "problem"), [
    ("other state", "no recorded validator result carries the certified state"),
    ("signers", "certificate signers are not a quorum of the validator set"),
    ("uncovered", "certified verdicts do not cover exactly the sealed submissions"),
    ("round", "certificate is for rules-run round 1"),
    ("faulted", "certificate counts a validator whose shard a quorum proved faulty"),
])
def test_invalid_round_finalized(case, problem):
    rnd = beaconed_round()
    state = state_with(rnd)
    view, facts = certified_result()
    if case == "uncovered":
        facts = dataclasses.replace(facts, submission_digests=sorted(SUBS[:3]))
    rules.process_round_result(state, 40, view, VALIDATORS[0], facts)
    other, _ = certified_result(rewards=(2.0,) * 4)
    body = finalized_body(other if case == "other state" else view,
                          signers=(0,) if case == "signers" else (0, 1))
    if case == "round":
        state.rounds[1] = closed_round(1)
        body["round"] = 1
    if case == "faulted":  # signer 1's shard was proven faulty earlier in the round
        rnd.shard_faults.add(1)
    raises(problem, rules.process_round_finalized, state, 42, body)
    assert rnd.certified is None and state.next_base is None
    raises("run finished with a round not finalized", rules.check_run_finished, state, 43, {})


@pytest.mark.parametrize("ban", [
    {"worker": WORKERS[0], "reason": "spot_check_failed", "until_round": 2},
    {"worker": SPOT_FAILED, "reason": "free_riding", "until_round": 2},
    {"worker": SPOT_FAILED, "reason": "spot_check_failed", "until_round": 3},
])
def test_invalid_ban_is_named_when_its_round_is_finalized(ban):
    state = state_with(beaconed_round())
    view, facts = certified_result()
    rules.process_round_result(state, 40, view, VALIDATORS[0], facts)
    rules.process_ban(state, 41, {"run_id": RUN, "round": 0, **ban})
    with pytest.raises(BadEarlier) as info:
        rules.process_round_finalized(state, 42, finalized_body(view))
    assert (info.value.index, info.value.kind, str(info.value)) == (
        41, "ban", "ban without a certified failed spot check")
    assert state.rounds[0].certified is None


def two_rounds_one_certified(vesting_rounds: int = 2) -> AuditState:
    """Round 0 certified (its rewards 1, 2, 3, 4), round 1 with its result recorded."""
    view0, facts0 = certified_result(0, rewards=(1.0, 2.0, 3.0, 4.0))
    done = beaconed_round(0)
    done.certified = RecordedResult(40, view0, facts0)
    view1, facts1 = certified_result(1)
    rnd = beaconed_round(1, results=[RecordedResult(140, view1, facts1)])
    return state_with(done, rnd, spec=make_spec(vesting_rounds=vesting_rounds))


def test_penalty_forfeits_a_certified_unvested_reward():
    state = two_rounds_one_certified()
    penalty = {"run_id": RUN, "round": 1, "worker": SPOT_FAILED, "source_round": 0,
               "amount": 4.0}
    rules.process_penalty(state, 141, penalty)
    view1 = state.rounds[1].results[0].message
    assert rules.process_round_finalized(state, 142, finalized_body(view1, 1)) is state.rounds[1]


@pytest.mark.parametrize(("change", "vesting_rounds"), [
    ({"amount": 3.0}, 2), ({"worker": WORKERS[2], "amount": 3.0}, 2), ({"source_round": 1}, 2),
    ({}, 1),  # round 0's reward has vested by round 1
])
def test_invalid_penalty_is_named_when_its_round_is_finalized(change, vesting_rounds):
    state = two_rounds_one_certified(vesting_rounds)
    rules.process_penalty(state, 141, {"run_id": RUN, "round": 1, "worker": SPOT_FAILED,
                                       "source_round": 0, "amount": 4.0, **change})
    view1 = state.rounds[1].results[0].message
    with pytest.raises(BadEarlier) as info:
        rules.process_round_finalized(state, 142, finalized_body(view1, 1))
    assert (info.value.index, info.value.kind) == (141, "penalty")
    raises("penalty outside the finalization of its round", rules.process_penalty, state, 143,
           {"round": 0})


def test_validator_fault_names_a_recorded_result_that_differs():
    view, facts = certified_result(validator=1)
    rnd = beaconed_round(results=[RecordedResult(40, view, facts)])
    state = state_with(rnd)
    fault = {"round": 0, "validator": VALIDATORS[1], "result_digest": digest_of(view.certified),
             "certified_digest": "77" * 32}
    rules.check_validator_fault(state, 50, fault)
    for wrong in ({"validator": VALIDATORS[0]}, {"certified_digest": fault["result_digest"]},
                  {"result_digest": "77" * 32}):
        raises("fault without a recorded result that differs from the certificate",
               rules.check_validator_fault, state, 50, fault | wrong)


def test_invalid_ledger_record_of_another_shape_or_run():
    body = {"run_id": RUN, "round": 0}
    assert rules.check_ledger_record(body, RUN) is body
    raises("a ledger record is a JSON object", rules.check_ledger_record, [body], RUN)
    raises("record of another run", rules.check_ledger_record, body, "other-run")


# ----------------------------------------------------------------------------- shards


RESULTS = ["c0" * 32, "c1" * 32, "c2" * 32]


def sharded_state(**fields: Any) -> AuditState:
    return state_with(beaconed_round(**fields), spec=make_spec(shards=3))


def publication(k: int, shard: int | None = None) -> ShardPublication:
    return ShardPublication(run_id=RUN, round=0, validator=VALIDATORS[k],
                            shard=k if shard is None else shard, inputs_digest="00" * 32,
                            result_digest=RESULTS[k], result_hash="00" * 32, result_bytes=1)


def check_share(k: int, results: list[str | None]) -> ShardCheckShare:
    return ShardCheckShare(run_id=RUN, round=0, validator=VALIDATORS[k], results=results,
                           share=SHARES[k])


def finding(k: int, shard: int, faulty: bool = True) -> ShardFindingReport:
    return ShardFindingReport(run_id=RUN, round=0, validator=VALIDATORS[k], shard=shard,
                              publisher=VALIDATORS[shard], faulty=faulty, reason="distance",
                              published_digest=RESULTS[shard], replacement_digest="00" * 32,
                              max_abs_deviation=1.0)


def test_a_sharded_round_from_the_results_to_a_fault():
    state = sharded_state()
    rnd = state.rounds[0]
    for k in range(3):
        rules.process_shard_result(state, 50 + k, publication(k), VALIDATORS[k])
    assert rnd.shard_results == RESULTS
    rules.process_shard_list_fixed(state, 53, {"round": 0, "results": RESULTS})
    for k in range(2):
        assert rules.process_shard_check_share(state, 54 + k, check_share(k, RESULTS),
                                               VALIDATORS[k]) == k
    seed = compute_beacon_seed([bytes.fromhex(x) for x in SHARES[:2]]).hex()
    rules.process_shard_check_fixed(state, 56, {"round": 0, "signers": [0, 1],
                                                "shares": SHARES[:2], "results": RESULTS,
                                                "seed": seed})
    assert rnd.shard_seed == seed
    rules.process_shard_finding(state, 57, finding(0, 2), VALIDATORS[0])
    rules.process_shard_finding(state, 58, finding(1, 2), VALIDATORS[1])
    rules.process_shard_finding(state, 59, finding(2, 0, faulty=False), VALIDATORS[2])
    assert rnd.shard_findings == {(0, 2): True, (1, 2): True, (2, 0): False}
    rules.process_shard_fault(state, 60, {"round": 0, "shard": 2, "reporters": [0, 1]})
    assert rnd.shard_faults == {2}
    raises("shard fault without a quorum of recorded faulty findings", rules.process_shard_fault,
           state, 61, {"round": 0, "shard": 2, "reporters": [0, 1]})


@pytest.mark.parametrize("reporters", [[0], [0, 1], [0, 2]])
def test_invalid_shard_fault_without_a_quorum_of_faulty_findings(reporters):
    state = sharded_state(shard_findings={(0, 2): True, (1, 2): False, (2, 1): True})
    raises("shard fault without a quorum of recorded faulty findings", rules.process_shard_fault,
           state, 60, {"round": 0, "shard": 2, "reporters": reporters})
    assert state.rounds[0].shard_faults == set()


def test_invalid_shard_result():
    state = sharded_state()
    raises("shard result for another shard, repeated, or after the list was fixed",
           rules.process_shard_result, state, 50, publication(0, shard=1), VALIDATORS[0])
    rules.process_shard_result(state, 50, publication(0), VALIDATORS[0])
    raises("shard result for another shard, repeated, or after the list was fixed",
           rules.process_shard_result, state, 51, publication(0), VALIDATORS[0])
    raises("shard message in a run that does not shard", rules.process_shard_result,
           state_with(beaconed_round()), 50, publication(0), VALIDATORS[0])
    raises("shard message before the round's beacon was fixed", rules.process_shard_result,
           state_with(closed_round(), spec=make_spec(shards=3)), 50, publication(0),
           VALIDATORS[0])
    view, facts = certified_result()
    raises("shard result for another shard, repeated, or after the list was fixed",
           rules.process_shard_result, sharded_state(shard_list=[None] * 3), 50, publication(0),
           VALIDATORS[0])
    raises("shard result or check share after the round was finalized",
           rules.process_shard_result, sharded_state(certified=RecordedResult(40, view, facts)),
           50, publication(0), VALIDATORS[0])


def test_invalid_shard_list_and_check_shares():
    state = sharded_state(shard_results=RESULTS[:2] + [None])
    raises("fixed shard list differs from the published results",
           rules.process_shard_list_fixed, state, 53, {"round": 0, "results": RESULTS})
    raises("check share over another list than the published results, or repeated",
           rules.process_shard_check_share, state, 54, check_share(0, RESULTS), VALIDATORS[0])
    rules.process_shard_check_share(state, 54, check_share(0, RESULTS[:2] + [None]),
                                    VALIDATORS[0])
    raises("check share over another list than the published results, or repeated",
           rules.process_shard_check_share, state, 55, check_share(0, RESULTS[:2] + [None]),
           VALIDATORS[0])


@pytest.mark.parametrize(("change", "problem"), [
    ({"signers": [0]}, "shard check signers are not a quorum of the validator set"),
    ({"signers": [1, 0]}, "shard check signers are not a quorum of the validator set"),
    ({"signers": [0, 2], "shares": [SHARES[0], SHARES[2]]},
     "shard check seed fixed twice, or from shares that were not recorded"),
    ({"seed": "00" * 32}, "shard check seed does not follow from its list and shares"),
    ({"results": RESULTS[::-1]}, "shard check seed does not follow from its list and shares"),
])
def test_invalid_shard_check_fixed(change, problem):
    state = sharded_state(shard_results=RESULTS, shard_list=RESULTS,
                          shard_shares={0: SHARES[0], 1: SHARES[1]})
    seed = compute_beacon_seed([bytes.fromhex(x) for x in SHARES[:2]]).hex()
    body = {"round": 0, "signers": [0, 1], "shares": SHARES[:2], "results": RESULTS,
            "seed": seed}
    raises(problem, rules.process_shard_check_fixed, state, 56, body | change)
    assert state.rounds[0].shard_seed is None


@pytest.mark.parametrize(("k", "found", "problem"), [
    (0, dataclasses.replace(finding(0, 2), shard=0, publisher=VALIDATORS[0]),
     "finding about a shard result that is not another validator's listed one"),
    (0, dataclasses.replace(finding(0, 2), published_digest="00" * 32),
     "finding about a shard result that is not another validator's listed one"),
    (0, dataclasses.replace(finding(0, 2), publisher=VALIDATORS[1]),
     "finding about a shard result that is not another validator's listed one"),
    (0, dataclasses.replace(finding(0, 2), shard=3),
     "finding about a shard result that is not another validator's listed one"),
    (1, finding(1, 2), "a second finding of one validator on one shard"),
])
def test_invalid_shard_finding(k, found, problem):
    state = sharded_state(shard_results=RESULTS, shard_list=RESULTS, shard_seed=SEED,
                          shard_findings={(1, 2): False})
    raises(problem, rules.process_shard_finding, state, 57, found, VALIDATORS[k])
    assert state.rounds[0].shard_findings == {(1, 2): False}
    raises("finding before the round's check seed was fixed", rules.process_shard_finding,
           sharded_state(shard_results=RESULTS, shard_list=RESULTS), 57, finding(0, 2),
           VALIDATORS[0])


# ----------------------------------------------------------------------------- masked buckets


MASKED = {"bucket_size": 2, "max_dropouts": 0, "clip_norm": 1.0, "phase_seconds": 1.0}


def masked_state(**fields: Any) -> AuditState:
    return state_with(beaconed_round(**fields), spec=make_spec(masked=MASKED))


def keys(worker: str, bucket: int) -> SecaggKeys:
    return SecaggKeys(run_id=RUN, round=0, bucket=bucket, worker=worker, enc_public="00" * 32,
                      mask_public="00" * 32)


def masked(worker: str, bucket: int) -> SecaggMasked:
    return SecaggMasked(run_id=RUN, round=0, bucket=bucket, worker=worker,
                        commitment="00" * 32, input_digest="00" * 32, words_hash="00" * 32,
                        words_bytes=4, dealers_digest="00" * 32)


def opening(worker: str, bucket: int) -> SecaggOpening:
    return SecaggOpening(run_id=RUN, round=0, bucket=bucket, worker=worker,
                         self_seed="00" * 32, mask_private="00" * 32)


def test_buckets_dealt_by_the_beacon_then_board_posts_from_their_members():
    state = masked_state()
    buckets = round_buckets(bytes.fromhex(SEED), WORKERS, 2)
    assert len(buckets) == 2
    rules.process_secagg_started(state, 60, {"round": 0, "buckets": buckets})
    rnd = state.rounds[0]
    assert rnd.secagg_bucket_of == {w: b for b, ws in enumerate(buckets) for w in ws}
    w = buckets[1][0]
    for post in (keys(w, 1), masked(w, 1), opening(w, 1)):
        rules.process_secagg_post(state, 61, post, w)
    assert rnd.secagg_posts == {("keys", w), ("masked", w), ("opening", w)}


@pytest.mark.parametrize(("case", "problem"), [
    ("unmasked", "buckets dealt in an unmasked run, before the beacon, or twice"),
    ("no beacon", "buckets dealt in an unmasked run, before the beacon, or twice"),
    ("overlap", "buckets overlap, hold more workers than the sealed list, or are short"),
    ("short", "buckets overlap, hold more workers than the sealed list, or are short"),
    ("3 sealed", "buckets overlap, hold more workers than the sealed list, or are short"),
    ("swapped", "buckets are not the beacon's deal of their members"),
])
def test_invalid_secagg_started(case, problem):
    buckets = round_buckets(bytes.fromhex(SEED), WORKERS, 2)
    state = masked_state()
    if case == "unmasked":
        state = state_with(beaconed_round())
    elif case == "no beacon":
        state = state_with(closed_round(), spec=make_spec(masked=MASKED))
    elif case == "overlap":
        buckets = [buckets[0], [buckets[0][0], buckets[1][1]]]
    elif case == "3 sealed":
        state.rounds[0].closed = SUBS[:3]
    elif case == "short":
        buckets = [buckets[0], buckets[1][:1]]
    else:  # the same workers, dealt otherwise
        buckets = [sorted([buckets[0][0], buckets[1][0]]), sorted([buckets[0][1], buckets[1][1]])]
    raises(problem, rules.process_secagg_started, state, 60, {"round": 0, "buckets": buckets})
    assert state.rounds[0].secagg_bucket_of is None


OPENING_KEYS = [bls.keygen(bytes([40 + j]) * 32) for j in range(len(VALIDATORS))]


def openings_state() -> tuple[AuditState, list[list[Any]]]:
    """A dealt masked round whose two workers' masked inputs are chained, under a spec whose
    validators hold real BLS keys."""
    spec = dataclasses.replace(make_spec(masked=MASKED), validators=[
        {"ed25519": v, "bls": bls.public_key(k).hex(), "bls_pop": ""}
        for v, k in zip(VALIDATORS, OPENING_KEYS, strict=True)])
    state = state_with(beaconed_round(secagg_bucket_of={WORKERS[0]: 0, WORKERS[1]: 0}),
                       spec=spec)
    for w in WORKERS[:2]:
        rules.process_secagg_masked(state, 61, masked(w, 0), w, hashlib.sha256(
            w.encode()).hexdigest())
    inputs = committed_inputs((0, w, hashlib.sha256(w.encode()).hexdigest())
                              for w in WORKERS[:2])
    return state, inputs


def openings_body(inputs: list[list[Any]], *, signed_over: str | None = None) -> dict[str, Any]:
    digest = inputs_digest(inputs)
    root = openings_root(RUN, 0, signed_over or digest)
    shares = [bls.sign(k, root).hex() for k in OPENING_KEYS[:2]]
    return {"round": 0, "inputs": inputs, "masked": digest, "signers": [0, 1],
            "shares": shares, "seed": seed_of_shares([bytes.fromhex(x) for x in shares]).hex()}


def test_a_masked_rounds_checks_come_from_its_openings_seed_over_chained_inputs():
    state, inputs = openings_state()
    raises("a masked round's checks fixed before its openings seed",
           rules.process_challenges_fixed, state, 62,
           {"round": 0, "reveal_deadline": 1.0, "challenges": {}})
    body = openings_body(inputs)
    rules.process_openings_fixed(state, 62, body)
    rnd = state.rounds[0]
    assert rnd.openings_seed == body["seed"]
    assert rnd.openings_buckets == [sorted(WORKERS[:2])]
    rules.process_challenges_fixed(state, 63, {"round": 0, "reveal_deadline": 1.0,
                                               "challenges": {}})
    raises("an openings seed outside a dealt masked round, or twice",
           rules.process_openings_fixed, state, 64, body)
    raises("a masked input after the round's openings were drawn", rules.process_secagg_masked,
           state, 65, masked(WORKERS[2], 0), WORKERS[2], "44" * 32)


@pytest.mark.parametrize(("case", "problem"), [
    ("unchained", "openings over inputs that are not exactly the round's chained masked "
     "inputs"),
    ("left out", "openings over inputs that are not exactly the round's chained masked "
     "inputs"),
    ("other bucket", "openings over inputs that are not exactly the round's chained masked "
     "inputs"),
    ("digest", "openings over a digest that is not its inputs'"),
    ("signed over other", "openings seed: validator 0's openings share is not its signature "
     "over these committed masked inputs"),
    ("seed", "the openings seed does not follow from its signature"),
])
def test_invalid_openings_fixed(case, problem):
    state, inputs = openings_state()
    body = openings_body(inputs)
    if case == "unchained":
        body = openings_body(inputs + [[0, WORKERS[2], "00" * 32]])
    elif case == "left out":  # a chained input the draw leaves out could never be opened
        body = openings_body(inputs[:1])
    elif case == "other bucket":
        body = openings_body([[1, w, d] for _, w, d in inputs])
    elif case == "digest":
        body["masked"] = "11" * 32
    elif case == "signed over other":
        body = openings_body(inputs, signed_over="22" * 32)
    else:
        body["seed"] = "33" * 32
    raises(problem, rules.process_openings_fixed, state, 62, body)
    assert state.rounds[0].openings_seed is None


@pytest.mark.parametrize(("post", "signer", "problem"), [
    (keys(WORKERS[0], 0), WORKERS[1], "board post not signed by its sender, before the "
     "buckets, or from outside the bucket it names"),
    (keys(WORKERS[0], 1), WORKERS[0], "board post not signed by its sender, before the "
     "buckets, or from outside the bucket it names"),
    (keys(WORKERS[0], 0), WORKERS[0],
     "a second board post of one kind, or an opening without a masked input"),
    (opening(WORKERS[1], 0), WORKERS[1],
     "a second board post of one kind, or an opening without a masked input"),
])
def test_invalid_secagg_post(post, signer, problem):
    state = masked_state(secagg_bucket_of={WORKERS[0]: 0, WORKERS[1]: 0},
                         secagg_posts={("keys", WORKERS[0])})
    raises(problem, rules.process_secagg_post, state, 61, post, signer)
    assert state.rounds[0].secagg_posts == {("keys", WORKERS[0])}
    view, facts = certified_result()
    raises("board post after the round was finalized", rules.process_secagg_post,
           masked_state(secagg_bucket_of={WORKERS[1]: 0},
                        certified=RecordedResult(40, view, facts)),
           61, keys(WORKERS[1], 0), WORKERS[1])
    raises("board post not signed by its sender, before the buckets, or from outside the "
           "bucket it names", rules.process_secagg_post, masked_state(), 61,
           keys(WORKERS[1], 0), WORKERS[1])


# ----------------------------------------------------------------------------- the module


def test_the_rules_do_no_io_and_do_not_import_the_engine():
    tree = ast.parse((ROOT / "ledger" / "audit_rules.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    io = {"os", "io", "json", "socket", "multiprocessing", "concurrent.futures", "threading",
          "sqlite3", "sqlalchemy", "aiohttp", "asyncio", "pathlib", ".verify", ".export",
          ".audit", ".store"}
    assert imported, "the import scan found nothing"
    assert not imported & io, imported & io


def test_every_rule_is_named_in_the_spec_and_every_name_there_is_a_rule():
    """specs/protocol.md 9.3 says which function implements each row kind's rule."""
    spec = (ROOT / "specs" / "protocol.md").read_text()
    section = spec[spec.index("### 9.3"):spec.index("### 9.4")]
    named = set(re.findall(r"`((?:process|check|get)_[a-z_]+)`", section))
    defined = {name for name in dir(rules) if re.fullmatch(r"(process|check|get)_[a-z_]+", name)
               and callable(getattr(rules, name))}
    assert named <= defined, named - defined
    rule_names = {name for name in defined if not name.startswith("get_")}
    assert rule_names <= named, rule_names - named
    dispatched = set(rules.SIGNED_RULES.values()) | set(rules.RECORD_RULES.values())
    assert {f.__name__ for f in dispatched} <= defined


# ----------------------------------------------------------------------------- checks and reveals


def checks_spec() -> RunSpec:
    return dataclasses.replace(make_spec(), inner={"steps": 4, "trail_every": 1}, verification={
        "ban_rounds": 2, "vesting_rounds": 2, "spot_checks_per_round": 0,
        "challenges_per_worker": 1.0, "always_last": False, "binding_chunks": 16})


def drawn_checks() -> dict[str, list[int]]:
    from veritrain.protocol.challenges import ChallengePolicy, compute_challenges

    return compute_challenges(bytes.fromhex(SEED), sorted(WORKERS),
                              ChallengePolicy.of_run(checks_spec()))


def spot_reveal(worker: str = WORKERS[0], digest: str = SUBS[0]) -> Any:
    from veritrain.protocol.messages import SpotReveal

    return SpotReveal(run_id=RUN, round=0, worker=worker, submission_digest=digest,
                      reveal_hash="ee" * 32, reveal_bytes=10, created_at=1)


def reveal_receipt(*, sequence: int = 40, digest: str = "ed" * 32, at: float = 5.0,
                   worker: str = WORKERS[0]) -> Any:
    from veritrain.protocol.messages import RevealReceipt

    return RevealReceipt(run_id=RUN, round=0, worker=worker, reveal_digest=digest,
                         reveal_hash="ee" * 32, received_at=at, deadline=9.0, sequence=sequence)


def test_checks_fixed_then_a_reveal_and_its_receipt():
    rnd = beaconed_round()
    state = state_with(rnd, spec=checks_spec())
    rules.process_challenges_fixed(state, 30, {"round": 0, "challenges": drawn_checks(),
                                               "reveal_deadline": 9.0})
    assert rnd.challenges == drawn_checks() and rnd.reveal_deadline == 9.0
    rules.process_spot_reveal(state, 40, spot_reveal(), WORKERS[0], "ed" * 32)
    rules.process_reveal_receipt(state, 41, reveal_receipt(), "1e" * 32, "1e" * 32)
    assert rnd.reveals == {WORKERS[0]: (40, SUBS[0])} and rnd.last_reveal is None


@pytest.mark.parametrize(("round_fields", "problem"), [
    ({}, "checks fixed before the beacon, or twice"),
    ({"beacon_seed": SEED, "challenges": {}}, "checks fixed before the beacon, or twice"),
])
def test_invalid_checks_fixed_out_of_order(round_fields, problem):
    state = state_with(closed_round(**round_fields), spec=checks_spec())
    raises(problem, rules.process_challenges_fixed, state, 30,
           {"round": 0, "challenges": drawn_checks(), "reveal_deadline": 9.0})


@pytest.mark.parametrize(("reveal", "signer", "round_fields", "problem"), [
    (spot_reveal(), WORKERS[1], {}, "reveal not signed by its worker"),
    (spot_reveal(), WORKERS[0], {"challenges": None},
     "reveal before the round's checks were fixed or after its certificate"),
    (spot_reveal(digest="ff" * 32), WORKERS[0], {},
     "reveal names a submission outside the round's sealed list"),
    (spot_reveal(), WORKERS[0], {"reveals": {WORKERS[0]: (39, SUBS[0])}},
     "a second reveal of one worker in one round"),
])
def test_invalid_spot_reveal(reveal, signer, round_fields, problem):
    fields = {"challenges": drawn_checks(), "reveal_deadline": 9.0, **round_fields}
    state = state_with(beaconed_round(**fields), spec=checks_spec())
    raises(problem, rules.process_spot_reveal, state, 40, reveal, signer, "ed" * 32)


@pytest.mark.parametrize(("receipt", "signer", "problem"), [
    (reveal_receipt(), "2e" * 32, "reveal receipt not signed by this ledger"),
    (reveal_receipt(sequence=39), "1e" * 32,
     "reveal receipt does not name the reveal row before it"),
    (reveal_receipt(digest="ab" * 32), "1e" * 32,
     "reveal receipt does not name the reveal row before it"),
    (reveal_receipt(worker=WORKERS[1]), "1e" * 32,
     "reveal receipt does not name the reveal row before it"),
    (reveal_receipt(at=9.5), "1e" * 32, "reveal receipt after the round's reveal deadline"),
])
def test_invalid_reveal_receipt(receipt, signer, problem):
    rnd = beaconed_round(challenges=drawn_checks(), reveal_deadline=9.0,
                         last_reveal=(40, "ed" * 32, WORKERS[0]))
    raises(problem, rules.process_reveal_receipt, state_with(rnd, spec=checks_spec()), 41,
           receipt, signer, "1e" * 32)


def _finalize_with(rnd: RoundState) -> None:
    view, facts = certified_result()
    state = state_with(rnd, spec=checks_spec())
    rnd.results.append(RecordedResult(50, view, facts))
    rules.process_round_finalized(state, 60, finalized_body(view))


def test_certificate_confirms_the_checks_and_the_reveals():
    rnd = beaconed_round(challenges=drawn_checks(), challenges_row=30, reveal_deadline=9.0,
                         reveals={w: (40 + k, d) for k, (w, d) in enumerate(zip(WORKERS, SUBS,
                                                                                  strict=True))})
    _finalize_with(rnd)
    assert rnd.certified is not None


def test_invalid_checks_named_by_the_certificate():
    """A ledger that records other checks than the beacon's draw (to spare a worker) is
    named at its challenges_fixed row once the certificate names the submitters."""
    spared = {**drawn_checks(), WORKERS[2]: []}
    rnd = beaconed_round(challenges=spared, challenges_row=30, reveal_deadline=9.0)
    with pytest.raises(BadEarlier) as info:
        _finalize_with(rnd)
    assert (info.value.index, info.value.kind) == (30, "challenges_fixed")


@pytest.mark.parametrize("chained", [False, True])
def test_a_missing_reveal_verdict_for_a_reveal_the_chain_holds_names_the_ledger(chained):
    """A reveal row is chained only with the ledger's receipt by the deadline, so a worker
    certified ``missing_reveal`` whose reveal the chain holds had it withheld from the
    validators by the ledger (issue #28: a censored reveal is named by the audit)."""
    reveals = {w: (40 + k, d) for k, (w, d) in enumerate(zip(WORKERS, SUBS, strict=True))}
    if not chained:
        del reveals[SPOT_FAILED]
    rnd = beaconed_round(challenges=drawn_checks(), challenges_row=30, reveal_deadline=9.0,
                         reveals=reveals)
    view, facts = certified_result()
    view = dataclasses.replace(view, verdicts=[
        v | {"reason": "missing_reveal"} if v["worker"] == SPOT_FAILED else v
        for v in view.verdicts])
    facts = dataclasses.replace(facts, missing_reveal={SPOT_FAILED})
    state = state_with(rnd, spec=checks_spec())
    rnd.results.append(RecordedResult(50, view, facts))
    if chained:
        raises(f"certified missing_reveal for {SPOT_FAILED[:12]}, whose reveal the chain "
               "holds at row 43 with a receipt by the deadline: the ledger withheld it from "
               "the validators", rules.process_round_finalized, state, 60,
               finalized_body(view))
    else:
        rules.process_round_finalized(state, 60, finalized_body(view))
        assert rnd.certified is not None


def test_invalid_reveal_of_another_workers_submission_named_by_the_certificate():
    rnd = beaconed_round(challenges=drawn_checks(), challenges_row=30, reveal_deadline=9.0,
                         reveals={WORKERS[0]: (40, SUBS[1])})
    with pytest.raises(BadEarlier) as info:
        _finalize_with(rnd)
    assert (info.value.index, info.value.kind) == (40, "spot_reveal")


def test_invalid_round_finalized_twice():
    rnd = beaconed_round()
    view, facts = certified_result()
    rnd.results.append(RecordedResult(50, view, facts))
    state = state_with(rnd)
    rules.process_round_finalized(state, 60, finalized_body(view))
    raises("round finalized twice", rules.process_round_finalized, state, 61,
           finalized_body(view))


def excluded_result(worker: str, reason: str) -> tuple[ResultView, ResultFacts]:
    """``certified_result`` whose verdict for ``worker`` is the exclusion ``reason``."""
    view, facts = certified_result()
    verdicts = [v | {"reason": reason} if v["worker"] == worker else v for v in view.verdicts]
    cert = CertifiedState.from_body(view.certified)
    certified = dataclasses.replace(cert, verdicts_hash=digest_of(verdicts)).to_body()
    view = dataclasses.replace(view, verdicts=verdicts, certified=certified)
    return view, dataclasses.replace(facts, verdicts_digest=digest_of(verdicts),
                                     excluded={worker: reason})


@pytest.mark.parametrize(("reason", "prior", "problem"), [
    ("banned", None, f"certified verdict bans {WORKERS[0][:12]}, whom no earlier ban covers"),
    ("banned", {"banned_until": 0}, None),
    ("unknown_worker", {"registered": 10},
     f"certified verdict calls {WORKERS[0][:12]} unknown, but it registered before the round "
     "closed"),
    ("unknown_worker", {"registered": 35}, None),
    ("unknown_worker", None, None),
])
def test_banned_and_unknown_verdicts_are_taken_from_the_chain(reason, prior, problem):
    """A certified ``banned`` or ``unknown_worker`` verdict must follow from the chain's
    ban and registration rows, not from the ledger's word (``check_exclusions``)."""
    worker = WORKERS[0]
    rnd = beaconed_round()
    rnd.closed_row = 30
    state = state_with(rnd)
    if prior and "banned_until" in prior:
        state.banned_until[worker] = prior["banned_until"]
    if prior and "registered" in prior:
        state.registered[worker] = prior["registered"]
    view, facts = excluded_result(worker, reason)
    rules.process_round_result(state, 40, view, VALIDATORS[0], facts)
    rules.process_ban(state, 41, {"run_id": RUN, "round": 0, "worker": SPOT_FAILED,
                                  "reason": "spot_check_failed", "until_round": 2})
    if problem is None:
        assert rules.process_round_finalized(state, 42, finalized_body(view)) is rnd
        assert state.banned_until[SPOT_FAILED] == 2  # this round's ban covers later rounds
    else:
        raises(problem, rules.process_round_finalized, state, 42, finalized_body(view))
        assert rnd.certified is None


def test_registrations_are_recorded_in_chain_order():
    state = state_with()
    rules.process_registration(state, 3, WORKERS[1])
    rules.process_registration(state, 9, WORKERS[1])  # a second registration row: the first
    assert state.registered == {WORKERS[1]: 3}


def test_a_round_is_voided_only_when_no_quorum_can_come_and_then_opens_again():
    """3 validators, quorum 2, certify_seconds max(600, 10 x round_seconds) when absent."""
    spec = dataclasses.replace(make_spec(), schedule={"round_seconds": 1.0})
    a, facts = certified_result(validator=0)
    b = ResultView(*[*dataclasses.astuple(certified_result(validator=1)[0])[:7],
                     {**a.certified, "model_hash": "77" * 32}])
    results = [RecordedResult(40, a, facts), RecordedResult(41, b, facts)]

    def state() -> AuditState:
        s = state_with(beaconed_round(results=list(results), closed_at=100.0), spec=spec)
        s.next_base = GENESIS  # the base round 0 opened on: still the next one's
        return s

    listed = [{"validator": 0, "certified_digest": digest_of(a.certified)},
              {"validator": 1, "certified_digest": digest_of(b.certified)}]
    early = {"round": 0, "reason": "split", "voided_at": 101.0, "results": listed}
    # Validator 2 may still side with either: no split yet, and 600 s have not passed.
    raises("round voided while a quorum could still agree before its certify_seconds",
           rules.process_round_voided, state(), 50, early)
    raises("voided round's results are not its recorded ones", rules.process_round_voided,
           state(), 50, {**early, "voided_at": 700.0, "results": listed[:1]})
    s = state()
    rules.process_round_voided(s, 50, {**early, "voided_at": 700.0})  # the timeout
    assert s.current.voided and s.next_base == GENESIS
    raises("finalizes a voided round", rules.process_round_finalized, s, 51,
           finalized_body(a))
    raises("result for a voided round", rules.process_round_result, s, 52, a,
           VALIDATORS[0], facts)
    rules.process_round_opened(s, 53, {"round": 1, "base_model_hash": GENESIS})
    assert s.current.index == 1
    # A split is final at once: the third validator certified yet another state.
    c = ResultView(*[*dataclasses.astuple(certified_result(validator=2)[0])[:7],
                     {**a.certified, "model_hash": "78" * 32}])
    s = state_with(beaconed_round(results=[*results, RecordedResult(42, c, facts)],
                                  closed_at=100.0), spec=spec)
    rules.process_round_voided(s, 50, {**early, "results": [
        *listed, {"validator": 2, "certified_digest": digest_of(c.certified)}]})
    assert s.current.voided


def test_a_sharded_certificate_takes_each_shard_from_the_list_or_a_proven_recomputation():
    spec = make_spec(shards=3)
    listed = ["a1" * 32, "a2" * 32, None]
    rnd = beaconed_round(shard_list=listed, shard_faults={1})

    def state_of(*results: str | None) -> CertifiedState:
        view, _ = certified_result()
        return dataclasses.replace(CertifiedState.from_body(view.certified), shards=[
            {"shard": k, "result": x, "aggregate": f"{k:02x}" * 32}
            for k, x in enumerate(results)])

    rules.check_shard_sources(spec, rnd, state_of(listed[0], None, None))
    raises("shard 0 certified from a result the fixed list does not name, or one a quorum "
           "proved faulty", rules.check_shard_sources, spec, rnd, state_of("a9" * 32, None, None))
    raises("shard 1 certified from a result the fixed list does not name, or one a quorum "
           "proved faulty", rules.check_shard_sources, spec, rnd,
           state_of(listed[0], listed[1], None))
    raises("shard 0 recomputed although listed and never proven faulty",
           rules.check_shard_sources, spec, rnd, state_of(None, None, None))
    raises("the certified state does not name each shard's source", rules.check_shard_sources,
           spec, rnd, dataclasses.replace(state_of(listed[0], None, None), shards=None))
    raises("certified shard sources in a run that does not shard", rules.check_shard_sources,
           make_spec(), rnd, state_of(listed[0], None, None))
