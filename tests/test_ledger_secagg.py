"""The ledger's board for masked buckets, over HTTP, on SQLite and PostgreSQL.

A masked run's submissions carry no payload. Once a quorum of beacon shares
fixes the beacon, the ledger deals the sealed submitters into buckets and takes,
phase by phase, each member's key advert, deal, masked input and reveal; it
refuses a post to a closed phase, from a sender the phase does not wait for, from
another bucket, signed by someone else, or contradicting the board (a deal to
other holders, a reveal for other survivors), and takes openings only from the
spot-checked workers. A phase closes when its last expected sender posts, or at
its deadline (an injected clock here, slowed down and jumped forward: no
sleeping). The chain audit passes over the whole board.

Most posts are structurally valid fakes (the ledger checks no cryptography); one
test runs the real masked workers against the board and unmasks the bucket sums.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import pytest
from fakes import FakeRun, make_fake_run, make_submission
from ledger_backends import make_fixture
from ledger_harness import Api, key_rate_limited, record_pairing_threads, replay_from, run_api
from veritrain.ledger import schema as t
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.beacon import (
    EVERY_WORKER_ADMITTED,
    beacon_root,
    beacon_seed_of,
    compute_beacon_seed,
    sealed_list_digest_of,
)
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    SEALED_SHARES_BYTES,
    BeaconShare,
    OpeningsShare,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    SecaggView,
    Submission,
    open_signed,
    sign,
)
from veritrain.protocol.openings import (
    inputs_digest,
    openings_root,
    survivor_buckets,
    verify_openings,
)
from veritrain.protocol.presets import run_preset
from veritrain.protocol.secagg import round_buckets, view_digest

from veritrain.synthetic import HONEST, build_results

ledger_url = make_fixture()
RUN = "secagg-ledger"
MASKED = {"bucket_size": 3, "max_dropouts": 1, "clip_norm": 10.0, "phase_seconds": 5.0}
BOARD = f"/v1/runs/{RUN}/rounds/0/secagg"
NUM_PARAMS = 10  # the synthetic run's D: a words file is 40 bytes
WORDS = bytes(4 * NUM_PARAMS)
NO_LIMITS = {"ip_rate": 0.0, "key_rate": 0.0}  # many posts per key within a second


def masked_run(run_id: str = RUN, *, spot_checks: int = 2) -> FakeRun:
    verification = {**run_preset("tiny")["verification"], "probe_examples": 0,
                    "spot_checks_per_round": spot_checks}
    run = make_fake_run(run_id, n_validators=2, quorum=2, verification=verification,
                        aggregator={"name": "centered_clip", "params": {"tau_rel": 1.0},
                                    "masked": MASKED},
                        schedule={**run_preset("tiny")["schedule"], "min_submissions": 2})
    assert run.spec.masked == MASKED and run.spec.masking_problem() is None
    assert run.spec.num_params == NUM_PARAMS
    return run


class LedgerClock:
    """The ledger's clock here: it runs at 1/100 of wall time, so no phase meets its
    deadline however slow the machine (a phase closes early only because everyone
    posted), and it jumps forward when a test lets a deadline pass."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.skew = 0.0

    def __call__(self) -> float:
        return self.t0 + (time.time() - self.t0) * 0.01 + self.skew

    def advance(self, seconds: float) -> None:
        self.skew += seconds


def hx(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def pk(w: Identity) -> str:
    return w.public_key.hex()


# ------------------------------------------------------------------ fake board posts

def keys_msg(w: Identity, bucket: int, tag: str = "") -> SecaggKeys:
    return SecaggKeys(run_id=RUN, round=0, bucket=bucket, worker=pk(w),
                      enc_public=hx("enc", pk(w), tag), mask_public=hx("mask", pk(w), tag))


def deal_msg(w: Identity, bucket: int, holders: list[str], *, seed_commitments: int | None = None,
             key_commitments: int | None = None) -> SecaggDeal:
    ns = len(holders) if seed_commitments is None else seed_commitments
    nk = len(holders) if key_commitments is None else key_commitments
    return SecaggDeal(run_id=RUN, round=0, bucket=bucket, dealer=pk(w),
                      seed_commitment=hx("seed", pk(w)),
                      seed_share_commitments=[hx("s", pk(w), i) for i in range(ns)],
                      key_share_commitments=[hx("k", pk(w), i) for i in range(nk)],
                      sealed=[{"holder": h, "ciphertext": "ab" * SEALED_SHARES_BYTES}
                              for h in holders])


def masked_msg(w: Identity, bucket: int, words: bytes = WORDS, *,
               words_bytes: int | None = None, group: list[str] | None = None
               ) -> SecaggMasked:
    """A masked input over ``group`` as members and dealers (none: a digest of nothing)."""
    dealt = (view_digest(RUN, 0, bucket, group, group) if group is not None
             else hx("no view"))
    return SecaggMasked(run_id=RUN, round=0, bucket=bucket, worker=pk(w),
                        commitment=hx("commit", pk(w)), input_digest=hx("input", pk(w)),
                        words_hash=hashlib.sha256(words).hexdigest(),
                        words_bytes=len(words) if words_bytes is None else words_bytes,
                        dealers_digest=dealt)


def view_msg(w: Identity, bucket: int, group: list[str], survivors: list[str]) -> SecaggView:
    return SecaggView(run_id=RUN, round=0, bucket=bucket, worker=pk(w), members=group,
                      dealers=group, survivors=survivors)


def _shares(dealers: list[str], holder: str) -> list[dict[str, str]]:
    return [{"dealer": d, "share": "01" * 33, "salt": hx("salt", d, holder)} for d in dealers]


def reveal_msg(w: Identity, bucket: int, survivors: list[str], seed_of: list[str],
               key_of: list[str], *, group: list[str] | None = None,
               signers: list[Identity] = ()) -> SecaggReveal:
    """A reveal on the view (``group`` as members and dealers, ``survivors``), carrying
    the ``signers``' signatures on that view."""
    group = list(survivors) if group is None else group
    sigs = [{"worker": pk(x), "signature": sign(x, view_msg(x, bucket, group,
                                                            survivors)).signature}
            for x in signers]
    return SecaggReveal(run_id=RUN, round=0, bucket=bucket, holder=pk(w),
                        survivors=survivors, seed_shares=_shares(seed_of, pk(w)),
                        key_shares=_shares(key_of, pk(w)), members=group, dealers=group,
                        view_signatures=sigs)


def opening_msg(w: Identity, bucket: int) -> SecaggOpening:
    return SecaggOpening(run_id=RUN, round=0, bucket=bucket, worker=pk(w),
                         self_seed=hx("self", pk(w)), mask_private=hx("mpriv", pk(w)))


async def post(api: Api, kind: str, signer: Identity, msg: Any) -> tuple[int, Any]:
    return await api.post_json(f"{BOARD}/{kind}", sign(signer, msg).to_wire())


async def post_masked(api: Api, signer: Identity, msg: SecaggMasked,
                      words: bytes = WORDS) -> tuple[int, Any]:
    return await api.post_parts(f"{BOARD}/masked", [("envelope", sign(signer, msg).encode()),
                                                    ("words", words)])


async def board(api: Api, query: str = "") -> dict[str, Any]:
    status, view = await api.get(BOARD + query)
    assert status == 200, view
    return view


def stable(view: dict[str, Any]) -> dict[str, Any]:
    """The board without its ``now`` (which moves with every read)."""
    return {k: v for k, v in view.items() if k != "now"}


def phase(view: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((p for p in view["phases"] if p["name"] == name), None)


def refused(reply: tuple[int, Any], status: int, reason: str) -> bool:
    return reply[0] == status and reply[1].get("reason") == reason


# ------------------------------------------------------------------ set-up

async def submit_envelope(api: Api, run: FakeRun, w: Identity) -> tuple[int, Any]:
    """A masked run's submission: the envelope only; the payload stays with the worker."""
    signed = make_submission(run, w, b"update of " + pk(w).encode())
    return await api.post_parts(f"/v1/runs/{run.spec.run_id}/rounds/0/submissions",
                                [("envelope", signed.encode())])


async def post_beacon(api: Api, run: FakeRun, v: Identity) -> tuple[int, Any]:
    sealed = sealed_list_digest_of(
        (await api.get(f"/v1/runs/{run.spec.run_id}/rounds/0/submissions"))[1]["submissions"])
    share = BeaconShare(run_id=run.spec.run_id, round=0, validator=pk(v),
                        share=v.sign_bls(beacon_root(run.spec.run_id, 0)).hex(), sealed=sealed,
                        participants=EVERY_WORKER_ADMITTED)
    return await api.post_json(f"/v1/runs/{run.spec.run_id}/rounds/0/beacon",
                               sign(v, share).to_wire())


async def open_board(api: Api, run: FakeRun, ids: list[Identity]) -> dict[str, Any]:
    """Create the run, take every worker's envelope, fix the beacon; the fresh board."""
    assert (await api.create_run(run))[0] == 201
    for w in ids:
        assert (await api.register(run, w))[0] in (200, 201)
    for w in ids:
        status, body = await submit_envelope(api, run, w)
        assert status == 201, body
    # Every registered worker submitted: the last submission closed the round.
    assert (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]["status"] == "closed"
    for v in run.validators:
        assert (await post_beacon(api, run, v))[0] in (200, 201)
    return await board(api)


def by_bucket(view: dict[str, Any], ids: list[Identity]) -> list[list[Identity]]:
    """The workers of each bucket, in the board's (ascending key) order."""
    who = {pk(w): w for w in ids}
    return [[who[k] for k in b["assigned"]] for b in view["buckets"]]


async def audit(api: Api, run_id: str = RUN) -> tuple[Any, Any, list[Any]]:
    async with LedgerClient(api.url) as client:
        key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
        events = await fetch_events(client, run_id)
        return verify_events(events, key), verify_events(events, key, full=True), events


# ------------------------------------------------------------------ tests

def test_masked_run_takes_envelopes_only_and_deals_buckets_at_the_beacon(tmp_path, ledger_url):
    run = masked_run()
    ids = [Identity.generate("worker") for _ in range(6)]
    v0, v1 = run.validators

    async def scenario(api: Api) -> dict[str, Any]:
        out: dict[str, Any] = {}
        api.store.clock = LedgerClock()
        assert (await api.create_run(run))[0] == 201
        for w in ids:
            await api.register(run, w)
        out["subs"] = [await submit_envelope(api, run, w) for w in ids[:5]]
        out["open_board"] = await api.get(BOARD)
        out["open_keys"] = await post(api, "keys", ids[0], keys_msg(ids[0], 0))
        out["last_sub"] = await submit_envelope(api, run, ids[5])
        out["status"] = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]["status"]
        out["no_beacon"] = await api.get(BOARD)
        out["share0"] = await post_beacon(api, run, v0)
        out["one_share"] = await api.get(BOARD)
        out["share1"] = await post_beacon(api, run, v1)
        out["view"] = await board(api)
        out["bucket1"] = await board(api, "?bucket=1")
        out["bad_query"] = await api.get(BOARD + "?bucket=-1")
        out["other_round"] = await api.get(f"/v1/runs/{RUN}/rounds/7/secagg")
        sub = make_submission(run, ids[0], b"update of " + pk(ids[0]).encode()).message
        out["payload_blob"] = await api.get(f"/v1/blobs/{sub.payload_hash}")
        out["audit"], _, out["events"] = await audit(api)
        # An unmasked run has no board.
        plain = make_fake_run("plain-run", n_validators=2, quorum=2)
        assert (await api.create_run(plain))[0] == 201
        out["plain"] = await api.get("/v1/runs/plain-run/rounds/0/secagg")
        plain_keys = SecaggKeys(**{**keys_msg(ids[0], 0).to_body(), "run_id": "plain-run"})
        out["plain_keys"] = await api.post_json("/v1/runs/plain-run/rounds/0/secagg/keys",
                                                sign(ids[0], plain_keys).to_wire())
        plain_masked = SecaggMasked(**{**masked_msg(ids[0], 0).to_body(), "run_id": "plain-run"})
        out["plain_masked"] = await api.post_parts(
            "/v1/runs/plain-run/rounds/0/secagg/masked",
            [("envelope", sign(ids[0], plain_masked).encode()), ("words", WORDS)])
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url, **NO_LIMITS)
    assert [s for s, _ in out["subs"]] == [201] * 5 and out["last_sub"][0] == 201
    assert [body["body"]["worker"] for _, body in out["subs"]] == [pk(w) for w in ids[:5]]
    assert out["status"] == "closed"
    assert refused(out["payload_blob"], 404, "not_found")  # no payload was stored
    for name in ("open_board", "open_keys", "no_beacon", "one_share"):
        assert refused(out[name], 409, "wrong_state"), (name, out[name])
    assert out["share0"][1]["beacon"] is None
    beacon = out["share1"][1]["beacon"]
    assert beacon["signers"] == [0, 1]
    seed = compute_beacon_seed([bytes.fromhex(x) for x in beacon["shares"]])
    view = out["view"]
    workers = sorted(pk(w) for w in ids)
    expected = round_buckets(seed, workers, MASKED["bucket_size"])
    assert [b["assigned"] for b in view["buckets"]] == expected
    assert len(expected) == 2 and sorted(w for b in expected for w in b) == workers
    assert all(b["members"] is None and b["live"] for b in view["buckets"])
    assert [p["name"] for p in view["phases"]] == ["keys"]
    keys = view["phases"][0]
    assert keys["opened_at"] == view["started_at"] and keys["closed_at"] is None
    assert keys["deadline"] == pytest.approx(view["started_at"] + MASKED["phase_seconds"])
    assert keys["expected"] == workers
    assert view["posts"] == {k: [] for k in ("keys", "deal", "masked", "view", "reveal",
                                             "opening")}
    assert not view["complete"]
    assert [b["index"] for b in out["bucket1"]["buckets"]] == [1]
    assert out["bucket1"]["buckets"][0]["assigned"] == expected[1]
    assert out["bad_query"][0] == 400
    assert refused(out["other_round"], 404, "not_found")
    assert refused(out["plain"], 409, "not_masked")
    assert refused(out["plain_keys"], 409, "not_masked")
    assert refused(out["plain_masked"], 409, "not_masked")
    started = [decode_canonical(e.body) for e in out["events"] if e.kind == "secagg_started"]
    assert len(started) == 1
    assert started[0]["buckets"] == expected and started[0]["started_at"] == view["started_at"]
    assert out["audit"].ok, out["audit"].problem


def test_keys_and_deal_refusals_leave_the_board_unchanged(tmp_path, ledger_url):
    run = masked_run()
    ids = [Identity.generate("worker") for _ in range(6)]
    stranger = Identity.generate("worker")

    async def scenario(api: Api) -> dict[str, Any]:
        out: dict[str, Any] = {}
        clock = api.store.clock = LedgerClock()
        view = await open_board(api, run, ids)
        (a, b, c), (d, e, f) = by_bucket(view, ids)
        out["buckets"] = [[pk(a), pk(b), pk(c)], [pk(d), pk(e), pk(f)]]
        out["first"] = await post(api, "keys", a, keys_msg(a, 0))
        before = stable(await board(api))
        out["refusals"] = {
            "stranger": await post(api, "keys", stranger, keys_msg(stranger, 0)),
            "wrong_bucket": await post(api, "keys", b, keys_msg(b, 1)),
            "forged": await post(api, "keys", c, keys_msg(b, 0)),  # b's advert signed by c
            # An X25519 key of low order agrees no secret: every member's dealing would fail.
            "zero_key": await post(api, "keys", b, SecaggKeys(
                **{**keys_msg(b, 0).to_body(), "mask_public": "00" * 32})),
            "other_keys": await post(api, "keys", a, keys_msg(a, 0, tag="again")),
            "early_deal": await post(api, "deal", a, deal_msg(a, 0, [pk(a), pk(b), pk(c)])),
            "early_masked": await post_masked(api, a, masked_msg(a, 0)),
            "early_reveal": await post(api, "reveal", a, reveal_msg(a, 0, [pk(a)], [pk(a)], [])),
            "early_opening": await post(api, "opening", a, opening_msg(a, 0)),
            "unknown_kind": await api.post_json(f"{BOARD}/votes",
                                                sign(a, keys_msg(a, 0)).to_wire()),
            "wrong_url": await api.post_json(f"/v1/runs/{RUN}/rounds/3/secagg/keys",
                                             sign(b, keys_msg(b, 0)).to_wire()),
        }
        out["again"] = await post(api, "keys", a, keys_msg(a, 0))
        out["after_refusals"] = stable(await board(api))
        out["before"] = before
        for w, bk in ((b, 0), (c, 0), (d, 1), (e, 1)):
            assert (await post(api, "keys", w, keys_msg(w, bk)))[0] == 201
        out["five"] = await board(api)
        out["last_sent"] = clock()
        out["last_keys"] = await post(api, "keys", f, keys_msg(f, 1))
        out["last_done"] = clock()
        out["keys_closed"] = await board(api)
        members0 = [pk(a), pk(b), pk(c)]
        before = stable(await board(api))
        out["deal_refusals"] = {
            "reordered": await post(api, "deal", a, deal_msg(a, 0, members0[::-1])),
            "missing_holder": await post(api, "deal", a, deal_msg(a, 0, members0[:2])),
            "other_bucket": await post(api, "deal", a, deal_msg(a, 0, out["buckets"][1])),
            "short_seed_commitments": await post(api, "deal", a, deal_msg(
                a, 0, members0, seed_commitments=2)),
            "long_key_commitments": await post(api, "deal", a, deal_msg(
                a, 0, members0, key_commitments=4)),
            "wrong_bucket": await post(api, "deal", a, deal_msg(a, 1, out["buckets"][1])),
            "stranger": await post(api, "deal", stranger, deal_msg(stranger, 0, members0)),
            "late_keys": await post(api, "keys", stranger, keys_msg(stranger, 0)),
            "late_other_keys": await post(api, "keys", a, keys_msg(a, 0, tag="late")),
        }
        out["late_same_keys"] = await post(api, "keys", a, keys_msg(a, 0))
        out["after_deal_refusals"] = stable(await board(api))
        out["deal_before"] = before
        out["deal"] = await post(api, "deal", a, deal_msg(a, 0, members0))
        out["deal_again"] = await post(api, "deal", a, deal_msg(a, 0, members0))
        out["audit"], _, _ = await audit(api)
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url, **NO_LIMITS)
    r = out["refusals"]
    assert out["first"][0] == 201 and out["first"][1] == {"kind": "keys", "already": False}
    assert refused(r["stranger"], 403, "not_expected")
    assert refused(r["wrong_bucket"], 403, "wrong_bucket")
    assert refused(r["forged"], 401, "bad_signature")
    assert refused(r["zero_key"], 400, "malformed")
    assert refused(r["other_keys"], 409, "duplicate")
    for name in ("early_deal", "early_masked", "early_reveal"):
        assert refused(r[name], 409, "phase_closed"), (name, r[name])
    assert refused(r["early_opening"], 409, "wrong_state")  # no masked input yet
    assert refused(r["unknown_kind"], 404, "not_found")
    assert refused(r["wrong_url"], 400, "wrong_round")
    # An exact resend is idempotent and stores nothing new.
    assert out["again"][0] in (200, 201) and out["again"][1] == {"kind": "keys",
                                                                  "already": True}
    assert out["after_refusals"] == out["before"]
    assert [p["body"]["worker"] for p in out["before"]["posts"]["keys"]] == [
        out["buckets"][0][0]]
    # Five of six advertised: keys stays open until the sixth.
    five = out["five"]
    assert [p["name"] for p in five["phases"]] == ["keys"]
    assert five["phases"][0]["closed_at"] is None
    assert out["last_keys"][0] == 201
    view = out["keys_closed"]
    keys, deal = view["phases"]
    # The sixth advert closed keys at once (at its receipt), well before its deadline.
    assert out["last_sent"] <= keys["closed_at"] <= out["last_done"]
    assert keys["closed_at"] < keys["deadline"] - 1.0
    assert deal["opened_at"] == keys["closed_at"] and deal["closed_at"] is None
    assert deal["expected"] == sorted(w for b in out["buckets"] for w in b)
    assert [b["members"] for b in view["buckets"]] == out["buckets"]
    d = out["deal_refusals"]
    for name in ("reordered", "missing_holder", "other_bucket", "short_seed_commitments",
                 "long_key_commitments"):
        assert refused(d[name], 400, "malformed"), (name, d[name])
    assert refused(d["wrong_bucket"], 403, "wrong_bucket")
    assert refused(d["stranger"], 403, "not_expected")
    assert refused(d["late_keys"], 409, "phase_closed")
    assert refused(d["late_other_keys"], 409, "duplicate")
    assert out["late_same_keys"][1] == {"kind": "keys", "already": True}
    assert out["after_deal_refusals"] == out["deal_before"]
    assert out["deal"][0] == 201 and not out["deal"][1]["already"]
    assert out["deal_again"][1]["already"]
    assert out["audit"].ok, out["audit"].problem


def test_replayed_board_posts_do_not_spend_the_senders_budget(tmp_path, ledger_url):
    """A worker's key advert is public on the board: a third party copying it from another
    address is answered from the store and throttled on its own address, never on the
    worker's key, whose next write goes through."""
    run = masked_run()
    ids = [Identity.generate("worker") for _ in range(6)]

    async def scenario(api: Api) -> dict[str, Any]:
        view = await open_board(api, run, ids)  # each worker: registration, submission
        (a, b, c), _ = by_bucket(view, ids)
        wire = sign(a, keys_msg(a, 0)).to_wire()
        first = await api.post_json(f"{BOARD}/keys", wire)  # a's third write
        replays = await replay_from(api, "127.0.0.2", f"{BOARD}/keys", wire, 30)
        # a's own fourth write, within the burst of 4 the replays would have spent.
        other = make_fake_run("other-board-run")
        assert (await api.create_run(other))[0] == 201
        return {"first": first, "replays": replays,
                "own": await api.register(other, a), "limited": await key_rate_limited(api)}

    out = run_api(tmp_path, scenario, db_url=ledger_url, key_rate=0.001, key_burst=4,
                  ip_rate=1000.0, ip_burst=1000.0)
    assert out["first"][0] == 201 and out["first"][1]["already"] is False
    assert out["replays"][0] == 201 and 429 in out["replays"]  # the copier throttles itself
    assert out["own"][0] in (200, 201), out["own"]
    assert out["limited"] == 0


async def post_share(api: Api, v: Identity, digest: str, *, signed_over: str | None = None
                     ) -> tuple[int, Any]:
    """Validator ``v``'s openings share over ``digest`` (its BLS signature over
    ``signed_over`` instead, if given)."""
    root = openings_root(RUN, 0, signed_over or digest)
    share = OpeningsShare(run_id=RUN, round=0, validator=pk(v), masked=digest,
                          share=v.sign_bls(root).hex())
    return await api.post_json(f"{BOARD}/openings", sign(v, share).to_wire())


def test_complete_board_with_openings_passes_the_audit(tmp_path, ledger_url, monkeypatch):
    run = masked_run(spot_checks=2)
    ids = [Identity.generate("worker") for _ in range(6)]
    pairing_threads = record_pairing_threads(monkeypatch)

    async def scenario(api: Api) -> dict[str, Any]:
        out: dict[str, Any] = {"closes": []}
        api.store.clock = LedgerClock()
        view = await open_board(api, run, ids)
        buckets = by_bucket(view, ids)
        keys_of = [[pk(w) for w in b] for b in buckets]
        out["buckets"] = keys_of
        v0, v1 = run.validators
        # The openings are drawn only once the masked inputs are committed: no checks
        # yet, and a share before the masked phase closed is refused.
        out["checks_at_deal"] = (await api.get(f"/v1/runs/{RUN}/rounds/0/challenges"))[1]
        out["early_share"] = await post_share(api, v0, "0" * 64)
        for i, b in enumerate(buckets):
            for w in b:
                assert (await post(api, "keys", w, keys_msg(w, i)))[0] == 201
        out["closes"].append(await board(api))
        for i, b in enumerate(buckets):
            for w in b:
                assert (await post(api, "deal", w, deal_msg(w, i, keys_of[i])))[0] == 201
        out["closes"].append(await board(api))
        a = buckets[0][0]
        before = stable(await board(api))
        out["masked_refusals"] = {
            "short_words": await post_masked(api, a, masked_msg(a, 0, WORDS[:-4]),
                                             WORDS[:-4]),
            "long_words": await post_masked(api, a, masked_msg(a, 0, WORDS + bytes(4)),
                                            WORDS + bytes(4)),
            # The envelope claims 40 bytes but hashes a 36-byte file.
            "size_lie": await post_masked(api, a, masked_msg(a, 0, WORDS[:-4], words_bytes=40),
                                          WORDS[:-4]),
            "hash_lie": await post_masked(api, a, masked_msg(a, 0, group=keys_of[0]),
                                          b"\x01" * len(WORDS)),
            "other_dealers": await post_masked(api, a, masked_msg(a, 0,
                                                                  group=keys_of[0][:2])),
            "wrong_bucket": await post_masked(api, a, masked_msg(a, 1)),
        }
        out["masked_unchanged"] = stable(await board(api)) == before
        # A refused masked input's words never reach the blob store.
        out["refused_words"] = await api.get(f"/v1/blobs/{hashlib.sha256(WORDS).hexdigest()}")
        for i, b in enumerate(buckets):
            for w in b:
                data = hashlib.sha256(pk(w).encode()).digest()[: len(WORDS)].ljust(len(WORDS),
                                                                                   b"\0")
                status, body = await post_masked(api, w, masked_msg(w, i, data,
                                                                    group=keys_of[i]), data)
                assert status == 201, body
        # An exact resend is answered from the board, its words are not read again.
        out["masked_again"] = await post_masked(api, w, masked_msg(w, i, data,
                                                                   group=keys_of[i]), b"")
        out["closes"].append(await board(api))
        committed = out["closes"][-1]["openings"]
        out["committed"] = committed
        # Each post's pairings actually computed (cache misses): only a share that passed
        # every cheap check costs one, and an exact resend none.
        pairings = out["pairings"] = {}
        computed = api.store.bls.computed

        async def counted(name: str, posting: Any) -> None:
            before = api.store.bls.computed
            out[name] = await posting
            pairings[name] = api.store.bls.computed - before

        await counted("wrong_share", post_share(api, v0, "0" * 64))
        await counted("bad_share", post_share(api, v0, committed["masked"],
                                              signed_over="1" * 64))
        await counted("share0", post_share(api, v0, committed["masked"]))
        await counted("share0_again", post_share(api, v0, committed["masked"]))
        out["checks_at_one"] = (await api.get(f"/v1/runs/{RUN}/rounds/0/challenges"))[1]
        await counted("share1", post_share(api, v1, committed["masked"]))
        await counted("second_share", post_share(api, v1, "0" * 64))
        out["all_pairings"] = api.store.bls.computed - computed
        out["fixed"] = (await board(api))["openings"]["fixed"]
        out["challenged"] = [c["worker"] for c in (await api.get(
            f"/v1/runs/{RUN}/rounds/0/challenges"))[1]["challenges"]]
        who = {pk(w): (w, i) for i, b in enumerate(buckets) for w in b}
        unchallenged = next(k for k in who if k not in out["challenged"])
        uw, ui = who[unchallenged]
        out["not_challenged"] = await post(api, "opening", uw, opening_msg(uw, ui))
        cw, ci = who[out["challenged"][0]]
        out["opening_wrong_bucket"] = await post(api, "opening", cw, opening_msg(cw, 1 - ci))
        out["openings"] = []
        for k in out["challenged"]:
            cw, ci = who[k]
            out["openings"].append(await post(api, "opening", cw, opening_msg(cw, ci)))
        out["opening_again"] = await post(api, "opening", cw, opening_msg(cw, ci))
        surv = keys_of[0]
        out["other_view"] = await post(api, "view", a, view_msg(a, 0, surv, surv[:2]))
        for i, b in enumerate(buckets):
            for w in b:
                assert (await post(api, "view", w, view_msg(w, i, keys_of[i],
                                                            keys_of[i])))[0] == 201
        out["closes"].append(await board(api))
        sig0 = buckets[0]
        before = stable(await board(api))
        out["reveal_refusals"] = {
            "unsigned": await post(api, "reveal", a, reveal_msg(a, 0, surv, surv, [])),
            "too_few_signatures": await post(api, "reveal", a, reveal_msg(
                a, 0, surv, surv, [], signers=sig0[:2])),
            "other_survivors": await post(api, "reveal", a, reveal_msg(a, 0, surv[:2], surv,
                                                                       [])),
            "reordered": await post(api, "reveal", a, reveal_msg(a, 0, surv[::-1], surv, [])),
            "key_of_survivor": await post(api, "reveal", a, reveal_msg(
                a, 0, surv, surv[:2], surv[2:], signers=sig0)),
            "twice": await post(api, "reveal", a, reveal_msg(a, 0, surv, surv + surv[:1],
                                                             [], signers=sig0)),
            "outsider_seed": await post(api, "reveal", a, reveal_msg(
                a, 0, surv, surv + keys_of[1][:1], [])),
        }
        out["reveal_unchanged"] = stable(await board(api)) == before
        for i, b in enumerate(buckets):
            for w in b:
                assert (await post(api, "reveal", w, reveal_msg(
                    w, i, keys_of[i], keys_of[i], [], signers=buckets[i])))[0] == 201
        out["final"] = await board(api)
        out["bucket0"] = await board(api, "?bucket=0")
        out["late_reveal"] = await post(api, "reveal", a, reveal_msg(a, 0, surv, surv[:1], []))
        out["audit"], out["full"], events = await audit(api)
        out["chained"] = [e.kind for e in events if e.kind.startswith("secagg")]
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url, **NO_LIMITS)
    everyone = sorted(w for b in out["buckets"] for w in b)
    # Each phase closed the moment its last sender posted, long before its deadline.
    for n, view in enumerate(out["closes"], start=1):
        closed = view["phases"][:n]
        assert all(p["closed_at"] is not None and p["closed_at"] < p["deadline"] - 1.0
                   for p in closed)
        nxt = view["phases"][n]
        assert nxt["opened_at"] == closed[-1]["closed_at"] and nxt["closed_at"] is None
        assert nxt["expected"] == everyone
    m = out["masked_refusals"]
    for name in ("short_words", "long_words"):
        assert refused(m[name], 400, "malformed"), (name, m[name])
    assert refused(m["size_lie"], 400, "malformed")
    assert refused(m["hash_lie"], 400, "payload_mismatch")
    assert refused(m["wrong_bucket"], 403, "wrong_bucket")
    assert refused(m["other_dealers"], 400, "malformed")  # masked over other dealers
    assert refused(out["other_view"], 400, "malformed")  # a view that is not the board's
    assert out["masked_unchanged"]
    assert refused(out["refused_words"], 404, "not_found")
    assert out["masked_again"] == (201, {"kind": "masked", "already": True})
    assert out["checks_at_deal"]["fixed"] is False
    assert refused(out["early_share"], 409, "phase_closed")
    committed = out["committed"]
    assert committed["fixed"] is None and len(committed["inputs"]) == 6
    assert committed["masked"] == inputs_digest(committed["inputs"])
    assert refused(out["wrong_share"], 409, "wrong_masked")
    assert refused(out["bad_share"], 401, "bad_signature")
    assert out["share0"][0] == 201 and out["checks_at_one"]["fixed"] is False
    assert out["share0_again"] == (201, {"kind": "openings_share", "already": True})
    assert out["pairings"] == {"wrong_share": 0, "bad_share": 1, "share0": 1,
                               "share0_again": 0, "share1": 1, "second_share": 0}
    assert out["all_pairings"] == 3
    assert out["share1"][0] == 201
    assert refused(out["second_share"], 409, "wrong_masked")
    fixed = out["fixed"]
    seed = verify_openings([{"bls": v.public.bls} for v in run.validators], 2, None,
                           RUN, 0, fixed, committed["masked"])
    assert fixed["seed"] == seed.hex() and fixed["signers"] == [0, 1]
    policy = ChallengePolicy.of_run(run.spec)
    drawn = compute_challenges(seed, everyone, policy,
                               buckets=survivor_buckets(committed["inputs"]))
    assert sorted(out["challenged"]) == sorted(w for w, segs in drawn.items() if segs)
    assert len(out["challenged"]) == 2
    assert refused(out["not_challenged"], 403, "not_challenged")
    assert [s for s, _ in out["openings"]] == [201, 201]
    assert refused(out["opening_wrong_bucket"], 409, "wrong_state")
    assert out["opening_again"][1] == {"kind": "opening", "already": True}
    rr = out["reveal_refusals"]
    for name, reply in rr.items():
        assert refused(reply, 400, "malformed"), (name, reply)
    assert out["reveal_unchanged"]
    final = out["final"]
    assert final["complete"]
    assert [p["name"] for p in final["phases"]] == ["keys", "deal", "masked", "view", "reveal"]
    assert all(p["closed_at"] < p["deadline"] for p in final["phases"])
    assert [b["survivors"] for b in final["buckets"]] == out["buckets"]
    assert all(b["live"] for b in final["buckets"])
    posts = final["posts"]
    assert {k: len(v) for k, v in posts.items()} == {"keys": 6, "deal": 6, "masked": 6,
                                                     "view": 6, "reveal": 6, "opening": 2}
    assert sorted(p["body"]["worker"] for p in posts["opening"]) == sorted(out["challenged"])
    b0 = out["bucket0"]
    assert len(b0["posts"]["keys"]) == 3
    assert {p["body"]["worker"] for p in b0["posts"]["keys"]} == set(out["buckets"][0])
    assert refused(out["late_reveal"], 409, "duplicate")
    # The bad share, the two shares that fixed the seed and the early one (valid over its
    # own digest), each computed once, off the writer; the writer found them cached.
    assert sum(n.startswith("ledger-verify") for n in pairing_threads) >= 3
    assert [n for n in pairing_threads if n.startswith("ledger-writer")] == []
    assert out["chained"].count("secagg_keys") == 6
    assert out["chained"].count("secagg_opening") == 2
    assert out["chained"].count("secagg_masked_input") == 6
    assert out["audit"].ok, out["audit"].problem
    assert out["full"].ok, out["full"].problem


def test_deadlines_close_phases_and_drop_buckets_that_cannot_finish(tmp_path, ledger_url):
    """An injected clock (no sleeping): keys closes at its deadline without one member,
    and buckets that fall below k = 3 (buckets of three: t is capped at
    floor((3 - 1) / 3) = 0) are dropped: one at keys, one at masked; nobody reveals."""
    run = masked_run()
    ids = [Identity.generate("worker") for _ in range(6)]
    seconds = MASKED["phase_seconds"]
    clock = LedgerClock()

    async def scenario(api: Api) -> dict[str, Any]:
        out: dict[str, Any] = {}
        api.store.clock = clock
        view = await open_board(api, run, ids)
        (a, b, c), (d, e, f) = by_bucket(view, ids)
        out["started_at"] = view["started_at"]
        out["keys_of"] = [[pk(a), pk(b), pk(c)], [pk(d), pk(e), pk(f)]]
        group = out["keys_of"][0]
        for w, i in ((a, 0), (b, 0), (c, 0), (d, 1), (e, 1)):  # f never advertises
            assert (await post(api, "keys", w, keys_msg(w, i)))[0] == 201
        out["keys_waiting"] = await board(api)
        clock.advance(seconds)
        out["keys_deadline"] = await board(api)
        out["late_keys"] = await post(api, "keys", f, keys_msg(f, 1))
        out["f_deal"] = await post(api, "deal", f, deal_msg(f, 1, [pk(d), pk(e), pk(f)]))
        out["d_deal"] = await post(api, "deal", d, deal_msg(d, 1, [pk(d), pk(e)]))
        for w in (a, b, c):
            assert (await post(api, "deal", w, deal_msg(w, 0, group)))[0] == 201
        out["deal_closed"] = await board(api)
        for w in (a, b):  # c drops out
            status, body = await post_masked(api, w, masked_msg(w, 0, group=group))
            assert status == 201, body
        out["masked_waiting"] = await board(api)
        clock.advance(seconds)
        out["masked_deadline"] = await board(api)
        out["late_masked"] = await post_masked(api, c, masked_msg(c, 0, group=group))
        out["view_a"] = await post(api, "view", a, view_msg(a, 0, group, group[:2]))
        out["reveal_a"] = await post(api, "reveal", a, reveal_msg(
            a, 0, group[:2], group[:2], group[2:], group=group, signers=[a, b]))
        out["finalized"] = await asyncio.to_thread(finalize, api.store, run)
        out["after_final"] = await post(api, "opening", a, opening_msg(a, 0))
        out["audit"], out["full"], _ = await audit(api)
        return out

    def finalize(store: Any, run: FakeRun) -> str:
        with store.sessions() as s:
            seed = beacon_seed_of(s.get(t.Round, (RUN, 0)).beacon)
        subs = {}
        for envelope in store.sealed_submissions(RUN, 0)[0]:
            signed = open_signed(decode_canonical(envelope), Submission)
            subs[signed.message.worker] = signed.digest
        results, blobs = build_results(run, 0, run.spec.genesis_model_hash, seed, subs,
                                       dict.fromkeys(subs, HONEST))
        for name, data in blobs.items():
            store.record_blob(hashlib.sha256(data).hexdigest(), len(data), name, RUN)
        return [store.post_result(res) for res in results][-1]["status"]

    out = run_api(tmp_path, scenario, db_url=ledger_url, **NO_LIMITS)
    start = out["started_at"]
    (ka, kb, kc), (kd, ke, _) = out["keys_of"]
    w = out["keys_waiting"]
    assert [p["name"] for p in w["phases"]] == ["keys"] and w["phases"][0]["closed_at"] is None
    kd_view = out["keys_deadline"]
    keys, deal = kd_view["phases"]
    assert keys["closed_at"] == pytest.approx(start + seconds)
    assert keys["closed_at"] == keys["deadline"]
    assert deal["opened_at"] == keys["closed_at"] and deal["closed_at"] is None
    # Bucket 1 has two advertisers, fewer than k = 3: dropped, it deals nothing.
    assert [b["members"] for b in kd_view["buckets"]] == [[ka, kb, kc], [kd, ke]]
    assert [b["live"] for b in kd_view["buckets"]] == [True, False]
    assert deal["expected"] == sorted([ka, kb, kc])
    assert refused(out["late_keys"], 409, "phase_closed")
    assert refused(out["f_deal"], 403, "not_expected")
    assert refused(out["d_deal"], 403, "not_expected")
    dc = out["deal_closed"]
    assert dc["phases"][1]["closed_at"] < dc["phases"][1]["deadline"]  # all three dealt
    assert dc["phases"][2]["expected"] == sorted([ka, kb, kc])
    mw = out["masked_waiting"]
    assert mw["phases"][2]["closed_at"] is None and len(mw["phases"]) == 3
    md = out["masked_deadline"]
    assert md["phases"][2]["closed_at"] == md["phases"][2]["deadline"]
    b0 = md["buckets"][0]
    # Two survivors of three, below k = 3: dropped, so nobody signs a view or reveals.
    assert b0["survivors"] == [ka, kb] and not b0["live"]
    assert [p["name"] for p in md["phases"]] == ["keys", "deal", "masked", "view", "reveal"]
    assert md["phases"][3]["expected"] == [] and md["complete"]
    assert refused(out["late_masked"], 409, "phase_closed")
    assert refused(out["view_a"], 409, "phase_closed")
    assert refused(out["reveal_a"], 409, "phase_closed")
    assert out["finalized"] == "finalized"
    assert refused(out["after_final"], 409, "round_finalized")
    assert out["audit"].ok, out["audit"].problem
    assert out["full"].ok, out["full"].problem


def test_real_masked_workers_complete_the_board_and_it_unmasks_to_their_sum(tmp_path,
                                                                            ledger_url):
    """The workers' own board walk (workers/masked.py, real X25519 keys, Shamir
    deals and masks) is taken as is, and the validators' reading of the final board
    unmasks each bucket to the sum of its members' updates."""
    import numpy as np
    import torch
    from veritrain.aggregation.secure import MaskedInput, unmask_bucket
    from veritrain.validators.masked import parse_board
    from veritrain.workers.masked import take_part

    run = masked_run(spot_checks=1)
    ids = [Identity.generate("worker") for _ in range(6)]
    gen = torch.Generator().manual_seed(5)
    updates = {pk(w): torch.randn(NUM_PARAMS, generator=gen) * 0.1 for w in ids}

    async def scenario(api: Api) -> dict[str, Any]:
        out: dict[str, Any] = {}
        api.store.clock = LedgerClock()
        await open_board(api, run, ids)

        async def validators_draw_the_openings() -> None:
            """What the validators do once the masked inputs are committed."""
            while (view := await board(api))["openings"]["masked"] is None:
                await asyncio.sleep(0.05)
            for v in run.validators:
                assert (await post_share(api, v, view["openings"]["masked"]))[0] == 201

        async with LedgerClient(api.url, retry_for=5.0) as client:
            out["ended"], _ = await asyncio.gather(asyncio.gather(*[
                take_part(client, run.spec, w, 0, updates[pk(w)], poll_seconds=0.05,
                          attack=None) for w in ids]), validators_draw_the_openings())
        view = await board(api)
        # take_part returns after its reveal; the last reveal closes the board.
        out["view"] = view
        out["challenged"] = [c["worker"] for c in (await api.get(
            f"/v1/runs/{RUN}/rounds/0/challenges"))[1]["challenges"]]
        words = {}
        for wire in view["posts"]["masked"]:
            body = wire["body"]
            async with api.session.get(f"{api.url}/v1/blobs/{body['words_hash']}") as resp:
                assert resp.status == 200
                words[body["worker"]] = np.frombuffer(await resp.read(), dtype="<u4").astype(
                    np.uint32)
        out["words"] = words
        out["audit"], out["full"], _ = await audit(api)
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url, **NO_LIMITS)
    assert out["ended"] == ["revealed"] * 6
    view = out["view"]
    assert view["complete"]
    assert all(p["closed_at"] < p["deadline"] for p in view["phases"])  # nobody waited
    assert len(out["challenged"]) == 1
    assert [p["body"]["worker"] for p in view["posts"]["opening"]] == out["challenged"]
    boards, openings = parse_board(run.spec, view)
    assert set(openings) == set(out["challenged"])
    assert len(boards) == 2 and all(b.live and b.survivors == b.assigned for b in boards)
    for b in boards:
        inputs = [MaskedInput(bytes.fromhex(w), b.index, bytes.fromhex(b.masked[w].commitment),
                              out["words"][w]) for w in b.survivors]
        total = unmask_bucket(b.ctx, b.adverts, b.commitments, inputs, b.reveals)
        assert not total.faults
        want = sum(updates[w].double() for w in b.survivors)
        assert torch.allclose(total.total, want, atol=1e-4), (total.total, want)
    assert out["audit"].ok, out["audit"].problem
    assert out["full"].ok, out["full"].problem
