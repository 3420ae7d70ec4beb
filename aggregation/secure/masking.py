"""Pairwise-masked bucket sums (SecAgg+ style) with Shamir recovery of dropouts.

A bucket is s workers (``BucketContext.members``, ascending byte order).  The
reconstruction threshold is k = s - t for ``max_dropouts`` = t, with k > s/2.

Round trip, per bucket (all messages are typed values; the nodes sign,
transport and store them):

1. **Advertise** (``KeyAdvertisement``): worker i draws fresh X25519 keys
   ``enc_i`` (share transport) and ``mask_i`` (pairwise masks) and a 32-byte
   self-mask seed ``b_i`` (``generate_secrets``).
2. **Deal** (``deal_shares``): i Shamir-shares ``b_i`` and the raw private key
   ``mask_i`` among all s members with threshold k, publishes
   ``ShareCommitments`` (salted SHA-256 of every share, and
   ``SHA-256(... || b_i)``), and sends each holder its ``SealedShares``,
   ChaCha20-Poly1305 under HKDF(X25519(enc_i, enc_h)).  Holders check their
   shares against the commitments on receipt (``open_shares``).  The dealers
   (who published commitments) form the mask graph.
3. **Mask** (``mask_update``): q_i = quantize(clip(x_i)) (``fixed_point``), and

       y_i = q_i + PRG(b_i) + sum_(j dealer, j > i) PRG(s_ij)
                            - sum_(j dealer, j < i) PRG(s_ij)      (mod 2^32)

   with s_ij = HKDF(X25519(mask_i, mask_j), "pair-mask", run, round, bucket,
   min(i, j), max(i, j)) (the lower id adds, the higher subtracts) and PRG the
   ChaCha20 keystream of ``prg``.  i sends ``MaskedInput`` (y_i and
   SHA-256 of q_i, the commitment a spot check opens).  The mask part does not
   depend on x_i: ``precompute_mask`` computes it ahead (while training).
4. **Unmask**: the survivors U are the dealers whose ``MaskedInput`` arrived,
   D the other dealers.  Every member reveals (``reveal_shares``) its share of
   ``b_i`` for i in U and of ``mask_i`` for i in D, never both for one i.
   ``unmask_bucket`` checks each revealed share against its commitment,
   reconstructs b_i (checked against its hash) and mask_i (checked against
   the advertised public key), and computes

       sum_(i in U) q_i = sum_(i in U) y_i - sum_(i in U) PRG(b_i)
                          - sum_(d in D, i in U) sign(i, d) PRG(s_id)

   where sign(i, d) = +1 if i < d else -1: exactly the masks that did not
   cancel.  Read as signed 32-bit integers over S, that is the bucket sum.

What the unmasking party learns: the sum over U and nothing about any single
q_i beyond it, since every y_i it holds is q_i plus a pseudorandom PRG(b_i)
(for i in D: b_i is never revealed) or plus pairwise masks with at least one
other honest survivor (for i in U).  See specs/secure-averaging.md.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from torch import Tensor

from .errors import (
    InconsistentSharesError,
    SecureAggregationError,
    ShareVerificationError,
    TooManyDropoutsError,
)
from .fixed_point import clip_factor, dequantize, fixed_point_scale, quantize
from .prg import combine_streams, derive_key, encode_parts
from .shamir import (
    SALT_BYTES,
    SHARE_BYTES,
    Share,
    commit_share,
    is_consistent,
    reconstruct_secret,
    split_secret,
)

__all__ = [
    "BucketContext",
    "BucketSum",
    "HeldShare",
    "KeyAdvertisement",
    "MaskOpening",
    "MaskedInput",
    "SealedShares",
    "ShareCommitments",
    "ShareFault",
    "ShareReveal",
    "WorkerSecrets",
    "deal_shares",
    "commitment_salt",
    "default_max_dropouts",
    "generate_secrets",
    "mask_update",
    "open_masked_contribution",
    "open_shares",
    "precompute_mask",
    "quantized_commitment",
    "reveal_shares",
    "rounding_key",
    "unmask_bucket",
]

KEY_BYTES = 32
_SEALED_PLAIN = 2 * (SHARE_BYTES + SALT_BYTES)
_NONCE = bytes(12)  # every transport key encrypts exactly one message


def default_max_dropouts(size: int) -> int:
    """ceil(s/2) - 1: the most dropouts a bucket of ``size`` tolerates with k > s/2."""
    return (size + 1) // 2 - 1


def _pub_bytes(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _priv_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def _exchange(private: X25519PrivateKey, public: bytes, who: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # low-order point or malformed key: the advertiser's fault
        raise ShareVerificationError(
            who, f"unusable X25519 public key from {who.hex()[:16]}"
        ) from exc


@dataclass(frozen=True)
class BucketContext:
    """Public parameters of one bucket in one round.

    ``members``: worker ids (bytes), strictly ascending.  ``max_dropouts`` t:
    members that may vanish after dealing; ``threshold`` k = s - t shares
    reconstruct a secret and k > s/2 is required.  ``dim``: D.  ``clip_norm``: C.
    """

    run_id: str
    round_index: int
    bucket: int
    members: tuple[bytes, ...]
    max_dropouts: int
    dim: int
    clip_norm: float

    def __post_init__(self) -> None:
        m = self.members
        if (
            not isinstance(m, tuple)
            or len(m) < 2
            or any(not isinstance(w, bytes) or not w for w in m)
        ):
            raise SecureAggregationError("a bucket needs at least 2 members with bytes ids")
        if any(a >= b for a, b in zip(m, m[1:], strict=False)):
            raise SecureAggregationError("bucket members must be distinct and in ascending order")
        t = self.max_dropouts
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise SecureAggregationError(f"max_dropouts must be an int >= 0, got {t!r}")
        if 2 * (len(m) - t) <= len(m):
            raise SecureAggregationError(
                f"max_dropouts {t} too large for a bucket of {len(m)}: the threshold "
                f"s - t must exceed s/2 (at most {default_max_dropouts(len(m))})"
            )
        if not isinstance(self.dim, int) or self.dim < 1:
            raise SecureAggregationError(f"dim must be a positive int, got {self.dim!r}")
        if not isinstance(self.round_index, int) or self.round_index < 0:
            raise SecureAggregationError("round_index must be a non-negative int")
        fixed_point_scale(self.clip_norm, len(m))  # validates clip_norm

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def threshold(self) -> int:
        """k = s - t: shares needed to reconstruct a secret."""
        return self.size - self.max_dropouts

    @property
    def scale(self) -> float:
        """Fixed-point scale S of this bucket (``fixed_point_scale(C, s)``)."""
        return fixed_point_scale(self.clip_norm, self.size)

    def index_of(self, worker: bytes) -> int:
        """1-based position of ``worker``: its Shamir x-coordinate."""
        try:
            return self.members.index(worker) + 1
        except ValueError:
            raise SecureAggregationError(
                f"{worker.hex()[:16]} is not a member of bucket {self.bucket}"
            ) from None

    def binding(self) -> bytes:
        """Canonical bytes of every field: bound into every key, commitment and AEAD."""
        return encode_parts(
            self.run_id,
            self.round_index,
            self.bucket,
            self.max_dropouts,
            self.dim,
            float(self.clip_norm).hex(),
            *self.members,
        )


@dataclass(frozen=True)
class KeyAdvertisement:
    """Message 1, public: a member's fresh X25519 public keys for this round."""

    worker: bytes
    enc_public: bytes
    mask_public: bytes

    def __post_init__(self) -> None:
        if len(self.enc_public) != KEY_BYTES or len(self.mask_public) != KEY_BYTES:
            raise SecureAggregationError("X25519 public keys are 32 bytes")


@dataclass(frozen=True, repr=False)
class WorkerSecrets:
    """A worker's per-round secrets; never sent except as shares or in an opening."""

    worker: bytes
    enc_key: X25519PrivateKey
    mask_key: X25519PrivateKey
    self_seed: bytes

    def advertisement(self) -> KeyAdvertisement:
        return KeyAdvertisement(
            self.worker,
            _pub_bytes(self.enc_key.public_key()),
            _pub_bytes(self.mask_key.public_key()),
        )


def generate_secrets(worker: bytes) -> WorkerSecrets:
    """Fresh X25519 keys and self-mask seed from the OS CSPRNG."""
    return WorkerSecrets(
        worker, X25519PrivateKey.generate(), X25519PrivateKey.generate(), os.urandom(32)
    )


@dataclass(frozen=True)
class ShareCommitments:
    """Message 2a, public: a dealer's commitments, indexed by holder position - 1."""

    dealer: bytes
    seed_commitment: bytes
    seed_share_commitments: tuple[bytes, ...]
    key_share_commitments: tuple[bytes, ...]


@dataclass(frozen=True)
class SealedShares:
    """Message 2b, dealer to one holder: AEAD of its two shares and their salts."""

    dealer: bytes
    holder: bytes
    ciphertext: bytes


@dataclass(frozen=True, repr=False)
class HeldShare:
    """What a holder keeps from one dealer after ``open_shares``."""

    dealer: bytes
    seed_share: Share
    seed_salt: bytes
    key_share: Share
    key_salt: bytes


@dataclass(frozen=True)
class ShareReveal:
    """Message 4, holder to the unmasking party: (dealer, share, salt) per dealer.

    ``seed_shares`` for survivors (shares of b_i), ``key_shares`` for dropped
    dealers (shares of mask_i).
    """

    holder: bytes
    seed_shares: tuple[tuple[bytes, Share, bytes], ...]
    key_shares: tuple[tuple[bytes, Share, bytes], ...]


@dataclass(frozen=True)
class MaskedInput:
    """Message 3, worker to the unmasking party: y_i and the commitment to q_i."""

    worker: bytes
    bucket: int
    commitment: bytes
    words: np.ndarray = field(repr=False)

    def digest(self) -> bytes:
        """SHA-256 over the canonical encoding (what the worker signs)."""
        h = hashlib.sha256(b"veritrain/v1/secure/masked-input")
        h.update(encode_parts(self.worker, self.bucket, self.commitment))
        h.update(np.ascontiguousarray(self.words, dtype="<u4").tobytes())
        return h.digest()


@dataclass(frozen=True, repr=False)
class MaskOpening:
    """What a spot-checked worker reveals: q_i, b_i and its raw mask private key."""

    worker: bytes
    quantized: np.ndarray
    self_seed: bytes
    mask_private: bytes


@dataclass(frozen=True)
class ShareFault:
    """A detected misbehaviour that ``unmask_bucket`` worked around: ``culprit`` to blame."""

    culprit: bytes
    dealer: bytes
    reason: str


@dataclass(frozen=True)
class BucketSum:
    """The unmasked bucket: sum of the survivors' clipped, rounded updates (float64 [D])."""

    bucket: int
    survivors: tuple[bytes, ...]
    dropped: tuple[bytes, ...]
    total: Tensor = field(repr=False)
    faults: tuple[ShareFault, ...] = ()

    @property
    def count(self) -> int:
        return len(self.survivors)

    def mean(self) -> Tensor:
        return self.total / self.count


# -- derivations ---------------------------------------------------------------


def rounding_key(ctx: BucketContext, worker: bytes) -> bytes:
    """Public key of worker's stochastic-rounding stream (anyone can recompute q_i from x_i)."""
    return derive_key(b"", "rounding", ctx.run_id, ctx.round_index, worker)


def _self_key(ctx: BucketContext, worker: bytes, seed: bytes) -> bytes:
    return derive_key(seed, "self-mask", ctx.binding(), worker)


def _pair_key(ctx: BucketContext, shared: bytes, a: bytes, b: bytes) -> bytes:
    lo, hi = (a, b) if a < b else (b, a)
    return derive_key(shared, "pair-mask", ctx.binding(), lo, hi)


def _seed_commitment(ctx: BucketContext, dealer: bytes, seed: bytes) -> bytes:
    return hashlib.sha256(
        b"veritrain/v1/secure/self-seed" + encode_parts(ctx.binding(), dealer, seed)
    ).digest()


def _share_context(ctx: BucketContext, dealer: bytes, kind: str) -> bytes:
    return encode_parts(ctx.binding(), dealer, kind)


def _transport_key(ctx: BucketContext, shared: bytes, dealer: bytes, holder: bytes) -> bytes:
    return derive_key(shared, "share-transport", ctx.binding(), dealer, holder)


def commitment_salt(ctx: BucketContext, worker: bytes, self_seed: bytes,
                    mask_private: bytes) -> bytes:
    """The salt of a worker's quantized-update commitment: a key derived from both its
    self-mask seed and its raw mask private key. Unmasking makes at most one of the two
    public (a survivor's seed, a dropout's key), so the salt stays secret until a spot
    check opens both: nobody can test a guess of q_i against the public commitment."""
    return derive_key(self_seed + mask_private, "quantized-salt", ctx.binding(), worker)


def quantized_commitment(ctx: BucketContext, worker: bytes, words: np.ndarray,
                         salt: bytes) -> bytes:
    """Salted SHA-256 commitment to a worker's quantized update q_i (opened by a spot
    check): ``sha256("veritrain/v1/secure/quantized" || lp(run, round, worker, salt) ||
    q LE)``."""
    h = hashlib.sha256(b"veritrain/v1/secure/quantized")
    h.update(encode_parts(ctx.run_id, ctx.round_index, worker, salt))
    h.update(np.ascontiguousarray(words, dtype="<u4").tobytes())
    return h.digest()


def _check_adverts(ctx: BucketContext, adverts: Mapping[bytes, KeyAdvertisement]) -> None:
    for w, ad in adverts.items():
        if ad.worker != w or w not in ctx.members:
            raise SecureAggregationError("advertisements must be keyed by their member's id")


def _mask_terms(
    ctx: BucketContext,
    worker: bytes,
    mask_key: X25519PrivateKey,
    adverts: Mapping[bytes, KeyAdvertisement],
    dealers: Collection[bytes],
) -> list[tuple[bytes, int]]:
    terms = []
    for j in sorted(dealers):
        if j == worker:
            continue
        if j not in adverts:
            raise SecureAggregationError(f"no key advertisement for dealer {j.hex()[:16]}")
        key = _pair_key(ctx, _exchange(mask_key, adverts[j].mask_public, j), worker, j)
        terms.append((key, 1 if worker < j else -1))
    return terms


# -- worker side ---------------------------------------------------------------


def deal_shares(
    ctx: BucketContext,
    mine: WorkerSecrets,
    adverts: Mapping[bytes, KeyAdvertisement],
) -> tuple[ShareCommitments, dict[bytes, SealedShares]]:
    """Share b_i and mask_i among all members (threshold k); commitments and sealed shares."""
    _check_adverts(ctx, adverts)
    me = mine.worker
    ctx.index_of(me)
    missing = [w for w in ctx.members if w not in adverts]
    if missing:
        raise SecureAggregationError(f"{len(missing)} members have not advertised keys")
    k, s = ctx.threshold, ctx.size
    seed_shares = split_secret(mine.self_seed, k, s)
    key_shares = split_secret(_priv_bytes(mine.mask_key), k, s)

    seed_ctx, key_ctx = _share_context(ctx, me, "seed"), _share_context(ctx, me, "key")
    seed_com, key_com, sealed = [], [], {}
    for holder, ss, ks in zip(ctx.members, seed_shares, key_shares, strict=True):
        s_salt, k_salt = os.urandom(SALT_BYTES), os.urandom(SALT_BYTES)
        seed_com.append(commit_share(seed_ctx, ss, s_salt))
        key_com.append(commit_share(key_ctx, ks, k_salt))
        plain = ss.value_bytes() + s_salt + ks.value_bytes() + k_salt
        shared = _exchange(mine.enc_key, adverts[holder].enc_public, holder)
        aead = ChaCha20Poly1305(_transport_key(ctx, shared, me, holder))
        ct = aead.encrypt(_NONCE, plain, encode_parts(ctx.binding(), me, holder))
        sealed[holder] = SealedShares(me, holder, ct)
    commitments = ShareCommitments(
        me, _seed_commitment(ctx, me, mine.self_seed), tuple(seed_com), tuple(key_com)
    )
    return commitments, sealed


def _check_commitments(ctx: BucketContext, com: ShareCommitments) -> None:
    if len(com.seed_share_commitments) != ctx.size or len(com.key_share_commitments) != ctx.size:
        raise ShareVerificationError(com.dealer, "commitment lists must have one entry per member")


def open_shares(
    ctx: BucketContext,
    mine: WorkerSecrets,
    adverts: Mapping[bytes, KeyAdvertisement],
    commitments: ShareCommitments,
    sealed: SealedShares,
) -> HeldShare:
    """Decrypt the shares a dealer sent us and check them against its public commitments.

    Raises ``ShareVerificationError`` blaming the dealer when the ciphertext does
    not decrypt or a share does not open its commitment.
    """
    dealer, me = sealed.dealer, mine.worker
    if sealed.holder != me or commitments.dealer != dealer:
        raise SecureAggregationError("sealed shares addressed to someone else or wrong commitments")
    x = ctx.index_of(me)
    ctx.index_of(dealer)
    _check_commitments(ctx, commitments)
    shared = _exchange(mine.enc_key, adverts[dealer].enc_public, dealer)
    aead = ChaCha20Poly1305(_transport_key(ctx, shared, dealer, me))
    try:
        plain = aead.decrypt(_NONCE, sealed.ciphertext, encode_parts(ctx.binding(), dealer, me))
    except InvalidTag:
        raise ShareVerificationError(
            dealer, f"sealed shares from {dealer.hex()[:16]} do not decrypt"
        ) from None
    if len(plain) != _SEALED_PLAIN:
        raise ShareVerificationError(dealer, "sealed shares have the wrong length")
    try:
        o = 0
        ss = Share.from_bytes(x, plain[o : o + SHARE_BYTES])
        o += SHARE_BYTES
        s_salt = plain[o : o + SALT_BYTES]
        o += SALT_BYTES
        ks = Share.from_bytes(x, plain[o : o + SHARE_BYTES])
        o += SHARE_BYTES
        k_salt = plain[o : o + SALT_BYTES]
    except SecureAggregationError as exc:
        raise ShareVerificationError(
            dealer, f"malformed share from {dealer.hex()[:16]}: {exc}"
        ) from None
    if (
        commit_share(_share_context(ctx, dealer, "seed"), ss, s_salt)
        != commitments.seed_share_commitments[x - 1]
    ):
        raise ShareVerificationError(
            dealer, f"seed share from {dealer.hex()[:16]} does not match its commitment"
        )
    if (
        commit_share(_share_context(ctx, dealer, "key"), ks, k_salt)
        != commitments.key_share_commitments[x - 1]
    ):
        raise ShareVerificationError(
            dealer, f"key share from {dealer.hex()[:16]} does not match its commitment"
        )
    return HeldShare(dealer, ss, s_salt, ks, k_salt)


def precompute_mask(
    ctx: BucketContext,
    mine: WorkerSecrets,
    adverts: Mapping[bytes, KeyAdvertisement],
    dealers: Collection[bytes],
    *,
    threads: int | None = None,
) -> np.ndarray:
    """M_i = PRG(b_i) + sum_(j > i) PRG(s_ij) - sum_(j < i) PRG(s_ij): the whole mask, uint32[D].

    It does not depend on the update, so a worker that knows its bucket and the
    dealers early (buckets drawn from the previous round's beacon) computes it
    while it trains; ``mask_update(..., mask=M_i)`` then only quantizes and adds.
    """
    me = mine.worker
    _check_adverts(ctx, adverts)
    if me not in dealers or any(d not in ctx.members for d in dealers):
        raise SecureAggregationError("dealers must be bucket members and include this worker")
    terms = [(_self_key(ctx, me, mine.self_seed), 1)]
    terms += _mask_terms(ctx, me, mine.mask_key, adverts, dealers)
    return combine_streams(np.zeros(ctx.dim, dtype=np.uint32), terms, threads=threads)


def mask_update(
    ctx: BucketContext,
    mine: WorkerSecrets,
    adverts: Mapping[bytes, KeyAdvertisement],
    dealers: Collection[bytes],
    update: Tensor,
    *,
    mask: np.ndarray | None = None,
    threads: int | None = None,
) -> tuple[MaskedInput, MaskOpening]:
    """Clip, quantize and mask ``update``: the ``MaskedInput`` to send and the opening to keep.

    ``dealers``: the members whose ``ShareCommitments`` were published (the mask
    graph; must include this worker).  ``mask``: the output of
    ``precompute_mask`` for the same arguments, if computed ahead.
    """
    me = mine.worker
    if update.ndim != 1 or update.shape[0] != ctx.dim:
        raise SecureAggregationError(
            f"update must have shape [{ctx.dim}], got {tuple(update.shape)}"
        )
    if mask is None:
        mask = precompute_mask(ctx, mine, adverts, dealers, threads=threads)
    elif not isinstance(mask, np.ndarray) or mask.dtype != np.uint32 or mask.shape != (ctx.dim,):
        raise SecureAggregationError(f"mask must be uint32[{ctx.dim}] from precompute_mask")
    q = quantize(
        update,
        clip_norm=ctx.clip_norm,
        scale=ctx.scale,
        rounding_key=rounding_key(ctx, me),
        threads=threads,
    )
    y = np.add(q, mask)  # mod 2^32
    private = _priv_bytes(mine.mask_key)
    salt = commitment_salt(ctx, me, mine.self_seed, private)
    masked = MaskedInput(me, ctx.bucket, quantized_commitment(ctx, me, q, salt), y)
    return masked, MaskOpening(me, q, mine.self_seed, private)


def reveal_shares(
    ctx: BucketContext,
    holder: bytes,
    held: Mapping[bytes, HeldShare],
    survivors: Collection[bytes],
) -> ShareReveal:
    """Shares to reveal once the survivor set U is fixed: b-shares for U, key shares for the rest.

    The node must call this at most once per bucket and only with the survivor
    list the round fixed for everyone: revealing both kinds of share for one
    dealer would let the unmasking party strip all of its masks.
    """
    ctx.index_of(holder)
    surv = set(survivors)
    if not surv <= set(ctx.members):
        raise SecureAggregationError("survivors must be bucket members")
    seed, key = [], []
    for dealer in sorted(held):
        hs = held[dealer]
        if hs.dealer != dealer:
            raise SecureAggregationError("held shares must be keyed by their dealer")
        if dealer in surv:
            seed.append((dealer, hs.seed_share, hs.seed_salt))
        else:
            key.append((dealer, hs.key_share, hs.key_salt))
    return ShareReveal(holder, tuple(seed), tuple(key))


# -- unmasking party -----------------------------------------------------------


def unmask_bucket(
    ctx: BucketContext,
    adverts: Mapping[bytes, KeyAdvertisement],
    commitments: Mapping[bytes, ShareCommitments],
    inputs: Sequence[MaskedInput],
    reveals: Sequence[ShareReveal],
    *,
    threads: int | None = None,
) -> BucketSum:
    """Recover the sum of the survivors' quantized updates; see the module docstring.

    ``commitments`` keyed by dealer (the mask graph), ``inputs`` the masked
    vectors received (their senders are U), ``reveals`` from any members.
    Forged revealed shares (not opening the dealer's commitment) and shares of
    the wrong kind are ignored and listed in ``BucketSum.faults``.

    Raises ``TooManyDropoutsError`` when some secret has fewer than k valid
    shares, ``InconsistentSharesError`` (blaming the dealer) when valid shares do
    not reconstruct the committed secret.
    """
    _check_adverts(ctx, adverts)
    dealers = sorted(commitments)
    for d in dealers:
        if commitments[d].dealer != d or d not in ctx.members or d not in adverts:
            raise SecureAggregationError("commitments must be keyed by advertised bucket members")
        _check_commitments(ctx, commitments[d])
    survivors: list[bytes] = []
    for y in inputs:
        if y.worker not in commitments:
            raise SecureAggregationError(
                f"masked input from {y.worker.hex()[:16]}, who did not deal shares"
            )
        if y.bucket != ctx.bucket or y.worker in survivors:
            raise SecureAggregationError("masked inputs must be for this bucket, one per worker")
        if (
            not isinstance(y.words, np.ndarray)
            or y.words.dtype != np.uint32
            or y.words.shape != (ctx.dim,)
        ):
            raise SecureAggregationError(
                f"masked input of {y.worker.hex()[:16]} must be uint32[{ctx.dim}]"
            )
        survivors.append(y.worker)
    surv = set(survivors)
    dropped = [d for d in dealers if d not in surv]

    faults: list[ShareFault] = []
    pools: dict[tuple[bytes, str], list[Share]] = {}
    seen_holders: set[bytes] = set()
    for rv in reveals:
        if rv.holder not in ctx.members or rv.holder in seen_holders:
            faults.append(ShareFault(rv.holder, b"", "reveal from a non-member or a second reveal"))
            continue
        seen_holders.add(rv.holder)
        x = ctx.index_of(rv.holder)
        for kind, items, allowed in (
            ("seed", rv.seed_shares, surv),
            ("key", rv.key_shares, set(dropped)),
        ):
            for dealer, share, salt in items:
                if dealer not in allowed:
                    faults.append(
                        ShareFault(rv.holder, dealer, f"{kind} share revealed for the wrong set")
                    )
                    continue
                com = commitments[dealer]
                expected = (
                    com.seed_share_commitments if kind == "seed" else com.key_share_commitments
                )[x - 1]
                ok = (
                    isinstance(share, Share)
                    and share.x == x
                    and isinstance(salt, bytes)
                    and len(salt) == SALT_BYTES
                    and commit_share(_share_context(ctx, dealer, kind), share, salt) == expected
                )
                if not ok:
                    faults.append(ShareFault(rv.holder, dealer, f"forged {kind} share"))
                    continue
                pools.setdefault((dealer, kind), []).append(share)

    k = ctx.threshold
    streams: list[tuple[bytes, int]] = []
    for i in survivors:
        seed = _reconstruct(ctx, i, "seed", pools.get((i, "seed"), []), k)
        if _seed_commitment(ctx, i, seed) != commitments[i].seed_commitment:
            raise InconsistentSharesError(
                i,
                f"self-mask seed shares of {i.hex()[:16]} reconstruct a value "
                "that does not match its commitment",
            )
        streams.append((_self_key(ctx, i, seed), -1))
    for d in dropped:
        raw = _reconstruct(ctx, d, "key", pools.get((d, "key"), []), k)
        try:
            key = X25519PrivateKey.from_private_bytes(raw)
        except ValueError:
            raise InconsistentSharesError(
                d, "key shares reconstruct an invalid X25519 key"
            ) from None
        if _pub_bytes(key.public_key()) != adverts[d].mask_public:
            raise InconsistentSharesError(
                d,
                f"mask-key shares of {d.hex()[:16]} reconstruct a key that "
                "does not match its advertised public key",
            )
        for i in survivors:
            pair = _pair_key(ctx, _exchange(key, adverts[i].mask_public, i), i, d)
            streams.append((pair, -1 if i < d else 1))

    out = np.zeros(ctx.dim, dtype=np.uint32)
    combine_streams(out, streams, arrays=[(y.words, 1) for y in inputs], threads=threads)
    total = dequantize(out, ctx.scale)
    return BucketSum(ctx.bucket, tuple(survivors), tuple(dropped), total, tuple(faults))


def _reconstruct(
    ctx: BucketContext, dealer: bytes, kind: str, shares: list[Share], k: int
) -> bytes:
    if len({s.x for s in shares}) < k:
        what = f"the {'self-mask seed' if kind == 'seed' else 'mask key'} of {dealer.hex()[:16]}"
        raise TooManyDropoutsError(ctx.bucket, k, len({s.x for s in shares}), what)
    if not is_consistent(shares, k):
        raise InconsistentSharesError(
            dealer,
            f"committed {kind} shares of {dealer.hex()[:16]} do not lie "
            "on one polynomial: inconsistent dealing",
        )
    try:
        return reconstruct_secret(shares, k)
    except SecureAggregationError as exc:
        raise InconsistentSharesError(
            dealer, f"{kind} shares of {dealer.hex()[:16]}: {exc}"
        ) from None


# -- spot check ----------------------------------------------------------------


def open_masked_contribution(
    ctx: BucketContext,
    adverts: Mapping[bytes, KeyAdvertisement],
    commitments: Mapping[bytes, ShareCommitments],
    masked: MaskedInput,
    opening: MaskOpening,
    *,
    update: Tensor | None = None,
    threads: int | None = None,
) -> bool:
    """True iff ``opening`` proves ``masked`` = mask(q) for a committed, clipped q.

    Checks, returning False on the first failure (never raises):
    the opening's mask key matches the advertised public key; SHA-256 of the
    seed matches the dealer's commitment; q hashes to ``masked.commitment``;
    ||q|| / S <= C + sqrt(D) / S (clipped); with ``update`` (e.g. the spot
    check's recomputed pseudo-gradient), |q_k / S - clip(update)_k| <= 1 / S for
    every k; and recomputing q + PRG(b_i) + sum +-PRG(s_ij) over the dealers
    gives exactly ``masked.words``.

    Reveals b_i and mask_i: use it only after the bucket was unmasked.  What it
    discloses about other members is their pairwise masks with this worker,
    which hide nothing the bucket sum minus q_i does not already give.
    """
    try:
        me = masked.worker
        if (
            opening.worker != me
            or me not in commitments
            or me not in adverts
            or masked.bucket != ctx.bucket
        ):
            return False
        key = X25519PrivateKey.from_private_bytes(opening.mask_private)
        if _pub_bytes(key.public_key()) != adverts[me].mask_public:
            return False
        if _seed_commitment(ctx, me, opening.self_seed) != commitments[me].seed_commitment:
            return False
        q = opening.quantized
        if not isinstance(q, np.ndarray) or q.dtype != np.uint32 or q.shape != (ctx.dim,):
            return False
        salt = commitment_salt(ctx, me, opening.self_seed, opening.mask_private)
        if quantized_commitment(ctx, me, q, salt) != masked.commitment:
            return False
        qf = torch.from_numpy(q.view(np.int32).astype(np.float64))
        scale = ctx.scale
        if float(torch.linalg.vector_norm(qf)) / scale > ctx.clip_norm + math.sqrt(ctx.dim) / scale:
            return False
        if update is not None:
            if update.shape != (ctx.dim,):
                return False
            clipped = update.detach().to("cpu", torch.float64) * clip_factor(update, ctx.clip_norm)
            if float((qf / scale - clipped).abs().max()) > (1 + 1e-9) / scale:
                return False
        if not isinstance(masked.words, np.ndarray) or masked.words.shape != (ctx.dim,):
            return False
        terms = [(_self_key(ctx, me, opening.self_seed), 1)]
        terms += _mask_terms(ctx, me, key, adverts, sorted(commitments))
        y = q.copy()
        combine_streams(y, terms, threads=threads)
        return bool(np.array_equal(y, masked.words))
    except (SecureAggregationError, ValueError, TypeError, AttributeError, KeyError):
        return False
