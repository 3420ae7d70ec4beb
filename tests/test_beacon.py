"""A fixed beacon as a worker or validator checks it before using its seed."""

from __future__ import annotations

import pytest
from fakes import validator_identities
from veritrain.protocol.beacon import beacon_root, compute_beacon_seed, verify_fixed_beacon
from veritrain.protocol.errors import RejectedInput

RUN, ROUND = "beacon-check", 3
VALIDATORS = validator_identities(3)
KEYS = [{"ed25519": v.public.ed25519, "bls": v.public.bls} for v in VALIDATORS]


def fixed(signers: list[int], *, round_index: int = ROUND) -> dict:
    return {"signers": signers, "shares": [
        VALIDATORS[k].sign_bls(beacon_root(RUN, round_index)).hex() for k in signers]}


def test_a_valid_quorum_gives_the_seed_of_its_shares():
    beacon = fixed([0, 2])
    seed = verify_fixed_beacon(KEYS, 2, RUN, ROUND, beacon)
    assert seed == compute_beacon_seed([bytes.fromhex(x) for x in beacon["shares"]])


@pytest.mark.parametrize("tamper", ["flipped_share", "other_round", "swapped_signers",
                                    "too_few", "unsorted", "repeated", "out_of_range",
                                    "not_hex", "count_mismatch", "too_many", "bool_index",
                                    "mixed_types", "not_a_dict"])
def test_a_beacon_the_ledger_made_up_is_refused(tamper: str):
    beacon = fixed([0, 1])
    if tamper == "flipped_share":
        raw = bytearray(bytes.fromhex(beacon["shares"][1]))
        raw[-1] ^= 1
        beacon["shares"][1] = raw.hex()
    elif tamper == "other_round":  # genuine shares, of another round's root
        beacon = fixed([0, 1], round_index=ROUND + 1)
    elif tamper == "swapped_signers":
        beacon["shares"].reverse()
    elif tamper == "too_few":
        beacon = fixed([1])
    elif tamper == "unsorted":
        beacon = fixed([1, 0])
    elif tamper == "repeated":
        beacon = fixed([1, 1])
    elif tamper == "out_of_range":
        beacon["signers"][1] = 3
    elif tamper == "too_many":  # the ledger fixes exactly the first quorum to arrive
        beacon = fixed([0, 1, 2])
    elif tamper == "bool_index":
        beacon["signers"] = [False, True]
    elif tamper == "mixed_types":
        beacon["signers"] = [0, "1"]
    elif tamper == "not_a_dict":
        beacon = [beacon["signers"], beacon["shares"]]
    elif tamper == "not_hex":
        beacon["shares"][0] = "zz"
    else:
        beacon["shares"].append(beacon["shares"][0])
    with pytest.raises(RejectedInput) as err:
        verify_fixed_beacon(KEYS, 2, RUN, ROUND, beacon)
    assert err.value.reason == "bad_signature"
