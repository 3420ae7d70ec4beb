"""What a request may cost the ledger before it is authorized (specs/threat-model.md).

* :class:`BlsVerifier`: BLS verifications (proofs of possession, beacon shares and
  partials, openings and shard check shares, result attestations) computed once per exact input and remembered, so a resent spec, share or
  result costs a dictionary lookup; the server runs the first computation on a thread of
  its own, after every cheap check passed, so the single writer only finds it cached.
* :class:`RejectionBudget`: how many refusals of one run, reason and hour become rows
  in ``rejections``; the rest are only counted in ``/metrics``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from veritrain.protocol import bls

#: ``bls.verify``'s shape: (public key, message, signature) -> whether it verifies.
BlsVerify = Callable[[bytes, bytes, bytes], bool]


class BlsVerifier:
    """py-ecc's verifications behind an LRU of their outcomes (keyed by the exact bytes).

    ``computed`` counts the verifications actually run (a test asserts a refusal ran none).
    """

    def __init__(self, max_entries: int = 65_536) -> None:
        self.max_entries = max_entries
        self.computed = 0
        self._known: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, key: bytes, compute: Callable[[], bool]) -> bool:
        with self._lock:
            hit = self._known.get(key)
            if hit is not None:
                self._known.move_to_end(key)
                return hit
        ok = compute()
        with self._lock:
            self.computed += 1
            self._known[key] = ok
            if len(self._known) > self.max_entries:
                self._known.popitem(last=False)
        return ok

    def verify(self, pub: bytes, message: bytes, signature: bytes) -> bool:
        """``bls.verify``, computed once per (key, message, signature)."""
        key = b"sig" + hashlib.sha256(b"\x00".join((pub, message, signature))).digest()
        return self._cached(key, lambda: bls.verify(pub, message, signature))

    def verify_possession(self, pub: bytes, proof: bytes) -> bool:
        """``bls.verify_possession``, computed once per (key, proof)."""
        key = b"pop" + hashlib.sha256(pub + b"\x00" + proof).digest()
        return self._cached(key, lambda: bls.verify_possession(pub, proof))

    def known(self, pub: bytes, proof: bytes) -> bool:
        """Whether this proof of possession was verified (either way) already."""
        key = b"pop" + hashlib.sha256(pub + b"\x00" + proof).digest()
        with self._lock:
            return key in self._known


class RejectionBudget:
    """At most ``per_hour`` rejection rows per (run, reason, hour); in memory, bounded."""

    def __init__(self, per_hour: int, clock: Callable[[], float] = time.time,
                 max_keys: int = 10_000) -> None:
        self.per_hour, self.clock, self.max_keys = per_hour, clock, max_keys
        self._used: OrderedDict[tuple[str, str, int], int] = OrderedDict()
        self.dropped = 0

    def take(self, run_id: str, reason: str) -> bool:
        """True when this refusal may be written as a row."""
        key = (run_id, reason, int(self.clock() // 3600))
        used = self._used.get(key, 0)
        if used >= self.per_hour:
            self.dropped += 1
            return False
        self._used[key] = used + 1
        self._used.move_to_end(key)
        if len(self._used) > self.max_keys:
            self._used.popitem(last=False)
        return True
