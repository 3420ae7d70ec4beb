"""One round of a worker, sans I/O: train, encode with error feedback, sign.

The worker node (:mod:`veritrain.workers.node`) and the in-process swarm
(``veritrain.swarm``) both call :func:`prepare_submission`, so they follow one code
path. ``attack`` turns it into one of the cheaters used to evaluate the protocol
(the demo's free rider and sign flipper); it is not for production.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.identity import Identity
from veritrain.protocol.memory import release_free_memory
from veritrain.protocol.messages import Signed, Submission, sign
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex

from .evidence import MemoryStore, RoundEvidence
from .masked import SECAGG_ATTACKS

ATTACKS = ("free_rider", "sign_flip") + SECAGG_ATTACKS


def apply_attack(attack: str | None, delta: torch.Tensor, seed: int) -> torch.Tensor:
    """The update a cheating worker sends instead of ``delta`` (evaluation only)."""
    if attack is None or attack in SECAGG_ATTACKS:  # those cheat on the board, not the update
        return delta
    if attack == "sign_flip":
        return -delta
    if attack == "free_rider":
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn(delta.shape, generator=gen)
        return noise * (float(torch.linalg.vector_norm(delta)) / float(torch.linalg.vector_norm(noise)))
    raise ValueError(f"unknown attack {attack!r}; expected one of {ATTACKS}")


@dataclass
class PreparedSubmission:
    signed: Signed[Submission]
    payload: bytes
    error_feedback: ErrorFeedback  # the residual to keep once the submission is accepted
    delta: torch.Tensor  # what the worker meant to send, before encoding
    evidence: RoundEvidence  # what the worker kept to answer the round's checks


def prepare_submission(
    run: RunContext,
    identity: Identity,
    r: int,
    base_flat: torch.Tensor,
    base_hash: str,
    error_feedback: ErrorFeedback,
    *,
    evidence: RoundEvidence | None = None,
    attack: str | None = None,
    device: str = "cpu",
    progress: Callable[[int, float], None] | None = None,
    replace_delta: torch.Tensor | None = None,
    pool: Executor | None = None,
) -> PreparedSubmission:
    """Train, encode with error feedback and sign one round's submission (no network).

    The worker node and the in-process swarm both call this, so they follow one code
    path. What the round's checks may ask for goes to ``evidence`` (by default a memory
    store keeping every state); with ``pool`` the state commitments are hashed on its
    threads while the next step computes. ``replace_delta`` lets an evaluation harness
    send a crafted update (an omniscient attack) through the same encoding and signing.
    """
    me = identity.public_key.hex()
    if evidence is None:
        evidence = RoundEvidence(MemoryStore(), run, r, me)
    # The residual is read here and again after training, never held across it: a worker
    # whose residual lives in a file (workers/state.py) does not keep it in memory then.
    ef_hash = evidence.begin(base_flat, error_feedback.residual)
    if replace_delta is not None or attack == "free_rider":
        delta = replace_delta if replace_delta is not None else apply_attack(
            "free_rider", torch.full_like(base_flat, 1e-3), run.codec_seed(r, me))
        trail = [sha256_hex(f"{me}{r}{i}".encode()) for i in range(len_trail(run))]
        losses = [0.0]
    else:
        result = run.train(base_flat, r, me, device=device, progress=progress,
                           sink=evidence.sink, pool=pool)
        delta = apply_attack(attack, result.delta, run.codec_seed(r, me))
        trail, losses = result.trail, result.losses
        del result  # its final parameters: not needed for the payload
    ef = ErrorFeedback.of(error_feedback.residual)  # step() replaces it; the caller's stays
    payload, _ = ef.step(run.codec, delta, seed=run.codec_seed(r, me),
                         decay=run.spec.feedback_decay)
    release_free_memory()  # the codec's temporaries
    sub = Submission(
        run_id=run.spec.run_id, round=r, worker=me, base_model_hash=base_hash,
        payload_hash=sha256_hex(payload), payload_bytes=len(payload), codec=run.spec.codec,
        samples=run.inner.steps * run.inner.batch_size, trail=trail,
        ef_hash=ef_hash, loss_first=float(losses[0]),
        loss_last=float(losses[-1]), created_at=int(time.time()))
    return PreparedSubmission(sign(identity, sub), payload, ef, delta, evidence)


def len_trail(run: RunContext) -> int:
    return run.inner.steps // run.inner.trail_every
