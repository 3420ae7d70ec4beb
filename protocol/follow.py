"""Following a run over HTTP: the checks every node makes before trusting data.

A node never adopts a run spec without the organiser's signature, nor a model
without the certificate that vouches for it (the genesis model is vouched for
by the signed spec itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from .certificates import verify_certificate
from .client import LedgerClient, LedgerRefused
from .errors import RejectedInput
from .messages import RunSpec, open_signed
from .outer import OuterState
from .runtime import RunContext

log = logging.getLogger("veritrain.follow")


async def fetch_run(client: LedgerClient, run_id: str | None, *, poll_seconds: float = 1.0,
                    wait_for: float = 3600.0) -> RunSpec:
    """The run's spec, with the organiser's signature checked.

    A node started before the organiser created the run waits for it (up to
    ``wait_for`` seconds): for the named run, or for the ledger's only active
    run when none is named.
    """
    deadline = time.monotonic() + wait_for
    announced = False
    while True:
        chosen = run_id
        if chosen is None:
            runs = (await client.get_json("/v1/ledger"))["runs"]
            active = [r["run_id"] for r in runs if r["status"] == "active"]
            if len(active) > 1:
                raise SystemExit(f"ledger has {len(active)} active runs; pass --run")
            chosen = active[0] if active else None
        if chosen is not None:
            try:
                overview = await client.get_json(f"/v1/runs/{chosen}")
                break
            except LedgerRefused as exc:
                if exc.reason != "not_found":
                    raise
        if time.monotonic() > deadline:
            raise SystemExit(f"no run {run_id or '(any)'} appeared on the ledger")
        if not announced:
            log.info("waiting for run %s to be created", run_id or "(any)")
            announced = True
        await asyncio.sleep(poll_seconds)
    signed = open_signed(overview["spec"], RunSpec)
    if signed.signer != signed.message.organiser:
        raise RejectedInput("run spec is not signed by its organiser", "bad_signature")
    return signed.message


async def fetch_base(client: LedgerClient, run: RunContext, info: dict[str, Any]
                     ) -> tuple[torch.Tensor, OuterState]:
    """Base model and outer state of a round (full download), checked against its certificate."""
    r = info["round"]
    if r == 0:
        if info["base_model_hash"] != run.spec.genesis_model_hash:
            raise RejectedInput("round 0 does not start from the genesis model", "invalid_base")
        outer_hash = None
    else:
        state = verify_certificate(info["base_certificate"], run.spec, base_of_round=r)
        if (state.model_hash, state.outer_state_hash) != (
                info["base_model_hash"], info["outer_state_hash"]):
            raise RejectedInput("round's base differs from its certificate", "invalid_base")
        outer_hash = state.outer_state_hash
    flat = run.decode_model(await client.get_blob(info["base_model_hash"],
                                                  max_bytes=run.max_model_bytes))
    if outer_hash is None:
        return flat, OuterState.zeros(run.numel)
    data = await client.get_blob(outer_hash, max_bytes=2 * run.max_model_bytes)
    return flat, OuterState.from_bytes(data, run.numel)
