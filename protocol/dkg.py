"""Distributed key generation and threshold BLS for the round beacon (sans I/O).

A Feldman-VSS DKG in the style of Pedersen's (the one drand runs), over the curve and
ciphersuite of :mod:`protocol.bls`: secrets are scalars mod the BLS12-381 group order
``r``, public keys and commitments 48-byte G1 points, signatures 96-byte G2 points.
Validator ``k`` (index in the run spec, 0-based) evaluates polynomials at ``x_k = k + 1``.

Phases, each a set of signed board posts (the ledger relays, never decides):

1. **keys** (:class:`DkgKeys`): every validator posts a fresh X25519 key for this DKG.
2. **deal** (:class:`DkgDeal`): dealer ``i`` draws ``f_i(x) = a_i0 + a_i1 x + ... +
   a_i,t-1 x^(t-1)`` (``t = quorum``), posts the Feldman commitments
   ``C_ik = a_ik * G1`` and, for every recipient ``j``, ``s_ij = f_i(x_j)`` sealed with
   ChaCha20-Poly1305 under ``HKDF(X25519(e_i, e_j), run, i, j)`` (AAD: the deal's
   commitments digest), naming the X25519 keys it used.
3. **complaint** (:class:`DkgComplaint`): recipient ``j`` checks
   ``s_ij * G1 == sum_k C_ik * x_j^k`` and accuses every dealer whose share does not
   open or does not verify.
4. **justification** (:class:`DkgJustification`): an accused dealer reveals the accused
   shares in the clear; anybody checks them against the commitments. A dealer accused
   and not (validly) justified, one that posted two different deals, or one whose deal
   is malformed, is disqualified. ``QUAL`` = the rest; the DKG succeeds iff
   ``|QUAL| >= quorum``.
5. **result** (:class:`DkgResult`): each validator signs what it computed:
   ``group_key = sum_{i in QUAL} C_i0``, public shares
   ``X_j = sum_{i in QUAL} sum_k C_ik x_j^k`` and the digests of the qualified deals.
   The run's group key is the one a quorum of validators signed identically.

Validator ``j``'s secret share is ``x_j = sum_{i in QUAL} s_ij``; ``X_j = x_j * G1``.
Nobody learns the group secret ``sum_i a_i0`` unless ``quorum`` shares come together.

Threshold beacon: validator ``j`` posts ``sigma_j = x_j * H(m)`` (a BLS signature of
``m`` under ``x_j``, checked against ``X_j``); any ``quorum`` partials ``S`` combine by
Lagrange interpolation in the exponent,

    sigma = sum_{j in S} lambda_j * sigma_j,   lambda_j = prod_{m in S, m != j} x_m / (x_m - x_j)  (mod r)

which is the unique BLS signature of ``m`` under ``group_key`` whatever ``S`` is. The
seed is ``sha256("veritrain/v1/threshold-beacon-seed" || sigma)``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from py_ecc.bls import G2ProofOfPossession as _Pop
from py_ecc.bls.g2_primitives import G1_to_pubkey, G2_to_signature, pubkey_to_G1, signature_to_G2
from py_ecc.optimized_bls12_381 import G1, Z1, Z2, add, curve_order, multiply

from . import bls
from . import fields as f
from .board import members_posts
from .encoding import encode_canonical
from .errors import RejectedInput
from .messages import MAX_ROUND, RUN_ID_PATTERN, Message, Signed
from .signing import compute_signing_root

R = curve_order
#: Sealed share: 12-byte nonce || ChaCha20-Poly1305(32-byte share) (32 + 16 bytes).
SEALED_SHARE_BYTES = 12 + 32 + 16
MAX_VALIDATORS = 256
_EMPTY = f.string(0)
SEALED = f.hex_bytes(SEALED_SHARE_BYTES)
SCALAR = f.hex_bytes(32)


def _sealed_or_empty(value: Any, path: str) -> str:
    return _EMPTY(value, path) if value == "" else SEALED(value, path)


def _key_or_empty(value: Any, path: str) -> str:
    return _EMPTY(value, path) if value == "" else f.PUBKEY(value, path)


class DkgFault(RejectedInput):
    """A DKG post or partial signature that does not check out."""

    reason = "dkg_fault"


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class DkgKeys(Message):
    """A validator's fresh X25519 key for the run's DKG (round 0)."""

    KIND: ClassVar[str] = "dkg_keys"
    run_id: str
    round: int
    validator: str
    enc_public: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "enc_public": f.PUBKEY,
    }


@dataclass(frozen=True)
class DkgDeal(Message):
    """A dealer's Feldman commitments (``quorum`` G1 points) and one sealed share per
    validator (index order, ``""`` where the recipient posted no key), with the X25519 keys
    it sealed them under (``enc_keys[dealer]`` is its own)."""

    KIND: ClassVar[str] = "dkg_deal"
    run_id: str
    round: int
    dealer: str
    commitments: list[str]
    enc_keys: list[str]
    shares: list[str]

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "dealer": f.PUBKEY,
        "commitments": f.list_of(f.BLS_PUBKEY, MAX_VALIDATORS),
        "enc_keys": f.list_of(_key_or_empty, MAX_VALIDATORS),
        "shares": f.list_of(_sealed_or_empty, MAX_VALIDATORS),
    }


@dataclass(frozen=True)
class DkgComplaint(Message):
    """A recipient's accusation: the dealers (indices) whose share to it did not open or
    did not verify against their commitments."""

    KIND: ClassVar[str] = "dkg_complaint"
    run_id: str
    round: int
    validator: str
    accused: list[int]

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "accused": f.list_of(f.integer(0, MAX_VALIDATORS - 1), MAX_VALIDATORS),
    }


REVEALED = f.record({"to": f.integer(0, MAX_VALIDATORS - 1), "share": SCALAR})


@dataclass(frozen=True)
class DkgJustification(Message):
    """An accused dealer's answer: the accused shares in the clear (``to``, ``share``)."""

    KIND: ClassVar[str] = "dkg_justification"
    run_id: str
    round: int
    dealer: str
    shares: list[dict[str, Any]]

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "dealer": f.PUBKEY,
        "shares": f.list_of(REVEALED, MAX_VALIDATORS),
    }


@dataclass(frozen=True)
class DkgResult(Message):
    """What a validator computed from the board: ``QUAL`` (dealer indices, ascending), the
    digests of their deals, the group key and every validator's public share."""

    KIND: ClassVar[str] = "dkg_result"
    run_id: str
    round: int
    validator: str
    qualified: list[int]
    deals: list[str]
    group_key: str
    public_shares: list[str]

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "qualified": f.list_of(f.integer(0, MAX_VALIDATORS - 1), MAX_VALIDATORS),
        "deals": f.list_of(f.HASH, MAX_VALIDATORS),
        "group_key": f.BLS_PUBKEY,
        "public_shares": f.list_of(f.BLS_PUBKEY, MAX_VALIDATORS),
    }

    def agreed(self) -> tuple:
        """The part every validator must agree on (everything but who signed)."""
        return (tuple(self.qualified), tuple(self.deals), self.group_key,
                tuple(self.public_shares))


@dataclass(frozen=True)
class BeaconPartial(Message):
    """A validator's partial signature ``x_j * H(threshold_beacon_root(run, r, sealed,
    participants))``."""

    KIND: ClassVar[str] = "beacon_partial"
    run_id: str
    round: int
    validator: str
    sealed: str
    participants: str
    partial: str

    SCHEMA: ClassVar[dict[str, f.Checker]] = {
        "run_id": f.string(64, RUN_ID_PATTERN),
        "round": f.integer(0, MAX_ROUND),
        "validator": f.PUBKEY,
        "sealed": f.HASH,
        "participants": f.HASH,
        "partial": f.BLS_SIGNATURE,
    }


# --------------------------------------------------------------------------- field and group


def point_x(index: int) -> int:
    """Evaluation point of validator ``index``: ``x = index + 1`` (0 is the secret)."""
    return index + 1


def eval_poly(coeffs: Sequence[int], x: int) -> int:
    """``f(x) = sum_k coeffs[k] x^k mod r`` (Horner)."""
    acc = 0
    for c in reversed(coeffs):
        acc = (acc * x + c) % R
    return acc


def _g1(raw: str | bytes) -> Any:
    """A G1 point from its compressed form: on the curve, in the subgroup, not infinity."""
    data = bytes.fromhex(raw) if isinstance(raw, str) else raw
    if len(data) != bls.PUBLIC_KEY_BYTES or not _Pop.KeyValidate(data):
        raise DkgFault("not a valid G1 point")
    return pubkey_to_G1(data)


def commit(coeffs: Sequence[int]) -> list[str]:
    """Feldman commitments ``C_k = a_k * G1`` (compressed, hex)."""
    return [bytes(G1_to_pubkey(multiply(G1, a % R))).hex() for a in coeffs]


def eval_commitments(points: Sequence[Any], x: int) -> Any:
    """``sum_k C_k x^k`` in G1: the public image ``f(x) * G1`` of the committed polynomial."""
    acc = Z1
    for c in reversed(points):
        acc = add(multiply(acc, x), c)
    return acc


def share_verifies(points: Sequence[Any], index: int, share: int) -> bool:
    """Feldman check: ``share * G1 == sum_k C_k x_index^k``."""
    if not 0 <= share < R:
        return False
    lhs = multiply(G1, share)
    rhs = eval_commitments(points, point_x(index))
    return bytes(G1_to_pubkey(lhs)) == bytes(G1_to_pubkey(rhs))


def lagrange_at_zero(indices: Sequence[int]) -> dict[int, int]:
    """``lambda_j = prod_{m != j} x_m / (x_m - x_j) mod r`` for validator indices ``j``."""
    xs = {j: point_x(j) for j in indices}
    if len(xs) != len(indices):
        raise ValueError("indices repeat")
    out = {}
    for j, xj in xs.items():
        num, den = 1, 1
        for m, xm in xs.items():
            if m != j:
                num = num * xm % R
                den = den * (xm - xj) % R
        out[j] = num * pow(den, -1, R) % R
    return out


# --------------------------------------------------------------------------- sealing shares


def x25519_public(secret: X25519PrivateKey) -> str:
    return secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def _share_key(mine: X25519PrivateKey, theirs_hex: str, run_id: str, dealer: int,
               recipient: int, dealer_pub: str, recipient_pub: str) -> bytes:
    shared = mine.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(theirs_hex)))
    info = (b"veritrain/v1/dkg-share" + encode_canonical(
        [run_id, dealer, recipient, dealer_pub, recipient_pub]))
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)


def _commitments_digest(commitments: Sequence[str]) -> bytes:
    return hashlib.sha256(b"veritrain/v1/dkg-commitments" + encode_canonical(list(commitments))
                          ).digest()


def seal_share(mine: X25519PrivateKey, recipient_pub: str, *, run_id: str, dealer: int,
               recipient: int, commitments: Sequence[str], share: int) -> str:
    """``nonce || ChaCha20-Poly1305(K_ij, nonce, share, AAD = commitments digest)`` (hex)."""
    key = _share_key(mine, recipient_pub, run_id, dealer, recipient, x25519_public(mine),
                     recipient_pub)
    nonce = secrets.token_bytes(12)
    ct = ChaCha20Poly1305(key).encrypt(nonce, share.to_bytes(32, "big"),
                                       _commitments_digest(commitments))
    return (nonce + ct).hex()


def open_share(mine: X25519PrivateKey, deal: DkgDeal, *, dealer: int, recipient: int) -> int:
    """The share ``deal`` sealed to ``recipient`` (this node), after the Feldman check;
    :class:`DkgFault` if it does not open or does not verify (grounds for a complaint)."""
    check_deal_shape(deal, dealer, len(deal.shares), len(deal.commitments))
    sealed, my_pub = deal.shares[recipient], x25519_public(mine)
    if not sealed or deal.enc_keys[recipient] != my_pub:
        raise DkgFault(f"dealer {dealer} sealed no share to this validator's key")
    try:
        key = _share_key(mine, deal.enc_keys[dealer], deal.run_id, dealer, recipient,
                         deal.enc_keys[dealer], my_pub)
        raw = bytes.fromhex(sealed)
        plain = ChaCha20Poly1305(key).decrypt(raw[:12], raw[12:],
                                              _commitments_digest(deal.commitments))
    except (InvalidTag, ValueError) as exc:
        raise DkgFault(f"dealer {dealer}'s share does not open: {exc or 'bad tag'}") from None
    share = int.from_bytes(plain, "big")
    if not share_verifies(deal_points(deal), recipient, share):
        raise DkgFault(f"dealer {dealer}'s share does not match its commitments")
    return share


# --------------------------------------------------------------------------- dealing


@dataclass
class Dealing:
    """A dealer's secret polynomial (kept by the dealer) and its public deal."""

    coeffs: list[int]
    deal: DkgDeal


def deal(*, run_id: str, round_index: int, dealer: int, dealer_key: str, quorum: int,
         enc_secret: X25519PrivateKey, enc_keys: Sequence[str | None],
         coeffs: Sequence[int] | None = None) -> Dealing:
    """Draw ``f(x)`` of degree ``quorum - 1`` (uniform coefficients mod r unless given),
    commit to it and seal ``f(x_j)`` to every validator ``j`` with a key in ``enc_keys``."""
    n = len(enc_keys)
    if not 1 <= quorum <= n or not 0 <= dealer < n:
        raise ValueError("quorum or dealer out of range")
    poly = [c % R for c in coeffs] if coeffs is not None else [
        secrets.randbelow(R - 1) + 1 for _ in range(quorum)]
    if len(poly) != quorum:
        raise ValueError("a polynomial of degree quorum - 1 has quorum coefficients")
    commitments = commit(poly)
    keys = [k or "" for k in enc_keys]
    keys[dealer] = x25519_public(enc_secret)
    shares = [seal_share(enc_secret, keys[j], run_id=run_id, dealer=dealer, recipient=j,
                         commitments=commitments, share=eval_poly(poly, point_x(j)))
              if keys[j] else "" for j in range(n)]
    return Dealing(poly, DkgDeal(run_id=run_id, round=round_index, dealer=dealer_key,
                                 commitments=commitments, enc_keys=keys, shares=shares))


def check_deal_shape(deal: DkgDeal, dealer: int, n: int, quorum: int) -> None:
    """A deal's shape: ``quorum`` commitments, ``n`` keys and sealed shares, its own key
    present. :class:`DkgFault` otherwise (the dealer is then disqualified)."""
    if len(deal.commitments) != quorum:
        raise DkgFault(f"dealer {dealer} committed to {len(deal.commitments)} coefficients, "
                       f"not {quorum}")
    if len(deal.enc_keys) != n or len(deal.shares) != n:
        raise DkgFault(f"dealer {dealer}'s deal does not have one share per validator")
    if not 0 <= dealer < n or not deal.enc_keys[dealer]:
        raise DkgFault(f"dealer {dealer} names no key of its own")


_POINTS: dict[tuple[str, ...], list[Any]] = {}


def deal_points(deal: DkgDeal) -> list[Any]:
    """The deal's commitments as G1 points (validated; cached per process)."""
    key = tuple(deal.commitments)
    if (pts := _POINTS.get(key)) is None:
        pts = [_g1(c) for c in deal.commitments]
        if len(_POINTS) >= 4096:
            _POINTS.clear()
        _POINTS[key] = pts
    return pts


def accusations(enc_secret: X25519PrivateKey, deals: Mapping[int, DkgDeal], *, me: int,
                n: int, quorum: int) -> tuple[dict[int, int], list[int]]:
    """Validator ``me``'s view of the deals: (the shares that verified, by dealer; the
    dealers it accuses). A malformed deal is not accused: everybody sees it is void."""
    good: dict[int, int] = {}
    bad: list[int] = []
    for i, d in sorted(deals.items()):
        try:
            check_deal_shape(d, i, n, quorum)
            deal_points(d)
        except DkgFault:
            continue
        try:
            good[i] = open_share(enc_secret, d, dealer=i, recipient=me)
        except DkgFault:
            bad.append(i)
    return good, bad


def justify(dealing: Dealing, accused_by: Sequence[int]) -> list[dict[str, Any]]:
    """The shares a dealer reveals to answer complaints: ``f(x_j)`` for each accuser."""
    return [{"to": j, "share": eval_poly(dealing.coeffs, point_x(j)).to_bytes(32, "big").hex()}
            for j in sorted(set(accused_by))]


# --------------------------------------------------------------------------- qualification


@dataclass(frozen=True)
class Qualification:
    """The public outcome of a DKG transcript."""

    qualified: list[int]
    disqualified: dict[int, str]
    deals: dict[int, DkgDeal]
    revealed: dict[int, dict[int, int]]  # dealer -> recipient -> share made public
    group_key: str
    public_shares: list[str]

    def deal_digests(self, digests: Mapping[int, str]) -> list[str]:
        return [digests[i] for i in self.qualified]


def qualify(*, n: int, quorum: int, deals: Mapping[int, Sequence[DkgDeal]],
            complaints: Mapping[int, Sequence[int]],
            justifications: Mapping[int, Sequence[dict[str, Any]]]) -> Qualification:
    """``QUAL`` and the group key from the public transcript (the same for everyone who
    sees the same posts). ``deals``: each dealer's distinct deals (two = equivocation);
    ``complaints``: accuser -> accused dealers; ``justifications``: dealer -> revealed
    shares. :class:`DkgFault` if fewer than ``quorum`` dealers qualify."""
    out: dict[int, DkgDeal] = {}
    dq: dict[int, str] = {}
    revealed: dict[int, dict[int, int]] = {}
    for i, posted in sorted(deals.items()):
        if len(posted) != 1:
            dq[i] = "posted two different deals"
            continue
        try:
            check_deal_shape(posted[0], i, n, quorum)
            deal_points(posted[0])
        except DkgFault as exc:
            dq[i] = f"malformed deal: {exc}"
            continue
        out[i] = posted[0]
    accused: dict[int, set[int]] = {}
    for j, dealers in complaints.items():
        for i in dealers:
            accused.setdefault(i, set()).add(j)
    for i, accusers in sorted(accused.items()):
        if i not in out:
            continue
        answers: dict[int, int] = {}
        for item in justifications.get(i, ()):
            answers.setdefault(item["to"], int(item["share"], 16))
        for j in sorted(accusers):
            if j not in answers:
                dq[i] = f"did not answer validator {j}'s complaint"
                break
            if not share_verifies(deal_points(out[i]), j, answers[j]):
                dq[i] = f"revealed a share for validator {j} that does not match its commitments"
                break
        else:
            revealed[i] = {j: answers[j] for j in accusers}
        if i in dq:
            out.pop(i)
    qualified = sorted(out)
    if len(qualified) < quorum:
        raise DkgFault(f"only {len(qualified)} dealers qualified, {quorum} needed")
    summed = [Z1] * quorum
    for i in qualified:
        summed = [add(a, c) for a, c in zip(summed, deal_points(out[i]), strict=True)]
    group_key = bytes(G1_to_pubkey(summed[0])).hex()
    public = [bytes(G1_to_pubkey(eval_commitments(summed, point_x(j)))).hex() for j in range(n)]
    return Qualification(qualified, dq, out, revealed, group_key, public)


def secret_share(q: Qualification, me: int, opened: Mapping[int, int]) -> int:
    """``x_me = sum_{i in QUAL} s_i,me``: shares it opened itself, else revealed ones.
    :class:`DkgFault` when a qualified dealer's share is neither (this node cannot sign)."""
    total = 0
    for i in q.qualified:
        s = opened.get(i, q.revealed.get(i, {}).get(me))
        if s is None:
            raise DkgFault(f"no share from qualified dealer {i}")
        total = (total + s) % R
    return total


def result_message(q: Qualification, *, run_id: str, round_index: int, validator: str,
                   digests: Mapping[int, str]) -> DkgResult:
    """The :class:`DkgResult` a validator signs for ``q``."""
    return DkgResult(run_id=run_id, round=round_index, validator=validator,
                     qualified=list(q.qualified), deals=q.deal_digests(digests),
                     group_key=q.group_key, public_shares=list(q.public_shares))


def agreed_result(results: Mapping[int, Sequence[Signed[DkgResult]]], *, quorum: int
                  ) -> DkgResult:
    """The result at least ``quorum`` distinct validators signed identically (posts already
    opened and bound to their members, e.g. by ``board.members_posts``). A validator with
    two different results counts for neither. :class:`DkgFault` when no result has a
    quorum (the DKG failed, or the board showed validators different transcripts)."""
    votes: dict[tuple, list[DkgResult]] = {}
    for posts in results.values():
        views = {p.message.agreed() for p in posts}
        if len(views) == 1:
            votes.setdefault(views.pop(), []).append(posts[0].message)
    best = [v for v in votes.values() if len(v) >= quorum]
    if len(best) != 1:
        raise DkgFault("no DKG result was signed by a quorum of validators")
    return best[0][0]


# --------------------------------------------------------------------------- threshold beacon


def threshold_beacon_root(run_id: str, round_index: int, sealed: str,
                          participants: str) -> bytes:
    """The BLS message of round r's threshold beacon: ``compute_signing_root(
    "threshold_beacon", run, r, canonical({"participants": participants_digest,
    "sealed": sealed_list_digest}))``: the seed exists only for one sealed list judged
    against one participant view."""
    return compute_signing_root("threshold_beacon", run_id, round_index,
                                encode_canonical({"participants": participants,
                                                  "sealed": sealed}))


def partial_sign(share: int, message: bytes) -> bytes:
    """``sigma_j = x_j * H(m)``: a BLS signature under the secret share."""
    return bls.sign(share, message)


def partial_verifies(public_share: str, message: bytes, partial: bytes) -> bool:
    """``e(X_j, H(m)) == e(G1, sigma_j)``: one pairing check (about 0.3 s in py-ecc)."""
    return bls.verify(bytes.fromhex(public_share), message, partial)


def combine(partials: Mapping[int, bytes], quorum: int) -> bytes:
    """``sigma = sum_j lambda_j sigma_j`` over exactly ``quorum`` partials (validator index
    -> 96-byte G2 point), each assumed verified. The same bytes for every quorum."""
    if len(partials) != quorum:
        raise ValueError(f"{len(partials)} partials, {quorum} needed")
    lam = lagrange_at_zero(sorted(partials))
    acc = Z2
    for j, sig in partials.items():
        acc = add(acc, multiply(signature_to_G2(sig), lam[j]))
    return bytes(G2_to_signature(acc))


def threshold_seed(group_signature: bytes) -> bytes:
    """``seed_r = sha256("veritrain/v1/threshold-beacon-seed" || sigma)``."""
    return hashlib.sha256(b"veritrain/v1/threshold-beacon-seed" + group_signature).digest()


def verify_group_signature(group_key: str, message: bytes, signature: bytes) -> bool:
    """``e(group_key, H(m)) == e(G1, sigma)``: the only check the seed needs."""
    return bls.verify(bytes.fromhex(group_key), message, signature)


# --------------------------------------------------------------------------- the round's beacon


def combine_verified(result: DkgResult, posts: Mapping[int, Sequence[Signed[BeaconPartial]]],
                     *, run_id: str, round_index: int, sealed: str, participants: str,
                     quorum: int, faults: list[str] | None = None) -> tuple[bytes, list[int]]:
    """The group signature of round r from the partial posts (opened and bound to their
    members, to ``sealed`` and to ``participants``, e.g. by ``board.members_posts(...,
    sealed=sealed, participants=participants)``):
    the first ``quorum`` validators' partials in index order are combined and the result
    checked against the group key (one pairing check, whatever the quorum: the group
    signature is unique, so a combination that verifies is the beacon). Only when it
    does not is each partial checked against its validator's public share and skipped,
    its reason in ``faults``, when it does not verify; the first ``quorum`` good ones are
    combined. Returns (signature, signer indices); :class:`DkgFault` when fewer than
    ``quorum`` verify. Which quorum is used does not change the signature."""
    root = threshold_beacon_root(run_id, round_index, sealed, participants)
    first = {j: posts[j][0] for j in sorted(posts)
             if 0 <= j < len(result.public_shares) and posts[j]}
    if len(first) >= quorum:
        chosen = dict(list(first.items())[:quorum])
        try:
            sig = combine({j: bytes.fromhex(p.message.partial) for j, p in chosen.items()},
                          quorum)
        except Exception:  # a partial that is no G2 point: the checks below name it
            sig = b""
        if sig and verify_group_signature(result.group_key, root, sig):
            return sig, sorted(chosen)
    good: dict[int, bytes] = {}
    for j in sorted(posts):
        if len(good) == quorum:
            break
        if not 0 <= j < len(result.public_shares):
            continue
        for post in posts[j]:
            raw = bytes.fromhex(post.message.partial)
            if partial_verifies(result.public_shares[j], root, raw):
                good[j] = raw
                break
            if faults is not None:
                faults.append(f"validator {j}'s partial signature does not verify against its "
                              "public key share")
    if len(good) < quorum:
        raise DkgFault(f"{len(good)} valid partial signatures, {quorum} needed")
    return combine(good, quorum), sorted(good)


_BEACONS: dict[tuple[str, str, int, str, str, str], bytes] = {}


def verify_threshold_beacon(group_key: str, run_id: str, round_index: int, fixed: Any, *,
                            sealed: str, participants: str) -> bytes:
    """The seed of a fixed threshold beacon ``{"signature": hex, ...}`` for a party that
    does not take the ledger's word: the signature must verify under the run's group key
    over ``threshold_beacon_root(run, r, sealed, participants)`` with ``sealed`` the
    digest of the list this party was served and ``participants`` the digest of the
    participant view it holds (one pairing check, cached per process). Who signed does
    not matter: the signature is unique. RejectedInput ``invalid_beacon`` otherwise."""
    sig = fixed.get("signature") if isinstance(fixed, dict) else None
    if not isinstance(sig, str):
        raise RejectedInput("the fixed beacon carries no group signature", "invalid_beacon")
    key = (group_key, run_id, round_index, sealed, participants, sig)
    if (seed := _BEACONS.get(key)) is not None:
        return seed
    try:
        raw = bytes.fromhex(sig)
    except ValueError:
        raise RejectedInput("the beacon's group signature is not hex", "invalid_beacon") from None
    if not verify_group_signature(
            group_key, threshold_beacon_root(run_id, round_index, sealed, participants), raw):
        raise RejectedInput("the beacon is not the group's signature over this run, round, "
                            "sealed list and participant view", "invalid_beacon")
    if len(_BEACONS) >= 1024:
        _BEACONS.clear()
    seed = _BEACONS[key] = threshold_seed(raw)
    return seed


def group_result_of(validators: Sequence[dict[str, Any]], quorum: int, run_id: str,
                    served_results: Any, faults: list[str] | None = None) -> DkgResult:
    """The run's DKG result for a party that does not take the ledger's word (a worker, a
    validator that joins late, the audit): the ``DkgResult`` posts served, each opened and
    bound to the run's validator it names, and the one a quorum signed identically."""
    posts = members_posts(served_results, DkgResult, member_field="validator",
                          members=[v["ed25519"] for v in validators], run_id=run_id,
                          round_index=0, faults=faults)
    return agreed_result(posts, quorum=quorum)
