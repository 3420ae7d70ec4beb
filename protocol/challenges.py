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

#: Chunks a check opens when a run spec predates the setting.
DEFAULT_OPENED_CHUNKS = 16


def select_spot_checks(seed: bytes, workers: Iterable[str], count: int) -> list[str]:
    """The ``count`` workers the beacon picks for a full check, lowest rank first."""
    ranked = sorted(
        workers, key=lambda w: hashlib.sha256(seed + b"spot-check" + bytes.fromhex(w)).digest()
    )
    return ranked[: max(0, count)]


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

    @classmethod
    def from_spec(cls, inner: dict, verification: dict, *, masked: bool = False
                  ) -> ChallengePolicy:
        return cls(
            segments=inner["steps"] // inner["trail_every"],
            per_worker=float(verification["challenges_per_worker"]),
            full_checks=int(verification["spot_checks_per_round"]),
            always_last=bool(verification["always_last"]),
            opened_only=masked,
            opened_chunks=int(verification.get("opened_chunks", DEFAULT_OPENED_CHUNKS)),
            binding_chunks=int(verification.get("binding_chunks", DEFAULT_OPENED_CHUNKS)),
        )

    @classmethod
    def of_run(cls, spec: Any) -> ChallengePolicy:
        """The policy of a run spec."""
        return cls.from_spec(spec.inner, spec.verification, masked=spec.masked is not None)

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


def compute_challenges(seed: bytes, workers: Sequence[str], policy: ChallengePolicy
                       ) -> dict[str, list[int]]:
    """Challenged segment indices (sorted) for every worker in ``workers``."""
    s = policy.segments
    full = set(select_spot_checks(seed, workers, policy.full_checks))
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
