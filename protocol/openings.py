"""Which workers a masked round opens, drawn only once their masked inputs are committed.

A masked round's spot checks open a few workers' masked inputs (their mask secrets and
training trail). Drawn from the round's beacon, as unmasked rounds draw theirs, the
opened set would be known before anyone masks, and a worker sure to stay unopened could
post any masked words at no risk. So a masked round draws its openings from a second
seed that exists only after every bucket's masked phase has closed
(specs/secure-averaging.md E.2, step 3a):

* the **committed inputs** are the survivors' signed masked-input posts, as
  ``[bucket, worker, post digest]`` sorted (:func:`committed_inputs`), and their digest
  ``inputs_digest = sha256("veritrain/v1/secure/masked-inputs" || canonical(inputs))``;
* each validator BLS-signs ``openings_root(run, r, inputs_digest)`` (domain
  ``openings``) once per round, with its threshold key share in a threshold-beacon run
  (a partial) or its own BLS key otherwise, and posts it as an ``OpeningsShare``;
* a quorum fixes the seed: the group signature sigma combined from the partials,
  ``seed = sha256("veritrain/v1/openings-seed" || sigma)``, unique for the inputs; or,
  with individual keys, the first quorum's shares in index order, ``seed =
  sha256("veritrain/v1/openings-seed" || share_1 || ... || share_q)``.

No worker can predict the seed while it masks (it needs a quorum of validators' keys),
and no party can change the inputs it covers without every honest validator's second
signature, which it never gives (each signs one inputs digest per round). The opened
workers are ``compute_challenges`` of this seed, bucketed by the survivor sets the
inputs name (:func:`survivor_buckets`), so no bucket is opened down to one unopened
survivor. Torch-free: the ledger and the audit run it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import bls
from .board import BoardFault, open_member_post
from .dkg import verify_group_signature
from .encoding import encode_canonical
from .errors import RejectedInput
from .messages import SecaggMasked
from .signing import compute_signing_root

_INPUTS_DOMAIN = b"veritrain/v1/secure/masked-inputs"
_SEED_DOMAIN = b"veritrain/v1/openings-seed"


def committed_inputs(posts: Iterable[tuple[int, str, str]]) -> list[list[Any]]:
    """The committed inputs ``[[bucket, worker, post digest], ...]``, sorted, from the
    survivors' masked-input posts ``(bucket, worker, digest of the signed post)``."""
    return sorted([int(b), str(w), str(d)] for b, w, d in posts)


def inputs_digest(inputs: Sequence[Sequence[Any]]) -> str:
    """``sha256(domain || canonical(inputs))`` (hex): what validators sign over."""
    return hashlib.sha256(_INPUTS_DOMAIN + encode_canonical([list(x) for x in inputs])
                          ).hexdigest()


def verified_inputs(run_id: str, r: int, view: Mapping[str, Any],
                    faults: list[str] | None = None) -> list[list[Any]]:
    """The committed masked inputs of the board ``view`` (``committed_inputs``: bucket,
    worker, post digest) from the masked-input posts that check out here: each bound to
    its member (signer = worker), this run and round, and the bucket the beacon dealt it.
    What a validator signs its openings share over, and what every party checks the
    fixed seed against; a post that does not check out is left out, its reason in
    ``faults``."""
    bucket_of = {w: b["index"] for b in view["buckets"] for w in b["assigned"]}
    found: list[tuple[int, str, str]] = []
    for wire in view["posts"].get("masked", []):
        body = wire.get("body") if isinstance(wire, dict) else None
        worker = body.get("worker") if isinstance(body, dict) else None
        if worker not in bucket_of:
            if faults is not None:
                faults.append("a masked input of a worker in no bucket")
            continue
        try:
            signed = open_member_post(wire, SecaggMasked, member_field="worker",
                                      members={worker}, run_id=run_id, round_index=r,
                                      bucket=bucket_of[worker])
        except BoardFault as exc:
            if faults is not None:
                faults.append(str(exc))
            continue
        found.append((bucket_of[worker], worker, signed.digest))
    return committed_inputs(found)


def survivor_buckets(inputs: Sequence[Sequence[Any]]) -> list[list[str]]:
    """Each bucket's survivors (the workers whose masked input is committed), sorted, in
    bucket order; buckets with none are left out."""
    by_bucket: dict[int, list[str]] = {}
    for bucket, worker, _ in inputs:
        by_bucket.setdefault(int(bucket), []).append(str(worker))
    return [sorted(by_bucket[b]) for b in sorted(by_bucket)]


def openings_root(run_id: str, round_index: int, digest: str) -> bytes:
    """The BLS message of round r's openings seed: ``compute_signing_root("openings", run,
    r, canonical({"masked": inputs_digest}))``."""
    return compute_signing_root("openings", run_id, round_index,
                                encode_canonical({"masked": digest}))


def seed_of_signature(signature: bytes) -> bytes:
    """``sha256("veritrain/v1/openings-seed" || sigma)`` of a group signature."""
    return hashlib.sha256(_SEED_DOMAIN + signature).digest()


def seed_of_shares(shares_in_index_order: Sequence[bytes]) -> bytes:
    """``sha256("veritrain/v1/openings-seed" || share_1 || ...)`` of a quorum's shares."""
    h = hashlib.sha256(_SEED_DOMAIN)
    for share in shares_in_index_order:
        h.update(share)
    return h.digest()


def verify_openings(validators: Sequence[dict[str, Any]], quorum: int, group_key: str | None,
                    run_id: str, round_index: int, fixed: Any, digest: str) -> bytes:
    """The openings seed of a fixed ``{"signature": hex}`` (``group_key`` given: a
    threshold-beacon run) or ``{"signers": [...], "shares": [...]}`` (individual keys),
    checked over ``digest``, the inputs digest this party computed from the posts it
    verified itself; a party never takes the ledger's word for it. RejectedInput
    ``invalid_openings`` otherwise. A seed that verified is remembered per process
    (parties sharing one process, as in tests and simulations, pay the pairings once)."""
    key = (tuple(v["bls"] for v in validators), quorum, group_key, run_id, round_index,
           encode_canonical(fixed) if isinstance(fixed, dict) else b"", digest)
    with _VERIFY_LOCK:  # concurrent callers of one process wait for the first one's answer
        if (seed := _VERIFIED.get(key)) is None:
            seed = _verify(validators, quorum, group_key, run_id, round_index, fixed, digest)
            if len(_VERIFIED) >= 1024:
                _VERIFIED.clear()
            _VERIFIED[key] = seed
        return seed


#: Openings seeds already verified in this process: the inputs that passed -> their seed.
_VERIFIED: dict[tuple[Any, ...], bytes] = {}
_VERIFY_LOCK = threading.Lock()


def _verify(validators: Sequence[dict[str, Any]], quorum: int, group_key: str | None,
            run_id: str, round_index: int, fixed: Any, digest: str) -> bytes:
    root = openings_root(run_id, round_index, digest)
    if not isinstance(fixed, dict):
        raise RejectedInput("the openings seed is not fixed", "invalid_openings")
    if group_key is not None:
        sig = fixed.get("signature")
        try:
            raw = bytes.fromhex(sig) if isinstance(sig, str) else b""
        except ValueError:
            raw = b""
        if not raw or not verify_group_signature(group_key, root, raw):
            raise RejectedInput("the openings seed is not the group's signature over these "
                                "committed masked inputs", "invalid_openings")
        return seed_of_signature(raw)
    signers, shares = fixed.get("signers"), fixed.get("shares")
    if (not isinstance(signers, list) or not isinstance(shares, list)
            or len(signers) != quorum or len(shares) != quorum
            or any(type(k) is not int or not 0 <= k < len(validators) for k in signers)
            or signers != sorted(set(signers)) or any(not isinstance(x, str) for x in shares)):
        raise RejectedInput("the openings seed's signers are not a quorum of the validators",
                            "invalid_openings")
    raw_shares = []
    for k, share in zip(signers, shares, strict=True):
        try:
            raw = bytes.fromhex(share)
        except ValueError:
            raw = b""
        if not raw or not bls.verify(bytes.fromhex(validators[k]["bls"]), root, raw):
            raise RejectedInput(f"validator {k}'s openings share is not its signature over "
                                "these committed masked inputs", "invalid_openings")
        raw_shares.append(raw)
    return seed_of_shares(raw_shares)
