"""A sharded round against a ledger board that lies (issue #29).

The validator node's sharded path (``validators.sharded.ShardedRound``) runs against a
fake client that serves crafted board views: forged, other-run, other-round and
misplaced publications, a check list and seed nobody signed, a second list after a 409.
Nothing inside veritrain is stubbed. The dense check is tested on sparse and dense
deviations and understated distances.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch
from fakes import validator_identities
from veritrain.aggregation.secure import ShardResult, assemble_shards
from veritrain.aggregation.secure.sharding import fixed_point_coefficients
from veritrain.ledger.client import LedgerRefused
from veritrain.protocol.beacon import compute_beacon_seed, shard_check_root, shard_checkers
from veritrain.protocol.board import BoardFault, SignedOnce
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    sign,
)
from veritrain.protocol.tensors import sha256_hex
from veritrain.validators import sharded
from veritrain.validators.round import FilteredRound
from veritrain.validators.sharded import (
    ShardedRound,
    compute_own_shard,
    dense_check,
    encode_shard_result,
    list_digest,
    list_to_sign,
    verified_check,
    verified_publications,
)

V, QUORUM, RUN, R, TAU = 3, 2, "board-run", 4, 60.0
VALIDATORS = validator_identities(V)
LEDGER = Identity.generate("validator")  # the ledger's own key, registered nowhere
INPUTS = "cd" * 32


def _spec(run_id: str = RUN, checkers: int = V - 1) -> Any:
    keys = [{"ed25519": v.public_key.hex(), "bls": v.public.bls} for v in VALIDATORS]
    return types.SimpleNamespace(
        run_id=run_id, shards=V, quorum=QUORUM, num_params=3000, validators=keys,
        shard_checkers=checkers,
        validator_index=lambda key: next((k for k, v in enumerate(keys)
                                          if v["ed25519"] == key), None))


SPEC = _spec()


def _filtered(rows: torch.Tensor) -> FilteredRound:
    return FilteredRound(R, {}, {}, {}, {}, [f"w{i}" for i in range(rows.shape[0])], rows,
                         {"tau": TAU, "iterations": 10})


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(29)
    x = torch.randn(6, 3000, generator=g) * 0.5
    x[5] *= 8.0
    return x


@pytest.fixture(autouse=True)
def _fixed_inputs(monkeypatch):
    monkeypatch.setattr(sharded, "inputs_digest", lambda filtered: INPUTS)


def _publication(result: ShardResult, signer: Identity, *, validator: Identity | None = None,
                 run_id: str = RUN, r: int = R, shard: int | None = None) -> tuple[dict, bytes]:
    blob = encode_shard_result(result)
    pub = ShardPublication(run_id=run_id, round=r,
                           validator=(validator or signer).public_key.hex(),
                           shard=result.shard if shard is None else shard,
                           inputs_digest=INPUTS, result_digest=result.digest().hex(),
                           result_hash=sha256_hex(blob), result_bytes=len(blob))
    return sign(signer, pub).to_wire(), blob


def _share(k: int, results: list[str | None]) -> dict:
    v = VALIDATORS[k]
    return sign(v, ShardCheckShare(
        run_id=RUN, round=R, validator=v.public_key.hex(), results=results,
        share=v.sign_bls(shard_check_root(RUN, R, results)).hex())).to_wire()


def _check(results: list[str | None], signers: list[int]) -> tuple[dict, list[dict]]:
    wires = [_share(k, results) for k in signers]
    shares = [w["body"]["share"] for w in wires]
    return ({"results": results, "signers": signers, "shares": shares,
             "seed": compute_beacon_seed([bytes.fromhex(x) for x in shares]).hex()}, wires)


class LyingBoard:
    """A ledger client whose shard board serves what the test says, records every post,
    and answers the first check share with ``refuse_first`` (a 409) when set."""

    def __init__(self, views: list[dict[str, Any]], blobs: dict[str, bytes], *,
                 refuse_first: bool = False) -> None:
        self.views, self.blobs, self.refuse_first = views, blobs, refuse_first
        self.posts: list[tuple[str, Any]] = []

    async def get_json(self, path: str) -> Any:
        if path.endswith("/shards"):
            return self.views[0] if len(self.views) == 1 else self.views.pop(0)
        return {"status": "closed"}

    async def post_multipart(self, path: str, parts: list, **_: Any) -> Any:
        self.posts.append((path, parts))
        return {}

    async def post_message(self, path: str, wire: Any) -> Any:
        self.posts.append((path, wire))
        if path.endswith("/check") and self.refuse_first:
            self.refuse_first = False
            raise LedgerRefused(409, "shard_list_fixed", "another list is fixed")
        return {}

    async def get_blob(self, digest: str, *, max_bytes: int, **_: Any) -> bytearray:
        if digest not in self.blobs:
            raise LedgerRefused(404, "not_found", digest)
        return bytearray(self.blobs[digest])

    def shares_posted(self) -> list[dict]:
        return [w for p, w in self.posts if p.endswith("/check")]

    def findings(self) -> list[dict]:
        return [w["body"] for p, w in self.posts if p.endswith("/findings")]


def _honest(rows: torch.Tensor) -> list[ShardResult]:
    return [compute_own_shard(_filtered(rows), V, k) for k in range(V)]


def _block(result: ShardResult, at: int = 200) -> ShardResult:
    agg = result.aggregate.clone()
    agg[at:at + 16] = 1e3  # honest values are a few units at most
    return dataclasses.replace(result, aggregate=agg)


#: The round's beacon seed in these tests (it draws the checkers where checking is delegated).
BEACON = bytes(range(32))


def _run(board: LyingBoard, rows: torch.Tensor, once: SignedOnce | None = None,
         me: int = 0, spec: Any = SPEC
         ) -> tuple[torch.Tensor | None, ShardedRound, Exception | None]:
    import asyncio

    node = ShardedRound(board, VALIDATORS[me], once or SignedOnce(), poll_seconds=0.0,
                        shard_wait=0.0)
    try:
        return asyncio.run(node.aggregate(spec, _filtered(rows), BEACON))[0], node, None
    except BoardFault as exc:
        return None, node, exc


# ------------------------------------------------------------------ publications


def test_only_the_assigned_validators_publications_count(rows):
    results = _honest(rows)
    genuine = _publication(results[1], VALIDATORS[1])[0]
    served = [
        _publication(_block(results[2]), LEDGER, validator=VALIDATORS[2])[0],  # forged name
        _publication(results[2], VALIDATORS[2], run_id="other-run")[0],
        _publication(results[2], VALIDATORS[2], r=R - 1)[0],
        _publication(results[1], VALIDATORS[2], shard=1)[0],  # validator 2 on shard 1
        _publication(results[2], VALIDATORS[2])[0]["body"],  # no signature at all
        genuine,
    ]
    faults: list[str] = []
    pubs = verified_publications(served, SPEC, R, faults)
    assert {k: [p.result_digest for p in v] for k, v in pubs.items()} == {
        1: [results[1].digest().hex()]}
    assert len(faults) == 5
    assert any("signed by" in f for f in faults) and any("other-run" in f for f in faults)
    assert any(f"round {R - 1}" in f for f in faults) and any("for shard 1" in f for f in faults)


# ------------------------------------------------------------------ list and seed


def test_the_check_list_and_seed_are_recomputed_from_a_quorum_of_signed_shares(rows):
    listed = [r.digest().hex() for r in _honest(rows)]
    check, wires = _check(listed, [1, 2])
    faults: list[str] = []
    served = dict(check, seed="00" * 32)  # the seed as served is never used
    got, seed = verified_check(served, wires, SPEC, R, faults)
    assert got == listed and seed.hex() == check["seed"]
    assert faults == ["the served check seed differs from the one its shares give"]


@pytest.mark.parametrize("lie", ["no_shares", "too_few", "ledger_share", "other_list",
                                 "unsorted", "bad_bls"])
def test_an_unverified_check_list_or_seed_is_refused(rows, lie):
    results = _honest(rows)
    listed = [r.digest().hex() for r in results]
    check, wires = _check(listed, [1, 2])
    if lie == "no_shares":
        wires = []
    elif lie == "too_few":
        check = dict(check, signers=[1], shares=check["shares"][:1])
    elif lie == "ledger_share":  # validator 2's share re-signed by the ledger's key
        wires = [wires[0], sign(LEDGER, ShardCheckShare.from_body(wires[1]["body"])).to_wire()]
    elif lie == "other_list":  # genuine shares, over a list that hides shard 2's result
        hidden = [listed[0], listed[1], _block(results[2]).digest().hex()]
        check = dict(_check(listed, [1, 2])[0], results=hidden)
    elif lie == "unsorted":
        check = dict(check, signers=[2, 1], shares=check["shares"][::-1])
    elif lie == "bad_bls":  # a well-formed share envelope whose BLS share is validator 1's
        body = dict(wires[1]["body"], share=check["shares"][0])
        wires = [wires[0], sign(VALIDATORS[2], ShardCheckShare.from_body(body)).to_wire()]
        check = dict(check, shares=[check["shares"][0]] * 2)
    with pytest.raises(BoardFault):
        verified_check(check, wires, SPEC, R, [])


def test_the_issues_attack_a_ledger_signed_shard_and_a_made_up_seed_is_refused(rows):
    """The finding of issue #29: the ledger serves shard 2 under its own key with a 1e3
    block and a fixed list and seed of its own making; the node never assembles it."""
    results = _honest(rows)
    forged = _block(results[2])
    pubs = [_publication(results[1], VALIDATORS[1]),
            _publication(forged, LEDGER, validator=VALIDATORS[2])]
    listed = [results[0].digest().hex(), results[1].digest().hex(), forged.digest().hex()]
    view = {"results": [w for w, _ in pubs], "list": listed, "check_shares": [],
            "check": {"results": listed, "signers": [1, 2], "shares": ["ab" * 96] * 2,
                      "seed": "11" * 32}}
    board = LyingBoard([view], {sha256_hex(b): b for _, b in pubs})
    aggregate, node, error = _run(board, rows)
    assert aggregate is None and isinstance(error, BoardFault)
    assert board.shares_posted() == []  # it signed no list naming the forged result
    assert any("signed by" in s["detail"] for s in node.skipped)


def test_forged_and_misplaced_posts_are_skipped_and_the_honest_model_assembled(rows):
    results = _honest(rows)
    pubs = [_publication(r, VALIDATORS[k]) for k, r in enumerate(results)]
    junk = [_publication(_block(results[2]), LEDGER, validator=VALIDATORS[2])[0],
            _publication(_block(results[1]), VALIDATORS[1], run_id="other-run")[0]]
    listed = [r.digest().hex() for r in results]
    check, wires = _check(listed, [1, 2])
    before = {"results": junk + [w for w, _ in pubs], "list": None, "check": None,
              "check_shares": []}
    after = dict(before, list=listed, check=check, check_shares=wires)
    board = LyingBoard([before, after], {sha256_hex(b): b for _, b in pubs})
    aggregate, node, error = _run(board, rows)
    assert error is None
    assert torch.equal(aggregate, assemble_shards(results, rows.shape[1]))
    assert board.findings() == []
    assert [s["body"]["results"] for s in board.shares_posted()] == [listed]
    assert len(node.skipped) >= 2


def test_a_byzantine_validators_sparse_block_is_caught_and_blamed(rows):
    results = _honest(rows)
    bad = _block(results[2], at=777)
    pubs = [_publication(results[0], VALIDATORS[0]), _publication(results[1], VALIDATORS[1]),
            _publication(bad, VALIDATORS[2])]
    listed = [r.digest().hex() for r in (results[0], results[1], bad)]
    check, wires = _check(listed, [1, 2])
    view = {"results": [w for w, _ in pubs], "list": listed, "check": check,
            "check_shares": wires}
    board = LyingBoard([view], {sha256_hex(b): b for _, b in pubs})
    aggregate, _, error = _run(board, rows)
    assert error is None
    assert torch.equal(aggregate, assemble_shards(results, rows.shape[1]))
    assert [(f["shard"], f["faulty"], f["reason"]) for f in board.findings()] == [
        (2, True, "stationarity")]


# ------------------------------------------------------------------ one list per round


def test_an_honest_validator_signs_one_list_per_round_even_after_a_409(rows, tmp_path):
    """It signs the full list, the ledger answers 409 and shows another fixed list (shard 2
    left out): it signs nothing more, acts on the quorum's list, and does not blame the
    publisher left out. After a restart it still signs no other list."""
    results = _honest(rows)
    pubs = [_publication(r, VALIDATORS[k]) for k, r in enumerate(results)]
    full = [r.digest().hex() for r in results]
    other = full[:2] + [None]
    check, wires = _check(other, [1, 2])
    open_view = {"results": [w for w, _ in pubs], "list": None, "check": None,
                 "check_shares": []}
    fixed_view = dict(open_view, list=other)
    checked_view = dict(fixed_view, check=check, check_shares=wires)
    blobs = {sha256_hex(b): b for _, b in pubs}
    path = tmp_path / "signed.json"
    board = LyingBoard([open_view, fixed_view, fixed_view, checked_view], blobs,
                       refuse_first=True)
    aggregate, _, error = _run(board, rows, SignedOnce.in_file(path))
    assert error is None
    assert [s["body"]["results"] for s in board.shares_posted()] == [full]
    assert torch.equal(aggregate, assemble_shards(results, rows.shape[1]))
    assert [(f["shard"], f["faulty"], f["reason"]) for f in board.findings()] == [
        (2, False, "missing")]
    restarted = SignedOnce.in_file(path)
    assert restarted.signed("shard_check", RUN, R) == list_digest(full)
    board = LyingBoard([fixed_view, checked_view], blobs)
    _, _, error = _run(board, rows, restarted)
    assert error is None and board.shares_posted() == []


def test_a_fixed_list_naming_an_unpublished_result_is_never_signed(rows):
    results = _honest(rows)
    faults: list[str] = []
    pubs = verified_publications([_publication(r, VALIDATORS[k])[0]
                                  for k, r in enumerate(results)], SPEC, R, faults)
    forged = [results[0].digest().hex(), results[1].digest().hex(), "ee" * 32]
    assert list_to_sign(forged, pubs, V, complete=True) is None
    assert list_to_sign(None, pubs, V, complete=False) == [r.digest().hex() for r in results]
    del pubs[2]
    assert list_to_sign(None, pubs, V, complete=False) is None
    assert list_to_sign(None, pubs, V, complete=True)[2] is None


# ------------------------------------------------------------------ the dense check


def test_the_dense_check_catches_every_sparse_block_and_clears_every_honest_result():
    """A 16-coordinate block set to 1e3 (honest values about 2) anywhere in the shard, 30
    draws: caught every time, whatever the seed or the block; honest results never fail."""
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        xs = torch.randn(8, 20_000, generator=g) * (0.5 + seed / 30)
        results = [compute_own_shard(_filtered(xs), 4, k) for k in range(4)]
        k = seed % 4
        n = results[k].stop - results[k].start
        at = int(torch.randint(0, n - 16, (1,), generator=g))
        honest = dense_check(results[k], xs, num_shards=4, tau=results[k].tau)
        assert honest.ok and honest.worst_stationarity < 0.1, (seed, honest)
        caught = dense_check(_block(results[k], at), xs, num_shards=4, tau=results[k].tau)
        assert not caught.ok and caught.reason == "stationarity", (seed, caught)


@pytest.mark.parametrize("deviation", ["one_coordinate", "dense_1e-3", "nan", "reweighted"])
def test_the_dense_check_catches_small_and_dense_deviations(rows, deviation):
    result = _honest(rows)[1]
    agg = result.aggregate.clone()
    if deviation == "one_coordinate":
        agg[5] += 1e-3 * float(agg.abs().max())
    elif deviation == "dense_1e-3":
        agg *= 1 + 1e-3
    elif deviation == "nan":
        agg[-1] = float("nan")
    else:  # v moved toward the far row: an exact reweighting, its distance understated
        d = result.distances.clone()
        d[5] *= 0.3
        a = fixed_point_coefficients(d, torch.ones(rows.shape[0], dtype=torch.float64),
                                     result.tau)
        agg = (a @ rows[:, result.start:result.stop].double()).float()
        result = dataclasses.replace(result, distances=d)
    check = dense_check(dataclasses.replace(result, aggregate=agg), rows, num_shards=V,
                        tau=result.tau)
    assert not check.ok
    assert check.reason == ("distance" if deviation == "reweighted" else "stationarity")
    if deviation == "reweighted":
        assert 5 in check.suspect_rows


def test_understated_distances_are_caught_exactly_not_by_a_z_test(rows):
    """Issue #29: colluding spiky rows had their distances understated 0.3x and passed the
    sampled check; the dense check recomputes every distance."""
    result = _honest(rows)[0]
    for row in range(rows.shape[0]):
        for factor in (0.3, 0.99, 1.01):
            d = result.distances.clone()
            d[row] *= factor
            check = dense_check(dataclasses.replace(result, distances=d), rows,
                                num_shards=V, tau=result.tau)
            # a clipped row's weight changes with it: stationarity fails too
            assert not check.ok and check.suspect_rows == (row,), (row, factor)


def test_a_result_that_fails_on_other_inputs_is_not_blamed(rows):
    """A publication naming other rows than this validator's: replaced, not blamed."""
    results = _honest(rows)
    other = compute_own_shard(_filtered(rows[:5]), V, 2)  # aggregated without the last row
    other = dataclasses.replace(other, distances=torch.cat([other.distances,
                                                            torch.ones(1).double()]))
    settled = sharded.settle_shards(_filtered(rows), results[0], {1: results[1], 2: other},
                                    num_shards=V, me=0, inputs_differ={2})
    assert [(d.shard, d.faulty) for d in settled.disputes] == [(2, False)]
    assert settled.disputes[0].reason.startswith("inputs_differ")
    assert torch.equal(settled.aggregate, assemble_shards(results, rows.shape[1]))


# ------------------------------------------------------------------ checking linear in V


@pytest.mark.parametrize("v", [2, 3, 4, 7, 16, 64])
def test_each_shard_gets_its_checkers_and_each_validator_checks_as_many(v):
    for k in range(1, v):
        seed = bytes([v, k]) * 16
        drawn = shard_checkers(seed, v, k)
        assert drawn == shard_checkers(seed, v, k)  # a function of the seed
        assert all(len(set(c)) == k and j not in c for j, c in enumerate(drawn))
        load = [sum(i in c for c in drawn) for i in range(v)]
        assert load == [k] * v
    assert shard_checkers(b"s" * 32, v, v - 1) == shard_checkers(b"t" * 32, v, 99)
    if v >= 16:
        assert shard_checkers(b"s" * 32, v, 3) != shard_checkers(b"t" * 32, v, 3)


def _ok(k: int, shard: int, digest: str, signer: Identity | None = None, *,
        faulty: bool = False, reason: str = "ok") -> dict:
    v = VALIDATORS[k]
    return sign(signer or v, ShardFindingReport(
        run_id=RUN, round=R, validator=v.public_key.hex(), shard=shard,
        publisher=VALIDATORS[shard].public_key.hex(), faulty=faulty, reason=reason,
        published_digest=digest, replacement_digest=digest,
        max_abs_deviation=0.0)).to_wire()


def _delegated_round(rows: torch.Tensor, corrupt: bool):
    """Validator 0's view of a round with one checker per shard, drawn from ``BEACON``: the
    shard it checks, the one it delegates (corrupted when asked) and that shard's checker."""
    drawn = shard_checkers(BEACON, V, 1)
    mine = next(j for j in (1, 2) if 0 in drawn[j])
    other = 3 - mine
    checker = drawn[other][0]
    results = _honest(rows)
    published = list(results)
    if corrupt:
        published[other] = _block(results[other], at=333)
    listed = [r.digest().hex() for r in published]
    check, wires = _check(listed, [1, 2])
    pubs = [_publication(r, VALIDATORS[k]) for k, r in enumerate(published)]
    view = {"results": [w for w, _ in pubs], "list": listed, "check": check,
            "check_shares": wires, "findings": []}
    return results, listed, view, {sha256_hex(b): b for _, b in pubs}, mine, other, checker


def _counting_dense_checks(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = sharded.dense_check

    def counted(result, *args, **kwargs):
        seen.append(result.shard)
        return real(result, *args, **kwargs)

    monkeypatch.setattr(sharded, "dense_check", counted)
    return seen


def test_a_result_all_its_checkers_vouch_for_is_taken_unchecked(rows, monkeypatch):
    """One checker per shard: validator 0 checks the shard drawn for it, posts an ok
    finding for it, and takes the other on its checker's signed ok: one dense check, not
    two, and the honest model."""
    results, listed, view, blobs, mine, other, checker = _delegated_round(rows, False)
    view["findings"] = [_ok(checker, other, listed[other])]
    checked = _counting_dense_checks(monkeypatch)
    aggregate, _, error = _run(LyingBoard([view], blobs), rows, spec=_spec(checkers=1))
    assert error is None
    assert torch.equal(aggregate, assemble_shards(results, rows.shape[1]))
    assert checked == [mine]


def test_a_doubted_or_unvouched_result_is_checked_here_and_a_bad_one_replaced(rows,
                                                                              monkeypatch):
    """The delegated shard is corrupted. Whether its checker reports it faulty, says
    nothing by the deadline, or the board serves an ok that is not the checker's (signed by
    the ledger, or by a validator not drawn for it), validator 0 checks it itself, catches
    it, recomputes it and reports it; its own shard gets its ok finding."""
    results, listed, view, blobs, mine, other, checker = _delegated_round(rows, True)
    bystander = next(k for k in range(V) if k not in (checker, other))
    for findings in ([_ok(checker, other, listed[other], faulty=True, reason="stationarity")],
                     [],
                     [_ok(checker, other, listed[other], signer=LEDGER),
                      _ok(bystander, other, listed[other]), _ok(other, other, listed[other])]):
        checked = _counting_dense_checks(monkeypatch)
        board = LyingBoard([dict(view, findings=findings)], blobs)
        aggregate, _, error = _run(board, rows, spec=_spec(checkers=1))
        assert error is None
        assert torch.equal(aggregate, assemble_shards(results, rows.shape[1]))
        assert sorted(checked) == sorted([mine, other])
        reported = {(f["shard"], f["faulty"], f["reason"]) for f in board.findings()}
        assert reported == {(mine, False, "ok"), (other, True, "stationarity")}
        ok = next(f for f in board.findings() if f["shard"] == mine)
        assert ok["published_digest"] == ok["replacement_digest"] == listed[mine]


def test_all_drawn_checkers_must_vouch_and_nothing_else_counts():
    """Five validators, two checkers per shard (the pure rule): one ok and one silent
    checker decide nothing yet; both ok vouch; an ok about another digest, a second post by
    one checker, or a faulty finding doubt; an ok from a validator not drawn counts for
    nothing."""
    from types import SimpleNamespace as Post

    from veritrain.validators.sharded import vouched_shards

    listed = ["aa" * 32, "bb" * 32, "cc" * 32, "dd" * 32, "ee" * 32]
    drawn = shard_checkers(BEACON, 5, 2)
    delegated = {1, 2, 3, 4}

    def post(shard: int, *, faulty: bool = False, reason: str = "ok",
             digest: str | None = None) -> Any:
        d = listed[shard] if digest is None else digest
        return Post(message=Post(shard=shard, faulty=faulty, reason=reason,
                                 published_digest=d, replacement_digest=d))

    a, b = drawn[1]
    stranger = next(v for v in range(5) if v not in drawn[1] and v != 1)
    cases = {
        "one ok, one silent": ({a: [post(1)]}, set(), set()),
        "both ok": ({a: [post(1)], b: [post(1)]}, {1}, {1}),
        "a stranger's ok": ({a: [post(1)], stranger: [post(1)]}, set(), set()),
        "another digest": ({a: [post(1)], b: [post(1, digest="ff" * 32)]}, set(), {1}),
        "two posts": ({a: [post(1)], b: [post(1), post(1)]}, set(), {1}),
        "faulty": ({a: [post(1, faulty=True, reason="distance")]}, set(), {1}),
    }
    for name, (posts, vouched, decided) in cases.items():
        got = vouched_shards(posts, listed, drawn, delegated)
        assert got == (vouched, decided), name


def test_a_spiky_worker_row_never_makes_an_honest_shard_fail_its_check():
    """Issue #29 item 5: one Byzantine row with spiky blocks (a few coordinates 40x the
    others', its norm that of an honest row) made an honest shard fail the sampled
    check in 59 of 60 rounds, so every validator recomputed every shard. The dense check
    estimates nothing: over 20 draws of rows and spikes, every honest result passes."""
    for seed in range(20):
        g = torch.Generator().manual_seed(100 + seed)
        xs = torch.randn(8, 12_000, generator=g) * 0.5
        spikes = torch.randint(0, 12_000, (6,), generator=g)
        xs[7] *= 0.05
        xs[7, spikes] = 20.0  # about the honest rows' norm: the norm filter passes it
        assert 0.5 < float(xs[7].norm() / xs[0].norm()) < 2.0
        for k in range(4):
            result = compute_own_shard(_filtered(xs), 4, k)
            check = dense_check(result, xs, num_shards=4, tau=result.tau)
            assert check.ok and check.worst_stationarity < 0.1, (seed, k, check)
