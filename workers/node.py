"""The worker node: join a run over HTTP, train each round, submit signed payloads.

Each round: read the round from the ledger, check the base model against its
certificate, derive this worker's data assignment, run H inner steps, encode
the pseudo-gradient with error feedback, sign and submit it, and keep the
ledger's signed receipt. Progress survives restarts: receipts and the
error-feedback residual are written atomically under ``state_dir``, and a
round that was already submitted is never submitted again (workers/state.py). The
round's work itself is workers/round.py, sans I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from veritrain.ledger.client import LedgerClient, LedgerRefused, fetch_base_files, fetch_run
from veritrain.protocol.certificates import (
    CERTIFIED_MARK_FILE,
    CertifiedMark,
    InvalidCertificate,
    base_round,
    verify_certificate,
)
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.memory import release_free_memory
from veritrain.protocol.messages import (
    Receipt,
    Registration,
    RunSpec,
    SpotReveal,
    Submission,
    open_signed,
    sign,
)
from veritrain.protocol.receipts import (
    certified_verdicts,
    check_reveal_receipt,
    check_submission_receipt,
    open_receipt,
    open_reveal_claim,
)
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import hash_flat
from veritrain.protocol.training import CommitPool

from .beacon import round_inputs, verified_openings, verified_seed
from .disputes import HAND_TIMEOUT_SECONDS, hand_to_validators
from .evidence import EvidenceMissing, RoundEvidence, default_keep_every, file_sha256
from .masked import SECAGG_ATTACKS, drawn_over_other_survivors, take_part
from .round import ATTACKS, prepare_submission
from .state import WorkerState

log = logging.getLogger("veritrain.worker")


@dataclass
class WorkerConfig:
    ledger_url: str
    state_dir: Path
    run_id: str | None = None
    device: str = "cpu"
    poll_seconds: float = 0.5
    retry_for: float = 300.0
    attack: str | None = None
    progress: bool = True
    #: Keep every n-th step's whole state for reveals (None: :func:`default_keep_every`);
    #: larger saves disk and writes, and a challenged step between kept states is replayed.
    keep_every: int | None = None
    #: Where to write what the node sent and received and how long its rounds took (JSON,
    #: rewritten after every round), or None.
    stats_path: Path | None = None


class ProgressLine:
    """A one-line progress bar on a terminal, silent otherwise."""

    def __init__(self, enabled: bool, r: int, total: int) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.r, self.total = r, total

    def __call__(self, step: int, loss: float) -> None:
        if self.enabled:
            done = int(30 * step / self.total)
            sys.stderr.write(f"\rround {self.r} [{'#' * done}{'.' * (30 - done)}] "
                             f"{step}/{self.total} loss {loss:.4f}")
            if step == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


class StepClock:
    """A progress callback that also keeps each inner step's wall time."""

    def __init__(self, then: Callable[[int, float], None]) -> None:
        self.then = then
        self.durations: list[float] = []
        self._last = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        self.durations.append(now - self._last)
        self._last = now
        self.then(step, loss)


class WorkerNode:
    def __init__(self, config: WorkerConfig, identity: Identity) -> None:
        if config.attack is not None and config.attack not in ATTACKS:
            raise ValueError(f"unknown attack {config.attack!r}; expected one of {ATTACKS}")
        self.config = config
        self.identity = identity
        self.me = identity.public_key.hex()
        #: Hashes each step's state commitment (protocol/training.py: CommitPool).
        self.hashing = CommitPool.for_device(config.device)
        self.refused: set[int] = set()
        self.ledger_key = ""
        #: The newest certified round this node took a base from, per run, kept in
        #: ``state_dir``: the ledger cannot roll it back to an older one, even across a
        #: restart (``certified_base``).
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.certified_mark = CertifiedMark.in_file(config.state_dir / CERTIFIED_MARK_FILE)
        self.stats: list[dict[str, Any]] = []  # one entry per submitted round

    async def run(self, *, max_rounds: int | None = None) -> int:
        """Train and submit until the run ends (or ``max_rounds`` submissions); returns the count."""
        async with LedgerClient(self.config.ledger_url, retry_for=self.config.retry_for) as client:
            self.client = client
            spec = await fetch_run(client, self.config.run_id)
            self.ledger_key = (await client.get_json("/v1/ledger"))["ledger_key"]
            # bytes: a task's load_dataset takes the blob as bytes (tasks.md)
            dataset = bytes(await client.get_blob(spec.dataset_hash,
                                                  max_bytes=spec.dataset_bytes, kind="dataset"))
            run = await asyncio.to_thread(RunContext.build, spec, dataset)
            state = WorkerState(self.config.state_dir, spec.run_id, run.numel)
            reg = Registration(run_id=spec.run_id, round=0, participant=self.me, role="worker",
                               created_at=int(time.time()))
            joined = await client.post_message(f"/v1/runs/{spec.run_id}/participants",
                                               sign(self.identity, reg).to_wire())
            log.info("worker %s joined run %s at round %d", self.me[:12], spec.run_id,
                     joined["registered_round"])
            submitted = 0
            while max_rounds is None or submitted < max_rounds:
                info = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/current")
                if info["run_status"] != "active":
                    await self.answer_challenges(client, run, state)
                    log.info("run %s is %s after %d submissions", spec.run_id,
                             info["run_status"], submitted)
                    break
                r = info["round"]
                await self.answer_challenges(client, run, state)
                self.write_stats()
                if info["status"] != "open" or state.submitted(r) or r in self.refused:
                    await asyncio.sleep(self.config.poll_seconds)
                    continue
                if await self.train_and_submit(client, run, state, info):
                    submitted += 1
            while state.pending_rounds():
                await self.answer_challenges(client, run, state)
                overview = await client.get_json(f"/v1/runs/{spec.run_id}")
                if overview["status"] != "active" and not state.pending_rounds():
                    break
                await asyncio.sleep(self.config.poll_seconds)
            await finish_handing()
            self.write_stats()
            return submitted

    def write_stats(self) -> None:
        """Rewrite the stats file (traffic by kind, each round's timings), if one is set."""
        if self.config.stats_path is None:
            return
        self.config.stats_path.write_text(json.dumps({
            "role": "worker", "traffic": self.client.traffic.to_json(), "rounds": self.stats}))

    async def sync_model(self, client: LedgerClient, run: RunContext, state: WorkerState,
                         info: dict[str, Any]) -> torch.Tensor:
        """The round's certified base model, as cheaply as possible.

        A worker that kept the previous round's model and outer momentum (on disk:
        workers/state.py) applies the round's small broadcast update itself (the
        canonical outer step) and accepts the result only if it hashes to the certified
        model; otherwise, and after joining or falling behind, it downloads the full
        model and outer state.
        """
        r, target = info["round"], info["base_model_hash"]
        kept = state.model_meta()
        if kept is not None and kept["model_hash"] == target:
            return state.model_vector("params")
        if kept is not None and r > 0 and kept["round"] == r - 1:
            cert = verify_certificate(info["base_certificate"], run.spec, base_of_round=r)
            self.certified_mark.raise_to(run.spec.run_id, cert.round)
            if cert.model_hash == target:
                payload = await client.get_blob(
                    cert.update_hash, max_bytes=run.codec.max_encoded_size(run.numel))
                params, momentum = await asyncio.to_thread(
                    run.apply_update, state.model_vector("params"),
                    state.model_vector("momentum"), payload, r - 1)
                if hash_flat(params, run.shapes) == target:
                    state.keep_model(r, target, params, momentum)
                    del momentum
                    release_free_memory()  # the decoded update and the outer step's temporaries
                    return params
                log.warning("round %d: the broadcast update does not reproduce the certified "
                            "model here; downloading it in full", r)
        params, outer = run.decode_base(*await fetch_base_files(
            client, run.spec, info, max_model_bytes=run.max_model_bytes,
            newest_certified=self.certified_mark.of(run.spec.run_id)))
        self.certified_mark.raise_to(run.spec.run_id, base_round(info))
        state.keep_model(r, target, params, outer.momentum)
        del outer
        release_free_memory()  # the downloaded files and the momentum: not needed to train
        return params

    async def answer_challenges(self, client: LedgerClient, run: RunContext,
                                state: WorkerState) -> None:
        await answer_checks(client, run, self.identity, state, self.ledger_key,
                            device=self.config.device)

    async def train_and_submit(self, client: LedgerClient, run: RunContext, state: WorkerState,
                               info: dict[str, Any]) -> bool:
        spec, r = run.spec, info["round"]
        base_flat = await self.sync_model(client, run, state, info)
        started = time.monotonic()
        steps = StepClock(ProgressLine(self.config.progress, r, run.inner.steps))
        store = state.evidence_store(r)
        evidence = RoundEvidence(store, run, r, self.me,
                                 keep_every=self.config.keep_every or default_keep_every(run))
        prepared = await asyncio.to_thread(
            prepare_submission, run, self.identity, r, base_flat, info["base_model_hash"],
            state.error_feedback, evidence=evidence, attack=self.config.attack,
            device=self.config.device, pool=self.hashing, progress=steps)
        trained = time.monotonic() - started
        # The evidence goes to disk before the ledger can accept the submission: a
        # crash right after acceptance must not leave the worker unable to answer
        # its checks (an honest worker would then fail its spot check).
        masked = spec.masked is not None
        if masked:  # the payload stays here; a spot check asks for it in the reveal
            evidence.keep_payload(prepared.payload)
        store.put_bytes("submission", prepared.signed.encode())
        await asyncio.to_thread(store.durable)
        parts = [("envelope", prepared.signed.encode(), "application/json")]
        if not masked:
            parts.append(("payload", prepared.payload, "application/octet-stream"))
        try:
            wire = await client.post_multipart(
                f"/v1/runs/{spec.run_id}/rounds/{r}/submissions", parts, kind="payload")
        except LedgerRefused as exc:
            if exc.reason == "duplicate":
                log.info("round %d was already submitted before a restart", r)
                state.record(r, None, prepared.error_feedback)
                return False
            log.warning("round %d: submission refused (%s): %s", r, exc.reason, exc.detail)
            self.refused.add(r)
            return False
        receipt = open_signed(wire, Receipt)
        if (receipt.signer != self.ledger_key
                or receipt.message.submission_digest != prepared.signed.digest):
            raise RuntimeError("the ledger's receipt is not signed by it or names another submission")
        state.record(r, wire, prepared.error_feedback)
        sub = prepared.signed.message
        log.info("round %d: submitted %d bytes (loss %.4f -> %.4f) in %.1fs", r, len(prepared.payload),
                 sub.loss_first, sub.loss_last, time.monotonic() - started)
        self.stats.append({"round": r, "train_s": trained, "step_s": steps.durations,
                           "submit_s": time.monotonic() - started - trained,
                           "payload_bytes": len(prepared.payload)})
        self.write_stats()
        del base_flat
        release_free_memory()  # the round's model and encoding: idle until the next round
        if masked:
            update = run.codec.decode(prepared.payload, run.numel, seed=run.codec_seed(r, self.me))
            attack = self.config.attack if self.config.attack in SECAGG_ATTACKS else None
            how = await take_part(client, spec, self.identity, r, update,
                                  poll_seconds=self.config.poll_seconds, attack=attack)
            log.info("round %d: masked bucket: %s", r, how)
        return True


def check_receipts_honoured(run: RunContext, receipts: list[Any], ledger_key: str,
                            info: dict[str, Any], results: list[Any]) -> bool:
    """Once a round is certified, every receipt this worker holds for it must be honoured
    by the certified verdicts (issue #28): its submission judged, its timely reveal not
    certified missing. The verdicts come from the round's quorum certificate and a result
    whose list hashes to it, never from the ledger's word. Logs what it finds; False when
    the ledger broke a receipt (``veritrain audit receipt`` shows the same to anyone)."""
    r = info["round"]
    try:
        cert = verify_certificate(info["certificate"], run.spec, base_of_round=r + 1)
        verdicts = certified_verdicts(results, cert, run.spec)
    except (RejectedInput, InvalidCertificate, KeyError, TypeError) as exc:
        log.warning("round %d: cannot read the certified verdicts to check this worker's "
                    "receipts: %s", r, exc)
        return True
    honoured = True
    for wire in receipts:
        try:
            signed = open_receipt(wire, ledger_key)
        except RejectedInput as exc:
            log.warning("round %d: a kept receipt does not open: %s", r, exc)
            continue
        msg = signed.message
        check = (check_submission_receipt(msg, verdicts) if isinstance(msg, Receipt)
                 else check_reveal_receipt(msg, verdicts))
        if check.honoured is False:
            honoured = False
            log.error("the ledger did not honour its %s: %s (`veritrain audit receipt` with "
                      "the receipt file shows it to anyone)", msg.KIND, check.reason)
        else:
            log.info("%s honoured: %s", msg.KIND, check.reason)
    return honoured


#: Seconds between two tries to hand a round's claim to the inboxes that did not take it.
HAND_RETRY_SECONDS = 5.0
_next_hand: dict[tuple[str, int], float] = {}


async def hand_claim(spec: RunSpec, state: WorkerState, r: int, ledger_key: str) -> None:
    """Hand round ``r``'s kept reveal claim to every validator inbox that does not hold it
    yet (workers/disputes.py), at most every ``HAND_RETRY_SECONDS``; which inboxes hold
    it (and which refused it for good) is kept beside the receipt, so a restart or an
    inbox that was down is caught up until the round is settled, and an inbox that will
    refuse it again is not asked again."""
    wire = state.claim(r)
    inboxes = spec.validator_inboxes()
    held, refused = state.handed(r), state.refused(r)
    key = (str(state.dir), r)
    if (wire is None or held | refused >= set(inboxes)
            or time.monotonic() < _next_hand.get(key, 0.0)):
        return
    _next_hand[key] = time.monotonic() + HAND_RETRY_SECONDS
    try:
        claim = open_reveal_claim(wire, spec.run_id, ledger_key)
    except RejectedInput as exc:
        log.error("round %d: the kept reveal claim does not open: %s", r, exc)
        return
    answers = await hand_to_validators(spec, claim, skip=held | refused)
    state.record_handed(r, held | {k for k, a in answers.items() if a == "held"},
                        refused | {k for k, a in answers.items() if a.startswith("refused")})


_handing: dict[tuple[str, int], asyncio.Task[None]] = {}


def start_handing(spec: RunSpec, state: WorkerState, r: int, ledger_key: str) -> None:
    """``hand_claim`` in the background, one at a time per round: an inbox that is slow
    or silent (up to ``HAND_TIMEOUT_SECONDS``) never holds up the worker's loop."""
    key = (str(state.dir), r)
    task = _handing.get(key)
    if task is None or task.done():
        _handing[key] = asyncio.get_running_loop().create_task(
            hand_claim(spec, state, r, ledger_key))


async def finish_handing(timeout: float = HAND_TIMEOUT_SECONDS + 1.0) -> None:
    """Let the claims being handed finish (before the worker exits)."""
    pending = [t for t in _handing.values() if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


def settle(state: WorkerState, r: int) -> None:
    """Round ``r`` is settled: its evidence goes, and so does the bookkeeping of handing
    its claim."""
    state.settle(r)
    _handing.pop((str(state.dir), r), None)
    _next_hand.pop((str(state.dir), r), None)


async def answer_checks(client: LedgerClient, run: RunContext, identity: Identity,
                        state: WorkerState, ledger_key: str, *, device: str = "cpu") -> None:
    """Answer every pending round's checks; drop settled rounds.

    The worker takes nothing on the ledger's word: it verifies the round's fixed beacon
    against the validators' keys and the sealed list it is served (which must hold its
    own submission), computes its checks itself, and reveals what they need whatever
    the ledger's challenge list says; it keeps the ledger's signed receipt.
    """
    spec, me = run.spec, identity.public_key.hex()
    for r in state.pending_rounds():
        base = f"/v1/runs/{spec.run_id}/rounds/{r}"
        info = await client.get_json(base)
        if info["status"] == "voided":  # no certificate could come: no verdicts, no pay
            log.warning("round %d was voided (its validators reached no quorum); its "
                        "submission earns nothing", r)
            settle(state, r)
            continue
        if info["status"] == "finalized":
            check_receipts_honoured(run, state.receipts(r), ledger_key, info,
                                    (await client.get_json(f"{base}/results"))["results"])
            settle(state, r)
            continue
        if state.revealed(r):
            start_handing(spec, state, r, ledger_key)  # to inboxes that missed it
            continue
        if info["status"] == "open":
            continue
        store = state.evidence_store(r)
        if not store.has("submission"):  # a crash before the submission was kept
            settle(state, r)
            continue
        beacon = await client.get_json(f"{base}/beacon")
        if beacon["beacon"] is None:
            continue
        signed = open_signed(decode_canonical(store.get_bytes("submission")), Submission)
        reply = await client.get_json(f"{base}/submissions")
        sealed = reply["submissions"]
        try:
            seed = await verified_seed(client, spec, r, beacon, *round_inputs(reply, me))
        except RejectedInput as exc:
            log.error("round %d: not revealing: %s (%s)", r, exc, exc.reason)
            continue
        workers = [open_signed(wire, Submission).message.worker for wire in sealed]
        if signed.digest not in {open_signed(w, Submission).digest for w in sealed}:
            log.error("round %d: the sealed list lacks this worker's receipted submission: "
                      "the ledger dropped it (receipt kept under %s)", r, state.dir)
            continue
        policy = ChallengePolicy.of_run(spec)
        checks_seed, buckets = seed, None
        if spec.masked is not None:  # a masked round's checks wait for its openings seed
            board = await client.get_json(f"{base}/secagg")
            if board["openings"]["fixed"] is None:
                continue
            try:
                checks_seed, buckets = await verified_openings(client, spec, r, board)
            except RejectedInput as exc:
                log.error("round %d: not revealing: %s (%s)", r, exc, exc.reason)
                continue
            mine = [b["index"] for b in board["buckets"] if me in b["assigned"]]
            problem = (drawn_over_other_survivors(spec, r, board, mine[0], buckets)
                       if len(mine) == 1 else None)
            if problem is not None:  # revealing would publish the update it masked
                log.error("round %d: not revealing: %s", r, problem)
                continue
        segments = compute_challenges(checks_seed, workers, policy, buckets=buckets).get(me, [])
        if me not in policy.checked_workers({me: segments}):
            continue
        path = store.path / "reveal.bin"
        started = time.monotonic()
        try:
            await asyncio.to_thread(RoundEvidence(store, run, r, me).write_reveal_file, path,
                                    checks_seed, segments, signed.message, device=device)
        except (EvidenceMissing, KeyError, FileNotFoundError) as exc:
            log.error("round %d: cannot build the reveal for segments %s: %s", r, segments, exc)
            state.record_reveal(r, {"failed": str(exc)[:500]})
            continue
        envelope = sign(identity, SpotReveal(
            run_id=spec.run_id, round=r, worker=me, submission_digest=signed.digest,
            reveal_hash=await asyncio.to_thread(file_sha256, path),
            reveal_bytes=path.stat().st_size, created_at=int(time.time())))
        try:
            wire = await client.post_multipart(f"{base}/reveals", [
                ("envelope", envelope.encode(), "application/json"),
                ("reveal", path, "application/octet-stream")], kind="verification")
        except LedgerRefused as exc:
            log.warning("round %d: reveal refused (%s): %s", r, exc.reason, exc.detail)
            if exc.reason in ("reveal_late", "round_finalized", "not_challenged",
                              "blob_sealed"):
                state.record_reveal(r, {"refused": exc.reason, "detail": exc.detail})
            continue
        try:
            claim = open_reveal_claim({"envelope": envelope.to_wire(), "receipt": wire},
                                      spec.run_id, ledger_key)
        except RejectedInput as exc:
            log.error("round %d: the reveal receipt is not the ledger's for this reveal in "
                      "time: %s", r, exc)
            continue
        state.record_claim(r, claim.to_wire())  # first: a revealed round always has it
        state.record_reveal(r, wire)
        # Past the ledger: a validator holding the claim never judges this reveal missing.
        start_handing(spec, state, r, ledger_key)
        release_free_memory()  # what building the reveal (and any replay) freed
        log.info("round %d: revealed %d bytes for segments %s and the payload binding "
                 "(%.1fs)", r, path.stat().st_size, segments, time.monotonic() - started)
