"""Which checks each worker must answer, drawn from the round's beacon.

A submission commits to S = H / k training-state commitments (its trail). Once the
round's beacon seed is fixed, every worker in the sealed list has its payload's
binding checked (at ``binding_chunks`` chunks drawn from the beacon) and is challenged:

* ``full_checks`` workers, ranked by sha256(seed || "spot-check" || key), must
  reveal every segment (their whole local training is recomputed);
* every other worker reveals ``floor(c)`` segments, plus one more with
  probability ``frac(c)`` (c = ``challenges_per_worker``), chosen by ranking
  sha256(seed || "segment" || key || u32be(j)); with ``always_last`` the last
  segment is always among them (it binds the payload to the trail).

A challenged segment's check opens ``opened_chunks`` chunks of its end state
(protocol/commitments.py), drawn from the beacon too. Cost for the validators: (sum
of challenged segments) / (N * S) of the workers' training compute. A worker that
fakes a fraction q of its segments escapes one round with probability about
(1 - q)^c, so a free rider (q = 1) is caught in its first round with certainty
whenever c >= 1. What the reveal of those checks weighs: protocol/reveal.py.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .commitments import CHUNK, LEAF, chunk_count
from .secagg import round_buckets

#: Chunks a check opens when a run spec predates the setting.
DEFAULT_OPENED_CHUNKS = 16


#: Masked runs: a bucket's unopened members number 0 or at least this many, so the bucket
#: sum minus the opened updates is never one worker's update (secure-averaging.md E.2).
MIN_UNOPENED = 2


def _spot_rank(seed: bytes, workers: Iterable[str]) -> list[str]:
    return sorted(
        workers, key=lambda w: hashlib.sha256(seed + b"spot-check" + bytes.fromhex(w)).digest()
    )


def select_spot_checks(seed: bytes, workers: Iterable[str], count: int) -> list[str]:
    """The ``count`` workers the beacon picks for a full check, lowest rank first."""
    return _spot_rank(seed, workers)[: max(0, count)]


def select_openings(seed: bytes, workers: Sequence[str], count: int, bucket_size: int,
                    buckets: Sequence[Sequence[str]] | None = None) -> list[str]:
    """A masked run's opened workers, at most ``count``: the seed's spot-check ranking,
    except that no bucket (``buckets``: a masked round's survivor sets; by default
    ``round_buckets`` of the same seed and sealed submitters) is left with exactly one
    unopened member, whose update would be the bucket sum minus the opened ones: a worker
    that would leave one is opened only together with that last one (when ``count``
    allows two more), else skipped. A worker in no bucket has no masked input to open."""
    ranked = _spot_rank(seed, workers)
    if buckets is None:
        buckets = round_buckets(seed, workers, bucket_size)
    bucket_of = {w: i for i, b in enumerate(buckets) for w in b}
    unopened = [len(b) for b in buckets]
    chosen: list[str] = []
    for w in ranked:
        i = bucket_of.get(w)
        if len(chosen) >= count:
            break
        if i is None or w in chosen:
            continue
        if unopened[i] - 1 >= MIN_UNOPENED or unopened[i] - 1 == 0:
            chosen.append(w)
            unopened[i] -= 1
        elif count - len(chosen) >= 2:  # the bucket's last two go together
            chosen += [w, next(x for x in ranked if bucket_of.get(x) == i
                               and x != w and x not in chosen)]
            unopened[i] -= 2
    return chosen


@dataclass(frozen=True)
class ChallengePolicy:
    segments: int  # S
    per_worker: float  # c
    full_checks: int
    always_last: bool
    #: Masked runs: only the ``full_checks`` workers reveal anything (any revealed
    #: training state would expose most of a worker's update), and they reveal all.
    opened_only: bool = False
    opened_chunks: int = DEFAULT_OPENED_CHUNKS  # C: chunks a segment check opens
    binding_chunks: int = DEFAULT_OPENED_CHUNKS  # C_b: chunks the binding check opens
    #: Masked runs: the buckets' target size, so that openings leave ``MIN_UNOPENED``
    #: members of each bucket unopened (:func:`select_openings`).
    bucket_size: int = 0

    @classmethod
    def from_spec(cls, inner: dict, verification: dict, *, masked: dict | None = None
                  ) -> ChallengePolicy:
        return cls(
            segments=inner["steps"] // inner["trail_every"],
            per_worker=float(verification["challenges_per_worker"]),
            full_checks=int(verification["spot_checks_per_round"]),
            always_last=bool(verification["always_last"]),
            opened_only=masked is not None,
            opened_chunks=int(verification.get("opened_chunks", DEFAULT_OPENED_CHUNKS)),
            binding_chunks=int(verification.get("binding_chunks", DEFAULT_OPENED_CHUNKS)),
            bucket_size=int(masked["bucket_size"]) if masked is not None else 0,
        )

    @classmethod
    def of_run(cls, spec: Any) -> ChallengePolicy:
        """The policy of a run spec."""
        return cls.from_spec(spec.inner, spec.verification, masked=spec.masked)

    @property
    def binding(self) -> bool:
        """Whether every worker's payload binding is checked (``binding_chunks`` > 0; 0 only
        where a benchmark isolates the aggregator)."""
        return self.binding_chunks > 0

    def checked_workers(self, challenges: dict[str, list[int]]) -> list[str]:
        """Workers whose reveal is due: the challenged ones, and everyone else too when the
        binding is checked (in a masked run only the opened ones reveal anything)."""
        return sorted(w for w, segs in challenges.items()
                      if segs or (self.binding and not self.opened_only))

    def expected_cost(self, n_workers: int) -> float:
        """Expected fraction of the workers' training compute that validators recompute."""
        if n_workers == 0:
            return 0.0
        full = min(self.full_checks, n_workers)
        per = min(self.per_worker, self.segments)
        return (full * self.segments + (n_workers - full) * per) / (n_workers * self.segments)


def _uniform(seed: bytes, label: bytes, worker: str) -> float:
    digest = hashlib.sha256(seed + label + bytes.fromhex(worker)).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def compute_challenges(seed: bytes, workers: Sequence[str], policy: ChallengePolicy, *,
                       buckets: Sequence[Sequence[str]] | None = None
                       ) -> dict[str, list[int]]:
    """Challenged segment indices (sorted) for every worker in ``workers``. A masked
    round passes its openings seed and survivor sets (``buckets``, protocol/openings.py)."""
    s = policy.segments
    full = set(select_openings(seed, workers, policy.full_checks, policy.bucket_size, buckets)
               if policy.opened_only and policy.bucket_size else
               select_spot_checks(seed, workers, policy.full_checks))
    out: dict[str, list[int]] = {}
    for worker in sorted(workers):
        if worker in full:
            out[worker] = list(range(s))
            continue
        if policy.opened_only:
            continue
        count = math.floor(policy.per_worker)
        if _uniform(seed, b"extra", worker) < policy.per_worker - count:
            count += 1
        count = min(count, s)
        ranked = sorted(range(s), key=lambda j: hashlib.sha256(
            seed + b"segment" + bytes.fromhex(worker) + j.to_bytes(4, "big")).digest())
        chosen: list[int] = []
        if policy.always_last and count > 0:
            chosen.append(s - 1)
        chosen += [j for j in ranked if j not in chosen][: count - len(chosen)]
        out[worker] = sorted(chosen)
    return out


def max_reveal_file_bytes(numel: int, trail_every: int, segments: int, policy: ChallengePolicy,
                          payload_bytes: int = 0) -> int:
    """An upper bound on a worker's reveal for ``segments`` challenged segments (the exact
    layout is protocol/reveal.py's; this bound needs no torch, for the ledger)."""
    n = chunk_count(numel)
    opened = 4 * CHUNK * min(policy.opened_chunks, n)
    per_segment = 4 * numel * (3 if trail_every > 1 else 1) + 5 * LEAF * n + 5 * opened
    binding = 4 * LEAF * n + max(8 * numel, 2 * 4 * CHUNK * min(policy.binding_chunks, n))
    return (1 << 20) + segments * per_segment + binding + payload_bytes
