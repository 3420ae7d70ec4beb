"""Admission policies (protocol/membership.py): message codecs, the fold that says who
is admitted in a round, what validators count, and the economics of cheating."""

from __future__ import annotations

import pytest
from fakes import make_fake_run
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol.board import BoardFault
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.membership import (
    AdmissionPolicy,
    AdmissionRevocation,
    AdmissionTicket,
    BondDeposit,
    BondWithdrawal,
    Membership,
    cheat_economics,
    fold_rows,
    open_membership,
    slash_record,
)
from veritrain.protocol.messages import RunSpec, decode_signed, sign
from veritrain.protocol.presets import run_preset
from veritrain.validators.membership import admitted_of

ORG = Identity.generate("organiser")
W1, W2 = Identity.generate("worker"), Identity.generate("worker")
KEYS = st.sampled_from([W1.public_key.hex(), W2.public_key.hex(), "ab" * 32])
ROUNDS = st.integers(0, 1 << 40)
RUN_IDS = st.from_regex(r"[a-z0-9][a-z0-9-]{2,20}", fullmatch=True)


def _run(policy: dict | None):
    if policy is None:
        return make_fake_run("member-run")
    return make_fake_run("member-run", admission=policy)


@settings(max_examples=60, deadline=None)
@given(run_id=RUN_IDS, r=ROUNDS, worker=KEYS, n=st.integers(1, 1 << 62),
       kind=st.sampled_from(["ticket", "revocation", "deposit", "withdrawal"]),
       ref=st.text(max_size=40))
def test_membership_messages_round_trip_and_bind_their_signature(run_id, r, worker, n, kind,
                                                                ref):
    me = ORG.public_key.hex()
    last = (1 << 40) - 1  # a ticket expires after the round it starts in, both in range
    msg = {"ticket": lambda: AdmissionTicket(run_id, min(r, last), me, worker,
                                             min(r, last) + 1, 5),
           "revocation": lambda: AdmissionRevocation(run_id, r, me, worker, 5),
           "deposit": lambda: BondDeposit(run_id, r, me, worker, n, ref, 5),
           "withdrawal": lambda: BondWithdrawal(run_id, r, me, n, 5)}[kind]()
    signed = sign(ORG, msg)
    back = decode_signed(signed.encode(), type(msg))
    assert back == signed and back.digest == signed.digest
    # Any other field value breaks the signature (the body is what is signed).
    wire = signed.to_wire()
    wire["body"]["round"] = r + 1 if r < 1 << 40 else r - 1
    with pytest.raises(RejectedInput):
        decode_signed(__import__("json").dumps(wire, sort_keys=True, separators=(",", ":"))
                      .encode(), type(msg))


def test_a_spec_without_admission_keeps_its_signed_body_and_is_open():
    run = _run(None)
    assert "admission" not in run.spec.to_body()
    assert RunSpec.from_body(run.spec.to_body()) == run.spec
    assert AdmissionPolicy.of_run(run.spec).open
    bond = _run({"policy": "bond", "min_bond": 10})
    assert bond.spec.to_body()["admission"] == {"policy": "bond", "min_bond": 10}
    policy = AdmissionPolicy.of_run(bond.spec)
    assert policy.treasury == bond.spec.organiser and policy.min_bond == 10
    with pytest.raises(RejectedInput):
        RunSpec.from_body({**bond.spec.to_body(), "admission": {"policy": "stake"}})


def test_allowlist_tickets_expire_are_revoked_and_voided_by_a_slash():
    run = _run({"policy": "allowlist"})
    org, w = run.organiser, W1.public_key.hex()
    state = Membership.of_run(run.spec)
    assert state.admission_problem(w, 0) == "no admission ticket for this key"
    state.add(open_membership(sign(org, AdmissionTicket(
        "member-run", 0, org.public_key.hex(), w, 3, 1)).to_wire(), state.policy).message)
    assert [state.admission_problem(w, r) is None for r in range(4)] == [True] * 3 + [False]
    assert "expired" in state.admission_problem(w, 3)
    state.add(AdmissionRevocation("member-run", 2, org.public_key.hex(), w, 1))
    assert state.admission_problem(w, 1) is None  # a revocation is not retroactive ...
    assert "revoked" in state.admission_problem(w, 2)  # ... but ends it from its round
    state.add(AdmissionTicket("member-run", 4, org.public_key.hex(), w, 9, 1))
    assert state.admission_problem(w, 5) is None  # a new ticket admits it again
    state.add_slash(slash_record("member-run", 5, w, "spot_check_failed", "0" * 64, 0, 0))
    assert state.admission_problem(w, 6) is not None  # a caught key needs a new ticket


def test_only_the_organiser_issuers_and_treasury_sign_membership():
    stranger = Identity.generate("organiser")
    run = _run({"policy": "allowlist", "issuers": [stranger.public_key.hex()]})
    policy = AdmissionPolicy.of_run(run.spec)
    ticket = AdmissionTicket("member-run", 0, stranger.public_key.hex(), W1.public_key.hex(),
                             5, 1)
    open_membership(sign(stranger, ticket).to_wire(), policy)  # a delegated issuer
    forged = AdmissionTicket("member-run", 0, W1.public_key.hex(), W1.public_key.hex(), 5, 1)
    with pytest.raises(BoardFault):
        open_membership(sign(W1, forged).to_wire(), policy)
    with pytest.raises(BoardFault):  # a deposit in an allowlist run
        open_membership(sign(run.organiser, BondDeposit(
            "member-run", 0, run.organiser.public_key.hex(), W1.public_key.hex(), 5, "",
            1)).to_wire(), policy)
    bond = _run({"policy": "bond", "min_bond": 10})
    with pytest.raises(BoardFault):  # a deposit not signed by the treasury
        open_membership(sign(W1, BondDeposit("member-run", 0, W1.public_key.hex(),
                                             W1.public_key.hex(), 50, "", 1)).to_wire(),
                        AdmissionPolicy.of_run(bond.spec))


def test_bond_balance_slash_and_withdrawal():
    run = _run({"policy": "bond", "min_bond": 10, "slash_share": 0.5})
    org, w = run.organiser.public_key.hex(), W1.public_key.hex()
    state = Membership.of_run(run.spec)
    state.add(BondDeposit("member-run", 1, org, w, 16, "wire 1", 1))
    assert state.balance(w, 0) == 0 and state.balance(w, 1) == 16
    assert state.admission_problem(w, 0) is not None and state.admission_problem(w, 1) is None
    assert state.slash_amount(w, 3) == (8, 16)
    state.add_slash(slash_record("member-run", 3, w, "spot_check_failed", "0" * 64, 8, 16))
    assert state.balance(w, 3) == 16 and state.balance(w, 4) == 8  # from the next round
    assert "bond of 8" in state.admission_problem(w, 4)
    state.add(BondWithdrawal("member-run", 6, w, 100, 1))  # takes at most what is left
    assert state.balance(w, 6) == 0


def test_a_validator_counts_only_the_workers_the_chain_admits():
    """The ledger's participant list names an extra key: without a deposit signed by the
    treasury it is not counted, and a deposit signed by anyone else is skipped."""
    run = _run({"policy": "bond", "min_bond": 10})
    org = run.organiser
    honest, extra = W1.public_key.hex(), W2.public_key.hex()
    rows = [{"kind": "bond_deposit", "body": sign(org, BondDeposit(
        "member-run", 0, org.public_key.hex(), honest, 10, "", 1)).to_wire()},
        {"kind": "bond_deposit", "body": sign(W2, BondDeposit(
            "member-run", 0, extra, extra, 10, "", 1)).to_wire()}]
    faults: list[str] = []
    assert admitted_of(run.spec, 0, {honest, extra}, {"rows": rows}, faults) == {honest}
    assert len(faults) == 1
    # A ledger that invents a slash cannot add anyone; under `open` everyone counts.
    assert admitted_of(_run(None).spec, 0, {honest, extra}, {"rows": []}) == {honest, extra}
    assert fold_rows(run.spec, [{"kind": "slash", "body": {"kind": "slash"}}]).moves == {}


@pytest.mark.parametrize("preset", ["tiny", "demo", "bench"])
def test_cheating_never_pays_under_the_presets(preset):
    """Every cheat's expected profit per round, from the preset's own challenge policy,
    vesting and reward, at the worst compute cost an honest worker accepts (its whole
    reward): at most zero with no bond, below zero with the bond policy."""
    settings_ = run_preset(preset)
    base = make_fake_run(f"econ-{preset}", inner=settings_["inner"],
                         verification=settings_["verification"], rewards=settings_["rewards"])
    per_worker = settings_["rewards"]["per_round"] / 16
    bonded = make_fake_run(f"econ-{preset}", inner=settings_["inner"],
                           verification=settings_["verification"],
                           rewards=settings_["rewards"],
                           admission={"policy": "bond", "min_bond": int(10 * per_worker)})
    open_ = cheat_economics(base.spec, workers=16)
    bond = cheat_economics(bonded.spec, workers=16)
    assert open_["worst_cheat_expected_profit"] <= 1e-9
    assert bond["worst_cheat_expected_profit"] < 0
    assert all(c["profit"] < 0 for c in bond["cheats"])
    assert bond["sybil_bond_for_f"][0.5] == 16 * int(10 * per_worker)
