"""Participant identities and key files.

Every participant has an Ed25519 key (signs messages); validators also hold a
BLS12-381 key with a proof of possession (co-sign certificates and beacons).
Key files are JSON, created with mode 0600 and refused when group- or
world-readable, like ssh does with private keys.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from . import bls

KEY_FILE_KIND = "veritrain-key/v1"
ROLES = ("worker", "validator", "organiser", "ledger")


@dataclass(frozen=True)
class PublicIdentity:
    """What others need to know about a participant: its public keys (hex) and, for a
    validator that takes reveal receipts from workers directly, its inbox URL."""

    ed25519: str
    bls: str | None = None
    bls_pop: str | None = None
    inbox: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"ed25519": self.ed25519}
        if self.bls is not None and self.bls_pop is not None:
            out["bls"] = self.bls
            out["bls_pop"] = self.bls_pop
        if self.inbox is not None:
            out["inbox"] = self.inbox
        return out


class Identity:
    """A participant's private keys; signs with Ed25519 and, for validators, BLS."""

    def __init__(self, role: str, ed25519_seed: bytes, bls_secret: int | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        if len(ed25519_seed) != 32:
            raise ValueError("Ed25519 seed must be 32 bytes")
        self.role = role
        self._ed = Ed25519PrivateKey.from_private_bytes(ed25519_seed)
        self._bls_secret = bls_secret
        raw_pub = self._ed.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public_key: bytes = raw_pub
        self._pop: bytes | None = bls.prove_possession(bls_secret) if bls_secret else None
        self._bls_pub: bytes | None = bls.public_key(bls_secret) if bls_secret else None

    @classmethod
    def generate(cls, role: str) -> Identity:
        bls_secret = bls.keygen(secrets.token_bytes(32)) if role == "validator" else None
        return cls(role, secrets.token_bytes(32), bls_secret)

    @property
    def public(self) -> PublicIdentity:
        return PublicIdentity(
            ed25519=self.public_key.hex(),
            bls=self._bls_pub.hex() if self._bls_pub else None,
            bls_pop=self._pop.hex() if self._pop else None,
        )

    def sign_ed25519(self, message: bytes) -> bytes:
        return self._ed.sign(message)

    def sign_bls(self, message: bytes) -> bytes:
        if self._bls_secret is None:
            raise ValueError(f"a {self.role} key has no BLS key")
        return bls.sign(self._bls_secret, message)

    def to_json(self) -> dict[str, object]:
        seed = self._ed.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        out: dict[str, object] = {
            "kind": KEY_FILE_KIND,
            "role": self.role,
            "ed25519_seed": seed.hex(),
            "public": self.public.to_json(),
        }
        if self._bls_secret is not None:
            out["bls_secret"] = format(self._bls_secret, "064x")
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Identity:
        if data.get("kind") != KEY_FILE_KIND:
            raise ValueError("not a veritrain key file")
        bls_hex = data.get("bls_secret")
        ident = cls(
            str(data["role"]),
            bytes.fromhex(str(data["ed25519_seed"])),
            int(str(bls_hex), 16) if bls_hex else None,
        )
        return ident


def write_key_file(path: Path, identity: Identity) -> None:
    """Write a new key file with mode 0600; never overwrite an existing one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(identity.to_json(), fh, indent=1, sort_keys=True)
        fh.write("\n")


def read_key_file(path: Path) -> Identity:
    """Load a key file, refusing one that others can read."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"key file {path} is accessible by others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
        )
    return Identity.from_json(json.loads(path.read_text()))


def load_or_create_key(path: Path, role: str) -> Identity:
    """The key at ``path``, generating it first if absent (ledger and demo use)."""
    if path.exists():
        return read_key_file(path)
    ident = Identity.generate(role)
    write_key_file(path, ident)
    return ident
