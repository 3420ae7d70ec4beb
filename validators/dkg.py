"""A validator's side of the run's DKG and of the threshold beacon (specs/protocol.md 5.4a).

Sans I/O: each phase method takes the wires the ledger's board served for the previous
phase and returns the signed wire this validator posts (or None). Every served post is
opened with ``board.members_posts`` (signature in its domain, signer = the validator it
names, this run and round 0); what does not check out is recorded in ``faults`` and
skipped. The deal, the result and each round's partial are signed once
(``SignedOnce``), so a board that shows two views gets at most one of each.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from veritrain.protocol import bls, dkg
from veritrain.protocol.board import SignedOnce, members_posts
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Message, RunSpec, Signed, sign

#: The DKG's posts carry round 0 (they precede the first round; the kind separates them).
DKG_ROUND = 0


class DkgNode:
    """One validator in one run's DKG; afterwards it holds its secret share."""

    def __init__(self, identity: Identity, spec: RunSpec, *,
                 signed_once: SignedOnce | None = None,
                 secrets_path: Path | None = None) -> None:
        self.identity = identity
        self.spec = spec
        self.members = [v["ed25519"] for v in spec.validators]
        self.me = identity.public_key.hex()
        index = spec.validator_index(self.me)
        if index is None:
            raise ValueError("this key is not one of the run's validators")
        self.index = index
        self.n, self.quorum = len(self.members), spec.quorum
        self.once = signed_once or SignedOnce()
        self.faults: list[str] = []
        #: Where the DKG's secrets (X25519 key, polynomial and deal) are kept until the
        #: group is fixed, so that a node restarted mid-DKG posts the same keys and deal
        #: again instead of dropping out (``signed_once`` allows no second deal).
        self.secrets_path = secrets_path
        kept = load_dkg_secrets(secrets_path, spec, index) if secrets_path else None
        self._enc, self._dealing = kept or (X25519PrivateKey.generate(), None)
        if kept is None:
            self._keep_secrets()
        self._deals: dict[int, list[Signed[dkg.DkgDeal]]] = {}
        self._opened: dict[int, int] = {}
        self._complaints: dict[int, list[int]] = {}
        self.qualification: dkg.Qualification | None = None
        self.result: dkg.DkgResult | None = None
        self.share: int | None = None

    def _keep_secrets(self) -> None:
        if self.secrets_path is not None:
            save_dkg_secrets(self.secrets_path, self.spec, self.index, self._enc,
                             self._dealing)

    def forget_secrets(self) -> None:
        """Delete the kept DKG secrets once the DKG is over (the share file remains)."""
        if self.secrets_path is not None:
            self.secrets_path.unlink(missing_ok=True)

    def _posts(self, wires: Any, cls: type[Any]) -> dict[int, list[Signed[Any]]]:
        field = "dealer" if cls in (dkg.DkgDeal, dkg.DkgJustification) else "validator"
        return members_posts(wires, cls, member_field=field, members=self.members,
                             run_id=self.spec.run_id, round_index=DKG_ROUND, faults=self.faults)

    def _sign(self, msg: Message) -> dict[str, Any]:
        return sign(self.identity, msg).to_wire()

    # phase 1
    def keys_post(self) -> dict[str, Any]:
        """This validator's fresh X25519 key for the DKG."""
        return self._sign(dkg.DkgKeys(run_id=self.spec.run_id, round=DKG_ROUND,
                                      validator=self.me, enc_public=dkg.x25519_public(self._enc)))

    # phase 2
    def deal_post(self, served_keys: Any) -> dict[str, Any]:
        """Deal to every validator whose (single) key post checks out."""
        keys: list[str | None] = [None] * self.n
        for k, posts in self._posts(served_keys, dkg.DkgKeys).items():
            if len(posts) == 1:
                keys[k] = posts[0].message.enc_public
        if self._dealing is None:
            self._dealing = dkg.deal(run_id=self.spec.run_id, round_index=DKG_ROUND,
                                     dealer=self.index, dealer_key=self.me, quorum=self.quorum,
                                     enc_secret=self._enc, enc_keys=keys)
            self._keep_secrets()
        signed = sign(self.identity, self._dealing.deal)
        self.once.claim("dkg_deal", self.spec.run_id, DKG_ROUND, signed.digest)
        return signed.to_wire()

    # phase 3
    def complaint_post(self, served_deals: Any) -> dict[str, Any]:
        """Open this validator's share of every deal; accuse those that do not verify."""
        self._deals = self._posts(served_deals, dkg.DkgDeal)
        single = {i: p[0].message for i, p in self._deals.items() if len(p) == 1}
        self._opened, accused = dkg.accusations(self._enc, single, me=self.index, n=self.n,
                                                quorum=self.quorum)
        return self._sign(dkg.DkgComplaint(run_id=self.spec.run_id, round=DKG_ROUND,
                                           validator=self.me, accused=accused))

    # phase 4
    def justification_post(self, served_complaints: Any) -> dict[str, Any] | None:
        """Reveal the shares this dealer was accused over (None when nobody accused it)."""
        self._complaints = {}
        for j, posts in self._posts(served_complaints, dkg.DkgComplaint).items():
            if len(posts) == 1:
                self._complaints[j] = list(posts[0].message.accused)
        accusers = [j for j, accused in self._complaints.items() if self.index in accused]
        if not accusers or self._dealing is None:
            return None
        return self._sign(dkg.DkgJustification(run_id=self.spec.run_id, round=DKG_ROUND,
                                               dealer=self.me,
                                               shares=dkg.justify(self._dealing, accusers)))

    # phase 5
    def result_post(self, served_justifications: Any) -> dict[str, Any]:
        """QUAL, the group key and public shares from the transcript this node saw, and
        its secret share; signed once. :class:`dkg.DkgFault` if under a quorum qualified."""
        just = {i: list(p[0].message.shares) for i, p in
                self._posts(served_justifications, dkg.DkgJustification).items() if len(p) == 1}
        q = dkg.qualify(n=self.n, quorum=self.quorum,
                        deals={i: [p.message for p in posts] for i, posts in self._deals.items()},
                        complaints=self._complaints, justifications=just)
        self.qualification = q
        digests = {i: self._deals[i][0].digest for i in q.qualified}
        try:
            self.share = dkg.secret_share(q, self.index, self._opened)
        except dkg.DkgFault as exc:
            self.faults.append(str(exc))
            self.share = None
        signed = sign(self.identity, dkg.result_message(
            q, run_id=self.spec.run_id, round_index=DKG_ROUND, validator=self.me, digests=digests))
        self.once.claim("dkg_result", self.spec.run_id, DKG_ROUND, signed.digest)
        return signed.to_wire()

    def adopt(self, served_results: Any) -> dkg.DkgResult:
        """The result a quorum signed identically; this node keeps its share only if its own
        public share there is ``share * G1``."""
        agreed = dkg.agreed_result(self._posts(served_results, dkg.DkgResult),
                                   quorum=self.quorum)
        self.result = agreed
        if self.share is not None and (
                bls.public_key(self.share).hex() != agreed.public_shares[self.index]):
            self.faults.append("the agreed DKG result is not the transcript this node saw")
            self.share = None
        return agreed

    @classmethod
    def restored(cls, identity: Identity, spec: RunSpec, result: dkg.DkgResult, share: int,
                 *, signed_once: SignedOnce | None = None) -> DkgNode:
        """After a restart: the node that holds ``share`` of the agreed ``result`` (checked
        by :func:`load_share`), ready to sign partials."""
        node = cls(identity, spec, signed_once=signed_once)
        node.result, node.share = result, share
        return node

    # every round
    def partial_post(self, round_index: int, sealed: str, participants: str
                     ) -> dict[str, Any] | None:
        """This validator's partial signature over (run, r, sealed list, participant view),
        signed once per round; None when it holds no share."""
        if self.share is None:
            return None
        root = dkg.threshold_beacon_root(self.spec.run_id, round_index, sealed, participants)
        msg = dkg.BeaconPartial(run_id=self.spec.run_id, round=round_index, validator=self.me,
                                sealed=sealed, participants=participants,
                                partial=dkg.partial_sign(self.share, root).hex())
        self.once.claim("beacon_partial", self.spec.run_id, round_index, root.hex())
        return self._sign(msg)


def beacon_seed_from_partials(result: dkg.DkgResult, spec: RunSpec, round_index: int,
                              sealed: str, participants: str, served_partials: Sequence[Any],
                              faults: list[str] | None = None) -> bytes:
    """A validator's own beacon for round r from the partials the board served: each
    opened and bound to its member, to ``sealed`` and to ``participants``, checked against
    its public share, a quorum combined and the result checked against the group key.
    Returns the seed."""
    members = [v["ed25519"] for v in spec.validators]
    posts = members_posts(served_partials, dkg.BeaconPartial, member_field="validator",
                          members=members, run_id=spec.run_id, round_index=round_index,
                          faults=faults, sealed=sealed, participants=participants)
    sig, _ = dkg.combine_verified(result, posts, run_id=spec.run_id, round_index=round_index,
                                  sealed=sealed, participants=participants, quorum=spec.quorum,
                                  faults=faults)
    return dkg.verify_threshold_beacon(result.group_key, spec.run_id, round_index,
                                       {"signature": sig.hex()}, sealed=sealed,
                                       participants=participants)


# --- the secret share on disk ----------------------------------------------------------


class ShareFileError(ValueError):
    """A share file that is not this validator's share of this run's agreed group key."""


def share_path(state_dir: Path, run_id: str) -> Path:
    """Where a validator keeps its secret share of run ``run_id``'s group key."""
    return state_dir / f"dkg-share-{run_id}.json"


def _write_secret(path: Path, body: dict[str, Any]) -> None:
    """Write ``body`` as JSON with mode 0600 (created so, never widened), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(body, fh, sort_keys=True)
    os.replace(tmp, path)


def _read_secret(path: Path) -> dict[str, Any]:
    """A secret JSON file; :class:`ShareFileError` when others can read it or it is not JSON."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ShareFileError(f"secret file {path} is accessible by others "
                             f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
    try:
        body = json.loads(path.read_text())
    except ValueError as exc:
        raise ShareFileError(f"secret file {path} is malformed: {exc}") from exc
    if not isinstance(body, dict):
        raise ShareFileError(f"secret file {path} is malformed")
    return body


def save_share(path: Path, spec: RunSpec, index: int, share: int) -> None:
    """Write the share (mode 0600, atomically): a restarted validator signs beacons again
    instead of only verifying them (5.4a)."""
    _write_secret(path, {"run_id": spec.run_id, "index": index, "share": f"{share:064x}",
                         "public_share": bls.public_key(share).hex()})


def dkg_secrets_path(state_dir: Path, run_id: str) -> Path:
    """Where a validator keeps its secrets of run ``run_id``'s DKG while it runs."""
    return state_dir / f"dkg-secrets-{run_id}.json"


def save_dkg_secrets(path: Path, spec: RunSpec, index: int, enc: X25519PrivateKey,
                     dealing: dkg.Dealing | None) -> None:
    """Keep the DKG's X25519 key and, once dealt, the polynomial and the deal (mode 0600),
    written before the post that depends on them leaves the node."""
    raw = enc.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    _write_secret(path, {
        "run_id": spec.run_id, "index": index, "enc_secret": raw.hex(),
        "coeffs": None if dealing is None else [f"{c:064x}" for c in dealing.coeffs],
        "deal": None if dealing is None else dealing.deal.to_body()})


def load_dkg_secrets(path: Path, spec: RunSpec, index: int
                     ) -> tuple[X25519PrivateKey, dkg.Dealing | None] | None:
    """The kept DKG secrets, or None when there are none. :class:`ShareFileError` when the
    file is readable by others, malformed, or another run's or validator's, or its deal
    is not the polynomial's (a node never posts a deal it cannot answer for)."""
    if not path.exists():
        return None
    body = _read_secret(path)
    try:
        if body["run_id"] != spec.run_id or body["index"] != index:
            raise ShareFileError(f"DKG secrets file {path} is another run's or validator's")
        enc = X25519PrivateKey.from_private_bytes(bytes.fromhex(body["enc_secret"]))
        dealing = None
        if body["coeffs"] is not None:
            coeffs = [int(c, 16) for c in body["coeffs"]]
            deal = dkg.DkgDeal(**body["deal"])
            if list(deal.commitments) != dkg.commit(coeffs) or deal.enc_keys[index] != (
                    dkg.x25519_public(enc)):
                raise ShareFileError(f"DKG secrets file {path}: the deal is not its "
                                     "polynomial's")
            dealing = dkg.Dealing(coeffs, deal)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        if isinstance(exc, ShareFileError):
            raise
        raise ShareFileError(f"DKG secrets file {path} is malformed: {exc}") from exc
    return enc, dealing


def load_share(path: Path, spec: RunSpec, result: dkg.DkgResult, index: int) -> int | None:
    """The share kept at ``path``, or None when there is none. :class:`ShareFileError` when
    others can read it, or it is not a share of ``spec``'s run whose public share is this
    validator's (``index``) in the agreed ``result``: a stale or foreign share never signs."""
    if not path.exists():
        return None
    body = _read_secret(path)
    try:
        share = int(body["share"], 16)
        ok = (body["run_id"] == spec.run_id and body["index"] == index
              and 0 < share < dkg.R)
    except (ValueError, KeyError, TypeError) as exc:
        raise ShareFileError(f"share file {path} is malformed: {exc}") from exc
    if not ok or bls.public_key(share).hex() != result.public_shares[index]:
        raise ShareFileError(f"share file {path} does not hold this validator's share of "
                             f"run {spec.run_id}'s agreed group key")
    return share
