"""The real masked worker (workers/masked.py) against a ledger board that lies.

The ledger relays every post of a masked round and is not trusted
(ARCHITECTURE, "Check every board message you act on"). Here a fake board shows
each worker a view of its choosing: adverts signed by the ledger's own key,
genuine adverts of another round, a dealer list of two for the victim while the
others are told a member dropped, the victim "dropped" for some holders and
"alive" for others with a colluder signing both views, a member's key of low
order. Every other part is the real code: X25519 keys, Shamir deals, masks,
signed views, reveals. In each attack the victim's update stays hidden (the
ledger never holds k shares of both kinds for one dealer); on an honest board the
validators' reading of it unmasks the bucket to the sum of the updates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from fakes import make_fake_run
from veritrain.aggregation.secure import MaskedInput, unmask_bucket
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import SecaggKeys, SecaggView, sign
from veritrain.protocol.presets import run_preset
from veritrain.protocol.secagg import PHASES, bucket_threshold
from veritrain.validators.masked import parse_board
from veritrain.workers.masked import MaskedRound

RUN = "lying-board"
D = 10
SENDER = {"keys": "worker", "deal": "dealer", "masked": "worker", "view": "worker",
          "reveal": "holder", "opening": "worker"}
#: shows(viewer, kind, sender) -> whether the board shows ``viewer`` that post
Shows = Callable[[str, str, str], bool]


def masked_spec(bucket_size: int, max_dropouts: int) -> Any:
    verification = {**run_preset("tiny")["verification"], "probe_examples": 0,
                    "spot_checks_per_round": 0}
    run = make_fake_run(RUN, n_validators=2, quorum=2, verification=verification,
                        aggregator={"name": "centered_clip", "params": {"tau_rel": 1.0},
                                    "masked": {"bucket_size": bucket_size,
                                               "max_dropouts": max_dropouts,
                                               "clip_norm": 10.0, "phase_seconds": 5.0}},
                        schedule={**run_preset("tiny")["schedule"], "min_submissions": 2})
    assert run.spec.num_params == D
    return run.spec


class LyingBoard:
    """One bucket's board, shown to each viewer through ``shows`` plus ``extra`` posts.

    A phase closes once every worker posted to it or stopped; the lists a viewer is
    shown are the posters it is shown, and the bucket always looks live.
    """

    def __init__(self, assigned: list[str], shows: Shows | None = None,
                 extra: Callable[[str, str], list[dict[str, Any]]] | None = None) -> None:
        self.assigned = sorted(assigned)
        self.shows: Shows = shows or (lambda viewer, kind, sender: True)
        self.extra = extra or (lambda viewer, kind: [])
        self.posts: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in SENDER}
        self.done: set[str] = set()
        self.words: dict[str, bytes] = {}

    def store(self, kind: str, wire: dict[str, Any]) -> None:
        self.posts[kind].setdefault(wire["body"][SENDER[kind]], wire)

    def view(self, viewer: str | None) -> dict[str, Any]:
        """What ``viewer`` is shown (None: everything, as an honest board would)."""
        def shown(kind: str) -> dict[str, dict[str, Any]]:
            return {w: p for w, p in self.posts[kind].items()
                    if viewer is None or self.shows(viewer, kind, w)}

        phases, lists, within = [], {}, list(self.assigned)
        for kind, name in zip(PHASES, ("members", "dealers", "survivors", "signers", None),
                              strict=True):
            closed = all(w in self.posts[kind] or w in self.done for w in self.assigned)
            phases.append({"name": kind, "closed_at": 1.0 if closed else None})
            if not closed:
                break
            if name is not None:
                within = sorted(w for w in shown(kind) if w in within)
                lists[name] = within
        posts = {kind: list(shown(kind).values()) + (self.extra(viewer, kind) if viewer else [])
                 for kind in SENDER}
        bucket = {"index": 0, "assigned": self.assigned, "live": True,
                  **{n: lists.get(n) for n in ("members", "dealers", "survivors", "signers")}}
        return {"round": 0, "phases": phases, "buckets": [bucket], "posts": posts,
                "complete": len(phases) == len(PHASES) and phases[-1]["closed_at"] is not None}


class FakeClient:
    """The LedgerClient calls a MaskedRound makes, answered by the lying board."""

    def __init__(self, board: LyingBoard, viewer: str) -> None:
        self.board, self.viewer = board, viewer

    async def get_json(self, path: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        if path.endswith("/challenges"):
            return {"challenges": []}
        return self.board.view(self.viewer)

    async def post_message(self, path: str, wire: dict[str, Any]) -> dict[str, Any]:
        self.board.store(path.rsplit("/", 1)[1], wire)
        return {}

    async def post_multipart(self, path: str, parts: list[tuple[str, bytes, str]]
                             ) -> dict[str, Any]:
        fields = {name: data for name, data, _ in parts}
        wire = decode_canonical(fields["envelope"])
        self.board.store("masked", wire)
        self.board.words[wire["body"]["worker"]] = fields["words"]
        return {}


async def _no_deal_check(self: MaskedRound, view: dict[str, Any]) -> None:
    """The beacon and the deal are checked elsewhere (test_masked_rounds): not here."""


async def _no_openings(self: MaskedRound) -> None:
    """The openings seed is drawn and checked elsewhere (test_ledger_secagg,
    test_masked_rounds): this board is about the bucket's views."""


@pytest.fixture(autouse=True)
def _skip_the_deal_check(monkeypatch):
    monkeypatch.setattr(MaskedRound, "_check_deal", _no_deal_check)
    monkeypatch.setattr(MaskedRound, "open_if_challenged", _no_openings)


def pk(w: Identity) -> str:
    return w.public_key.hex()


def run_bucket(spec: Any, ids: list[Identity], board: LyingBoard,
               updates: dict[str, torch.Tensor], *, skip: set[str] = frozenset()
               ) -> dict[str, str]:
    """Every worker not in ``skip`` walks the board with the real MaskedRound."""
    async def one(w: Identity) -> str:
        try:
            return await MaskedRound(FakeClient(board, pk(w)), spec, w, 0,
                                     poll_seconds=0.001).run(updates[pk(w)])
        finally:
            board.done.add(pk(w))

    async def main() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*(one(w) for w in ids
                                                       if pk(w) not in skip)), 60)

    walkers = [pk(w) for w in ids if pk(w) not in skip]
    board.done.update(skip)
    return dict(zip(walkers, asyncio.run(main()), strict=True))


def shares_revealed(board: LyingBoard, dealer: str, kind: str,
                    holders: set[str] | None = None) -> int:
    """How many reveals on the board hold a ``kind`` share (seed, key) of ``dealer``."""
    field = "seed_shares" if kind == "seed" else "key_shares"
    return sum(1 for holder, rv in board.posts["reveal"].items()
               if (holders is None or holder in holders)
               and any(it["dealer"] == dealer for it in rv["body"][field]))


def ledger_unmasks(board: LyingBoard, victim: str, k: int, colluders: set[str]) -> bool:
    """Whether the ledger, holding every reveal and the colluders' shares, has k seed
    shares of the victim and k key shares of the victim (or of every dealer it masked
    with): what stripping all of its masks takes."""
    c = len(colluders)
    seeds = shares_revealed(board, victim, "seed", set(board.assigned) - colluders) + c
    if seeds < k:
        return False
    if shares_revealed(board, victim, "key", set(board.assigned) - colluders) + c >= k:
        return True
    masked = board.posts["masked"].get(victim)
    if masked is None:
        return False
    partners = [w for w in board.assigned if w != victim and w not in colluders]
    return all(shares_revealed(board, p, "key", set(board.assigned) - colluders) + c >= k
               for p in partners)


def at_most_one_kind_per_dealer(board: LyingBoard, honest: set[str]) -> bool:
    return all(not (shares_revealed(board, d, "seed", honest)
                    and shares_revealed(board, d, "key", honest)) for d in board.assigned)


def updates_for(ids: list[Identity]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {pk(w): torch.randn(D, generator=gen) * 0.1 for w in ids}


# ------------------------------------------------------------------ the honest board

def test_an_honest_board_unmasks_to_the_sum_and_every_member_reveals():
    spec = masked_spec(5, 2)
    ids = [Identity.generate("worker") for _ in range(5)]
    updates = updates_for(ids)
    board = LyingBoard([pk(w) for w in ids])
    ended = run_bucket(spec, ids, board, updates)
    assert set(ended.values()) == {"revealed"}
    view = board.view(None)
    assert view["complete"]
    (parsed,), _ = parse_board(spec, view)
    assert parsed.live and parsed.survivors == parsed.assigned and not parsed.faults
    inputs = [MaskedInput(bytes.fromhex(w), 0, bytes.fromhex(parsed.masked[w].commitment),
                          np.frombuffer(board.words[w], dtype="<u4")
                          .astype(np.uint32)) for w in parsed.survivors]
    total = unmask_bucket(parsed.ctx, parsed.adverts, parsed.commitments, inputs,
                          parsed.reveals)
    want = sum(updates[w].double() for w in parsed.survivors)
    assert torch.allclose(total.total, want, atol=1e-4)
    # Each reveal carries k survivors' signatures on the one view everyone signed.
    k = bucket_threshold(2, 5)
    assert k == 4  # t = 2 is capped at floor((5 - 1) / 3) = 1
    assert all(len(rv["body"]["view_signatures"]) >= k for rv in board.posts["reveal"].values())


# ------------------------------------------------------------------ attack 1: forged adverts

def test_adverts_signed_by_the_ledger_or_of_another_round_are_refused():
    """The ledger shows the victim adverts for every peer carrying keys it holds, signed
    with its own key (or genuine ones of another round): the victim seals no share to
    them and masks with no key the ledger knows. It stops, and the others go on."""
    spec = masked_spec(4, 1)
    ids = [Identity.generate("worker") for _ in range(4)]
    victim, ledger = pk(ids[0]), Identity.generate("worker")
    ledger_keys = Identity.generate("worker")  # stands for X25519 keys the ledger holds

    def forged(viewer: str, kind: str) -> list[dict[str, Any]]:
        if viewer != victim or kind != "keys":
            return []
        out = []
        for w in ids[1:]:
            body = SecaggKeys(run_id=RUN, round=0, bucket=0, worker=pk(w),
                              enc_public=pk(ledger_keys), mask_public=pk(ledger_keys))
            out.append(sign(ledger, body).to_wire())  # the peer's name, the ledger's key
            replay = SecaggKeys(run_id=RUN, round=1, bucket=0, worker=pk(w),
                                enc_public=pk(ledger_keys), mask_public=pk(ledger_keys))
            out.append(sign(w, replay).to_wire())  # the peer's own key, another round
        return out

    board = LyingBoard([pk(w) for w in ids],
                       shows=lambda viewer, kind, sender: not (
                           viewer == victim and kind == "keys" and sender != victim),
                       extra=forged)
    ended = run_bucket(spec, ids, board, updates_for(ids))
    assert ended[victim] == "bucket did not form"  # its own advert alone is not k members
    assert victim not in board.posts["deal"] and victim not in board.posts["masked"]
    assert not ledger_unmasks(board, victim, bucket_threshold(1, 4), set())


# ------------------------------------------------------------------ attack 2: split views

def test_a_dealer_view_of_two_for_the_victim_makes_it_stop_before_masking():
    """Bucket of 5: the victim is told dealers = {V, H1}, survivors = {V}; the others
    that H1 dropped. The victim's own threshold (k of the assigned five) stops it."""
    spec = masked_spec(5, 2)
    ids = [Identity.generate("worker") for _ in range(5)]
    keys = [pk(w) for w in ids]
    victim, h1 = keys[0], keys[1]

    def shows(viewer: str, kind: str, sender: str) -> bool:
        if viewer == victim:
            if kind == "keys":
                return True
            return sender in (victim, h1) if kind == "deal" else sender == victim
        return not (kind in ("masked", "view", "reveal") and sender == h1)

    board = LyingBoard(keys, shows=shows)
    ended = run_bucket(spec, ids, board, updates_for(ids))
    assert ended[victim] == "too few dealers"
    assert victim not in board.posts["masked"]
    assert not ledger_unmasks(board, victim, bucket_threshold(2, 5), set())
    assert at_most_one_kind_per_dealer(board, set(keys))


def test_the_victim_dropped_for_some_and_alive_for_others_reveals_nothing():
    """The classic attack: holders H1, V are shown V's masked input, H2, H3 are not (V
    "dropped"), and a colluder C signs both views. Neither view reaches k = 4 signatures
    (k > 2s/3), so nobody reveals and the ledger holds no share of the victim."""
    spec = masked_spec(5, 2)
    ids = [Identity.generate("worker") for _ in range(5)]
    keys = [pk(w) for w in ids]
    victim, h1, h2, h3, colluder = keys
    told_dropped = {h2, h3}

    def shows(viewer: str, kind: str, sender: str) -> bool:
        if kind == "masked" and sender == victim:
            return viewer not in told_dropped
        if kind == "view":  # each side sees only the views signed on its side
            return (viewer in told_dropped) == (sender in told_dropped) or sender == colluder
        return True

    def colluder_signs_both(viewer: str, kind: str) -> list[dict[str, Any]]:
        if kind != "view" or viewer not in told_dropped:
            return []
        theirs = board.posts["view"].get(h2)
        if theirs is None:
            return []
        body = {**theirs["body"], "worker": colluder}
        return [sign(ids[4], SecaggView(**body)).to_wire()]

    board = LyingBoard(keys, shows=shows, extra=colluder_signs_both)
    ended = run_bucket(spec, ids, board, updates_for(ids))
    assert all(ended[w].startswith("board fault") for w in (victim, h1, h2, h3)), ended
    assert board.posts["reveal"] == {} or all(w == colluder for w in board.posts["reveal"])
    assert not ledger_unmasks(board, victim, bucket_threshold(2, 5), {colluder})
    assert at_most_one_kind_per_dealer(board, {victim, h1, h2, h3})


def test_a_second_signed_view_shown_to_a_member_stops_its_reveal():
    """Shown a genuine signature of another member on another view, a member refuses to
    reveal: the ledger showed the bucket two views."""
    spec = masked_spec(4, 1)
    ids = [Identity.generate("worker") for _ in range(4)]
    keys = [pk(w) for w in ids]
    victim = keys[0]
    other = Identity.generate("worker")

    def other_view(viewer: str, kind: str) -> list[dict[str, Any]]:
        mine = board.posts["view"].get(keys[1])
        if kind != "view" or viewer != keys[2] or mine is None:
            return []
        body = {**mine["body"], "survivors": [k for k in mine["body"]["survivors"]
                                              if k != victim]}
        return [sign(ids[1], SecaggView(**body)).to_wire(),
                sign(other, SecaggView(**{**body, "worker": pk(other)})).to_wire()]

    board = LyingBoard(keys, extra=other_view)
    ended = run_bucket(spec, ids, board, updates_for(ids))
    assert ended[keys[2]].startswith("board fault") and "another view" in ended[keys[2]]
    assert keys[2] not in board.posts["reveal"]


# ------------------------------------------------------------------ a bad key

def test_a_member_key_of_low_order_ends_the_walk_without_an_exception():
    """A member advertising an all-zero X25519 key (an honest ledger refuses it; this one
    lists it): every honest member ends its walk as a board fault instead of dying."""
    spec = masked_spec(4, 1)
    ids = [Identity.generate("worker") for _ in range(4)]
    keys = [pk(w) for w in ids]
    bad = ids[3]
    board = LyingBoard(keys)
    board.store("keys", sign(bad, SecaggKeys(run_id=RUN, round=0, bucket=0, worker=keys[3],
                                            enc_public="00" * 32,
                                            mask_public="00" * 32)).to_wire())
    ended = run_bucket(spec, ids, board, updates_for(ids), skip={keys[3]})
    assert all("low order" in ended[w] for w in keys[:3]), ended
    assert board.posts["deal"] == {}
