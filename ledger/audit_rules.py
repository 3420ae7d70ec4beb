"""The audit's rules: what each kind of chained row must satisfy (specs/protocol.md 9.3).

One function per row kind, named after it (the signed rows first, then the
ledger's records): ``process_<kind>`` checks a row against the audit's state and advances it,
``check_<kind>`` checks a row against the state (or the row before it) and
changes nothing, ``get_*`` reads the state. specs/protocol.md 9.3 names the
function that implements each row kind's rule.

Each rule raises :class:`Bad` with what is wrong with its row, or
:class:`BadEarlier` when it shows an earlier row wrong (a ``ban`` is checked
when its round's certificate arrives). A body that does not have the shape a
rule reads raises ``KeyError``, ``TypeError`` or ``ValueError`` (a message
schema's ``RejectedInput``), which the engine reports for the row as well.

The rules do no I/O and verify no signature: the engine
(:mod:`veritrain.ledger.verify`) reads and hashes the rows, opens each signed
row (its Ed25519 signature verified) and hands the message and its signer to
the row's rule, runs the BLS checks and the signature jobs on its process
pool, and walks the rows in order, dispatching each one here
(:data:`SIGNED_RULES`, :data:`RECORD_RULES`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from veritrain.protocol import dkg
from veritrain.protocol.beacon import (
    beacon_seed_of,
    compute_beacon_seed,
    participant_exclusions,
    participants_digest,
    sealed_list_digest,
)
from veritrain.protocol.certificates import CERTIFICATE, shard_sources_problem
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.membership import (
    SIGNER_FIELD,
    SLASH,
    SLASH_RECORD,
    BondWithdrawal,
    Membership,
)
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Receipt,
    Registration,
    RevealReceipt,
    RoundResult,
    RunSpec,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    SpotReveal,
    Submission,
    digest_of,
)
from veritrain.protocol.openings import (
    committed_inputs,
    inputs_digest,
    survivor_buckets,
    verify_openings,
)
from veritrain.protocol.rules import PENALIZED_REASONS
from veritrain.protocol.schedule import void_reason
from veritrain.protocol.secagg import round_buckets

from .chain import ChainRow

# ----------------------------------------------------------------------------- errors


class Bad(Exception):
    """A row that fails a check (raised inside the pass, turned into the result)."""


class BadEarlier(Exception):
    """An earlier row (``index``, of ``kind``) turns out to be wrong once a later row is read."""

    def __init__(self, index: int, kind: str, problem: str) -> None:
        super().__init__(problem)
        self.index = index
        self.kind = kind


@dataclass(frozen=True)
class Deferred:
    """A problem met while deriving a value ahead of the pass (possibly in another process):
    the pass raises it where it reads the value, so the same row fails with the same text."""

    problem: str


def take(value: Any) -> Any:
    """``value``, or its :class:`Deferred` problem raised as the reading row's :class:`Bad`."""
    if isinstance(value, Deferred):
        raise Bad(value.problem)
    return value


# ----------------------------------------------------------------------------- state


@dataclass(frozen=True)
class ResultView:
    """The fields of a round result the audit uses (fast mode). ``verdicts`` and ``scores``
    are None once their :class:`ResultFacts` are derived and the result has travelled
    between processes without them (they are parsed again from the row when needed)."""

    run_id: str
    round: int
    validator: str
    base_model_hash: str
    beacon_seed: str
    verdicts: list[dict[str, Any]] | None
    scores: list[dict[str, Any]] | None
    certified: dict[str, Any]


@dataclass(frozen=True)
class ResultFacts:
    """What the rules read of a result's verdicts and scores, derived where they were
    parsed so the lists need not travel between processes. Each is its value or the
    :class:`Deferred` problem its derivation raised."""

    verdicts_digest: str | Deferred
    scores_digest: str | Deferred
    submission_digests: list[str] | Deferred  # sorted
    failed: set[str] | Deferred  # workers whose spot check failed
    submitted: dict[str, str] | Deferred  # worker -> its submission's digest
    #: worker -> reason, for verdicts that say the worker may not submit at all
    excluded: dict[str, str] | Deferred
    missing_reveal: set[str] | Deferred  # workers certified ``missing_reveal``


Lists = tuple[list[dict[str, Any]], list[dict[str, Any]]]


@dataclass
class RecordedResult:
    """A recorded round result: its row's index, the message and the facts of its lists."""

    index: int
    message: RoundResult | ResultView
    facts: ResultFacts
    reread: Callable[[], Lists] | None = None  # the lists, parsed again from the row

    def lists(self) -> Lists:
        """The verdicts and scores (parsed again if the message travelled without them)."""
        msg = self.message
        if msg.verdicts is None or msg.scores is None:
            assert self.reread is not None, "a result without its lists needs a reread"
            return self.reread()
        return msg.verdicts, msg.scores


@dataclass
class RoundState:
    """What the rows of one round have established so far."""

    index: int
    base: str
    outer: str | None = None  # the base's outer state (None in round 0)
    submissions: dict[str, int] = field(default_factory=dict)  # digest -> row index
    closed: list[str] | None = None
    closed_row: int = -1  # the round_closed row
    sealed: str | None = None  # sealed_list_digest(closed), once closed
    shares: dict[int, str] = field(default_factory=dict)  # validator -> its logged BLS share
    #: The participant view digest the beacon was signed over, and the row that names it
    participants: str | None = None
    participants_row: int = -1
    beacon_seed: str | None = None
    results: list[RecordedResult] = field(default_factory=list)
    shard_results: list[str | None] | None = None  # result digests by shard, once published
    shard_list: list[str | None] | None = None
    shard_shares: dict[int, str] = field(default_factory=dict)  # validator -> BLS share
    shard_seed: str | None = None
    shard_findings: dict[tuple[int, int], bool] = field(default_factory=dict)  # -> faulty
    shard_faults: set[int] = field(default_factory=set)
    secagg_bucket_of: dict[str, int] | None = None  # worker -> bucket, once dealt
    secagg_posts: set[tuple[str, str]] = field(default_factory=set)  # (board kind, sender)
    secagg_masked: dict[str, tuple[int, str]] = field(default_factory=dict)  # worker -> (bucket, post digest)
    openings_seed: str | None = None  # masked runs: the seed the checks are drawn from
    openings_buckets: list[list[str]] | None = None  # ... and the survivor sets they keep
    challenges: dict[str, list[int]] | None = None  # worker -> segments, once fixed
    challenges_row: int = -1
    reveal_deadline: float | None = None
    #: worker -> (its spot_reveal row, the submission digest it names)
    reveals: dict[str, tuple[int, str]] = field(default_factory=dict)
    reveal_files: dict[str, str] = field(default_factory=dict)  # worker -> reveal file hash
    last_reveal: tuple[int, str, str] | None = None  # (row, envelope digest, worker)
    bans: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    penalties: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    certified: RecordedResult | None = None
    closed_at: float | None = None  # the ledger's close time (round_closed)
    voided: bool = False  # given up without a certificate (round_voided)


@dataclass
class AuditState:
    """The audit's state after the rows read so far: the run spec, the rounds opened (the
    last one is ``current``) and the base model the next round must open on."""

    spec: RunSpec | None = None
    rounds: dict[int, RoundState] = field(default_factory=dict)
    current: RoundState | None = None
    next_base: str | None = None
    registered: dict[str, int] = field(default_factory=dict)  # participant -> its row
    banned_until: dict[str, int] = field(default_factory=dict)  # worker -> last banned round
    #: The admission state the membership rows read so far establish (protocol/membership.py)
    membership: Membership | None = None
    #: A threshold-beacon run's group key, from the DKG results a quorum signed (5.4a)
    dkg_group_key: str | None = None
    #: The run ended with ``run_failed`` (its DKG fixed no group key)
    failed: bool = False
    #: The proven faults (worker, submission digest) of the round just finalized that a
    #: non-open run must slash before its next row that is not a slash
    slashes_due: set[tuple[str, str]] = field(default_factory=set)


def check_no_slash_due(state: AuditState) -> None:
    """Every proven fault of the last finalized round got its ``slash`` (bond and
    allowlist runs): called at the rows that follow a round's slashes."""
    if state.slashes_due:
        worker, _ = min(state.slashes_due)
        raise Bad(f"{len(state.slashes_due)} proven fault(s) of round "
                  f"{state.current.index if state.current else '?'} without a slash "
                  f"(worker {worker[:12]})")


def get_spec(state: AuditState) -> RunSpec:
    """The run spec; every row but the first comes after it."""
    if state.spec is None:
        raise Bad("before the run spec")
    return state.spec


def get_round(state: AuditState, r: int) -> RoundState:
    """Round ``r``, which a ``round_opened`` row must have opened."""
    rnd = state.rounds.get(r)
    if rnd is None:
        raise Bad(f"round {r} was never opened")
    return rnd


def get_validator_index(state: AuditState, signer: str, named: str) -> int:
    """The index in the run spec of the validator that signed a row naming it ``named``."""
    idx = get_spec(state).validator_index(signer)
    if idx is None or signer != named:
        raise Bad("not signed by a validator of this run")
    return idx


def _is_quorum_list(signers: list[int], spec: RunSpec, *, exact: bool) -> bool:
    """Distinct validator indices in ascending order, ``quorum`` of them (at least, unless
    ``exact``)."""
    return not (len(set(signers)) != len(signers)
                or (len(signers) != spec.quorum if exact else len(signers) < spec.quorum)
                or signers != sorted(signers)
                or any(not 0 <= k < len(spec.validators) for k in signers))


# ----------------------------------------------------------------------------- signed rows


def check_first_row(index: int, kind: str) -> None:
    """9.3 ``run_spec``: "row 0" (a registration or a submission first fails its own rule)."""
    if index == 0 and kind != "run_spec":
        raise Bad("the first row must be the run spec")


def process_run_spec(state: AuditState, index: int, spec: RunSpec, signer: str,
                     run_id: str) -> None:
    """9.3 ``run_spec``: "its signature; signer = `organiser`; row 0" (of the row's run).
    The genesis model is the base of round 0."""
    if index != 0 or state.spec is not None:
        raise Bad("a second run spec")
    if signer != spec.organiser:
        raise Bad("run spec not signed by its organiser")
    if spec.run_id != run_id:
        raise Bad("run spec of another run")
    state.spec = spec
    state.next_base = spec.genesis_model_hash
    state.membership = Membership.of_run(spec)


def process_registration(state: AuditState, index: int, participant: str) -> None:
    """9.3 ``registration`` in the pass: after the run spec (:func:`get_spec`); the
    participant is registered from this row on (certified ``unknown_worker`` verdicts are
    checked against it: :func:`check_exclusions`)."""
    get_spec(state)
    if participant not in state.registered and state.membership is not None:
        r = _first_unclosed(state)
        problem = state.membership.admission_problem(participant, r)
        if problem is not None:  # the ledger admitted a key the chain does not admit
            raise Bad(f"registration the run's admission policy does not allow: {problem}")
    state.registered.setdefault(participant, index)


def check_registration(registration: Registration, signer: str, run_id: str) -> None:
    """9.3 ``registration``: "its signature; signer = `participant`; the run". (The pass
    checks it comes after the run spec: :func:`get_spec`.)"""
    if registration.run_id != run_id or signer != registration.participant:
        raise Bad("registration of another run or signed by another key")


def check_submission(submission: Submission, signer: str, run_id: str, round_index: int
                     ) -> None:
    """9.3 ``submission``, where no certificate covers it (and every one in full mode): "its
    signature, run and round, signer = `worker`"; ``round_index`` is the round it was
    recorded in."""
    if signer != submission.worker:
        raise Bad("submission signed by a key other than its worker")
    if submission.run_id != run_id or submission.round != round_index:
        raise Bad(f"submission for round {submission.round} recorded in round {round_index}")


def process_submissions(state: AuditState, indices: Iterable[int], digests: Iterable[str]
                        ) -> RoundState:
    """9.3 ``submission``: each belongs to the open round, whose ``round_closed`` must list
    exactly its submission rows; recorded there under its digest ``sha256(body)``, which
    the certified verdicts must name. A run of consecutive submission rows at once (the
    same rule for each); returns the round."""
    rnd = state.current
    if state.failed:
        raise Bad("a submission after the run failed")
    if rnd is None or rnd.closed is not None:
        raise Bad("no open round to record it in")
    rnd.submissions.update(zip(digests, indices, strict=True))
    return rnd


def check_receipt(receipt: Receipt, signer: str, ledger_key: str, before: ChainRow | None
                  ) -> None:
    """9.3 ``receipt`` (full mode): "its signature by the ledger key, names the submission
    row before it (`sequence`, `submission_digest`)"; ``before`` is that row."""
    if signer != ledger_key:
        raise Bad("receipt not signed by this ledger")
    if (before is None or before.kind != "submission" or receipt.sequence != before.seq
            or receipt.submission_digest != hashlib.sha256(before.body).hexdigest()):
        raise Bad("receipt does not name the submission row before it")


def process_spot_reveal(state: AuditState, index: int, reveal: SpotReveal, signer: str,
                        digest: str) -> None:
    """9.3 ``spot_reveal``: "signer = `worker`; after the round's checks were fixed, before
    its certificate; once per worker and round; it names a sealed submission" (that the
    submission is the worker's and its reveal was due: :func:`check_checks_and_reveals`).
    ``digest`` is the row's envelope digest, which its receipt names."""
    if signer != reveal.worker:
        raise Bad("reveal not signed by its worker")
    rnd = get_round(state, reveal.round)
    if rnd.challenges is None or rnd.certified is not None:
        raise Bad("reveal before the round's checks were fixed or after its certificate")
    if reveal.worker in rnd.reveals:
        raise Bad("a second reveal of one worker in one round")
    if reveal.submission_digest not in (rnd.closed or ()):
        raise Bad("reveal names a submission outside the round's sealed list")
    rnd.reveals[reveal.worker] = (index, reveal.submission_digest)
    rnd.reveal_files[reveal.worker] = reveal.reveal_hash
    rnd.last_reveal = (index, digest, reveal.worker)


def process_reveal_receipt(state: AuditState, index: int, receipt: RevealReceipt, signer: str,
                           ledger_key: str) -> None:
    """9.3 ``reveal_receipt``: "signed by the ledger; names the `spot_reveal` row before it
    (`sequence`, `reveal_digest`); received by the reveal deadline"."""
    if signer != ledger_key:
        raise Bad("reveal receipt not signed by this ledger")
    rnd = get_round(state, receipt.round)
    last = rnd.last_reveal
    if (last is None or last[0] != index - 1 or receipt.sequence != index - 1
            or receipt.reveal_digest != last[1] or receipt.worker != last[2]):
        raise Bad("reveal receipt does not name the reveal row before it")
    if rnd.reveal_deadline is None or receipt.received_at > rnd.reveal_deadline \
            or receipt.deadline != rnd.reveal_deadline:
        raise Bad("reveal receipt after the round's reveal deadline")
    rnd.last_reveal = None


def process_beacon_share(state: AuditState, index: int, share: BeaconShare, signer: str
                         ) -> int:
    """9.3 ``beacon_share``: "a validator of the run; after the round closed; `sealed` is the
    digest of the round's sealed list". Each validator's first share is kept for
    ``beacon_fixed``; returns the validator's index (full mode checks its BLS share)."""
    idx = get_validator_index(state, signer, share.validator)
    rnd = get_round(state, share.round)
    if rnd.closed is None:
        raise Bad("beacon share before the round closed")
    if share.sealed != rnd.sealed:
        raise Bad("beacon share names another sealed list than the round's")
    if rnd.participants is not None and share.participants != rnd.participants:
        raise Bad("beacon share names another participant view than the round's shares")
    if rnd.participants is None:
        rnd.participants, rnd.participants_row = share.participants, index
    rnd.shares.setdefault(idx, share.share)
    return idx


def process_round_result(state: AuditState, index: int, result: RoundResult | ResultView,
                         signer: str, facts: ResultFacts,
                         reread: Callable[[], Lists] | None = None) -> None:
    """9.3 ``round_result``: "its Ed25519 envelope; a validator of the run; base model, beacon
    seed, `verdicts_hash` and `scores_hash` recomputed" (against the round's base and
    beacon and the certified state it carries, for the next round). Recorded for the
    round's ``round_finalized``; ``reread`` parses its lists again if they travelled
    without it."""
    get_validator_index(state, signer, result.validator)
    rnd = get_round(state, result.round)
    if rnd.voided:
        raise Bad("result for a voided round")
    cert = CertifiedState.from_body(result.certified)
    if result.base_model_hash != rnd.base or cert.round != result.round + 1:
        raise Bad("result for another base model or round")
    if cert.verdicts_hash != take(facts.verdicts_digest) or cert.scores_hash != take(
            facts.scores_digest):
        raise Bad("verdicts or scores differ from the certified digests")
    if rnd.beacon_seed is None or result.beacon_seed != rnd.beacon_seed:
        raise Bad("result uses another beacon than the round's")
    rnd.results.append(RecordedResult(index, result, facts, reread))


def _sharded_round(state: AuditState, signer: str, named: str, r: int, *,
                   open_only: bool = True) -> tuple[int, RoundState]:
    """9.3 shard rows: "a validator of a sharded run; after the beacon" (and before the
    certificate, ``open_only``). The signer's index and the round."""
    spec = get_spec(state)
    idx = get_validator_index(state, signer, named)
    rnd = get_round(state, r)
    if not spec.shards:
        raise Bad("shard message in a run that does not shard")
    if rnd.beacon_seed is None:
        raise Bad("shard message before the round's beacon was fixed")
    if open_only and rnd.certified is not None:
        raise Bad("shard result or check share after the round was finalized")
    if rnd.shard_results is None:
        rnd.shard_results = [None] * spec.shards
    return idx, rnd


def process_shard_result(state: AuditState, index: int, publication: ShardPublication,
                         signer: str) -> None:
    """9.3 ``shard_result``: "a validator of a sharded run; after the beacon; a result only
    for the signer's own shard and before the list was fixed" (one per shard)."""
    idx, rnd = _sharded_round(state, signer, publication.validator, publication.round)
    assert rnd.shard_results is not None
    if (publication.shard != idx or rnd.shard_results[idx] is not None
            or rnd.shard_list is not None):
        raise Bad("shard result for another shard, repeated, or after the list was fixed")
    rnd.shard_results[idx] = publication.result_digest


def process_shard_check_share(state: AuditState, index: int, share: ShardCheckShare,
                              signer: str) -> int:
    """9.3 ``shard_check_share``: "a validator of a sharded run; after the beacon; ... a
    share signs exactly the fixed list" (the published results until it is fixed; one per
    validator). Returns the validator's index (full mode checks its BLS share)."""
    idx, rnd = _sharded_round(state, signer, share.validator, share.round)
    if share.results != (rnd.shard_list if rnd.shard_list is not None
                         else rnd.shard_results) or idx in rnd.shard_shares:
        raise Bad("check share over another list than the published results, or repeated")
    rnd.shard_shares[idx] = share.share
    return idx


def process_shard_finding(state: AuditState, index: int, finding: ShardFindingReport,
                          signer: str) -> None:
    """9.3 ``shard_finding``: "a validator of a sharded run; after the beacon; ... a finding
    names a listed result of another validator" (after the check seed; one per validator
    and shard)."""
    idx, rnd = _sharded_round(state, signer, finding.validator, finding.round, open_only=False)
    spec = get_spec(state)
    if rnd.shard_seed is None or rnd.shard_list is None:
        raise Bad("finding before the round's check seed was fixed")
    if (finding.shard == idx or not 0 <= finding.shard < len(rnd.shard_list)
            or finding.published_digest != rnd.shard_list[finding.shard]
            or finding.publisher != spec.validators[finding.shard]["ed25519"]):
        raise Bad("finding about a shard result that is not another validator's listed one")
    if (idx, finding.shard) in rnd.shard_findings:
        raise Bad("a second finding of one validator on one shard")
    rnd.shard_findings[(idx, finding.shard)] = finding.faulty


#: A masked round's board posts: chain kind -> (board kind, the field naming the sender).
SECAGG_POSTS = {"secagg_keys": ("keys", "worker"), "secagg_deal": ("deal", "dealer"),
                "secagg_masked_input": ("masked", "worker"), "secagg_reveal": ("reveal", "holder"),
                "secagg_opening": ("opening", "worker"), "secagg_view": ("view", "worker")}


def process_secagg_post(state: AuditState, index: int, post: Any, signer: str) -> None:
    """9.3 ``secagg_keys``, ``secagg_deal``, ``secagg_masked_input``, ``secagg_reveal``,
    ``secagg_opening`` (``post``'s kind): "signer = its sender; the sender is in the bucket
    it names (from `secagg_started`); one per kind, sender and round; before the
    certificate; an opening after the sender's masked input"."""
    board_kind, field_name = SECAGG_POSTS[post.KIND]
    sender = getattr(post, field_name)
    rnd = get_round(state, post.round)
    if signer != sender or rnd.secagg_bucket_of is None or (
            rnd.secagg_bucket_of.get(sender) != post.bucket):
        raise Bad("board post not signed by its sender, before the buckets, or from "
                  "outside the bucket it names")
    if (board_kind, sender) in rnd.secagg_posts or (
            board_kind == "opening" and ("masked", sender) not in rnd.secagg_posts):
        raise Bad("a second board post of one kind, or an opening without a masked input")
    if rnd.certified is not None:
        raise Bad("board post after the round was finalized")
    rnd.secagg_posts.add((board_kind, sender))


def process_secagg_masked(state: AuditState, index: int, post: Any, signer: str,
                          digest: str) -> None:
    """A ``secagg_masked_input`` row (:func:`process_secagg_post`), its digest kept for the
    round's ``openings_fixed``."""
    if get_round(state, post.round).openings_seed is not None:
        raise Bad("a masked input after the round's openings were drawn")
    process_secagg_post(state, index, post, signer)
    get_round(state, post.round).secagg_masked[post.worker] = (post.bucket, digest)


def process_openings_fixed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``openings_fixed``: "after the buckets of a masked run, once per round; the
    inputs exactly the round's chained `secagg_masked_input` rows (bucket, sender,
    digest), none after it; `masked` their
    `inputs_digest`, and `signature` the run's group signature (threshold beacon) or
    `shares` a quorum's BLS signatures over `openings_root(run, r, masked)`; `seed`
    follows from it" (protocol/openings.py)."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    if spec.masked is None or rnd.secagg_bucket_of is None or rnd.openings_seed is not None:
        raise Bad("an openings seed outside a dealt masked round, or twice")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or any(
            not isinstance(x, list) or len(x) != 3 or not isinstance(x[1], str)
            for x in inputs) or len({x[1] for x in inputs}) != len(inputs) or {
            x[1]: (x[0], x[2]) for x in inputs} != rnd.secagg_masked:
        raise Bad("openings over inputs that are not exactly the round's chained masked "
                  "inputs")
    if inputs != committed_inputs(inputs) or body.get("masked") != inputs_digest(inputs):
        raise Bad("openings over a digest that is not its inputs'")
    group = state.dkg_group_key if spec.threshold_beacon else None
    if spec.threshold_beacon and group is None:
        raise Bad("a threshold openings seed without the run's DKG group key")
    try:
        seed = verify_openings(spec.validators, spec.quorum, group, spec.run_id, rnd.index,
                               body, body["masked"])
    except RejectedInput as exc:
        raise Bad(f"openings seed: {exc}") from None
    if body.get("seed") != seed.hex():
        raise Bad("the openings seed does not follow from its signature")
    rnd.openings_seed = seed.hex()
    rnd.openings_buckets = survivor_buckets(inputs)


# ----------------------------------------------------------------------------- ledger records


def check_ledger_record(body: Any, run_id: str) -> dict[str, Any]:
    """9.1: a ledger-authored record is "a canonical object whose `run_id` names the row's
    run". The body, for the record's own rule."""
    if not isinstance(body, dict):
        raise Bad("a ledger record is a JSON object")
    if body.get("run_id") != run_id:
        raise Bad("record of another run")
    return body


def process_round_opened(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "rounds open in order on the last certified model" (each after
    the one before it was finalized)."""
    r = body["round"]
    check_no_slash_due(state)
    if state.current is not None and state.current.certified is None and (
            not state.current.voided):
        raise Bad("a round opened before the previous one finalized")
    if r != (0 if state.current is None else state.current.index + 1):
        raise Bad(f"round {r} opened out of order")
    if body["base_model_hash"] != state.next_base:
        raise Bad("base model is not the one the last certificate vouches for")
    state.current = state.rounds[r] = RoundState(r, body["base_model_hash"],
                                                 body.get("outer_state_hash"))


def process_round_closed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "`round_closed` lists exactly the round's submission rows" (of
    the open round); its sealed list's digest is what the beacon shares name."""
    rnd = get_round(state, body["round"])
    if state.failed:
        raise Bad("closes a round after the run failed")
    if rnd is not state.current or rnd.closed is not None:
        raise Bad("closes a round that is not open")
    listed = list(body["submissions"])
    if set(map(type, listed)) <= {str}:  # as sorted lists, without sorting:
        # the digests recorded are distinct, so equal multisets are equal sets
        same = len(listed) == len(rnd.submissions) and set(listed) == rnd.submissions.keys()
    else:
        same = sorted(listed) == sorted(rnd.submissions)
    if not same:
        raise Bad("sealed list differs from the submissions recorded in the round")
    rnd.closed = listed
    rnd.closed_row = index
    rnd.closed_at = body.get("closed_at")
    rnd.sealed = sealed_list_digest(listed)


def process_round_voided(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``round_voided``: "the open round, closed, without a certificate; `results` are
    exactly its recorded results that count (validator, certified digest), and with them
    and `voided_at` no quorum can agree or `certify_seconds` passed since the close
    (``schedule.void_reason``)". The next round opens on the same base."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    if rnd is not state.current or rnd.closed is None or rnd.certified is not None or (
            rnd.voided):
        raise Bad("voids a round that is not closed and unfinalized")
    counted = {spec.validator_index(res.message.validator): digest_of(res.message.certified)
               for res in rnd.results}
    counted = {k: d for k, d in counted.items() if k is not None and k not in rnd.shard_faults}
    listed = {item["validator"]: item["certified_digest"] for item in body["results"]}
    if listed != counted or len(listed) != len(body["results"]):
        raise Bad("voided round's results are not its recorded ones")
    if rnd.closed_at is None or void_reason(
            closed_at=rnd.closed_at, now=body["voided_at"],
            certify_seconds=spec.certify_seconds, results=counted,
            eligible=len(spec.validators) - len(rnd.shard_faults), quorum=spec.quorum) is None:
        raise Bad("round voided while a quorum could still agree before its certify_seconds")
    rnd.voided = True


def process_beacon_fixed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``beacon_fixed``: "exactly `quorum` distinct signers in ascending order; each
    share is that signer's logged `beacon_share`". The round's beacon seed follows."""
    rnd = get_round(state, body["round"])
    spec = get_spec(state)
    if spec.threshold_beacon:
        raise Bad("a quorum-of-shares beacon in a threshold-beacon run")
    if not _is_quorum_list(body["signers"], spec, exact=True):
        raise Bad("beacon signers are not a quorum of the validator set")
    if [rnd.shares.get(k) for k in body["signers"]] != list(body["shares"]):
        raise Bad("beacon shares are not the signers' logged beacon_share rows")
    rnd.beacon_seed = beacon_seed_of({"shares": body["shares"]})


def process_dkg_group_fixed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``dkg_group_fixed`` (5.4a): "once, in a threshold-beacon run; `results` are the
    run's validators' signed DkgResults and a quorum of them signed `group_key`"."""
    spec = get_spec(state)
    if not spec.threshold_beacon or state.dkg_group_key is not None or state.failed:
        raise Bad("a DKG group in a quorum-of-shares run, fixed twice, or after the run failed")
    try:
        agreed = dkg.group_result_of(spec.validators, spec.quorum, spec.run_id,
                                     body["results"])
    except RejectedInput as exc:
        raise Bad(f"DKG group not signed by a quorum of validators: {exc}") from None
    if (agreed.group_key, agreed.public_shares) != (body["group_key"], body["public_shares"]):
        raise Bad("DKG group key differs from the one its validators signed")
    state.dkg_group_key = agreed.group_key


def process_threshold_beacon_fixed(state: AuditState, index: int, body: dict[str, Any]
                                   ) -> None:
    """9.3 ``threshold_beacon_fixed`` (5.4a): "once per round, after it closed; `signature`
    verifies under the run's group key over `threshold_beacon_root(run, r, sealed,
    participants)` with `sealed` the round's sealed list" (`participants` is checked
    against the chain when the round is certified: :func:`check_participant_view`). Who
    signed is not checked: the signature is unique. The round's beacon seed follows from
    the signature alone."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    if not spec.threshold_beacon or state.dkg_group_key is None:
        raise Bad("a threshold beacon without the run's DKG group key")
    if rnd.sealed is None or rnd.beacon_seed is not None or body.get("sealed") != rnd.sealed:
        raise Bad("threshold beacon before the round closed, twice, or over another list")
    try:
        seed = dkg.verify_threshold_beacon(state.dkg_group_key, spec.run_id, rnd.index, body,
                                           sealed=rnd.sealed,
                                           participants=str(body.get("participants")))
    except RejectedInput as exc:
        raise Bad(f"threshold beacon: {exc}") from None
    rnd.beacon_seed = seed.hex()
    rnd.participants, rnd.participants_row = body["participants"], index


def process_challenges_fixed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``challenges_fixed``: "once, after the round's beacon; the checks are
    `compute_challenges` of the beacon seed over the sealed submitters" (checked when the
    round's certificate names them: :func:`check_checks_and_reveals`). It also records the
    reveal deadline."""
    rnd = get_round(state, body["round"])
    if rnd.beacon_seed is None or rnd.challenges is not None:
        raise Bad("checks fixed before the beacon, or twice")
    if get_spec(state).masked is not None and rnd.openings_seed is None:
        raise Bad("a masked round's checks fixed before its openings seed")
    challenges, deadline = body["challenges"], body["reveal_deadline"]
    if not isinstance(challenges, dict) or not isinstance(deadline, int | float) or any(
            not isinstance(v, list) for v in challenges.values()):
        raise Bad("checks are not a map of workers to segments with a deadline")
    rnd.challenges = challenges
    rnd.challenges_row = index
    rnd.reveal_deadline = float(deadline)


def process_shard_list_fixed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``shard_list_fixed``: "the list equals the published results" (fixed once)."""
    rnd = get_round(state, body["round"])
    if rnd.shard_list is not None or body["results"] != rnd.shard_results:
        raise Bad("fixed shard list differs from the published results")
    rnd.shard_list = body["results"]


def process_shard_check_fixed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``shard_check_fixed``: "the seed is `compute_beacon_seed` of a quorum's shares"
    (distinct signers in ascending order, each share that signer's logged
    ``shard_check_share``, over the fixed list; fixed once)."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    signers = body["signers"]
    if not _is_quorum_list(signers, spec, exact=False):
        raise Bad("shard check signers are not a quorum of the validator set")
    if rnd.shard_seed is not None or [rnd.shard_shares.get(k) for k in signers] != body[
            "shares"]:
        raise Bad("shard check seed fixed twice, or from shares that were not recorded")
    if body["results"] != rnd.shard_list or body["seed"] != compute_beacon_seed(
            [bytes.fromhex(x) for x in body["shares"]]).hex():
        raise Bad("shard check seed does not follow from its list and shares")
    rnd.shard_seed = body["seed"]


def process_shard_fault(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``shard_fault``: "a `shard_fault` names a shard that a quorum of recorded
    findings found faulty, exactly those findings' validators as its reporters; once per
    shard"."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    shard = body["shard"]
    reporters = sorted(k for (k, sh), faulty in rnd.shard_findings.items()
                       if sh == shard and faulty)
    if shard in rnd.shard_faults or body["reporters"] != reporters or len(
            reporters) < spec.quorum:
        raise Bad("shard fault without a quorum of recorded faulty findings")
    rnd.shard_faults.add(shard)


def process_secagg_started(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``secagg_started``: "after the beacon of a masked run; buckets disjoint, sorted,
    of two or more, no more workers than the sealed list, the beacon's deal of their
    members" (once a round)."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    if spec.masked is None or rnd.beacon_seed is None or rnd.secagg_bucket_of is not None:
        raise Bad("buckets dealt in an unmasked run, before the beacon, or twice")
    buckets = body["buckets"]
    members = [w for b in buckets for w in b]
    if (len(set(members)) != len(members) or len(members) > len(rnd.closed or ())
            or any(len(b) < 2 or b != sorted(b) for b in buckets)):
        raise Bad("buckets overlap, hold more workers than the sealed list, or are short")
    if buckets != round_buckets(bytes.fromhex(rnd.beacon_seed), members,
                                spec.masked["bucket_size"]):
        raise Bad("buckets are not the beacon's deal of their members")
    rnd.secagg_bucket_of = {w: b for b, ws in enumerate(buckets) for w in ws}


def process_ban(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "a `ban` matches a certified `spot_check_failed` verdict". Written
    just before its round's certificate, so checked when that arrives
    (:func:`process_round_finalized`, which raises :class:`BadEarlier` for it)."""
    rnd = get_round(state, body["round"])
    if rnd.certified is not None or rnd.closed is None:
        raise Bad("ban outside the finalization of its round")
    rnd.bans.append((index, body))


def process_penalty(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "a `penalty` forfeits exactly a certified reward of that worker
    from its vesting window". Written just before its round's certificate, so checked
    when that arrives (:func:`process_round_finalized`, which raises :class:`BadEarlier`
    for it)."""
    rnd = get_round(state, body["round"])
    if rnd.certified is not None or rnd.closed is None:
        raise Bad("penalty outside the finalization of its round")
    rnd.penalties.append((index, body))


def check_validator_fault(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "a `validator_fault` names a recorded result that differs from
    the certificate" (a result of that validator whose certified state has the
    ``result_digest`` the record names, not the ``certified_digest``)."""
    rnd = get_round(state, body["round"])
    differs = any(res.message.validator == body["validator"] and digest_of(
        res.message.certified) == body["result_digest"] != body["certified_digest"]
        for res in rnd.results)
    if not differs:
        raise Bad("fault without a recorded result that differs from the certificate")


def check_shard_sources(spec: RunSpec, rnd: RoundState, certified: CertifiedState) -> None:
    """9.3 ``round_finalized`` of a sharded run: "the certified state takes each shard from
    the fixed list (`result` = its entry, never one a `shard_fault` names) or from a
    recomputation of a shard the list left empty or a `shard_fault` names (`result`
    null)"; other runs name no shards (``shard_sources_problem``, the ledger's own rule
    before it certifies)."""
    problem = shard_sources_problem(spec.shards, certified.shards, rnd.shard_list,
                                    rnd.shard_faults)
    if problem is not None:
        raise Bad(problem)


def process_round_finalized(state: AuditState, index: int, body: dict[str, Any]
                            ) -> RoundState:
    """9.3 ``round_finalized``: "the certificate (section 7.4) ...; a recorded `round_result`
    carries the certified state; its verdicts cover exactly the round's sealed list".
    Here the certificate's run, round and signers (a quorum of the validator set, none
    with a proven ``shard_fault`` in the round); its
    BLS signature is the engine's (batched, 9.5). Then the round's bans and penalties
    (:func:`check_bans_and_penalties`), and the certified model is the next round's
    base. Returns the round, its ``certified`` result set."""
    spec = get_spec(state)
    rnd = get_round(state, body["round"])
    if rnd.voided:
        raise Bad("finalizes a voided round")
    checked = CERTIFICATE(body["certificate"], "certificate")
    certified = CertifiedState.from_body(checked["certified"])
    signers = checked["signers"]
    if certified.run_id != spec.run_id or certified.round != rnd.index + 1:
        raise Bad(f"certificate is for {certified.run_id} round {certified.round}")
    if len(set(signers)) != len(signers) or len(signers) < spec.quorum or any(
            k >= len(spec.validators) for k in signers):
        raise Bad("certificate signers are not a quorum of the validator set")
    if set(signers) & rnd.shard_faults:
        raise Bad("certificate counts a validator whose shard a quorum proved faulty")
    check_shard_sources(spec, rnd, certified)
    match = [res for res in rnd.results if res.message.certified == checked["certified"]]
    if not match:
        raise Bad("no recorded validator result carries the certified state")
    res = match[0]
    if rnd.certified is not None:
        raise Bad("round finalized twice")
    if take(res.facts.submission_digests) != sorted(rnd.closed or []):
        raise Bad("certified verdicts do not cover exactly the sealed submissions")
    check_checks_and_reveals(state, rnd, res)
    check_participant_view(state, rnd, res)
    check_exclusions(state, rnd, res)
    check_bans_and_penalties(state, rnd, res)
    rnd.certified = res
    state.next_base = certified.model_hash
    if state.membership is not None and not state.membership.policy.open:
        state.slashes_due = {(v["worker"], v["submission_digest"]) for v in res.lists()[0]
                             if v["reason"] in PENALIZED_REASONS}
    return rnd


def check_checks_and_reveals(state: AuditState, rnd: RoundState, res: RecordedResult) -> None:
    """The round's ``challenges_fixed`` and ``spot_reveal`` rows against its certified
    verdicts, which name every sealed submission's worker: the checks are the beacon's draw
    over those workers, and each reveal is its worker's own submission's, and due. Raises
    :class:`BadEarlier` naming the first wrong row."""
    if rnd.challenges is None:
        return
    submitted = take(res.facts.submitted)
    seed = rnd.openings_seed or rnd.beacon_seed
    assert seed is not None
    policy = ChallengePolicy.of_run(get_spec(state))
    expected = compute_challenges(bytes.fromhex(seed), sorted(submitted), policy,
                                  buckets=rnd.openings_buckets)
    if rnd.challenges != expected:
        raise BadEarlier(rnd.challenges_row, "challenges_fixed",
                         "checks are not the beacon's (masked: the openings seed's) draw "
                         "over the sealed submitters")
    due = set(policy.checked_workers(expected))
    for worker, (i, digest) in sorted(rnd.reveals.items(), key=lambda kv: kv[1][0]):
        if worker not in due or submitted.get(worker) != digest:
            raise BadEarlier(i, "spot_reveal", "reveal of a worker with no reveal due, or "
                             "naming another worker's submission")
    for worker in sorted(take(res.facts.missing_reveal)):
        if worker in rnd.reveals:  # chained, with the ledger's receipt by the deadline
            raise Bad(f"certified missing_reveal for {worker[:12]}, whose reveal the chain "
                      f"holds at row {rnd.reveals[worker][0]} with a receipt by the deadline: "
                      "the ledger withheld it from the validators")


def check_participant_view(state: AuditState, rnd: RoundState, res: RecordedResult) -> None:
    """9.3 ``beacon_share`` / ``threshold_beacon_fixed``: "`participants` is the digest of
    the chain's participant view of the sealed list (``participant_exclusions``: a worker
    with no registration row before the round closed, or not admitted, is
    ``unknown_worker``; one an earlier round's ban covers, ``banned``)", over the sealed
    workers the certified verdicts name. A beacon over another view means the validators
    judged against a participant list the chain contradicts. Raises :class:`BadEarlier`
    naming the row."""
    if rnd.participants is None:
        return
    workers = list(take(res.facts.submitted))
    registered = {w for w in workers if state.registered.get(w, rnd.closed_row) < rnd.closed_row
                  and (state.membership is None
                       or state.membership.admission_problem(w, rnd.index) is None)}
    banned = {w for w in workers if state.banned_until.get(w, -1) >= rnd.index}
    if rnd.participants != participants_digest(
            participant_exclusions(workers, registered, banned)):
        kind = "threshold_beacon_fixed" if get_spec(state).threshold_beacon else "beacon_share"
        raise BadEarlier(rnd.participants_row, kind, "the beacon was signed over a "
                         "participant view the chain contradicts (registrations, admission "
                         "or bans of the sealed workers)")


def check_exclusions(state: AuditState, rnd: RoundState, res: RecordedResult) -> None:
    """9.3 ``round_finalized``: "a certified `banned` verdict names a worker a ban row of
    an earlier round covers; a certified `unknown_worker` verdict names a worker with no
    registration row before the round closed" (validators take both from the chain, not
    from the ledger's word)."""
    for worker, reason in take(res.facts.excluded).items():
        if reason == "banned" and state.banned_until.get(worker, -1) < rnd.index:
            raise Bad(f"certified verdict bans {worker[:12]}, whom no earlier ban covers")
        if reason == "unknown_worker" and state.registered.get(worker, rnd.closed_row) \
                < rnd.closed_row and (state.membership is None or state.membership
                                      .admission_problem(worker, rnd.index) is None):
            raise Bad(f"certified verdict calls {worker[:12]} unknown, but it registered "
                      "before the round closed")


def check_bans_and_penalties(state: AuditState, rnd: RoundState, res: RecordedResult) -> None:
    """The round's ``ban`` and ``penalty`` rows against its certified result ``res``: a ban
    names a worker whose spot check failed, reason ``spot_check_failed``, until
    ``round + ban_rounds``; a penalty forfeits exactly the reward that worker was
    certified in an earlier round of its vesting window. Raises :class:`BadEarlier`
    naming the first wrong row."""
    failed = take(res.facts.failed)
    spec = get_spec(state)
    ban_rounds = spec.verification["ban_rounds"]
    for i, body in rnd.bans:
        if body["worker"] not in failed or body["reason"] not in PENALIZED_REASONS or body[
                "until_round"] != rnd.index + ban_rounds:
            raise BadEarlier(i, "ban", "ban without a certified failed spot check")
        state.banned_until[body["worker"]] = body["until_round"]
    vesting = spec.verification.get("vesting_rounds", 0)
    for i, body in rnd.penalties:
        src = state.rounds.get(body["source_round"])
        earned = None if src is None or src.certified is None else next(
            (sc["reward"] for sc in src.certified.lists()[1]
             if sc["worker"] == body["worker"]), None)
        if (body["worker"] not in failed or earned is None or body["amount"] != earned
                or not rnd.index - vesting < body["source_round"] < rnd.index):
            raise BadEarlier(i, "penalty", "penalty that is not an unvested certified "
                             "reward of a worker whose spot check failed")


def check_run_finished(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "`run_finished` comes after the last round opened was finalized
    (or voided)"."""
    if state.current is None or (state.current.certified is None and not state.current.voided):
        raise Bad("run finished with a round not finalized")
    check_no_slash_due(state)


def check_run_failed(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ledger records: "`run_failed` (reason `dkg_failed`) only in a threshold-beacon
    run whose DKG group was never fixed, before any round was finalized, and once"."""
    spec = get_spec(state)
    if body.get("reason") != "dkg_failed" or not spec.threshold_beacon:
        raise Bad("a run failed for another reason than its DKG, or in a quorum-of-shares run")
    if state.dkg_group_key is not None or state.failed:
        raise Bad("run failed after its DKG fixed a group key, or twice")
    if any(rnd.certified is not None for rnd in state.rounds.values()):
        raise Bad("run failed after a round was finalized")
    state.failed = True


# ----------------------------------------------------------------------------- pruned blobs

#: Verdict reasons whose reveal file is the evidence of a failed check (never pruned): the
#: proven ones (``PENALIZED_REASONS``).
EVIDENCE_REASONS = PENALIZED_REASONS


def is_failed_check(status: str, reason: str, checks: Any) -> bool:
    """A certified verdict that is the evidence of a failed check: a rejection for one of
    :data:`EVIDENCE_REASONS`, or any recorded check that did not pass."""
    if status == "rejected" and reason in EVIDENCE_REASONS:
        return True
    return isinstance(checks, list) and any(
        isinstance(c, dict) and c.get("ok") is False for c in checks)


def _failed_workers(rnd: RoundState) -> set[str]:
    """The workers whose certified verdict in ``rnd`` is evidence (none in a voided round:
    nothing was certified, nobody was judged)."""
    if rnd.certified is None:
        assert rnd.voided
        return set()
    return {v["worker"] for v in rnd.certified.lists()[0]
            if is_failed_check(v["status"], v["reason"], v.get("checks"))}


def audit_pruned(state: AuditState, pruned: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """specs/protocol.md 9.7: the blobs the ledger lists as deleted by its retention policy
    (``GET /v1/runs/{run}/pruned``), against the rows, after the pass. None may be a file
    the policy keeps forever: the dataset, the genesis model, the latest certified model
    and its outer state, the base of a round not settled (finalized or voided), a reveal
    file of a round not settled, or the evidence of a failed check (the failing worker's reveal file, the
    base model and outer state of its round). Returns how many blobs and bytes are gone;
    raises :class:`Bad` naming the first that should not be."""
    spec = get_spec(state)
    never = {spec.dataset_hash: "the run's dataset",
             spec.genesis_model_hash: "the genesis model"}
    last = max((r for r in state.rounds.values() if r.certified is not None),
               key=lambda r: r.index, default=None)
    if last is not None:
        assert last.certified is not None
        certified = last.certified.message.certified
        never.setdefault(certified["model_hash"], "the latest certified model")
        never.setdefault(certified["outer_state_hash"], "the latest certified outer state")
    reveal_of: dict[str, tuple[RoundState, str]] = {}
    base_of: dict[str, list[RoundState]] = {}
    for rnd in state.rounds.values():
        reveal_of.update((h, (rnd, w)) for w, h in rnd.reveal_files.items())
        for h in (rnd.base, rnd.outer):
            if h is not None:
                base_of.setdefault(h, []).append(rnd)
    failed: dict[int, set[str]] = {}

    def failed_in(rnd: RoundState) -> set[str]:
        if rnd.index not in failed:
            failed[rnd.index] = _failed_workers(rnd)
        return failed[rnd.index]

    count = size = 0
    for row in pruned:
        digest, nbytes = row["sha256"], row["size"]
        if not isinstance(digest, str) or type(nbytes) is not int:
            raise Bad("pruned blobs: a row without its digest or size")
        where = f"pruned blob {digest[:16]}"
        if digest in never:
            raise Bad(f"{where} is {never[digest]}, which is never pruned")
        if digest in reveal_of:
            rnd, worker = reveal_of[digest]
            if rnd.certified is None and not rnd.voided:
                raise Bad(f"{where} is a reveal file of round {rnd.index}, not settled")
            if worker in failed_in(rnd):
                raise Bad(f"{where} is the reveal file of worker {worker[:16]} in round "
                          f"{rnd.index}, whose check failed: evidence is never pruned")
        for rnd in base_of.get(digest, ()):
            if rnd.certified is None and not rnd.voided:
                raise Bad(f"{where} is the base of round {rnd.index}, not settled")
            if failed_in(rnd):
                raise Bad(f"{where} is the base of round {rnd.index}, whose failed check "
                          "it is the evidence of: evidence is never pruned")
        count += 1
        size += nbytes
    return count, size


# ----------------------------------------------------------------------------- dispatch

#: Signed kinds (besides ``run_spec`` and ``round_result``, whose rules take more) -> rule
#: of (state, row index, message, signer); a validator's index where the engine needs it.
def _first_unclosed(state: AuditState) -> int:
    """The first round not yet closed at this point of the chain."""
    rnd = state.current
    if rnd is None:
        return 0
    return rnd.index + 1 if rnd.closed is not None else rnd.index


def process_membership_message(state: AuditState, index: int, message: Any, signer: str
                               ) -> None:
    """9.3 ``admission_ticket``, ``admission_revocation``, ``bond_deposit``,
    ``bond_withdrawal``: signed by the key the run's admission policy gives the kind (an
    issuer, the treasury, the worker itself), in a run whose policy uses it, for the
    row's run, for a round not yet closed when it was recorded (a withdrawal at least
    ``unbonding_rounds`` ahead, of no more than the bond then); then folded in."""
    spec = get_spec(state)
    assert state.membership is not None
    policy = state.membership.policy
    kind = message.KIND
    if message.run_id != spec.run_id or signer != getattr(message, SIGNER_FIELD[kind]):
        raise Bad(f"{kind} of another run or signed by another key than it names")
    if policy.open or (kind in ("bond_deposit", "bond_withdrawal")) != (
            policy.policy == "bond"):
        raise Bad(f"{kind} in a run whose admission is {policy.policy}")
    if kind in ("admission_ticket", "admission_revocation") and signer not in policy.issuers:
        raise Bad(f"{kind} signed by a key that is not one of the run's issuers")
    if kind == "bond_deposit" and signer != policy.treasury:
        raise Bad("bond deposit not signed by the run's treasury")
    if kind == "admission_ticket" and message.expires_round <= message.round:
        raise Bad("ticket that expires before it admits")
    now = _first_unclosed(state)
    if message.round < now:
        raise Bad(f"{kind} for round {message.round}, recorded after it closed")
    if isinstance(message, BondWithdrawal) and (
            message.round < now + policy.unbonding_rounds
            or message.amount > state.membership.balance(message.worker, message.round)):
        raise Bad("withdrawal within the unbonding period or larger than the bond")
    state.membership.add(message)


def process_slash(state: AuditState, index: int, body: dict[str, Any]) -> None:
    """9.3 ``slash``: right after its round's certificate, for a worker whose certified
    verdict proves a fault (``PENALIZED_REASONS``), naming that verdict's submission and
    reason, taking exactly ``floor(slash_share * bond)`` of the bond the chain gives the
    worker in that round (0 under an allowlist); then folded in."""
    checked = SLASH_RECORD(body, SLASH)
    get_spec(state)
    assert state.membership is not None
    policy = state.membership.policy
    rnd = get_round(state, checked["round"])
    if policy.open or rnd is not state.current or rnd.certified is None:
        raise Bad("slash outside the finalization of its round, or in an open run")
    worker = checked["worker"]
    verdict = next((v for v in rnd.certified.lists()[0] if v["worker"] == worker), None)
    if (verdict is None or verdict["reason"] not in PENALIZED_REASONS
            or verdict["reason"] != checked["reason"]
            or verdict["submission_digest"] != checked["submission_digest"]):
        raise Bad("slash without a certified proven fault of that worker and submission")
    if (worker, checked["submission_digest"]) not in state.slashes_due:
        raise Bad("a second slash for one proven fault")
    expected = (state.membership.slash_amount(worker, rnd.index) if policy.policy == "bond"
                else (0, 0))
    if (checked["amount"], checked["balance"]) != expected:
        raise Bad(f"slash of {checked['amount']} from a bond of {checked['balance']}; the "
                  f"chain gives {expected[0]} of {expected[1]}")
    state.membership.add_slash(checked)
    state.slashes_due.discard((worker, checked["submission_digest"]))


SIGNED_RULES: dict[str, Callable[[AuditState, int, Any, str], int | None]] = {
    "beacon_share": process_beacon_share,
    "shard_result": process_shard_result,
    "shard_check_share": process_shard_check_share,
    "shard_finding": process_shard_finding,
    **dict.fromkeys(SECAGG_POSTS, process_secagg_post),
    **dict.fromkeys(SIGNER_FIELD, process_membership_message),
}
#: Ledger records with a rule beyond :func:`check_ledger_record` -> rule of (state, row
#: index, body); ``round_finalized`` gives the round it finalized. Other records (for
#: example ``round_extended``, ``challenges_fixed``, ``reveal``) need only that check.
RECORD_RULES: dict[str, Callable[[AuditState, int, dict[str, Any]], RoundState | None]] = {
    "round_opened": process_round_opened,
    "round_closed": process_round_closed,
    "round_voided": process_round_voided,
    "beacon_fixed": process_beacon_fixed,
    "dkg_group_fixed": process_dkg_group_fixed,
    "threshold_beacon_fixed": process_threshold_beacon_fixed,
    "challenges_fixed": process_challenges_fixed,
    "openings_fixed": process_openings_fixed,
    "shard_list_fixed": process_shard_list_fixed,
    "shard_check_fixed": process_shard_check_fixed,
    "shard_fault": process_shard_fault,
    "secagg_started": process_secagg_started,
    "ban": process_ban,
    "penalty": process_penalty,
    "validator_fault": check_validator_fault,
    "round_finalized": process_round_finalized,
    "run_finished": check_run_finished,
    "run_failed": check_run_failed,
    SLASH: process_slash,
}
