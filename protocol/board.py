"""Checking what the ledger's board serves before a node acts on it.

The ledger relays every message between the members of a run (workers, validators)
and is not trusted: it can serve a message under another member's name, one of
another run, round, bucket or shard, show members different lists, or pick among
valid alternatives (which quorum, which survivors). The rule every node follows
(ARCHITECTURE, "Check every board message you act on"):

1. **Bound to its member.** A post counts only if its signature verifies in its
   kind's domain and its signer is the registered key of the member the post names
   (:func:`open_member_post`), for this run and round and, where it has one, this
   bucket or shard.
2. **Lists from signed shares.** A list, quorum or seed the node acts on is
   recomputed from the signed shares it comes from, never taken as served.
3. **One list per round.** A node signs at most one list of each kind per run and
   round (:class:`SignedOnce`, kept across restarts by the node): two views shown to
   one honest node yield at most one signature, so a ledger showing two views is
   caught by the signatures it holds.
4. **What it acted on is in what it signs** (the digest of the list or view), so a
   ledger that showed two views is provably caught.
5. **Bad input is a fault, not an exit.** A post that fails these checks raises
   :class:`BoardFault` (a ``RejectedInput``): the node records it and skips the post;
   it never stops over it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from . import bls
from .beacon import compute_beacon_seed
from .errors import RejectedInput
from .messages import Message, Signed, open_signed
from .statefile import json_saver, load_json_state

M = TypeVar("M", bound=Message)


class BoardFault(RejectedInput):
    """The ledger's board served something that does not check out (rule 1-4)."""

    reason = "board_fault"


def open_member_post(wire: Any, cls: type[M], *, member_field: str,
                     members: Mapping[str, Any] | frozenset[str] | set[str],
                     run_id: str, round_index: int, **bound: Any) -> Signed[M]:
    """A post served by the board, after rule 1: its signature (domain ``cls.KIND``),
    its signer equal to the member it names in ``member_field``, that member in
    ``members``, and its run, round and every ``bound`` field (bucket, shard, ...) as
    given. Raises :class:`BoardFault` saying what does not check out."""
    try:
        signed = open_signed(wire, cls)
    except RejectedInput as exc:
        raise BoardFault(f"a {cls.KIND} post does not open: {exc}") from exc
    msg = signed.message
    member = getattr(msg, member_field)
    if signed.signer != member:
        raise BoardFault(f"a {cls.KIND} post names {member[:12]} but is signed by "
                         f"{signed.signer[:12]}")
    if member not in members:
        raise BoardFault(f"a {cls.KIND} post from {member[:12]}, not a member here")
    if (msg.run_id, msg.round) != (run_id, round_index):  # type: ignore[attr-defined]
        raise BoardFault(f"a {cls.KIND} post of run {msg.run_id} round "  # type: ignore[attr-defined]
                         f"{msg.round}, served for {run_id} round {round_index}")  # type: ignore[attr-defined]
    for name, expected in bound.items():
        if getattr(msg, name) != expected:
            raise BoardFault(f"a {cls.KIND} post for {name} {getattr(msg, name)!r}, served "
                             f"for {expected!r}")
    return signed


class SignedOnce:
    """What one node has signed, by (kind, run, round): at most one digest each (rule 3).

    Sans I/O: ``state`` is what the node loaded from its disk and ``save`` writes it back
    (called before the signature leaves the node, so a restart remembers it). A claim is
    atomic: nodes sign on threads as well as on their event loop, and two claims saving
    at once must not lose one on disk."""

    def __init__(self, state: dict[str, str] | None = None,
                 save: Callable[[dict[str, str]], None] | None = None) -> None:
        self.state: dict[str, str] = dict(state or {})
        self._save = save
        self._lock = threading.Lock()

    @staticmethod
    def key(kind: str, run_id: str, round_index: int) -> str:
        return f"{kind}/{run_id}/{round_index}"

    def claim(self, kind: str, run_id: str, round_index: int, digest: str) -> None:
        """Record that this node signs ``digest`` for (kind, run, round); a second, other
        digest raises :class:`BoardFault` (the ledger showed this node another view)."""
        key = self.key(kind, run_id, round_index)
        with self._lock:
            held = self.state.get(key)
            if held is not None and held != digest:
                raise BoardFault(f"already signed another {kind} of run {run_id} round "
                                 f"{round_index} ({held[:12]}, now shown {digest[:12]})")
            if held is None:
                self.state[key] = digest
                if self._save is not None:
                    self._save(dict(self.state))

    def signed(self, kind: str, run_id: str, round_index: int) -> str | None:
        return self.state.get(self.key(kind, run_id, round_index))

    @classmethod
    def in_file(cls, path: Path | None) -> SignedOnce:
        """A ``SignedOnce`` kept in the JSON file ``path`` (read now, rewritten atomically
        before each new signature leaves the node); in memory only when ``path`` is None."""
        if path is None:
            return cls()
        state = load_json_state(path, lambda s: all(
            isinstance(k, str) and isinstance(v, str) for k, v in s.items()),
            "a signed-once state")
        return cls(state, json_saver(path))


def members_posts(wires: Any, cls: type[M], *, member_field: str, members: Sequence[str],
                  run_id: str, round_index: int, faults: list[str] | None = None,
                  **bound: Any) -> dict[int, list[Signed[M]]]:
    """The posts of ``wires`` that pass :func:`open_member_post`, by the index in
    ``members`` of the member each names, distinct posts in served order (two of one member
    are that member's own doing: the caller picks the one a list names). What does not
    check out is skipped, its reason appended to ``faults`` (rule 5)."""
    index = {key: k for k, key in enumerate(members)}
    out: dict[int, list[Signed[M]]] = {}
    for wire in wires if isinstance(wires, list | tuple) else ():
        try:
            signed = open_member_post(wire, cls, member_field=member_field, members=index,
                                      run_id=run_id, round_index=round_index, **bound)
        except BoardFault as exc:
            if faults is not None:
                faults.append(str(exc))
            continue
        held = out.setdefault(index[getattr(signed.message, member_field)], [])
        if all(p.digest != signed.digest for p in held):
            held.append(signed)
    return out


def quorum_seed(fixed: Any, posts: Mapping[int, Sequence[Signed[Any]]], *, bls_keys: Sequence[str],
                quorum: int, root: bytes, share_field: str = "share") -> bytes:
    """The seed of a fixed quorum ``{"signers": [...], "shares": [hex, ...]}`` after rule 2:
    ``signers`` exactly ``quorum`` distinct member indices in ascending order, each with its
    own post in ``posts`` (already opened and bound, e.g. by :func:`members_posts` with the
    list the shares sign as a bound field) carrying that share, and every share a valid BLS
    signature of ``root`` by that member's key in ``bls_keys``. Returns
    ``compute_beacon_seed`` of the shares in signer order; :class:`BoardFault` otherwise.
    Costs a pairing check per share (cached per process for inputs already verified)."""
    signers = fixed.get("signers") if isinstance(fixed, dict) else None
    shares = fixed.get("shares") if isinstance(fixed, dict) else None
    if (not isinstance(signers, list) or not isinstance(shares, list)
            or any(type(k) is not int or not 0 <= k < len(bls_keys) for k in signers)
            or any(not isinstance(x, str) for x in shares)
            or len(signers) != len(shares) or len(signers) != quorum
            or signers != sorted(set(signers))):
        raise BoardFault("the fixed quorum's signers are not a quorum of the members")
    for k, share in zip(signers, shares, strict=True):
        if all(getattr(p.message, share_field) != share for p in posts.get(k, ())):
            raise BoardFault(f"member {k}'s share is not in a signed post of its own over "
                             "this list")
    key = (root, tuple(signers), tuple(shares), tuple(bls_keys[k] for k in signers))
    with _QUORUM_LOCK:
        if (seed := _QUORUMS.get(key)) is not None:
            return seed
        raw = []
        for k, share in zip(signers, shares, strict=True):
            try:
                sig = bytes.fromhex(share)
                valid = bls.verify(bytes.fromhex(bls_keys[k]), root, sig)
            except ValueError:
                valid = False
            if not valid:
                raise BoardFault(f"member {k}'s share does not verify")
            raw.append(sig)
        if len(_QUORUMS) >= 1024:
            _QUORUMS.clear()
        seed = _QUORUMS[key] = compute_beacon_seed(raw)
        return seed


#: Quorums already verified in this process (nodes sharing one process, as in tests and
#: simulations, pay the pairings once): the inputs that passed -> their seed.
_QUORUMS: dict[tuple, bytes] = {}
_QUORUM_LOCK = threading.Lock()
