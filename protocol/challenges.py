"""Which training segments each worker must reveal, drawn from the round's beacon.

A submission commits to S = H / k training-state hashes (its trail). Once the
round's beacon seed is fixed, every worker in the sealed list is challenged:

* ``full_checks`` workers, ranked by sha256(seed || "spot-check" || key), must
  reveal every segment (their whole local training is recomputed);
* every other worker reveals ``floor(c)`` segments, plus one more with
  probability ``frac(c)`` (c = ``challenges_per_worker``), chosen by ranking
  sha256(seed || "segment" || key || u32be(j)); with ``always_last`` the last
  segment is always among them (it binds the payload to the trail).

Cost for the validators: (sum of challenged segments) / (N * S) of the
workers' training compute. A worker that fakes a fraction q of its segments
escapes one round with probability about (1 - q)^c, so a free rider (q = 1)
is caught in its first round with certainty whenever c >= 1.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def max_reveal_bytes(numel: int) -> int:
    """Upper bound on a revealed training-state file: 8-byte length, header, 3D + 1 floats."""
    return 8 + (1 << 20) + 4 * (3 * numel + 1)


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

    @classmethod
    def from_spec(cls, inner: dict, verification: dict, *, masked: bool = False
                  ) -> ChallengePolicy:
        return cls(
            segments=inner["steps"] // inner["trail_every"],
            per_worker=float(verification["challenges_per_worker"]),
            full_checks=int(verification["spot_checks_per_round"]),
            always_last=bool(verification["always_last"]),
            opened_only=masked,
        )

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


def needed_hashes(trail: Sequence[str], segments: Iterable[int], ef_hash: str,
                  payload_hash: str | None = None) -> list[str]:
    """Blobs a worker must reveal: each challenged segment's start (but the base, which
    validators rebuild) and end state, and its error-feedback residual for the last one;
    in a masked run also its payload, which the ledger never stored."""
    need: list[str] = [payload_hash] if payload_hash is not None else []
    last = len(trail) - 1
    for j in segments:
        if j > 0:
            need.append(trail[j - 1])
        need.append(trail[j])
        if j == last:
            need.append(ef_hash)
    return sorted(set(need))
