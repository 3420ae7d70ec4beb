"""Typed protocol messages, their canonical bodies and Ed25519 envelopes.

Each message is a frozen dataclass with a ``KIND`` (its signing domain) and a
``SCHEMA`` that :meth:`Message.from_body` enforces field by field. On the wire
a signed message is the canonical JSON object

    {"kind": KIND, "body": {...}, "signer": <ed25519 hex>, "signature": <hex>}

and the signature covers ``compute_signing_root(KIND, body.run_id,
body.round, canonical(body))``. specs/protocol.md lists every field.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from . import fields as f
from .encoding import decode_canonical, encode_canonical
from .errors import EncodingError, SignatureError
from .identity import Identity
from .signing import compute_signing_root, verify_ed25519

RUN_ID_PATTERN = r"[a-z0-9][a-z0-9-]{2,63}"
MAX_ROUND = 1 << 40
MAX_TRAIL = 4096
MAX_WORKERS_PER_ROUND = 10_000
TIME = f.integer(0, 1 << 40)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A message class's fields, in order (``dataclasses.fields`` is slow on a hot path:
    the ledger builds a receipt per submission)."""
    return tuple(fld.name for fld in dataclasses.fields(cls))


class Message:
    """Base of every typed message: canonical body, schema check, signing root."""

    KIND: ClassVar[str]
    SCHEMA: ClassVar[dict[str, f.Checker]]
    #: Fields added after a kind's first release: absent in a body signed before them
    #: (None here), and then left out of the re-encoded body so its signature still holds.
    ABSENT_OK: ClassVar[frozenset[str]] = frozenset()

    run_id: str
    round: int

    def to_body(self) -> dict[str, Any]:
        if self.ABSENT_OK:
            return {name: getattr(self, name) for name in _field_names(type(self))
                    if name not in self.ABSENT_OK or getattr(self, name) is not None}
        return {name: getattr(self, name) for name in _field_names(type(self))}

    def body_bytes(self) -> bytes:
        return encode_canonical(self.to_body())

    def signing_root(self) -> bytes:
        return compute_signing_root(self.KIND, self.run_id, self.round, self.body_bytes())

    @classmethod
    def from_body(cls, body: Any) -> Any:
        checked = f.record(cls.SCHEMA, absent_ok=cls.ABSENT_OK)(body, cls.KIND)
        return cls(**checked)


M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Signed(Generic[M]):
    """A message with its signer's Ed25519 public key and signature (hex)."""

    message: M
    signer: str
    signature: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.message.KIND,
            "body": self.message.to_body(),
            "signer": self.signer,
            "signature": self.signature,
        }

    def encode(self) -> bytes:
        return encode_canonical(self.to_wire())

    @property
    def digest(self) -> str:
        """sha256 (hex) of the canonical signed encoding: the message's identity."""
        return hashlib.sha256(self.encode()).hexdigest()


def sign(identity: Identity, message: M) -> Signed[M]:
    """Sign ``message`` with the identity's Ed25519 key in the message's domain."""
    signature = identity.sign_ed25519(message.signing_root())
    return Signed(message, identity.public_key.hex(), signature.hex())


_WIRE_SCHEMA = {
    "kind": f.string(32),
    "body": lambda value, path: value,
    "signer": f.PUBKEY,
    "signature": f.SIGNATURE,
}


def open_signed(wire: Any, cls: type[M]) -> Signed[M]:
    """Validate a received signed message of type ``cls`` and verify its signature.

    Raises :class:`EncodingError` for malformed input and
    :class:`SignatureError` when the signature does not verify.
    """
    checked = f.record(_WIRE_SCHEMA)(wire, "message")
    if checked["kind"] != cls.KIND:
        raise EncodingError(f"expected a {cls.KIND} message, got {checked['kind']!r}")
    message = cls.from_body(checked["body"])
    if not verify_ed25519(
        bytes.fromhex(checked["signer"]),
        message.signing_root(),
        bytes.fromhex(checked["signature"]),
    ):
        raise SignatureError(f"{cls.KIND} signature does not verify for {checked['signer']}")
    return Signed(message, checked["signer"], checked["signature"])


def decode_signed(data: bytes, cls: type[M], *, max_bytes: int = 1 << 20) -> Signed[M]:
    """Canonical bytes to a verified signed message."""
    return open_signed(decode_canonical(data, max_bytes=max_bytes), cls)


# --------------------------------------------------------------------------- run spec

#: Where a validator takes workers' reveal receipts straight from them (specs/protocol.md
#: 7.2 step 6a): an http(s) base URL, or absent (that validator takes none).
INBOX_URL = f.string(200, r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?")
VALIDATOR_INFO = f.record({"ed25519": f.PUBKEY, "bls": f.BLS_PUBKEY, "bls_pop": f.BLS_SIGNATURE,
                           "inbox": INBOX_URL}, absent_ok=frozenset({"inbox"}))
NAMED_PARAMS = f.record({"name": f.string(200), "params": f.free_params()})
INNER = f.record(
    {
        "steps": f.integer(1, 100_000),
        "batch_size": f.integer(1, 65_536),
        "lr": f.number(0.0, 10.0),
        "beta1": f.number(0.0, 1.0),
        "beta2": f.number(0.0, 1.0),
        "eps": f.number(0.0, 1.0),
        "weight_decay": f.number(0.0, 10.0),
        "grad_clip": f.optional(f.number(0.0, 1e6)),
        "trail_every": f.integer(1, 100_000),
        "feedback_decay": f.number(0.0, 1.0),
    },
    # Added after the first release: specs signed before it keep the whole residual (1).
    absent_ok=frozenset({"feedback_decay"}),
)
OUTER = f.record(
    {"lr": f.number(0.0, 100.0), "momentum": f.number(0.0, 1.0), "nesterov": f.boolean}
)
SCHEDULE = f.record(
    {
        "round_seconds": f.number(0.1, 86_400 * 7),
        "min_submissions": f.integer(1, MAX_WORKERS_PER_ROUND),
        "max_rounds": f.integer(1, MAX_ROUND),
        "certify_seconds": f.number(1.0, 86_400 * 7),
    },
    # ``certify_seconds`` (how long a closed round waits for its certificate before it
    # is voided, specs/protocol.md 6): ``RunSpec.certify_seconds`` when absent.
    absent_ok=frozenset({"certify_seconds"}),
)
VERIFICATION = f.record(
    {
        "spot_checks_per_round": f.integer(0, MAX_WORKERS_PER_ROUND),
        "challenges_per_worker": f.number(0.0, float(MAX_TRAIL)),
        "always_last": f.boolean,
        "reveal_seconds": f.number(0.1, 86_400.0),
        "tolerance": f.number(0.0, 1.0),
        "norm_factor": f.number(1.0, 1e6),
        "ban_rounds": f.integer(0, MAX_ROUND),
        "vesting_rounds": f.integer(0, MAX_ROUND),
        "probe_examples": f.integer(0, 1 << 16),
        "probe_factor": f.number(0.0, 1e6),
        "opened_chunks": f.integer(1, 1 << 20),
        "binding_chunks": f.integer(0, 1 << 20),
        "recompute_threads": f.integer(1, 256),
        "beacon": f.one_of("shares", "threshold"),
        "byzantine_share": f.number(0.0, 0.5),
    },
    # Added with the probe filter: specs signed before it have no probe (both 0); added
    # with chunked commitments: the chunks a check opens (16 when absent); the CPU threads
    # a validator recomputes with (1 when absent).
    # ``beacon`` (threshold beacon from a DKG, specs/protocol.md 5.4a): "shares" when absent.
    # ``byzantine_share``: the share of workers the run must tolerate, 0 (none declared)
    # when absent; a masked run whose breakdown point is not above it is refused.
    absent_ok=frozenset({"probe_examples", "probe_factor", "opened_chunks", "binding_chunks",
                         "recompute_threads", "beacon", "byzantine_share"}),
)
#: Largest bucket a run may ask for (buckets hold ``bucket_size`` to ``2 bucket_size - 1``).
MAX_BUCKET_SIZE = 64


def masked_withstands(byzantine: int, workers: int, bucket_size: int) -> bool:
    """Whether a masked round of ``workers`` submitters withstands ``byzantine`` of them
    wherever the beacon deals them: N workers make ``B = floor(N / s)`` buckets, a
    Byzantine member spoils its whole bucket, so f of them spoil up to ``min(f, B)``, and
    CenteredClip over the bucket means needs fewer than half spoiled: ``2 f < B``."""
    return 2 * byzantine < workers // bucket_size


def masked_breakdown(bucket_size: int) -> float:
    """The breakdown point of masked buckets of s, as a share of the workers: ``1 / (2 s)``,
    the limit of :func:`masked_withstands` as N grows (for N workers, ``2 f < floor(N /
    s)`` allows a little less: ``f / N < (1 - (s - 1) / N) / (2 s)``). Unmasked
    CenteredClip's is 1/2."""
    return 1.0 / (2 * bucket_size)
MASKED = f.record({
    "bucket_size": f.integer(2, MAX_BUCKET_SIZE),
    "max_dropouts": f.integer(0, MAX_BUCKET_SIZE),
    "clip_norm": f.number(1e-6, 1e6),
    "phase_seconds": f.number(0.1, 3600.0),
})
AGGREGATOR = f.record(
    {"name": f.string(200), "params": f.free_params(), "shards": f.integer(2, 256),
     "shard_checkers": f.integer(1, 255), "masked": MASKED},
    absent_ok=frozenset({"shards", "shard_checkers", "masked"}),
)
LIMITS = f.record({"max_payload_bytes": f.integer(1, 1 << 34)})
REWARDS = f.record({"per_round": f.number(0.0, 1e18)})
#: Admission policies (specs/protocol.md 4.1a; rules in protocol/membership.py).
ADMISSION_POLICIES = ("open", "allowlist", "bond")
MAX_UNITS = 1 << 62
#: ``RunSpec.admission``: every key but ``policy`` may be absent (protocol/membership.py
#: resolves the defaults); a spec without ``admission`` is ``open``.
ADMISSION = f.record(
    {
        "policy": f.one_of(*ADMISSION_POLICIES),
        "issuers": f.list_of(f.PUBKEY, 64),
        "treasury": f.PUBKEY,
        "min_bond": f.integer(0, MAX_UNITS),
        "slash_share": f.number(0.0, 1.0),
        "unbonding_rounds": f.integer(0, MAX_ROUND),
    },
    absent_ok=frozenset({"issuers", "treasury", "min_bond", "slash_share",
                         "unbonding_rounds"}),
)


@dataclass(frozen=True)
class RunSpec(Message):
    """Everything that defines a run; signed by the organiser, fixed for its lifetime."""

    KIND: ClassVar[str] = "run_spec"
    run_id: str
    round: int  # always 0: the spec precedes every round
    created_at: int
    organiser: str
    seed: str
    task: dict[str, Any]
    dataset_hash: str
    dataset_bytes: int
    genesis_model_hash: str
    num_params: int
    inner: dict[str, Any]
    outer: dict[str, Any]
    codec: dict[str, Any]
    aggregator: dict[str, Any]
    schedule: dict[str, Any]
    verification: dict[str, Any]
    limits: dict[str, Any]
    rewards: dict[str, Any]
    validators: list[dict[str, str]]
    quorum: int
    #: Who may register as a worker (protocol/membership.py); None: ``open``, and left
    #: out of the body (specs signed before admission policies existed).
    admission: dict[str, Any] | None = None

    ABSENT_OK: ClassVar[frozenset[str]] = frozenset({"admission"})
    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, 0),
        "created_at": TIME,
        "organiser": f.PUBKEY,
        "seed": f.HASH,
        "task": NAMED_PARAMS,
        "dataset_hash": f.HASH,
        "dataset_bytes": f.integer(0, 1 << 40),
        "genesis_model_hash": f.HASH,
        "num_params": f.integer(1, 1 << 40),
        "inner": INNER,
        "outer": OUTER,
        "codec": NAMED_PARAMS,
        "aggregator": AGGREGATOR,
        "schedule": SCHEDULE,
        "verification": VERIFICATION,
        "limits": LIMITS,
        "rewards": REWARDS,
        "validators": f.list_of(VALIDATOR_INFO, 256),
        "quorum": f.integer(1, 256),
        "admission": ADMISSION,
    }

    @property
    def feedback_decay(self) -> float:
        """The share of its error-feedback residual a worker carries to the next round
        (``inner.feedback_decay``; 1.0, all of it, when absent)."""
        return float(self.inner.get("feedback_decay", 1.0))

    @property
    def probe(self) -> tuple[int, float]:
        """``(probe_examples, probe_factor)``; ``(0, 0.0)`` (no probe filter) when absent."""
        v = self.verification
        return int(v.get("probe_examples", 0)), float(v.get("probe_factor", 0.0))

    @property
    def certify_seconds(self) -> float:
        """How long a closed round waits for a quorum's certificate before the ledger voids
        it (``schedule.certify_seconds``; absent: the larger of 600 s and 10 rounds'
        time, room for validators that recompute at scale)."""
        value = self.schedule.get("certify_seconds")
        return float(value) if value is not None else max(
            600.0, 10.0 * float(self.schedule["round_seconds"]))

    @property
    def threshold_beacon(self) -> bool:
        """Whether the round beacon is a threshold BLS signature under a DKG group key
        (``verification.beacon == "threshold"``, specs/protocol.md 5.4a); otherwise the
        quorum-of-shares beacon of 5.4 ("shares", the default for specs without it)."""
        return self.verification.get("beacon", "shares") == "threshold"

    @property
    def shards(self) -> int:
        """How many coordinate shards the validators aggregate (``aggregator.shards``):
        0 when one validator aggregates everything alone."""
        return int(self.aggregator.get("shards", 0))

    @property
    def shard_checkers(self) -> int:
        """How many other validators check each shard result (``aggregator.shard_checkers``,
        drawn from the check seed: ``beacon.shard_checkers``); absent: every other one."""
        return int(self.aggregator.get("shard_checkers", max(self.shards - 1, 0)))

    def sharding_problem(self) -> str | None:
        """Why ``aggregator.shards`` cannot run, or None (specs/secure-averaging.md E):
        sharding computes the CenteredClip fixed point, one shard per validator."""
        if not self.shards:
            if "shard_checkers" in self.aggregator:
                return "shard_checkers without shards"
            return None
        if self.aggregator["name"] != "centered_clip":
            return "sharded aggregation needs the centered_clip aggregator"
        if not 1 <= self.shard_checkers <= self.shards - 1:
            return (f"{self.shard_checkers} checkers per shard: between 1 and the "
                    f"{self.shards - 1} other validators")
        if self.shard_checkers < self.shards - 1 and not self.threshold_beacon:
            return ("fewer shard checkers than the other validators needs the threshold "
                    "beacon (verification.beacon = threshold): the draw must come from a "
                    "seed nobody can grind")
        if self.shards != len(self.validators):
            return (f"{self.shards} shards for {len(self.validators)} validators: "
                    "each validator aggregates one shard")
        if self.aggregator["params"].get("bucket_size", 1) != 1:
            return "sharded aggregation does not combine with bucket_size"
        if "tau" not in self.aggregator["params"] and "tau_rel" not in self.aggregator["params"]:
            return "sharded aggregation needs a clipping radius (tau or tau_rel)"
        if self.shards > self.num_params:
            return "more shards than parameters"
        return None

    @property
    def masked(self) -> dict[str, Any] | None:
        """Masked buckets (``aggregator.masked``: bucket_size, max_dropouts, clip_norm,
        phase_seconds), or None when workers send their updates in the clear."""
        return self.aggregator.get("masked")

    def masking_problem(self) -> str | None:
        """Why ``aggregator.masked`` cannot run, or None (specs/secure-averaging.md E.2):
        validators see bucket sums only, so the aggregate is CenteredClip over bucket
        means and no per-update filter can run."""
        m = self.masked
        if m is None:
            return None
        if self.aggregator["name"] != "centered_clip":
            return "masked buckets need the centered_clip aggregator"
        if self.shards:
            return "masked buckets do not combine with sharded aggregation yet"
        if self.aggregator["params"].get("bucket_size", 1) != 1:
            return "masked buckets replace the aggregator's bucket_size: leave it out"
        if "tau" not in self.aggregator["params"] and "tau_rel" not in self.aggregator["params"]:
            return "masked buckets need a clipping radius (tau or tau_rel)"
        if 2 * m["max_dropouts"] >= m["bucket_size"]:
            return (f"max_dropouts {m['max_dropouts']} needs buckets of more than "
                    f"{2 * m['max_dropouts']} (the threshold s - t must exceed s / 2)")
        if self.probe[0] > 0:
            return "masked buckets hide single updates: the probe filter cannot run (set 0)"
        if self.schedule["min_submissions"] < 2:
            return ("masked buckets need schedule.min_submissions >= 2: a round sealed "
                    "with one submitter has no bucket to hide it in")
        share = self.verification.get("byzantine_share", 0.0)
        if share >= masked_breakdown(m["bucket_size"]):
            s = m["bucket_size"]
            return (f"masked buckets of {s} withstand a Byzantine share below 1/(2 x {s}) = "
                    f"{masked_breakdown(s):.4g}, not the {share:.4g} this run declares "
                    "(specs/secure-averaging.md E.2, Breakdown)")
        return None

    def validator_index(self, ed25519_hex: str) -> int | None:
        for i, v in enumerate(self.validators):
            if v["ed25519"] == ed25519_hex:
                return i
        return None

    def quorum_problem(self) -> str | None:
        """Why the quorum cannot work, or None: it must be at most the validator count and
        more than half of it (``2 quorum > n``), so two disjoint quorums never exist to
        certify two states of one round, or fix two seeds from two boards a ledger shows
        two validator groups (protocol.md 5.4 assumes ``2 quorum > n + f``)."""
        n = len(self.validators)
        if not 1 <= self.quorum <= n:
            return f"quorum {self.quorum} is not between 1 and the {n} validators"
        if 2 * self.quorum <= n:
            return (f"quorum {self.quorum} of {n} validators is not a majority: two disjoint "
                    f"quorums could certify two states of one round (need 2 quorum > n)")
        return None

    def validator_inboxes(self) -> dict[str, str]:
        """Each validator's inbox URL (validator key -> base URL), for those that name one:
        where a worker hands its reveal receipts past the ledger (protocol.md 7.2)."""
        return {v["ed25519"]: v["inbox"] for v in self.validators if v.get("inbox")}


# --------------------------------------------------------------------------- registration


@dataclass(frozen=True)
class Registration(Message):
    """A worker asks to take part in a run (validators are named in the run spec)."""

    KIND: ClassVar[str] = "registration"
    run_id: str
    round: int  # always 0
    participant: str
    role: str
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, 0),
        "participant": f.PUBKEY,
        "role": f.one_of("worker"),
        "created_at": TIME,
    }


# --------------------------------------------------------------------------- submission

LOSS = f.number(-1e9, 1e9)


@dataclass(frozen=True)
class Submission(Message):
    """A worker's signed claim: this payload is my pseudo-gradient for this round."""

    KIND: ClassVar[str] = "submission"
    run_id: str
    round: int
    worker: str
    base_model_hash: str
    payload_hash: str
    payload_bytes: int
    codec: dict[str, Any]
    samples: int
    trail: list[str]
    ef_hash: str
    loss_first: float
    loss_last: float
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "worker": f.PUBKEY,
        "base_model_hash": f.HASH,
        "payload_hash": f.HASH,
        "payload_bytes": f.integer(0, 1 << 40),
        "codec": NAMED_PARAMS,
        "samples": f.integer(0, 1 << 40),
        "trail": f.list_of(f.HASH, MAX_TRAIL),
        "ef_hash": f.HASH,
        "loss_first": LOSS,
        "loss_last": LOSS,
        "created_at": TIME,
    }


@dataclass(frozen=True)
class Receipt(Message):
    """The ledger's signed acknowledgement that a submission arrived in time."""

    KIND: ClassVar[str] = "receipt"
    run_id: str
    round: int
    worker: str
    submission_digest: str
    received_at: float
    sequence: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "worker": f.PUBKEY,
        "submission_digest": f.HASH,
        "received_at": f.number(0, 1e12),
        "sequence": f.integer(0, 1 << 62),
    }


@dataclass(frozen=True)
class SpotReveal(Message):
    """A worker's reveal for a round's checks: the envelope of its reveal file
    (protocol/reveal.py), naming the submission it opens and the file by hash and size."""

    KIND: ClassVar[str] = "spot_reveal"
    run_id: str
    round: int
    worker: str
    submission_digest: str
    reveal_hash: str
    reveal_bytes: int
    created_at: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "worker": f.PUBKEY,
        "submission_digest": f.HASH,
        "reveal_hash": f.HASH,
        "reveal_bytes": f.integer(1, 1 << 40),
        "created_at": f.integer(0, 1 << 40),
    }


@dataclass(frozen=True)
class RevealReceipt(Message):
    """The ledger's signed acknowledgement that a worker's reveal arrived, and when: a
    worker holding one for its round cannot be failed for a missing reveal."""

    KIND: ClassVar[str] = "reveal_receipt"
    run_id: str
    round: int
    worker: str
    reveal_digest: str  # digest of the worker's signed SpotReveal envelope
    reveal_hash: str
    received_at: float
    deadline: float
    sequence: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "worker": f.PUBKEY,
        "reveal_digest": f.HASH,
        "reveal_hash": f.HASH,
        "received_at": f.number(0, 1e12),
        "deadline": f.number(0, 1e12),
        "sequence": f.integer(0, 1 << 62),
    }


# --------------------------------------------------------------------------- round result

#: ``excluded``: kept out of the aggregate by a statistical filter (``FILTER_REASONS`` in
#: protocol/rules.py), or in a masked run with its bucket when that was dropped by no fault
#: of its own (``bucket_dropped``), and still paid (specs/scoring.md, secure-averaging.md
#: E.2); ``rejected``: not admissible work.
VERDICT_STATUS = ("accepted", "rejected", "excluded")
CHECK_KINDS = ("step", "binding")
SEGMENT_CHECK = f.record(
    {
        "kind": f.one_of(*CHECK_KINDS),
        "segment": f.integer(0, MAX_TRAIL),
        "start": f.optional(f.HASH),
        "end": f.HASH,
        "ef": f.optional(f.HASH),
        "distance": f.optional(f.number(0.0, 1e300)),
        "ok": f.boolean,
        "note": f.string(200),
    },
    # Added with the binding check: results recorded before it are all segment checks.
    absent_ok=frozenset({"kind"}),
)
VERDICT = f.record(
    {
        "worker": f.PUBKEY,
        "submission_digest": f.HASH,
        "status": f.one_of(*VERDICT_STATUS),
        "reason": f.string(64, r"[a-z_]*"),
        "detail": f.string(500),
        "spot_checked": f.boolean,
        "distance": f.optional(f.number(0.0, 1e300)),
        "checks": f.list_of(SEGMENT_CHECK, MAX_TRAIL + 1),  # the segments, then the binding
    }
)
SCORE = f.record(
    {
        "worker": f.PUBKEY,
        "samples": f.integer(0, 1 << 40),
        "quality": f.number(0.0, 1.0),
        "score": f.number(0.0, 1e18),
        "reward": f.number(0.0, 1e18),
    }
)


@dataclass(frozen=True)
class CertifiedState(Message):
    """What a certificate vouches for: the model that round ``round`` starts from.

    Validators BLS-sign this message's signing root (domain ``certificate``);
    ``round`` is the round the model is the base of.
    """

    KIND: ClassVar[str] = "certificate"
    run_id: str
    round: int
    model_hash: str
    outer_state_hash: str
    update_hash: str
    verdicts_hash: str
    scores_hash: str
    eval_loss: float
    #: Sharded runs only: where each coordinate shard of the aggregate came from, in shard
    #: order: ``{"shard": k, "result": the verified list's digest of the publication
    #: used, or null when recomputed, "aggregate": shard_aggregate_digest of its values}``
    #: (specs/secure-averaging.md E.1). Absent otherwise.
    shards: list[dict[str, Any]] | None = None

    ABSENT_OK: ClassVar[frozenset[str]] = frozenset({"shards"})
    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(1, MAX_ROUND),
        "model_hash": f.HASH,
        "outer_state_hash": f.HASH,
        "update_hash": f.HASH,
        "verdicts_hash": f.HASH,
        "scores_hash": f.HASH,
        "eval_loss": LOSS,
        "shards": f.list_of(f.record({"shard": f.integer(0, 255),
                                      "result": f.optional(f.HASH),
                                      "aggregate": f.HASH}), 256),
    }


@dataclass(frozen=True)
class RoundResult(Message):
    """One validator's outcome of round ``round``: verdicts, scores, new model, attestation."""

    KIND: ClassVar[str] = "round_result"
    run_id: str
    round: int
    validator: str
    base_model_hash: str
    beacon_seed: str
    verdicts: list[dict[str, Any]]
    scores: list[dict[str, Any]]
    certified: dict[str, Any]
    attestation: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "base_model_hash": f.HASH,
        "beacon_seed": f.HASH,
        "verdicts": f.list_of(VERDICT, MAX_WORKERS_PER_ROUND),
        "scores": f.list_of(SCORE, MAX_WORKERS_PER_ROUND),
        "certified": lambda v, p: CertifiedState.from_body(v).to_body(),
        "attestation": f.BLS_SIGNATURE,
    }

    @property
    def certified_state(self) -> CertifiedState:
        return CertifiedState.from_body(self.certified)


@dataclass(frozen=True)
class BeaconShare(Message):
    """A validator's BLS signature over the round's beacon root, sent after the round closed,
    with the digest of the sealed list it saw (``sealed_list_digest``) and of the participant
    view it judges that list against (``participants_digest``): the validator's signed word
    that both were fixed before anyone could know the seed."""

    KIND: ClassVar[str] = "beacon_share"
    run_id: str
    round: int
    validator: str
    share: str
    sealed: str
    participants: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "share": f.BLS_SIGNATURE,
        "sealed": f.HASH,
        "participants": f.HASH,
    }


# --------------------------------------------------------------------------- sharded aggregation

MAX_SHARDS = 256


def max_shard_file_bytes(num_params: int, shards: int) -> int:
    """Largest shard result file: float32 aggregate of the longest shard, float64 distance
    and up to 4 int64 heavy blocks per row for MAX_WORKERS_PER_ROUND rows, a 64 KiB header."""
    return 4 * (num_params // shards + 1) + MAX_WORKERS_PER_ROUND * (8 + 4 * 8) + (1 << 16)


@dataclass(frozen=True)
class ShardPublication(Message):
    """A validator's CenteredClip fixed point on its coordinate shard (sharded runs).

    ``result_digest`` is ``ShardResult.digest()`` (specs/secure-averaging.md A.3),
    ``result_hash`` the sha256 of the safetensors blob that carries it, and
    ``inputs_digest`` what the validator aggregated: the accepted submissions
    and the radius (``validators.sharded.inputs_digest``).
    """

    KIND: ClassVar[str] = "shard_result"
    run_id: str
    round: int
    validator: str
    shard: int
    inputs_digest: str
    result_digest: str
    result_hash: str
    result_bytes: int

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "shard": f.integer(0, MAX_SHARDS - 1),
        "inputs_digest": f.HASH,
        "result_digest": f.HASH,
        "result_hash": f.HASH,
        "result_bytes": f.integer(1, 1 << 40),
    }


@dataclass(frozen=True)
class ShardCheckShare(Message):
    """A validator's BLS signature over the round's published shard results.

    ``results`` lists each shard's ``result_digest`` in shard order (None where
    none was published); ``share`` signs ``shard_check_root`` of that list. A
    quorum of shares fixes the check seed exactly as the round beacon is fixed.
    """

    KIND: ClassVar[str] = "shard_check_share"
    run_id: str
    round: int
    validator: str
    results: list[str | None]
    share: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "results": f.list_of(f.optional(f.HASH), MAX_SHARDS),
        "share": f.BLS_SIGNATURE,
    }


@dataclass(frozen=True)
class ShardFindingReport(Message):
    """A validator's settled dispute over another validator's shard result.

    ``faulty`` comes from the exact check of every coordinate (deterministic, so
    honest validators agree); ``reason`` is ``stationarity``, ``distance``,
    ``malformed: ...``, ``missing`` (nothing published in time) or ``ok``.
    """

    KIND: ClassVar[str] = "shard_finding"
    run_id: str
    round: int
    validator: str
    shard: int
    publisher: str
    faulty: bool
    reason: str
    published_digest: str | None
    replacement_digest: str
    max_abs_deviation: float | None

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "shard": f.integer(0, MAX_SHARDS - 1),
        "publisher": f.PUBKEY,
        "faulty": f.boolean,
        "reason": f.string(200),
        "published_digest": f.optional(f.HASH),
        "replacement_digest": f.HASH,
        "max_abs_deviation": f.optional(f.number(0.0, 1e300)),
    }


def digest_of(value: Any) -> str:
    """sha256 (hex) of a value's canonical encoding (verdict and score lists)."""
    return hashlib.sha256(encode_canonical(value)).hexdigest()


# --------------------------------------------------------------------------- masked buckets

#: ChaCha20-Poly1305 sealing of a seed share, its salt, a key share and its salt.
SEALED_SHARES_BYTES = 2 * (33 + 32) + 16
SHARE_ITEM = f.record({"dealer": f.PUBKEY, "share": f.hex_bytes(33), "salt": f.HASH})
SEALED_ITEM = f.record({"holder": f.PUBKEY, "ciphertext": f.hex_bytes(SEALED_SHARES_BYTES)})
MAX_BUCKET_MEMBERS = 2 * MAX_BUCKET_SIZE
VIEW_SIGNATURE = f.record({"worker": f.PUBKEY, "signature": f.SIGNATURE})


@dataclass(frozen=True)
class SecaggKeys(Message):
    """A bucket member's fresh X25519 keys for the round (spec B.5 KeyAdvertisement)."""

    KIND: ClassVar[str] = "secagg_keys"
    run_id: str
    round: int
    bucket: int
    worker: str
    enc_public: str
    mask_public: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "bucket": f.integer(0, MAX_WORKERS_PER_ROUND),
        "worker": f.PUBKEY,
        "enc_public": f.PUBKEY,
        "mask_public": f.PUBKEY,
    }


@dataclass(frozen=True)
class SecaggDeal(Message):
    """A dealer's share commitments (public) and its shares sealed to each holder.

    The ciphertexts are public too: each opens only with the holder's X25519
    key, and the commitments let anyone check a revealed share later.
    """

    KIND: ClassVar[str] = "secagg_deal"
    run_id: str
    round: int
    bucket: int
    dealer: str
    seed_commitment: str
    seed_share_commitments: list[str]
    key_share_commitments: list[str]
    sealed: list[dict[str, str]]

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "bucket": f.integer(0, MAX_WORKERS_PER_ROUND),
        "dealer": f.PUBKEY,
        "seed_commitment": f.HASH,
        "seed_share_commitments": f.list_of(f.HASH, MAX_BUCKET_MEMBERS),
        "key_share_commitments": f.list_of(f.HASH, MAX_BUCKET_MEMBERS),
        "sealed": f.list_of(SEALED_ITEM, MAX_BUCKET_MEMBERS),
    }


@dataclass(frozen=True)
class SecaggMasked(Message):
    """A dealer's masked input: the digest of ``MaskedInput`` and the words file's hash.

    ``commitment`` binds the quantized update q (opened by a spot check);
    ``words_hash`` is the sha256 of the uint32 little-endian file of 4 D bytes.
    """

    KIND: ClassVar[str] = "secagg_masked_input"
    run_id: str
    round: int
    bucket: int
    worker: str
    commitment: str
    input_digest: str
    words_hash: str
    words_bytes: int
    dealers_digest: str  # protocol/secagg.py view_digest of the members and dealers it masked over

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "bucket": f.integer(0, MAX_WORKERS_PER_ROUND),
        "worker": f.PUBKEY,
        "commitment": f.HASH,
        "input_digest": f.HASH,
        "words_hash": f.HASH,
        "words_bytes": f.integer(4, 1 << 40),
        "dealers_digest": f.HASH,
    }


@dataclass(frozen=True)
class SecaggReveal(Message):
    """A holder's shares for its bucket once the survivors are fixed: seed shares of the
    survivors, key shares of the dealers that dropped out, never both for one dealer."""

    KIND: ClassVar[str] = "secagg_reveal"
    run_id: str
    round: int
    bucket: int
    holder: str
    survivors: list[str]
    seed_shares: list[dict[str, str]]
    key_shares: list[dict[str, str]]
    members: list[str]
    dealers: list[str]
    view_signatures: list[dict[str, str]]  # the SecaggView signatures it revealed on

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "bucket": f.integer(0, MAX_WORKERS_PER_ROUND),
        "holder": f.PUBKEY,
        "survivors": f.list_of(f.PUBKEY, MAX_BUCKET_MEMBERS),
        "seed_shares": f.list_of(SHARE_ITEM, MAX_BUCKET_MEMBERS),
        "key_shares": f.list_of(SHARE_ITEM, MAX_BUCKET_MEMBERS),
        "members": f.list_of(f.PUBKEY, MAX_BUCKET_MEMBERS),
        "dealers": f.list_of(f.PUBKEY, MAX_BUCKET_MEMBERS),
        "view_signatures": f.list_of(VIEW_SIGNATURE, MAX_BUCKET_MEMBERS),
    }


@dataclass(frozen=True)
class SecaggView(Message):
    """A survivor's signature on the bucket view it acted on (spec E.2, consistency round):
    the members, the dealers it masked over and the survivors. A member reveals shares
    only once k members signed exactly its own view."""

    KIND: ClassVar[str] = "secagg_view"
    run_id: str
    round: int
    bucket: int
    worker: str
    members: list[str]
    dealers: list[str]
    survivors: list[str]

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "bucket": f.integer(0, MAX_WORKERS_PER_ROUND),
        "worker": f.PUBKEY,
        "members": f.list_of(f.PUBKEY, MAX_BUCKET_MEMBERS),
        "dealers": f.list_of(f.PUBKEY, MAX_BUCKET_MEMBERS),
        "survivors": f.list_of(f.PUBKEY, MAX_BUCKET_MEMBERS),
    }


@dataclass(frozen=True)
class OpeningsShare(Message):
    """A validator's BLS signature over ``openings_root(run, r, masked)``, ``masked`` the
    digest of the committed masked inputs it verified (protocol/openings.py): a partial
    under its threshold key share in a threshold-beacon run, under its own BLS key
    otherwise. One per validator and round."""

    KIND: ClassVar[str] = "openings_share"
    run_id: str
    round: int
    validator: str
    masked: str
    share: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "masked": f.HASH,
        "share": f.BLS_SIGNATURE,
    }


@dataclass(frozen=True)
class SecaggOpening(Message):
    """A spot-checked worker's mask secrets, so validators can re-mask the quantized
    update they recompute from its revealed payload and compare with its masked input."""

    KIND: ClassVar[str] = "secagg_opening"
    run_id: str
    round: int
    bucket: int
    worker: str
    self_seed: str
    mask_private: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "bucket": f.integer(0, MAX_WORKERS_PER_ROUND),
        "worker": f.PUBKEY,
        "self_seed": f.HASH,
        "mask_private": f.HASH,
    }
