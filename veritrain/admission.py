"""``veritrain admit`` and ``veritrain bond``: the organiser's (or a delegated issuer's)
admission tickets and revocations, the treasury's bond deposits and a worker's bond
withdrawal, each signed here and posted to ``POST /v1/runs/RUN/membership``
(specs/ledger-api.md, "Admission"; rules in protocol/membership.py).

Every message names the round from which it takes effect: the first round the ledger
has not closed (``GET /v1/runs/RUN/membership`` says which), or, for a withdrawal, that
round plus the run's unbonding period. A refusal ends the command with the ledger's one
line (veritrain/failures.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from veritrain.ledger.client import LedgerClient, fetch_membership, fetch_run
from veritrain.protocol.identity import Identity
from veritrain.protocol.membership import (
    AdmissionPolicy,
    AdmissionRevocation,
    AdmissionTicket,
    BondDeposit,
    BondWithdrawal,
    fold_rows,
)
from veritrain.protocol.messages import RunSpec, sign

KEY_HEX = re.compile(r"[0-9a-f]{64}")


def worker_key(value: str, option: str = "--worker") -> str:
    """A participant's Ed25519 key: 64 hex digits, or a ``.pub.json`` written by keygen."""
    if KEY_HEX.fullmatch(value.lower()):
        return value.lower()
    path = Path(value)
    if not path.is_file():
        raise SystemExit(f"{option} must be a public key (64 hex digits) or a .pub.json "
                         f"written by `veritrain keygen`, not {value!r}")
    try:
        key = json.loads(path.read_text())["ed25519"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path} is not a .pub.json with an ed25519 key "
                         f"({type(exc).__name__})") from None
    if not isinstance(key, str) or not KEY_HEX.fullmatch(key):
        raise SystemExit(f"{path}: its ed25519 key is not 64 hex digits")
    return key


async def _run_and_rows(client: LedgerClient, run_id: str | None
                        ) -> tuple[RunSpec, dict[str, Any]]:
    spec = await fetch_run(client, run_id, wait_for=0.0)
    served = await fetch_membership(client, spec.run_id)
    return spec, served


def _policy_must_be(spec: RunSpec, wanted: str, command: str) -> AdmissionPolicy:
    policy = AdmissionPolicy.of_run(spec)
    if policy.policy != wanted:
        raise SystemExit(f"run {spec.run_id} admits workers by {policy.policy}: `{command}` "
                         f"is for {wanted} runs")
    return policy


async def admit(ledger: str, key: Identity, run_id: str | None, worker: str, *,
                until_round: int | None, revoke: bool) -> str:
    """Sign and post a ticket for ``worker`` (rounds from the first open one up to
    ``until_round``, exclusive; default: the run's last round), or its revocation."""
    async with LedgerClient(ledger, retry_for=30.0) as client:
        spec, served = await _run_and_rows(client, run_id)
        policy = _policy_must_be(spec, "allowlist", "veritrain admit")
        me = key.public_key.hex()
        if me not in policy.issuers:
            raise SystemExit(f"key {me[:12]} is neither the organiser of run {spec.run_id} "
                             "nor one of its ticket issuers")
        r = int(served["first_unclosed_round"])
        now = int(time.time())
        if revoke:
            signed: Any = sign(key, AdmissionRevocation(spec.run_id, r, me, worker, now))
            what = f"revoked every ticket of {worker[:12]} from round {r}"
        else:
            until = int(spec.schedule["max_rounds"]) if until_round is None else until_round
            if until <= r:
                raise SystemExit(f"--until-round {until} is not after round {r}, the first "
                                 "round not yet closed")
            signed = sign(key, AdmissionTicket(spec.run_id, r, me, worker, until, now))
            what = f"admitted {worker[:12]} for rounds {r}-{until - 1}"
        reply = await client.post_message(f"/v1/runs/{spec.run_id}/membership",
                                          signed.to_wire())
        return f"{what} in run {spec.run_id}{'' if reply.get('new', True) else ' (already)'}"


async def deposit(ledger: str, key: Identity, run_id: str | None, worker: str, amount: int,
                  reference: str) -> str:
    """Sign (as the run's treasury) and post a deposit of ``amount`` to ``worker``'s bond."""
    async with LedgerClient(ledger, retry_for=30.0) as client:
        spec, served = await _run_and_rows(client, run_id)
        policy = _policy_must_be(spec, "bond", "veritrain bond deposit")
        me = key.public_key.hex()
        if me != policy.treasury:
            raise SystemExit(f"key {me[:12]} is not the treasury of run {spec.run_id} "
                             f"({policy.treasury[:12]}): only its deposits count")
        r = int(served["first_unclosed_round"])
        signed = sign(key, BondDeposit(spec.run_id, r, me, worker, amount, reference,
                                       int(time.time())))
        await client.post_message(f"/v1/runs/{spec.run_id}/membership", signed.to_wire())
        _, served = await _run_and_rows(client, spec.run_id)
        bond = fold_rows(spec, served["rows"]).balance(worker, r)
        return (f"deposited {amount} units to the bond of {worker[:12]} in run {spec.run_id} "
                f"from round {r}: bond {bond} (the run needs {policy.min_bond})")


async def withdraw(ledger: str, key: Identity, run_id: str | None, amount: int | None,
                   at_round: int | None) -> str:
    """Sign (as the worker) and post a withdrawal of ``amount`` (default: the whole bond)
    effective at ``at_round`` (default: the earliest the unbonding period allows)."""
    async with LedgerClient(ledger, retry_for=30.0) as client:
        spec, served = await _run_and_rows(client, run_id)
        policy = _policy_must_be(spec, "bond", "veritrain bond withdraw")
        me = key.public_key.hex()
        earliest = int(served["first_unclosed_round"]) + policy.unbonding_rounds
        r = earliest if at_round is None else at_round
        if r < earliest:
            raise SystemExit(f"a withdrawal takes effect {policy.unbonding_rounds} round(s) "
                             f"ahead at the earliest: round {earliest}, not {r}")
        bond = fold_rows(spec, served["rows"]).balance(me, r)
        amount = bond if amount is None else amount
        if amount <= 0:
            raise SystemExit(f"{me[:12]} has no bond in run {spec.run_id} to withdraw")
        signed = sign(key, BondWithdrawal(spec.run_id, r, me, amount, int(time.time())))
        await client.post_message(f"/v1/runs/{spec.run_id}/membership", signed.to_wire())
        return (f"withdrawal of {amount} units from the bond of {me[:12]} in run "
                f"{spec.run_id} recorded, effective from round {r}")


def admission_settings(policy: str | None, *, min_bond: int | None, slash_share: float | None,
                       unbonding_rounds: int | None, treasury: str | None,
                       issuers: list[str]) -> dict[str, Any] | None:
    """``RunSpec.admission`` from ``run create``'s options (None: the field stays out of
    the spec, which means ``open``); a one-line SystemExit for options that do not fit."""
    bond_only = {"--min-bond": min_bond, "--slash-share": slash_share,
                 "--unbonding-rounds": unbonding_rounds, "--treasury": treasury}
    if policy in (None, "open"):
        given = [k for k, v in bond_only.items() if v is not None] + (
            ["--issuer"] if issuers else [])
        if given:
            raise SystemExit(f"{', '.join(given)}: only with --admission bond or allowlist")
        return None if policy is None else {"policy": "open"}
    out: dict[str, Any] = {"policy": policy}
    if policy == "allowlist":
        given = [k for k, v in bond_only.items() if v is not None]
        if given:
            raise SystemExit(f"{', '.join(given)}: only with --admission bond")
        if issuers:
            out["issuers"] = [worker_key(i, "--issuer") for i in issuers]
        return out
    if issuers:
        raise SystemExit("--issuer: only with --admission allowlist")
    if min_bond is None or min_bond <= 0:
        raise SystemExit("--admission bond needs --min-bond B (units, > 0)")
    out["min_bond"] = min_bond
    if slash_share is not None:
        if not 0.0 <= slash_share <= 1.0:
            raise SystemExit("--slash-share is a share of the bond: between 0 and 1")
        out["slash_share"] = slash_share
    if unbonding_rounds is not None:
        if unbonding_rounds < 0:
            raise SystemExit("--unbonding-rounds must be 0 or more")
        out["unbonding_rounds"] = unbonding_rounds
    if treasury is not None:
        out["treasury"] = worker_key(treasury, "--treasury")
    return out
