"""Masked-bucket rounds: the rules every party applies alike (specs/secure-averaging.md E.2).

Once a round's beacon is fixed, the sealed submitters are dealt into buckets
(:func:`round_buckets`), and each bucket runs four phases on the ledger's
board: ``keys`` (every member advertises fresh X25519 keys), ``deal`` (the
advertisers share their secrets among each other), ``masked`` (the dealers
post masked inputs; who did is the survivor set U) and ``reveal`` (the
survivors reveal the shares that unmask the bucket's sum, and nothing else).

:func:`phase_schedule` is the one clock of those phases. A phase closes as
soon as everyone it expects has posted, or at its deadline
(``phase_seconds`` after the previous phase closed); the ledger refuses a post
to a closed phase, so the schedule follows from the stored rows and their
receipt times alone (the audit does not recheck it: receipt times are not
chained). Torch-free: the ledger runs it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import RejectedInput

PHASES = ("keys", "deal", "masked", "reveal")
_BUCKET_DOMAIN = b"veritrain/v1/secure/bucket"


def bucket_rank(seed: bytes, worker: bytes) -> bytes:
    """The 32-byte sort key of ``worker`` under ``seed`` (spec B.1)."""
    return hashlib.sha256(_BUCKET_DOMAIN + len(seed).to_bytes(4, "big") + seed + worker).digest()


def deal_ranked(seed: bytes, workers: Sequence[bytes], size: int) -> list[tuple[bytes, ...]]:
    """floor(n / size) buckets, the workers ranked by :func:`bucket_rank` and dealt
    round-robin; each bucket in ascending byte order. Needs n >= size >= 1."""
    ranked = sorted(workers, key=lambda w: bucket_rank(seed, w))
    count = len(ranked) // size
    buckets: list[list[bytes]] = [[] for _ in range(count)]
    for pos, w in enumerate(ranked):
        buckets[pos % count].append(w)
    return [tuple(sorted(b)) for b in buckets]


def round_buckets(seed: bytes, workers: Sequence[str], size: int) -> list[list[str]]:
    """The round's buckets of worker keys (hex): buckets of ``size`` to ``2 size - 1``.

    Fewer than ``size`` workers (but at least two) share one bucket; a lone
    worker has no bucket (its update would be its bucket's sum).
    """
    ids = sorted(set(workers))
    if len(ids) < 2:
        return []
    raw = [bytes.fromhex(w) for w in ids]
    return [[w.hex() for w in b] for b in deal_ranked(seed, raw, min(size, len(raw)))]


def check_dealt(seed: bytes, sealed_workers: Sequence[str], size: int,
                buckets: Sequence[Sequence[str]]) -> None:
    """Refuse a board whose buckets are not :func:`round_buckets` of the beacon seed over
    the sealed submitters (``invalid_board``). A ledger free to deal would put a victim
    with colluding workers, whose own inputs then isolate the victim's in the sum."""
    expected = round_buckets(seed, sealed_workers, size)
    if [list(b) for b in buckets] != expected:
        raise RejectedInput("the board's buckets are not the beacon's deal of the sealed "
                            "submitters", "invalid_board")


def bucket_dropouts(max_dropouts: int, members: int) -> int:
    """t for a bucket of ``members`` advertisers: the run's t, capped so k = s - t > s / 2."""
    return min(max_dropouts, (members + 1) // 2 - 1)


@dataclass(frozen=True)
class Phase:
    """One phase of a masked round: when it opened, its deadline, when it closed
    (None while open) and the senders it waits for."""

    name: str
    opened_at: float
    deadline: float
    closed_at: float | None
    expected: frozenset[str]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "opened_at": self.opened_at, "deadline": self.deadline,
                "closed_at": self.closed_at, "expected": sorted(self.expected)}


@dataclass(frozen=True)
class BucketState:
    """What the board says about one bucket so far."""

    index: int
    assigned: tuple[str, ...]
    members: tuple[str, ...] | None  # the advertisers, once ``keys`` closed
    dealers: tuple[str, ...] | None  # once ``deal`` closed
    survivors: tuple[str, ...] | None  # once ``masked`` closed
    live: bool  # False once it can no longer finish (too few members, dealers or survivors)


#: received[phase][sender] = (bucket, receipt time)
Received = Mapping[str, Mapping[str, tuple[int, float]]]


def _close(opened: float, seconds: float, expected: frozenset[str],
           got: Mapping[str, tuple[int, float]], now: float, name: str) -> Phase:
    deadline = opened + seconds
    if not expected:
        return Phase(name, opened, deadline, opened, expected)
    if expected <= got.keys():
        return Phase(name, opened, deadline, max(opened, max(got[w][1] for w in expected)),
                     expected)
    return Phase(name, opened, deadline, deadline if now >= deadline else None, expected)


def phase_schedule(start: float, seconds: float, buckets: Sequence[Sequence[str]],
                   received: Received, now: float, *, max_dropouts: int
                   ) -> tuple[list[Phase], list[BucketState]]:
    """The phases opened so far and every bucket's state (see the module docstring).

    Expected senders: ``keys`` every assigned member; ``deal`` the advertisers of
    buckets with at least two; ``masked`` the dealers of buckets with at least
    two; ``reveal`` the survivors of buckets where U reaches the threshold
    k = s - t (fewer survivors would expose their sum to too few masks, so such a
    bucket is dropped and nobody reveals for it).
    """
    phases: list[Phase] = []
    states = [BucketState(b, tuple(m), None, None, None, True) for b, m in enumerate(buckets)]
    opened = start
    for name in PHASES:
        got = received.get(name, {})
        expected: set[str] = set()
        for st in states:
            if not st.live:
                continue
            if name == "keys":
                expected.update(st.assigned)
            elif name == "deal":
                assert st.members is not None
                expected.update(st.members)
            elif name == "masked":
                assert st.dealers is not None
                expected.update(st.dealers)
            else:
                assert st.survivors is not None
                expected.update(st.survivors)
        phase = _close(opened, seconds, frozenset(expected), got, now, name)
        phases.append(phase)
        if phase.closed_at is None:
            break
        new_states = []
        for st in states:
            if name == "keys":
                members = tuple(w for w in st.assigned if w in got)
                st = BucketState(st.index, st.assigned, members, None, None,
                                 st.live and len(members) >= 2)
            elif name == "deal":
                assert st.members is not None
                dealers = tuple(w for w in st.members if w in got)
                st = BucketState(st.index, st.assigned, st.members, dealers, None,
                                 st.live and len(dealers) >= 2)
            elif name == "masked":
                assert st.members is not None and st.dealers is not None
                survivors = tuple(w for w in st.dealers if w in got)
                k = len(st.members) - bucket_dropouts(max_dropouts, len(st.members))
                st = BucketState(st.index, st.assigned, st.members, st.dealers, survivors,
                                 st.live and len(survivors) >= k)
            new_states.append(st)
        states = new_states
        opened = phase.closed_at
    return phases, states


def open_phase(phases: Sequence[Phase], name: str) -> Phase | None:
    """The phase called ``name`` if it is open now, else None."""
    for p in phases:
        if p.name == name:
            return p if p.closed_at is None else None
    return None


def words_file_bytes(num_params: int) -> int:
    """Size of a masked input's words file: D uint32 words, little-endian."""
    return 4 * num_params
