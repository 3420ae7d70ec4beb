"""The round beacon: randomness nobody can know before a round closes or grind.

Each validator BLS-signs the beacon root of (run, round). BLS signatures are
unique (one valid signature per key and message), so a validator cannot try
several values; the shares are published only after the round has closed.

    seed_r = sha256( "veritrain/v1/beacon-seed" || share_i1 || share_i2 || ... )

over the shares of the lowest-indexed validators that make a quorum, in index
order. A withholding validator can refuse to publish (delaying the round until
another quorum forms) but cannot choose the seed: each possible quorum yields
one fixed value, so its influence is at most a choice among those values.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from . import bls
from .encoding import encode_canonical
from .errors import RejectedInput
from .messages import BeaconShare, open_signed
from .signing import compute_signing_root


def beacon_root(run_id: str, round_index: int) -> bytes:
    """What each validator BLS-signs for round ``round_index``'s beacon (empty body)."""
    return compute_signing_root("beacon", run_id, round_index, b"")


def shard_check_root(run_id: str, round_index: int, results: Sequence[str | None]) -> bytes:
    """What each validator BLS-signs to draw a sharded round's check seed.

    The body is ``shard_check_body`` of the shard results' digests in shard
    order, an empty digest where a shard has none (specs/secure-averaging.md A.4).
    """
    body = shard_check_body([bytes.fromhex(d) if d else b"" for d in results])
    return compute_signing_root("shard_check", run_id, round_index, body)


def shard_check_body(result_digests: Sequence[bytes]) -> bytes:
    """SHA-256 over the shard results' digests in shard order, each length-prefixed.

    Fixed by the results and unknown before they are all published; the check
    seed is ``compute_beacon_seed`` of a quorum's BLS signatures over it (unique
    signatures: nobody can grind the sample).
    """
    h = hashlib.sha256(b"veritrain/v1/secure/shard-check-body")
    for dgst in result_digests:
        h.update(len(dgst).to_bytes(4, "big") + dgst)
    return h.digest()


def compute_check_seed(beacon_seed: bytes, result_digests: Sequence[bytes]) -> bytes:
    """Fallback check seed without a second beacon: SHA-256(beacon seed, all result digests).

    Sound against a publisher that cannot grind (it would have to republish to
    try another sample); a grinding publisher gets about 1/p tries for a cheat
    that escapes one sample with probability p, so use it only where p is
    negligible (dense cheats) or prefer the BLS-drawn seed over :func:`shard_check_body`.
    """
    h = hashlib.sha256(b"veritrain/v1/secure/shard-check-seed")
    h.update(len(beacon_seed).to_bytes(4, "big") + beacon_seed)
    h.update(shard_check_body(result_digests))
    return h.digest()


def sealed_list_digest(submission_digests: Sequence[str]) -> str:
    """sha256 (hex) of a round's sealed list: its submission digests (hex), sorted, each
    length-prefixed, after the tag "veritrain/v1/sealed-list". Validators sign it into
    their ``BeaconShare``, so a list changed after the seed is known contradicts them."""
    h = hashlib.sha256(b"veritrain/v1/sealed-list")
    for d in sorted(submission_digests):
        raw = d.encode()
        h.update(len(raw).to_bytes(4, "big") + raw)
    return h.hexdigest()


def sealed_list_digest_of(envelopes: Sequence[Any]) -> str:
    """``sealed_list_digest`` of a served sealed list (signed Submission wires): each
    submission's digest is sha256 of its canonical encoding, as the ledger records it."""
    return sealed_list_digest([hashlib.sha256(encode_canonical(w)).hexdigest()
                               for w in envelopes])


def participant_exclusions(workers: Iterable[str], registered: Container[str],
                           banned: Container[str]) -> dict[str, str]:
    """What the participant list says about a sealed list's ``workers``: worker ->
    ``unknown_worker`` (no registration the chain admits) or ``banned`` (a ban covers the
    round), in ``check_submission``'s order; workers it admits are not named. Empty for
    every sealed list an honest ledger serves (it refuses such submissions)."""
    out: dict[str, str] = {}
    for worker in workers:
        if worker not in registered:
            out[worker] = "unknown_worker"
        elif worker in banned:
            out[worker] = "banned"
    return out


def bans_round(banned_until_round: int, ban_rounds: int, r: int) -> bool:
    """Whether a worker's ban covers round r as that round is judged: a ban issued in round
    r' runs to ``r' + ban_rounds``, and only one issued before r counts (round r's own bans,
    set when it is finalized, would otherwise change its participant view afterwards)."""
    return banned_until_round - ban_rounds < r <= banned_until_round


def participants_digest(exclusions: Mapping[str, str]) -> str:
    """sha256 (hex) of a round's participant view (``participant_exclusions``): the
    excluded workers, sorted, each with its reason, length-prefixed, after the tag
    "veritrain/v1/participant-view". Validators sign it beside the sealed list digest
    before they judge, so every certifying validator judged against one view and a view
    the chain contradicts is named by the audit."""
    h = hashlib.sha256(b"veritrain/v1/participant-view")
    for worker in sorted(exclusions):
        for part in (worker, exclusions[worker]):
            raw = part.encode()
            h.update(len(raw).to_bytes(4, "big") + raw)
    return h.hexdigest()


#: The participant view of a sealed list whose every worker is registered and not banned.
EVERY_WORKER_ADMITTED = participants_digest({})


def compute_beacon_seed(shares_in_index_order: Sequence[bytes]) -> bytes:
    """32-byte seed from the quorum's beacon shares, ordered by validator index."""
    if not shares_in_index_order:
        raise ValueError("a beacon needs at least one share")
    h = hashlib.sha256(b"veritrain/v1/beacon-seed")
    for share in shares_in_index_order:
        h.update(share)
    return h.digest()


def beacon_seed_of(fixed: bytes | dict) -> str:
    """Hex seed of a fixed beacon ``{"signers": [...], "shares": [hex, ...]}`` (index order),
    or of a threshold beacon ``{"signature": hex, "signers": [...]}`` (specs/protocol.md
    5.4a: ``sha256("veritrain/v1/threshold-beacon-seed" || sigma)``; unchecked here)."""
    beacon = json.loads(fixed) if isinstance(fixed, bytes) else fixed
    if "signature" in beacon:
        return hashlib.sha256(b"veritrain/v1/threshold-beacon-seed"
                              + bytes.fromhex(beacon["signature"])).hexdigest()
    return compute_beacon_seed([bytes.fromhex(x) for x in beacon["shares"]]).hex()


def verify_fixed_beacon(validators: Sequence[dict], quorum: int, run_id: str, round_index: int,
                        fixed: dict, *, sealed: str, participants: str,
                        envelopes: Sequence[Any]) -> bytes:
    """The seed of a fixed beacon after checking it, for a party that does not take the
    ledger's word for it: ``signers`` exactly ``quorum`` distinct validator indices in
    ascending order (the ledger fixes the first quorum to arrive), one share each, each
    share in its validator's signed ``BeaconShare`` (``envelopes``, signer order) naming
    ``sealed`` (the digest of the sealed list this party was served) and ``participants``
    (the digest of the participant view this party holds), and every share a
    valid BLS signature of the beacon root by its validator (a pairing check each,
    about 0.3 s in pure Python). RejectedInput otherwise."""
    signers = fixed.get("signers") if isinstance(fixed, dict) else None
    shares = fixed.get("shares") if isinstance(fixed, dict) else None
    if (not isinstance(signers, list) or not isinstance(shares, list)
            or any(type(k) is not int or not 0 <= k < len(validators) for k in signers)
            or any(not isinstance(x, str) for x in shares)
            or len(signers) != len(shares) or len(signers) != quorum
            or signers != sorted(set(signers))):
        raise RejectedInput("the beacon's signers are not a quorum of the validators",
                            "bad_signature")
    if not isinstance(envelopes, (list, tuple)) or len(envelopes) != len(signers):
        raise RejectedInput("one signed share per beacon signer", "bad_signature")
    for k, share, wire in zip(signers, shares, envelopes, strict=True):
        env = open_signed(wire, BeaconShare)  # its Ed25519 signature, domain beacon_share
        msg = env.message
        if (env.signer != validators[k]["ed25519"] or msg.validator != env.signer
                or (msg.run_id, msg.round, msg.share) != (run_id, round_index, share)):
            raise RejectedInput(f"validator {k}'s signed share does not match the beacon",
                                "bad_signature")
        if msg.sealed != sealed:
            raise RejectedInput(f"validator {k} signed another sealed list than the one "
                                "served here", "wrong_sealed_list")
        if msg.participants != participants:
            raise RejectedInput(f"validator {k} judged against another participant view "
                                "than the one held here", "wrong_participants")
    key = (run_id, round_index, quorum, tuple(signers), tuple(shares),
           tuple(validators[k]["bls"] for k in signers))
    with _VERIFY_LOCK:  # concurrent callers of one process wait for the first one's answer
        if (seed := _VERIFIED.get(key)) is not None:
            return seed
        root = beacon_root(run_id, round_index)
        raw = []
        for k, share in zip(signers, shares, strict=True):
            try:
                sig = bytes.fromhex(share)
            except (TypeError, ValueError):
                raise RejectedInput("a beacon share is not hex", "bad_signature") from None
            if not bls.verify(bytes.fromhex(validators[k]["bls"]), root, sig):
                raise RejectedInput(f"validator {k}'s beacon share does not verify",
                                    "bad_signature")
            raw.append(sig)
        if len(_VERIFIED) >= 1024:
            _VERIFIED.clear()
        seed = _VERIFIED[key] = compute_beacon_seed(raw)
        return seed


#: Beacons already verified in this process (nodes sharing one process, as in tests and
#: simulations, pay the pairings once): the inputs that passed -> their seed.
_VERIFIED: dict[tuple, bytes] = {}
_VERIFY_LOCK = threading.Lock()


def shard_checkers(seed: bytes, num_shards: int, per_shard: int) -> list[tuple[int, ...]]:
    """Who checks each shard result of a sharded round: ``per_shard`` validators other than
    its publisher (validator j publishes shard j), drawn from the round's check seed, which
    is fixed after the results (so no publisher knows its checkers when it publishes).

    A seeded permutation ``p`` of the validators (Fisher-Yates with
    ``derive_seed(seed, "shard-checkers", i)``), then the checkers of shard j are the
    ``per_shard`` validators after j in ``p``, cyclically: each shard gets ``per_shard``
    distinct checkers and each validator checks exactly ``per_shard`` shards, so the
    round's checking costs ``V * per_shard`` checks of one shard, linear in V.
    ``per_shard`` of ``num_shards - 1`` or more: every other validator (ascending)."""
    if per_shard >= num_shards - 1:
        return [tuple(k for k in range(num_shards) if k != j) for j in range(num_shards)]
    order = list(range(num_shards))
    for i in range(num_shards - 1, 0, -1):
        j = derive_seed(seed, "shard-checkers", i) % (i + 1)
        order[i], order[j] = order[j], order[i]
    place = {v: i for i, v in enumerate(order)}
    return [tuple(sorted(order[(place[j] + t) % num_shards] for t in range(1, per_shard + 1)))
            for j in range(num_shards)]


def derive_seed(seed: bytes, label: str, *parts: bytes | str | int) -> int:
    """A 63-bit integer for one purpose (``label``) drawn from a beacon seed."""
    h = hashlib.sha256(b"veritrain/v1/derive" + seed + label.encode())
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(raw).to_bytes(4, "big") + raw)
    return int.from_bytes(h.digest()[:8], "big") >> 1
