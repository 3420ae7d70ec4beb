"""Masked-bucket rounds: the rules every party applies alike (specs/secure-averaging.md E.2).

Once a round's beacon is fixed, the sealed submitters are dealt into buckets
(:func:`round_buckets`), and each bucket runs five phases on the ledger's
board: ``keys`` (every member advertises fresh X25519 keys), ``deal`` (the
advertisers share their secrets among each other), ``masked`` (the dealers
post masked inputs; who did is the survivor set U), ``view`` (each survivor signs
the members, dealers and survivors it acted on: Bonawitz et al.'s consistency
round) and ``reveal`` (the signers reveal the shares that unmask the bucket's sum,
and nothing else, once k members signed exactly their view).

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

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from .encoding import encode_canonical
from .errors import RejectedInput
from .messages import SecaggReveal, SecaggView
from .signing import verify_ed25519

PHASES = ("keys", "deal", "masked", "view", "reveal")
_BUCKET_DOMAIN = b"veritrain/v1/secure/bucket"
_VIEW_DOMAIN = b"veritrain/v1/secure/bucket-view"
#: A fixed X25519 scalar: any public key that gives an all-zero secret with it is of low
#: order (clamped scalars are multiples of the cofactor), so it gives one with every key.
_PROBE_KEY = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"veritrain/v1/x25519-probe")
                                                 .digest())


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


def bucket_dropouts(max_dropouts: int, assigned: int) -> int:
    """t for a bucket dealt ``assigned`` workers: the run's t capped at floor((a - 1) / 3),
    so k = a - t > 2a / 3 (spec E.2): two views each signed by k members share at least
    2k - a = a - 2t > a / 3 signers, which only colluding members would be."""
    return max(0, min(max_dropouts, (assigned - 1) // 3))


def bucket_threshold(max_dropouts: int, assigned: int) -> int:
    """k for a bucket dealt ``assigned`` workers: the least number of members, dealers,
    survivors and view signers it needs. It follows from the beacon's deal alone, so a
    ledger that hides members from one worker cannot lower it."""
    return assigned - bucket_dropouts(max_dropouts, assigned)


def view_digest(run_id: str, r: int, bucket: int, members: Sequence[str],
                dealers: Sequence[str], survivors: Sequence[str] | None = None) -> str:
    """The digest of a bucket view: members and dealers (what a masked input was masked
    over) and, once fixed, the survivors (what a reveal unmasks)."""
    body: dict[str, object] = {"run_id": run_id, "round": r, "bucket": bucket,
                               "members": list(members), "dealers": list(dealers)}
    if survivors is not None:
        body["survivors"] = list(survivors)
    return hashlib.sha256(_VIEW_DOMAIN + encode_canonical(body)).hexdigest()


def usable_x25519(public_hex: str) -> bool:
    """Whether an advertised X25519 key agrees a secret at all (not a low-order point such
    as all zeros, with which every exchange fails and the whole bucket would stall)."""
    try:
        _PROBE_KEY.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)))
        return True
    except ValueError:
        return False


def view_of(msg: SecaggView | SecaggReveal, worker: str) -> SecaggView:
    """The SecaggView that ``worker`` signed, in the lists a view or a reveal names."""
    return SecaggView(run_id=msg.run_id, round=msg.round, bucket=msg.bucket, worker=worker,
                      members=list(msg.members), dealers=list(msg.dealers),
                      survivors=list(msg.survivors))


def view_signers(msg: SecaggReveal) -> set[str]:
    """The survivors whose signatures in ``msg.view_signatures`` verify on the reveal's
    view (each once); the rest are ignored."""
    good: set[str] = set()
    for item in msg.view_signatures:
        worker = item["worker"]
        if worker in good or worker not in msg.survivors:
            continue
        if verify_ed25519(bytes.fromhex(worker), view_of(msg, worker).signing_root(),
                          bytes.fromhex(item["signature"])):
            good.add(worker)
    return good


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
    live: bool  # False once it can no longer finish (fewer than k members, dealers, ...)
    signers: tuple[str, ...] | None = None  # the survivors that signed the view, once closed


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

    Expected senders, in live buckets only: ``keys`` every assigned member; ``deal`` the
    advertisers; ``masked`` the dealers; ``view`` the survivors U; ``reveal`` the
    survivors that signed the view. A bucket lives while each of these sets reaches the
    threshold k of :func:`bucket_threshold` (fewer survivors would expose their sum to
    too few masks, so such a bucket is dropped and nobody reveals for it).
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
            elif name == "view":
                assert st.survivors is not None
                expected.update(st.survivors)
            else:
                assert st.signers is not None
                expected.update(st.signers)
        phase = _close(opened, seconds, frozenset(expected), got, now, name)
        phases.append(phase)
        if phase.closed_at is None:
            break
        new_states = []
        for st in states:
            k = bucket_threshold(max_dropouts, len(st.assigned))
            if name == "keys":
                members = tuple(w for w in st.assigned if w in got)
                st = BucketState(st.index, st.assigned, members, None, None,
                                 st.live and len(members) >= max(2, k))
            elif name == "deal":
                assert st.members is not None
                dealers = tuple(w for w in st.members if w in got)
                st = BucketState(st.index, st.assigned, st.members, dealers, None,
                                 st.live and len(dealers) >= max(2, k))
            elif name == "masked":
                assert st.dealers is not None
                survivors = tuple(w for w in st.dealers if w in got)
                st = BucketState(st.index, st.assigned, st.members, st.dealers, survivors,
                                 st.live and len(survivors) >= k)
            elif name == "view":
                assert st.survivors is not None
                signers = tuple(w for w in st.survivors if w in got)
                st = BucketState(st.index, st.assigned, st.members, st.dealers, st.survivors,
                                 st.live and len(signers) >= k, signers)
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
