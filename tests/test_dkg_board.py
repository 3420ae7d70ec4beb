"""The DKG and the threshold beacon over a ledger that lies (validators/dkg.py,
ledger/dkg.py): the board's choice of quorum cannot change the seed, forged or wrong
partials are refused without blocking the round, and a seed not from the group
signature is named."""

from __future__ import annotations

import json
import stat
import types
from typing import Any

import pytest
from fakes import validator_identities
from veritrain.ledger.dkg import DkgBoard
from veritrain.protocol import bls, dkg
from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED as VIEW
from veritrain.protocol.board import BoardFault, SignedOnce
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import sign
from veritrain.validators.dkg import (
    DkgNode,
    ShareFileError,
    beacon_seed_from_partials,
    dkg_secrets_path,
    load_share,
    save_share,
    share_path,
)

V, QUORUM, RUN, R = 4, 3, "dkg-board-run", 5
VALIDATORS = validator_identities(V)
LEDGER = Identity.generate("validator")  # the ledger's own key, registered nowhere
SEALED, OTHER = "5e" * 32, "0f" * 32


def _spec() -> Any:
    keys = [{"ed25519": v.public_key.hex(), "bls": v.public.bls} for v in VALIDATORS]
    return types.SimpleNamespace(
        run_id=RUN, quorum=QUORUM, validators=keys,
        validator_index=lambda key: next((k for k, v in enumerate(keys)
                                          if v["ed25519"] == key), None))


SPEC = _spec()


def run_dkg(*, bad_dealer: int | None = None, victim: int = 0,
            forge_deal: bool = False) -> tuple[list[DkgNode], DkgBoard]:
    """All phases over one board; ``bad_dealer`` seals garbage to ``victim`` and then
    does not answer the complaint; ``forge_deal`` has the ledger add a deal under
    dealer 0's name signed with its own key (served, not stored: the board lies)."""
    board = DkgBoard(SPEC)
    nodes = [DkgNode(v, SPEC) for v in VALIDATORS]
    for node in nodes:
        board.post(node.keys_post())
    for node in nodes:
        wire = node.deal_post(board.served("dkg_keys"))
        if node.index == bad_dealer:
            body = dict(wire["body"])
            shares = list(body["shares"])
            shares[victim] = "00" * dkg.SEALED_SHARE_BYTES
            body["shares"] = shares
            wire = sign(node.identity, dkg.DkgDeal(**body)).to_wire()
        board.post(wire)
    served = board.served("dkg_deal")
    if forge_deal:
        honest0 = next(w for w in served if w["signer"] == nodes[0].me)
        served = served + [sign(LEDGER, dkg.DkgDeal(**honest0["body"])).to_wire()]
    for node in nodes:
        board.post(node.complaint_post(served))
    for node in nodes:
        wire = node.justification_post(board.served("dkg_complaint"))
        if wire is not None and node.index != bad_dealer:
            board.post(wire)
    for node in nodes:
        board.post(node.result_post(board.served("dkg_justification")))
    for node in nodes:
        node.adopt(board.served("dkg_result"))
    board.fix_group()
    return nodes, board


@pytest.fixture(scope="module")
def honest() -> tuple[list[DkgNode], DkgBoard]:
    return run_dkg()


@pytest.fixture(scope="module")
def partials(honest) -> list[dict[str, Any]]:
    nodes, _ = honest
    return [node.partial_post(R, SEALED, VIEW) for node in nodes]


def test_the_dkg_over_the_board_agrees_on_one_group_key(honest):
    nodes, board = honest
    assert all(n.result == board.result for n in nodes) and board.result is not None
    assert board.result.qualified == [0, 1, 2, 3]
    assert all(n.share is not None and not n.faults for n in nodes)


def test_a_ledger_choosing_among_quorums_cannot_change_the_seed(honest, partials):
    nodes, board = honest
    seeds = {beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW,
                                       [partials[j] for j in chosen])
             for chosen in ((0, 1, 2), (1, 2, 3), (0, 2, 3), (3, 1, 0))}
    assert len(seeds) == 1
    fixed = None
    for wire in partials[::-1]:  # the ledger fixes whichever quorum arrives first
        fixed = board.post_partial(wire, sealed=SEALED, participants=VIEW) or fixed
    assert fixed is not None and fixed["signers"] == [1, 2, 3]
    # a worker checks the fixed beacon against the group key alone, not who signed it
    assert dkg.verify_threshold_beacon(board.result.group_key, RUN, R, fixed,
                                       sealed=SEALED, participants=VIEW) in seeds


def test_a_forged_partial_is_refused_and_does_not_block_the_round(honest, partials):
    nodes, board = honest
    wrong = dkg.BeaconPartial(run_id=RUN, round=R, validator=nodes[0].me, sealed=SEALED,
                              participants=VIEW, partial=dkg.partial_sign(
                                  12345, dkg.threshold_beacon_root(RUN, R, SEALED, VIEW)).hex())
    by_ledger = sign(LEDGER, wrong).to_wire()  # under validator 0's name, the ledger's key
    by_validator = sign(VALIDATORS[0], wrong).to_wire()  # validator 0's own, wrong share
    other_list = nodes[0].partial_post(R + 1, OTHER, VIEW)  # a genuine partial of another list
    faults: list[str] = []
    seed = beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW,
                                     [by_ledger, by_validator, other_list] + partials[1:],
                                     faults)
    assert seed == beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW, partials[:3])
    assert any("signed by" in x for x in faults)
    assert any("does not verify against its public key share" in x for x in faults)
    assert any("round 6" in x for x in faults)
    fresh = DkgBoard(SPEC)
    fresh.result = board.result
    with pytest.raises(dkg.DkgFault, match="public key share") as info:
        fresh.post_partial(by_validator, sealed=SEALED, participants=VIEW)
    assert info.value.reason == "dkg_fault"
    with pytest.raises(BoardFault, match="signed by"):
        fresh.post_partial(by_ledger, sealed=SEALED, participants=VIEW)
    with pytest.raises(BoardFault, match="sealed"):
        fresh.post_partial(partials[1], sealed=OTHER, participants=VIEW)
    assert [fresh.post_partial(w, sealed=SEALED, participants=VIEW)
            for w in partials[1:]][-1] is not None


def test_good_partials_cost_one_pairing_check_and_a_bad_one_is_still_named(honest, partials,
                                                                          monkeypatch):
    """A validator combines the first quorum of partials and checks the group signature
    once; only when that fails does it check partials one by one (and name the bad one).
    The seed is the same either way."""
    _, board = honest
    checked = []
    real = dkg.partial_verifies
    monkeypatch.setattr(dkg, "partial_verifies",
                        lambda *a: checked.append(1) or real(*a))
    seed = beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW, partials)
    assert checked == []
    wrong = dkg.BeaconPartial(run_id=RUN, round=R, validator=VALIDATORS[1].public_key.hex(),
                              sealed=SEALED, participants=VIEW, partial=dkg.partial_sign(
                                  7, dkg.threshold_beacon_root(RUN, R, SEALED, VIEW)).hex())
    faults: list[str] = []
    again = beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW,
                                      [partials[0], sign(VALIDATORS[1], wrong).to_wire(),
                                       *partials[2:]], faults)
    assert again == seed and checked  # fell back to the per-partial checks
    assert faults == ["validator 1's partial signature does not verify against its public "
                      "key share"]


def test_a_seed_not_from_the_group_signature_is_named(honest, partials):
    _, board = honest
    key = board.result.group_key
    one_share = {"signature": partials[0]["body"]["partial"]}  # a single partial
    other_list = {"signature": dkg.combine(
        {j: bytes.fromhex(partial_of(honest, j, OTHER)) for j in (0, 1, 2)},
        QUORUM).hex()}
    for fixed in (one_share, other_list, {"signers": [0, 1, 2], "shares": []}, {}):
        with pytest.raises(RejectedInput) as info:
            dkg.verify_threshold_beacon(key, RUN, R, fixed, sealed=SEALED, participants=VIEW)
        assert info.value.reason == "invalid_beacon"


def partial_of(honest, j: int, sealed: str) -> str:
    nodes, _ = honest
    return dkg.partial_sign(nodes[j].share, dkg.threshold_beacon_root(RUN, R, sealed, VIEW)).hex()


def test_a_partial_is_signed_once_per_round(honest):
    nodes, _ = honest
    node = nodes[2]
    node.partial_post(R + 7, SEALED, VIEW)
    with pytest.raises(BoardFault, match="already signed"):
        node.partial_post(R + 7, OTHER, VIEW)


def test_a_dealer_with_a_bad_share_is_disqualified_and_the_dkg_completes():
    nodes, board = run_dkg(bad_dealer=3, victim=1)
    assert board.result.qualified == [0, 1, 2]
    assert "did not answer" in nodes[0].qualification.disqualified[3]
    assert all(n.share is not None for n in nodes)
    parts = [n.partial_post(R, SEALED, VIEW) for n in nodes]
    a = beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW, parts[:3])
    b = beacon_seed_from_partials(board.result, SPEC, R, SEALED, VIEW, parts[1:])
    assert a == b


def test_a_deal_forged_by_the_ledger_is_skipped():
    nodes, board = run_dkg(forge_deal=True)
    assert board.result.qualified == [0, 1, 2, 3]
    assert all(any("signed by" in x for x in n.faults) for n in nodes)


def test_a_kept_share_is_read_back_only_if_it_is_this_validators(honest, tmp_path) -> None:
    nodes, _ = honest
    result = nodes[0].result
    path = share_path(tmp_path / "state", RUN)
    assert load_share(path, SPEC, result, 1) is None  # nothing kept: nothing to restore
    save_share(path, SPEC, 1, nodes[1].share)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_share(path, SPEC, result, 1) == nodes[1].share
    with pytest.raises(ShareFileError, match="does not hold this validator's share"):
        load_share(path, SPEC, result, 2)  # another validator's public share
    other = types.SimpleNamespace(**{**vars(SPEC), "run_id": "another-run"})
    with pytest.raises(ShareFileError, match="does not hold"):
        load_share(path, other, result, 1)
    path.chmod(0o644)
    with pytest.raises(ShareFileError, match="accessible by others"):
        load_share(path, SPEC, result, 1)
    path.chmod(0o600)
    path.write_text('{"share": "zz"}')
    with pytest.raises(ShareFileError, match="malformed"):
        load_share(path, SPEC, result, 1)


def test_a_failed_dkg_says_what_the_board_showed():
    from veritrain.validators.node import dkg_board_summary

    result = {"qualified": [0, 1], "group_key": "aa", "validator": "v0"}
    view = {"phases": [{"kind": "dkg_keys", "opened_at": 0.0, "closed_at": 1.0},
                       {"kind": "dkg_result", "opened_at": 1.0, "closed_at": None}],
            "posts": {"dkg_keys": [{}, {}, {}],
                      "dkg_result": [{"body": result},
                                     {"body": {**result, "validator": "v1"}},
                                     {"body": {**result, "qualified": [0, 1, 2]}}]}}
    assert dkg_board_summary(view) == "keys 3 posts, result 3 posts (open); 2 different results"


def test_a_validator_restarted_mid_dkg_resumes_from_its_kept_secrets(tmp_path):
    """Validator 0 restarts after dealing: from its kept secrets (mode 0600) it posts the
    same keys and deal again (its signed-once record allows no other), opens its shares
    and ends the DKG holding its share. Without them it could not deal a second time."""
    board = DkgBoard(SPEC)
    onces = [SignedOnce() for _ in VALIDATORS]
    paths = [dkg_secrets_path(tmp_path / f"v{i}", RUN) for i in range(V)]
    nodes = [DkgNode(v, SPEC, signed_once=o, secrets_path=p)
             for v, o, p in zip(VALIDATORS, onces, paths, strict=True)]
    keys = [n.keys_post() for n in nodes]
    for wire in keys:
        board.post(wire)
    deals = [n.deal_post(board.served("dkg_keys")) for n in nodes]
    for wire in deals:
        board.post(wire)
    assert stat.S_IMODE(paths[0].stat().st_mode) == 0o600
    with pytest.raises(BoardFault, match="already signed another dkg_deal"):
        DkgNode(VALIDATORS[0], SPEC, signed_once=onces[0]).deal_post(board.served("dkg_keys"))
    nodes[0] = DkgNode(VALIDATORS[0], SPEC, signed_once=onces[0], secrets_path=paths[0])
    assert nodes[0].keys_post() == keys[0]
    assert nodes[0].deal_post(board.served("dkg_keys")) == deals[0]
    for node in nodes:
        board.post(node.complaint_post(board.served("dkg_deal")))
    assert all(not w["body"]["accused"] for w in board.served("dkg_complaint"))
    for node in nodes:
        board.post(node.result_post(board.served("dkg_justification")))
    group = board.fix_group()
    for node in nodes:
        node.adopt(board.served("dkg_result"))
        node.forget_secrets()
    assert list(group.qualified) == list(range(V))
    assert nodes[0].share is not None
    assert bls.public_key(nodes[0].share).hex() == group.public_shares[0]
    assert not any(p.exists() for p in paths)


def test_dkg_secrets_of_another_run_or_with_a_foreign_deal_are_refused(tmp_path):
    path = dkg_secrets_path(tmp_path, RUN)
    node = DkgNode(VALIDATORS[1], SPEC, secrets_path=path)
    node.deal_post([node.keys_post()])
    body = json.loads(path.read_text())
    for change, problem in (({"run_id": "another-run"}, "another run's or validator's"),
                            ({"index": 2}, "another run's or validator's"),
                            ({"coeffs": [f"{7:064x}"] * QUORUM}, "not its polynomial's"),
                            ({"enc_secret": "zz"}, "malformed")):
        path.write_text(json.dumps({**body, **change}))
        with pytest.raises(ShareFileError, match=problem):
            DkgNode(VALIDATORS[1], SPEC, secrets_path=path)
    path.chmod(0o644)
    with pytest.raises(ShareFileError, match="accessible by others"):
        DkgNode(VALIDATORS[1], SPEC, secrets_path=path)
