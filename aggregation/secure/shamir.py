"""Shamir secret sharing over GF(p), p = 2^256 + 297, with hash-committed shares.

Splitting a secret s (any 32-byte string, read big-endian, so s < 2^256 < p)
among n holders with threshold k (any k shares reconstruct, k - 1 reveal
nothing):

    f(X) = s + a_1 X + ... + a_(k-1) X^(k-1),   a_j uniform in GF(p) (``secrets``)
    share_h = (h, f(h))                          holder h in 1..n

Reconstruction is Lagrange interpolation at 0 from any k shares:

    s = sum_h f(h) prod_(h' != h) h' / (h' - h)   (mod p)

Any k - 1 shares are uniform and independent of s: for every candidate
secret there is exactly one polynomial through them, so they carry no
information about it (perfect secrecy).

Shares are authenticated by salted hash commitments that the dealer
publishes before anyone reveals anything:

    commit(context, h, share, salt) = SHA-256("veritrain/v1/secure/share" ||
        lp(context) || u32(h) || share as 33 bytes big-endian || salt (32 bytes))

A revealed share that does not open its commitment is a forgery by whoever
revealed it.  Shares that open their commitments but do not lie on one
polynomial of degree k - 1, or interpolate to something other than the
dealer's committed secret, were dealt inconsistently: the dealer is to blame.
Hash commitments are cheap (one SHA-256 per share) and hiding (the salt is 256
random bits); unlike Feldman commitments they do not let a holder check on
receipt that its share is consistent with the others, which is why
consistency is checked at reconstruction against the secret's own commitment
(a public key, or a hash of a high-entropy seed).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import SecureAggregationError

__all__ = [
    "PRIME",
    "SALT_BYTES",
    "SHARE_BYTES",
    "Share",
    "commit_share",
    "interpolate_at_zero",
    "is_consistent",
    "reconstruct_secret",
    "split_secret",
]

#: The smallest prime above 2^256 (checked with ``openssl prime``): any
#: 32-byte secret is a field element.
PRIME = 2**256 + 297
SHARE_BYTES = 33
SALT_BYTES = 32
_COMMIT_DOMAIN = b"veritrain/v1/secure/share"
#: Holders per secret: x-coordinates 1..MAX_HOLDERS.
MAX_HOLDERS = 1024


@dataclass(frozen=True)
class Share:
    """One point (x, f(x)) of a sharing polynomial; ``x`` is the holder's index (1-based)."""

    x: int
    y: int

    def __post_init__(self) -> None:
        if not (isinstance(self.x, int) and 1 <= self.x <= MAX_HOLDERS):
            raise SecureAggregationError(f"share index must be in 1..{MAX_HOLDERS}, got {self.x!r}")
        if not (isinstance(self.y, int) and 0 <= self.y < PRIME):
            raise SecureAggregationError("share value must be an integer in [0, p)")

    def value_bytes(self) -> bytes:
        """f(x) as 33 bytes big-endian."""
        return self.y.to_bytes(SHARE_BYTES, "big")

    @classmethod
    def from_bytes(cls, x: int, raw: bytes) -> Share:
        """The share ``(x, int(raw))``; refuses values that are not field elements."""
        if len(raw) != SHARE_BYTES:
            raise SecureAggregationError(f"share values are {SHARE_BYTES} bytes, got {len(raw)}")
        return cls(x, int.from_bytes(raw, "big"))


def _check_params(threshold: int, holders: int) -> None:
    if not (isinstance(threshold, int) and isinstance(holders, int)):
        raise SecureAggregationError("threshold and holders must be ints")
    if not 1 <= threshold <= holders <= MAX_HOLDERS:
        raise SecureAggregationError(
            f"need 1 <= threshold <= holders <= {MAX_HOLDERS}, got threshold={threshold}, "
            f"holders={holders}"
        )


def split_secret(secret: bytes, threshold: int, holders: int) -> list[Share]:
    """Shares 1..holders of a random degree threshold-1 polynomial with f(0) = secret."""
    _check_params(threshold, holders)
    if not isinstance(secret, bytes) or len(secret) != 32:
        raise SecureAggregationError("secrets are 32-byte strings")
    coeffs = [int.from_bytes(secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)
    ]
    shares = []
    for x in range(1, holders + 1):
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares.append(Share(x, y))
    return shares


def _lagrange_at(shares: Sequence[Share], at: int) -> int:
    total = 0
    for i, si in enumerate(shares):
        num, den = 1, 1
        for j, sj in enumerate(shares):
            if i != j:
                num = num * (at - sj.x) % PRIME
                den = den * (si.x - sj.x) % PRIME
        total = (total + si.y * num * pow(den, -1, PRIME)) % PRIME
    return total


def _distinct(shares: Sequence[Share]) -> list[Share]:
    seen: dict[int, Share] = {}
    for s in shares:
        if not isinstance(s, Share):
            raise SecureAggregationError("shares must be Share objects")
        if s.x in seen and seen[s.x].y != s.y:
            raise SecureAggregationError(f"two different values for share index {s.x}")
        seen[s.x] = s
    return [seen[x] for x in sorted(seen)]


def interpolate_at_zero(shares: Sequence[Share]) -> int:
    """f(0) of the unique polynomial of degree < len(shares) through ``shares``."""
    pts = _distinct(shares)
    if not pts:
        raise SecureAggregationError("no shares to interpolate")
    return _lagrange_at(pts, 0)


def is_consistent(shares: Sequence[Share], threshold: int) -> bool:
    """True iff all ``shares`` lie on one polynomial of degree < ``threshold``.

    Only decidable with more than ``threshold`` distinct shares; with fewer, any
    set is consistent.
    """
    pts = _distinct(shares)
    base = pts[:threshold]
    return all(_lagrange_at(base, s.x) == s.y for s in pts[threshold:])


def reconstruct_secret(shares: Sequence[Share], threshold: int) -> bytes:
    """The 32-byte secret from at least ``threshold`` distinct shares.

    Raises ``SecureAggregationError`` with fewer shares, if the shares are not
    consistent (more than ``threshold`` given), or if the result is not a
    32-byte value.
    """
    pts = _distinct(shares)
    if len(pts) < threshold:
        raise SecureAggregationError(
            f"{len(pts)} distinct shares cannot reconstruct a threshold-{threshold} secret"
        )
    if not is_consistent(pts, threshold):
        raise SecureAggregationError("shares do not lie on one polynomial of the threshold degree")
    value = _lagrange_at(pts[:threshold], 0)
    if value >= 2**256:
        raise SecureAggregationError("shares interpolate to a value that is not a 32-byte secret")
    return value.to_bytes(32, "big")


def commit_share(context: bytes, share: Share, salt: bytes) -> bytes:
    """The salted SHA-256 commitment of one share; see the module docstring."""
    if len(salt) != SALT_BYTES:
        raise SecureAggregationError(f"salts are {SALT_BYTES} bytes")
    h = hashlib.sha256(_COMMIT_DOMAIN)
    h.update(len(context).to_bytes(4, "big") + context)
    h.update(share.x.to_bytes(4, "big"))
    h.update(share.value_bytes())
    h.update(salt)
    return h.digest()
