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

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .errors import RejectedInput
from .messages import Message, Signed, open_signed

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
    (called before the signature leaves the node, so a restart remembers it)."""

    def __init__(self, state: dict[str, str] | None = None,
                 save: Callable[[dict[str, str]], None] | None = None) -> None:
        self.state: dict[str, str] = dict(state or {})
        self._save = save

    @staticmethod
    def key(kind: str, run_id: str, round_index: int) -> str:
        return f"{kind}/{run_id}/{round_index}"

    def claim(self, kind: str, run_id: str, round_index: int, digest: str) -> None:
        """Record that this node signs ``digest`` for (kind, run, round); a second, other
        digest raises :class:`BoardFault` (the ledger showed this node another view)."""
        key = self.key(kind, run_id, round_index)
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
