"""Who may work in a run: admission policies, tickets, bonds and slashes (sans I/O).

A run spec's ``admission`` (specs/protocol.md 4.1a) names one of three policies:

* ``open`` (the default, and what a spec without the field means): any key registers;
* ``allowlist``: a worker needs an :class:`AdmissionTicket` signed by the organiser or a
  key in ``issuers``, naming its key, the run and the round it expires at; an
  :class:`AdmissionRevocation` from such a key ends every earlier ticket of the worker;
* ``bond``: a worker needs a balance of at least ``min_bond`` units, credited by
  :class:`BondDeposit` rows signed by the run's ``treasury`` key (the organiser's by
  default) and debited by the worker's own :class:`BondWithdrawal` (effective only
  ``unbonding_rounds`` rounds ahead) and by the ledger's ``slash`` records.

Every signed membership message names the round from which it takes effect, and the
ledger accepts it only while that round has not closed, so the state of round ``r`` is a
function of the rows' content alone (:class:`Membership`): every honest validator
folding the rows it is served gets the same admitted set, and the audit folds the chain
the same way. A proven fault (``PENALIZED_REASONS``) in round ``r`` gets a ``slash``
record at the round's finalization: it takes ``slash_share`` of the bond (floor, in
units) and voids every ticket issued up to round ``r``, so a banned key, or a fresh key
of the same party, needs a new ticket or a new bond to come back.

:func:`cheat_economics` computes what each cheat is expected to earn under a run's own
settings (specs/scoring.md, "Cheating never pays").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import fields as f
from .board import BoardFault, open_member_post
from .messages import (
    ADMISSION,
    ADMISSION_POLICIES,
    MAX_ROUND,
    MAX_UNITS,
    RUN_ID_PATTERN,
    TIME,
    Message,
    RunSpec,
    Signed,
)

POLICIES = ADMISSION_POLICIES


#: A ``bond`` policy's defaults: a bond of 10 rounds of the whole reward, half slashed.
DEFAULT_SLASH_SHARE = 0.5
DEFAULT_UNBONDING_ROUNDS = 2


@dataclass(frozen=True)
class AdmissionPolicy:
    """A run's admission policy, with its defaults resolved."""

    policy: str
    organiser: str
    issuers: frozenset[str]  # keys whose tickets count (the organiser's always does)
    treasury: str
    min_bond: int
    slash_share: float
    unbonding_rounds: int

    @classmethod
    def of_run(cls, spec: RunSpec) -> AdmissionPolicy:
        """The policy of ``spec`` (``open`` when it names none)."""
        raw = getattr(spec, "admission", None) or {"policy": "open"}
        adm = ADMISSION(raw, "admission")
        return cls(
            policy=adm["policy"], organiser=spec.organiser,
            issuers=frozenset({spec.organiser, *adm.get("issuers", ())}),
            treasury=adm.get("treasury", spec.organiser),
            min_bond=int(adm.get("min_bond", 0)),
            slash_share=float(adm.get("slash_share", DEFAULT_SLASH_SHARE)),
            unbonding_rounds=int(adm.get("unbonding_rounds", DEFAULT_UNBONDING_ROUNDS)))

    @property
    def open(self) -> bool:
        return self.policy == "open"


def admission_problem_of_spec(admission: Any, validators: Iterable[str] = ()) -> str | None:
    """Why a spec's ``admission`` cannot run, or None: a bond policy needs a positive
    ``min_bond`` (a zero bond admits every key, which ``open`` says plainly)."""
    if admission is None:
        return None
    adm = ADMISSION(admission, "admission")
    if adm["policy"] == "bond" and adm.get("min_bond", 0) <= 0:
        return "a bond policy needs min_bond > 0"
    if adm["policy"] != "allowlist" and adm.get("issuers"):
        return "issuers only make sense with the allowlist policy"
    return None


# --------------------------------------------------------------------------- messages

RUN_ID = f.string(64, RUN_ID_PATTERN)
ROUND = f.integer(0, MAX_ROUND)


@dataclass(frozen=True)
class AdmissionTicket(Message):
    """The organiser (or a delegated issuer) admits ``worker`` for rounds
    ``round .. expires_round - 1``."""

    KIND: ClassVar[str] = "admission_ticket"
    run_id: str
    round: int  # the first round it admits (the ledger records it only while it is open)
    issuer: str
    worker: str
    expires_round: int
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": RUN_ID, "round": ROUND, "issuer": f.PUBKEY, "worker": f.PUBKEY,
        "expires_round": ROUND, "created_at": TIME,
    }


@dataclass(frozen=True)
class AdmissionRevocation(Message):
    """An issuer ends every ticket of ``worker`` issued for rounds up to ``round``, from
    ``round`` on (a later ticket admits it again)."""

    KIND: ClassVar[str] = "admission_revocation"
    run_id: str
    round: int
    issuer: str
    worker: str
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": RUN_ID, "round": ROUND, "issuer": f.PUBKEY, "worker": f.PUBKEY,
        "created_at": TIME,
    }


@dataclass(frozen=True)
class BondDeposit(Message):
    """The run's treasury credits ``amount`` units to ``worker``'s bond from ``round`` on
    (``reference``: the treasury's own record of the payment; how money moves is not
    veritrain's business)."""

    KIND: ClassVar[str] = "bond_deposit"
    run_id: str
    round: int
    treasury: str
    worker: str
    amount: int
    reference: str
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": RUN_ID, "round": ROUND, "treasury": f.PUBKEY, "worker": f.PUBKEY,
        "amount": f.integer(1, MAX_UNITS), "reference": f.string(128), "created_at": TIME,
    }


@dataclass(frozen=True)
class BondWithdrawal(Message):
    """A worker takes ``amount`` units (at most what is left then) out of its bond at
    ``round``, at least ``unbonding_rounds`` after the first round not yet closed."""

    KIND: ClassVar[str] = "bond_withdrawal"
    run_id: str
    round: int
    worker: str
    amount: int
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": RUN_ID, "round": ROUND, "worker": f.PUBKEY,
        "amount": f.integer(1, MAX_UNITS), "created_at": TIME,
    }


MEMBERSHIP_MESSAGES: dict[str, type[Message]] = {
    cls.KIND: cls for cls in (AdmissionTicket, AdmissionRevocation, BondDeposit,
                              BondWithdrawal)
}
#: The ledger record of a proven fault's consequence on admission.
SLASH = "slash"
MEMBERSHIP_KINDS = (*MEMBERSHIP_MESSAGES, SLASH)
#: The field naming each message's signer.
SIGNER_FIELD = {"admission_ticket": "issuer", "admission_revocation": "issuer",
                "bond_deposit": "treasury", "bond_withdrawal": "worker"}


def open_membership(wire: Any, policy: AdmissionPolicy) -> Signed[Any]:
    """A signed membership message after :func:`board.open_member_post`: its kind one of
    :data:`MEMBERSHIP_MESSAGES`, its signature, and its signer the key the run's policy
    gives that kind (an issuer, the treasury, or the worker itself for a withdrawal).
    Raises :class:`BoardFault` otherwise."""
    kind = wire.get("kind") if isinstance(wire, dict) else None
    cls = MEMBERSHIP_MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BoardFault(f"not a membership message: {str(kind)[:40]!r}")
    body = wire.get("body")
    run_id, r = (body.get("run_id"), body.get("round")) if isinstance(body, dict) else (0, 0)
    if not isinstance(run_id, str) or type(r) is not int:
        raise BoardFault(f"a {kind} post without a run and round")
    if kind == "admission_ticket" or kind == "admission_revocation":
        members: Any = policy.issuers
    elif kind == "bond_deposit":
        members = {policy.treasury}
    else:
        members = _Anyone()
    signed = open_member_post(wire, cls, member_field=SIGNER_FIELD[kind], members=members,
                              run_id=run_id, round_index=r)
    if policy.open or (kind in ("bond_deposit", "bond_withdrawal")) != (
            policy.policy == "bond"):
        raise BoardFault(f"a {kind} in a run whose admission is {policy.policy}")
    if isinstance(signed.message, AdmissionTicket) and (
            signed.message.expires_round <= signed.message.round):
        raise BoardFault("a ticket that expires before it admits")
    return signed


class _Anyone(frozenset):
    """Every key is a member (a withdrawal's signer is checked against its worker)."""

    def __contains__(self, item: object) -> bool:
        return True


def slash_record(run_id: str, r: int, worker: str, reason: str, submission_digest: str,
                 amount: int, balance: int) -> dict[str, Any]:
    """The body of a ``slash`` ledger record (without its ``kind``)."""
    return {"run_id": run_id, "round": r, "worker": worker, "reason": reason,
            "submission_digest": submission_digest, "amount": amount, "balance": balance}


SLASH_RECORD = f.record({
    "kind": f.one_of(SLASH), "run_id": RUN_ID, "round": ROUND, "worker": f.PUBKEY,
    "reason": f.string(64), "submission_digest": f.HASH,
    "amount": f.integer(0, MAX_UNITS), "balance": f.integer(0, MAX_UNITS),
})


# --------------------------------------------------------------------------- the fold


@dataclass
class Membership:
    """The admission state a run's membership rows establish, folded in chain order.

    Nothing here depends on where a row sits in the chain beyond what its own ``round``
    says (the ledger takes a row only while that round is open), so the admitted set of a
    round is the same for every honest node served the same rows."""

    policy: AdmissionPolicy
    tickets: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    revocations: dict[str, list[int]] = field(default_factory=dict)
    #: worker -> [(round, phase, amount)]: phase 0 deposit, 1 withdrawal, 2 slash
    moves: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    slashed: dict[str, list[int]] = field(default_factory=dict)  # worker -> rounds

    @classmethod
    def of_run(cls, spec: RunSpec) -> Membership:
        return cls(AdmissionPolicy.of_run(spec))

    def add(self, message: Message) -> None:
        """Fold in one opened membership message (:func:`open_membership`)."""
        if isinstance(message, AdmissionTicket):
            self.tickets.setdefault(message.worker, []).append(
                (message.round, message.expires_round))
        elif isinstance(message, AdmissionRevocation):
            self.revocations.setdefault(message.worker, []).append(message.round)
        elif isinstance(message, BondDeposit):
            self.moves.setdefault(message.worker, []).append((message.round, 0, message.amount))
        elif isinstance(message, BondWithdrawal):
            self.moves.setdefault(message.worker, []).append((message.round, 1, message.amount))
        else:
            raise TypeError(f"not a membership message: {type(message).__name__}")

    def add_slash(self, body: Mapping[str, Any]) -> None:
        """Fold in a ``slash`` record (round r's fault: effective from round r + 1)."""
        worker, r = body["worker"], int(body["round"])
        self.slashed.setdefault(worker, []).append(r)
        if body["amount"]:
            self.moves.setdefault(worker, []).append((r, 2, int(body["amount"])))

    def balance(self, worker: str, r: int) -> int:
        """The bond of ``worker`` in round ``r``: deposits and withdrawals of rounds up to
        ``r``, slashes of rounds before ``r``, in round order (a withdrawal takes at most
        what is left)."""
        bal = 0
        for rr, phase, amount in sorted(self.moves.get(worker, ())):
            if rr > r or (phase == 2 and rr >= r):
                break
            bal = bal + amount if phase == 0 else max(0, bal - amount)
        return bal

    def slash_amount(self, worker: str, r: int) -> tuple[int, int]:
        """``(amount, balance)`` a proven fault in round ``r`` takes: ``floor(slash_share
        * balance)`` of the bond the worker held in round ``r``."""
        bal = self.balance(worker, r)
        return math.floor(self.policy.slash_share * bal), bal

    def admission_problem(self, worker: str, r: int) -> str | None:
        """Why ``worker`` is not admitted in round ``r``, or None when it is."""
        p = self.policy
        if p.open:
            return None
        if p.policy == "allowlist":
            # (round it names, first round it takes effect): a revocation from its round, a
            # slash (a proven fault of round v) from v + 1; each ends tickets issued up to v.
            voids = [(v, v) for v in self.revocations.get(worker, ())] + [
                (v, v + 1) for v in self.slashed.get(worker, ())]
            tickets = self.tickets.get(worker, [])
            if not tickets:
                return "no admission ticket for this key"
            valid = [(a, b) for a, b in tickets
                     if not any(a <= v and eff <= r for v, eff in voids)]
            if any(a <= r < b for a, b in valid):
                return None
            if not valid:
                return "its admission tickets were revoked or voided by a slash"
            return f"no admission ticket of this key covers round {r} (expired or not yet valid)"
        bal = self.balance(worker, r)
        if bal < p.min_bond:
            return f"bond of {bal} units in round {r}, the run needs {p.min_bond}"
        return None

    def admitted(self, workers: Iterable[str], r: int) -> set[str]:
        """Those of ``workers`` admitted in round ``r``."""
        return {w for w in workers if self.admission_problem(w, r) is None}


def fold_rows(spec: RunSpec, rows: Iterable[Mapping[str, Any]],
              faults: list[str] | None = None) -> Membership:
    """The :class:`Membership` of served rows ``{"kind", "body"}`` (a signed wire for a
    message, a record for a slash), each checked first; what does not check out is
    skipped, its reason appended to ``faults`` (board rule 5)."""
    state = Membership.of_run(spec)
    for row in rows:
        try:
            kind = row.get("kind") if isinstance(row, Mapping) else None
            if kind == SLASH:
                body = SLASH_RECORD(row.get("body"), "slash")
                if body["run_id"] != spec.run_id:
                    raise BoardFault("a slash of another run")
                state.add_slash(body)
            else:
                signed = open_membership(row.get("body") if isinstance(row, Mapping) else None,
                                         state.policy)
                if signed.message.run_id != spec.run_id:
                    raise BoardFault(f"a {kind} of another run")
                state.add(signed.message)
        except (BoardFault, f.EncodingError) as exc:
            if faults is not None:
                faults.append(str(exc))
    return state


# --------------------------------------------------------------------------- economics


@dataclass(frozen=True)
class Cheat:
    """A cheat: the share ``saved`` of a round's training it skips, and the probability
    ``caught`` that a round's checks prove it."""

    name: str
    saved: float
    caught: float


def escape_probability(segments: int, per_worker: float, faked: int, *, full_checks: int = 0,
                       workers: int = 1, always_last: bool = False,
                       last_faked: bool = False) -> float:
    """Probability that a worker faking ``faked`` of ``segments`` segments passes one
    round's challenges (specs/protocol.md 10.1: hypergeometric over the challenged
    segments, m = floor(c) or floor(c) + 1 with probability frac(c))."""
    s, fk = segments, faked
    base, frac = int(per_worker), per_worker - int(per_worker)
    full = min(1.0, full_checks / max(workers, 1))

    def passes(m: int) -> float:
        m = min(m, s)
        if m == 0:
            return 1.0
        if always_last:
            if last_faked:
                return 0.0
            return math.comb(s - 1 - fk, m - 1) / math.comb(s - 1, m - 1) if s - 1 - fk >= m - 1 \
                else 0.0
        return math.comb(s - fk, m) / math.comb(s, m) if s - fk >= m else 0.0

    if fk == 0:
        return 1.0
    p = (1 - frac) * passes(base) + frac * passes(base + 1)
    return (1 - full) * p


def cheats_of_run(spec: RunSpec) -> list[Cheat]:
    """The verification benchmark's cheats (specs/protocol.md 10.2) with what each saves
    and how likely a round's checks catch it under ``spec``'s challenge policy."""
    s = spec.inner["steps"] // spec.inner["trail_every"]
    v = spec.verification
    c, always = float(v["challenges_per_worker"]), bool(v["always_last"])
    binding = int(v.get("binding_chunks", 16)) > 0

    def faker(n: int) -> float:
        return 1.0 - escape_probability(s, c, n, always_last=always)

    every = faker(s)  # a cheat that changes every segment
    out = [
        Cheat("free_rider", 1.0, 1.0 if c >= 1 or binding else faker(s)),
        Cheat("lazy_replay", 1.0, 1.0 if binding else every),
        Cheat("half_batch", 0.5, every),
        Cheat("other_rows", 0.0, every),
        Cheat("lr_x0.5", 0.0, every),
        Cheat("noise_on_update", 0.0, 1.0 if binding else every),
        Cheat("forged_final_state", 0.0, faker(1) if not always else 1.0),
    ]
    for n in sorted({1, max(1, s // 10), max(1, s // 4), max(1, s // 2)}):
        out.append(Cheat(f"faker_{n}_of_{s}", n / s, faker(n)))
    return out


def expected_profit(cheat: Cheat, *, reward: float, compute: float, vesting: int,
                    bond_lost: float) -> float:
    """Expected gain per round of cheating, against honest work, for a worker whose fair
    share of a round's reward is ``reward`` and whose round of training costs ``compute``.

    Each round it cheats it saves ``saved * compute``; a catch (probability ``caught`` a
    round) costs it the round's reward, the rewards of its earlier unvested rounds, and
    ``bond_lost``. The worst case for the run is a fresh key that starts cheating at once,
    whose unvested rewards at the catch are ``sum_{t=1}^{V}(1 - p)^t`` rounds' worth in
    expectation (the catch round T is geometric; ``min(V, T - 1)`` earlier rounds unvested).
    Per round: ``saved * compute - caught * (reward * (1 + U) + bond_lost)``."""
    p = cheat.caught
    unvested = sum((1 - p) ** t for t in range(1, vesting + 1)) if p < 1 else 0.0
    return cheat.saved * compute - p * (reward * (1 + unvested) + bond_lost)


def cheat_economics(spec: RunSpec, *, workers: int, compute_share: float = 1.0,
                    bond: int | None = None, slash_share: float | None = None
                    ) -> dict[str, Any]:
    """Every cheat's expected profit per round under ``spec``'s settings with ``workers``
    workers: each earns ``reward = per_round / workers`` a round, and its round of training
    costs ``compute_share * reward`` (1: the margin where honest work just pays, the worst
    case: above it no honest worker takes part). ``bond`` and ``slash_share`` default to the
    spec's admission policy (0 under ``open`` and ``allowlist``). Also the bond a Sybil
    party locks, and loses on a catch, to hold a share f of the workers."""
    policy = AdmissionPolicy.of_run(spec)
    bond = (policy.min_bond if policy.policy == "bond" else 0) if bond is None else bond
    share = policy.slash_share if slash_share is None else slash_share
    reward = spec.rewards["per_round"] / workers
    compute = compute_share * reward
    vesting = int(spec.verification["vesting_rounds"])
    lost = math.floor(share * bond)
    rows = [(c, expected_profit(c, reward=reward, compute=compute, vesting=vesting,
                                bond_lost=lost)) for c in cheats_of_run(spec)]
    worst = max(rows, key=lambda cp: cp[1])

    def sybil_bond(fraction: float) -> int:
        """Keys a party needs for a share ``fraction`` of ``workers`` honest others, times
        the bond each locks."""
        keys = math.ceil(fraction * workers / (1 - fraction)) if fraction < 1 else 0
        return keys * bond

    return {
        "reward_per_worker": reward, "compute": compute, "bond": bond, "slash_share": share,
        "vesting_rounds": vesting, "bond_lost": lost,
        "cheats": [{"cheat": c.name, "saved": c.saved, "caught": c.caught, "profit": p}
                   for c, p in rows],
        "worst_cheat": worst[0].name, "worst_cheat_expected_profit": worst[1],
        "sybil_bond_for_f": {0.5: sybil_bond(0.5), 0.33: sybil_bond(0.33)},
        "honest_net_reward_share": (reward - compute) / reward if reward else 0.0,
    }
