"""A fixed beacon as a worker or validator checks it before using its seed."""

from __future__ import annotations

import pytest
from fakes import validator_identities
from hypothesis import given
from hypothesis import strategies as st
from veritrain.protocol.beacon import (
    EVERY_WORKER_ADMITTED,
    bans_round,
    beacon_root,
    compute_beacon_seed,
    sealed_list_digest,
    verify_fixed_beacon,
)
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import BeaconShare, sign

RUN, ROUND = "beacon-check", 3
VALIDATORS = validator_identities(3)
KEYS = [{"ed25519": v.public.ed25519, "bls": v.public.bls} for v in VALIDATORS]
SEALED = sealed_list_digest(["a" * 64, "b" * 64])


def fixed(signers: list[int], *, round_index: int = ROUND, sealed: str = SEALED
          ) -> tuple[dict, list]:
    shares = [VALIDATORS[k].sign_bls(beacon_root(RUN, round_index)).hex() for k in signers]
    envelopes = [sign(VALIDATORS[k], BeaconShare(
        run_id=RUN, round=round_index, validator=VALIDATORS[k].public_key.hex(), share=x,
        sealed=sealed, participants=EVERY_WORKER_ADMITTED)).to_wire()
        for k, x in zip(signers, shares, strict=True)]
    return {"signers": signers, "shares": shares}, envelopes


def check(beacon: object, envelopes: object) -> bytes:
    return verify_fixed_beacon(KEYS, 2, RUN, ROUND, beacon, sealed=SEALED,  # type: ignore[arg-type]
                               participants=EVERY_WORKER_ADMITTED,
                               envelopes=envelopes)  # type: ignore[arg-type]


def test_a_valid_quorum_gives_the_seed_of_its_shares():
    beacon, envelopes = fixed([0, 2])
    seed = check(beacon, envelopes)
    assert seed == compute_beacon_seed([bytes.fromhex(x) for x in beacon["shares"]])


def test_the_sealed_list_is_order_free_and_changes_with_any_entry():
    assert sealed_list_digest(["b" * 64, "a" * 64]) == SEALED
    assert sealed_list_digest(["a" * 64]) != SEALED
    assert sealed_list_digest(["a" * 64, "c" * 64]) != SEALED


@pytest.mark.parametrize("tamper", ["flipped_share", "other_round", "swapped_signers",
                                    "too_few", "unsorted", "repeated", "out_of_range",
                                    "not_hex", "count_mismatch", "too_many", "bool_index",
                                    "mixed_types", "not_a_dict", "no_envelopes",
                                    "envelope_of_another_validator", "envelope_other_share"])
def test_a_beacon_the_ledger_made_up_is_refused(tamper: str):
    beacon, envelopes = fixed([0, 1])
    if tamper == "flipped_share":
        raw = bytearray(bytes.fromhex(beacon["shares"][1]))
        raw[-1] ^= 1
        beacon["shares"][1] = raw.hex()
    elif tamper == "other_round":  # genuine shares, of another round's root
        beacon, envelopes = fixed([0, 1], round_index=ROUND + 1)
    elif tamper == "swapped_signers":
        beacon["shares"].reverse()
    elif tamper == "too_few":
        beacon, envelopes = fixed([1])
    elif tamper == "unsorted":
        beacon, envelopes = fixed([1, 0])
    elif tamper == "repeated":
        beacon, envelopes = fixed([1, 1])
    elif tamper == "out_of_range":
        beacon["signers"][1] = 3
    elif tamper == "too_many":  # the ledger fixes exactly the first quorum to arrive
        beacon, envelopes = fixed([0, 1, 2])
    elif tamper == "bool_index":
        beacon["signers"] = [False, True]
    elif tamper == "mixed_types":
        beacon["signers"] = [0, "1"]
    elif tamper == "not_a_dict":
        beacon = [beacon["signers"], beacon["shares"]]
    elif tamper == "not_hex":
        beacon["shares"][0] = "zz"
    elif tamper == "no_envelopes":
        envelopes = []
    elif tamper == "envelope_of_another_validator":
        envelopes[1] = fixed([2])[1][0]
    elif tamper == "envelope_other_share":
        envelopes[0] = fixed([0], round_index=ROUND + 1)[1][0]
    else:
        beacon["shares"].append(beacon["shares"][0])
    with pytest.raises(RejectedInput) as err:
        check(beacon, envelopes)
    assert err.value.reason == "bad_signature"


def test_validators_who_saw_another_sealed_list_expose_a_list_changed_after_the_seed():
    """The ledger served its signers one list and this party another (say, without a
    colluder's submission, to steer the deal once the seed was known)."""
    beacon, envelopes = fixed([0, 1], sealed=sealed_list_digest(["a" * 64, "b" * 64, "c" * 64]))
    with pytest.raises(RejectedInput) as err:
        check(beacon, envelopes)
    assert err.value.reason == "wrong_sealed_list"


@given(issued=st.integers(0, 50), ban_rounds=st.integers(1, 10), r=st.integers(0, 80))
def test_a_ban_counts_in_a_rounds_participant_view_only_if_issued_before_it(issued, ban_rounds,
                                                                          r):
    """A ban issued when round ``issued`` is finalized covers rounds issued+1 ..
    issued+ban_rounds; round ``issued`` itself keeps the view it was judged with."""
    until = issued + ban_rounds
    assert bans_round(until, ban_rounds, r) == (issued < r <= until)
