"""An in-process swarm: many workers and a validator in one process, for benchmarks.

It runs the real code path of the nodes without HTTP: workers call
:func:`prepare_submission` (train, encode with error feedback, sign), the
validator calls :func:`process_round` (admit, decode, spot-check, filter,
aggregate, outer step) with a real BLS beacon, and bans follow failed spot
checks. Byzantine workers are either worker-side cheats (free rider, sign
flip, label flip: they run the node's own code with an attack) or omniscient
attacks from :mod:`veritrain.aggregation.attacks` that see the round's honest
updates and send a crafted one through the same encoding and signing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from veritrain.aggregation import attacks as A
from veritrain.aggregation import build_aggregator
from veritrain.aggregation.copies import COPY_RADIUS
from veritrain.protocol import bls
from veritrain.protocol.beacon import beacon_root, compute_beacon_seed
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.identity import Identity
from veritrain.protocol.organiser import RunBundle, build_run
from veritrain.protocol.outer import OuterState
from veritrain.protocol.rules import PENALIZED_REASONS
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex
from veritrain.validators.checks import Candidate
from veritrain.validators.probe import loss_regressions, probe_gains, probe_rows
from veritrain.validators.round import RoundOutcome, process_round, resolve_aggregator_params
from veritrain.workers.evidence import MemoryStore, RoundEvidence, reveal_bytes
from veritrain.workers.round import prepare_submission

WORKER_SIDE_ATTACKS = ("free_rider", "sign_flip", "label_flip")
#: Shejwalkar-Houmansadr (NDSS 2021) aggregator-agnostic attacks, one per perturbation
#: direction (aggregation/attacks.py): ``min_max_unit`` ... ``min_sum_std``.
SHEJWALKAR_ATTACKS = tuple(f"{kind}_{direction}" for kind in ("min_max", "min_sum")
                           for direction in A.DIRECTIONS)
OMNISCIENT_ATTACKS = ("alie", "ipm", "gaussian", "zeros", "mimic", "mimic_jitter", "optimal_alie",
                      "optimal_ipm", "optimal_sign", *SHEJWALKAR_ATTACKS)
ATTACKS = WORKER_SIDE_ATTACKS + OMNISCIENT_ATTACKS
#: ``mimic_jitter``'s noise per copy, as a fraction of the honest spread: a little more
#: than the copy radius, the least that escapes the copy rule (aggregation/copies.py; a
#: scan at f = 7 of 16 found the damage largest just past it and falling beyond).
MIMIC_JITTER = 1.2 * COPY_RADIUS


def deterministic_identity(role: str, seed: str, index: int) -> Identity:
    """Reproducible keys, so runs with the same seed assign the same data to the same workers."""
    ed = hashlib.sha256(f"veritrain/swarm/{seed}/{role}/{index}".encode()).digest()
    return Identity(role, ed, None)


class LabelFlipTask:
    """A task wrapper whose training labels y become C - 1 - y (a worker-side data attack)."""

    def __init__(self, task: Any, num_classes: int) -> None:
        self._task = task
        self._classes = num_classes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def make_batch(self, dataset: Any, indices: torch.Tensor, *, device: Any) -> Any:
        x, y = self._task.make_batch(dataset, indices, device=device)
        return x, (self._classes - 1) - y


@dataclass
class SwarmResult:
    eval_loss: list[float]
    outcomes: list[RoundOutcome]
    seconds: float
    caught: dict[str, int] = field(default_factory=dict)  # worker -> round first rejected


class Swarm:
    def __init__(self, settings: dict[str, Any], *, n_workers: int,
                 byzantine: dict[int, str] | None = None, seed: str = "swarm",
                 device: str = "cpu", bundle: RunBundle | None = None,
                 keep_updates: bool = False, workers: list[Identity] | None = None,
                 run_seed: str | None = None) -> None:
        """``workers`` and ``run_seed`` (default: derived from ``seed``) give the swarm the
        keys and data of another run: each worker's data assignment is a function of the
        run seed, the round and its key (protocol/data.py), so the same keys and seed
        train on the same examples as that run's workers."""
        self.byzantine = dict(byzantine or {})
        for attack in self.byzantine.values():
            if attack not in ATTACKS:
                raise ValueError(f"unknown attack {attack!r}; expected one of {ATTACKS}")
        self.device = device
        # A seeded validator key: its BLS beacon shares, hence the challenges, the probe
        # batches and the aggregation seeds, are the same in every run with this seed.
        v_seed = hashlib.sha256(f"veritrain/swarm/{seed}/validator".encode()).digest()
        self.validator = Identity("validator", v_seed, bls.keygen(v_seed))
        if workers is not None and len(workers) != n_workers:
            raise ValueError(f"{len(workers)} worker keys for {n_workers} workers")
        self.workers = workers or [deterministic_identity("worker", seed, i)
                                   for i in range(n_workers)]
        run_seed = run_seed or hashlib.sha256(f"veritrain/swarm/{seed}/run".encode()).hexdigest()
        self.bundle = bundle or build_run(deterministic_identity("organiser", seed, 0),
                                          "swarm", settings, [self.validator.public],
                                          seed=run_seed)
        self.run = RunContext.build(self.bundle.signed.message, self.bundle.dataset)
        if self.run.spec.validators[0]["ed25519"] != self.validator.public_key.hex():
            raise ValueError("a shared bundle must be built with this swarm's validator")
        self.base = self.run.decode_model(self.bundle.genesis)
        self.base_hash = self.run.spec.genesis_model_hash
        self.outer = OuterState.zeros(self.run.numel)
        self.error_feedback = [ErrorFeedback(self.run.numel) for _ in self.workers]
        self.banned_until: dict[str, int] = {}
        self.payload_bytes: list[int] = []  # the last round's payload sizes (what workers sent)
        #: With ``keep_updates``, the last round's uncompressed updates by worker index
        #: (bench/worker_agreement.py); n x D floats, so off by default.
        self.keep_updates = keep_updates
        self.updates: dict[int, torch.Tensor] = {}
        if "label_flip" in self.byzantine.values():
            classes = int(self.run.task.params.get("n_classes", 256))
            self._flipped = dataclasses.replace(self.run, task=LabelFlipTask(self.run.task,
                                                                              classes))

    def genesis_loss(self) -> float:
        return self.run.evaluate(self.run.decode_model(self.bundle.genesis), device=self.device)

    def _omniscient(self, attack: str, honest: torch.Tensor, f: int, r: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(r)
        if attack == "alie":
            return A.a_little_is_enough(honest, f, n=honest.shape[0] + f)
        if attack == "ipm":
            return A.inner_product_manipulation(honest, f)
        if attack == "gaussian":
            return A.gaussian_noise(honest, f, std=float(honest.std()), generator=gen)
        if attack == "zeros":
            return A.free_rider(honest, f)
        if attack == "mimic":
            return A.mimic(honest, f)
        if attack == "mimic_jitter":  # the least noise that escapes the copy rule
            return A.mimic(honest, f, jitter=MIMIC_JITTER, generator=gen)
        if attack in SHEJWALKAR_ATTACKS:
            kind, direction = attack.rsplit("_", 1)
            return (A.min_max if kind == "min_max" else A.min_sum)(honest, f, direction)
        params = resolve_aggregator_params(self.run.spec.aggregator["params"], honest)
        agg = build_aggregator(self.run.spec.aggregator["name"], params, seed=r)
        probe_examples, probe_factor = self.run.spec.probe
        if probe_examples > 0 and probe_factor > 0:
            agg = self._probe_aware(agg, r)
        if attack == "optimal_alie":
            return A.optimal_alie(honest, f, agg)
        if attack == "optimal_sign":
            return A.optimal_sign(honest, f, agg)
        return A.optimal_ipm(honest, f, agg)

    def _probe_aware(self, agg: Callable[[torch.Tensor], torch.Tensor], r: int
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The validator's pipeline as an adaptive attacker can model it: the probe filter
        on a batch of its own (the public training data; the round's probe batch comes from
        a beacon it cannot know), then the aggregator. The optimal attacks line-search
        against this, so they find the largest scale that still passes the filter."""
        probe_examples, probe_factor = self.run.spec.probe
        rows = probe_rows(self.run, b"an attacker's own probe batch", r, probe_examples)

        def filtered(updates: torch.Tensor) -> torch.Tensor:
            gains = probe_gains(self.run, self.base, {str(i): u for i, u in enumerate(updates)},
                                rows, device=self.device)
            dropped = loss_regressions(gains, probe_factor)
            return agg(updates[[i for i in range(len(updates)) if str(i) not in dropped]])

        return filtered

    def step(self, r: int) -> RoundOutcome:
        run = self.run
        active = [i for i, w in enumerate(self.workers)
                  if self.banned_until.get(w.public_key.hex(), -1) < r]
        # The beacon share depends only on (run, round), and the challenges only on the
        # seed and who submits, so they can be known here without changing anyone's
        # behaviour; it lets each worker keep just the states its checks open, and write
        # its reveal right away.
        share = self.validator.sign_bls(beacon_root(run.spec.run_id, r))
        seed = compute_beacon_seed([share])
        policy = ChallengePolicy.of_run(run.spec)
        challenges = compute_challenges(
            seed, sorted(self.workers[i].public_key.hex() for i in active), policy)
        due = set(policy.checked_workers(challenges))
        reveals: dict[str, bytes | None] = {}

        def evidence_for(i: int) -> RoundEvidence:
            me = self.workers[i].public_key.hex()
            k = run.inner.trail_every
            wanted = {run.inner.steps} | {s for j in challenges.get(me, [])
                                          for s in (j * k, (j + 1) * k)}
            return RoundEvidence(MemoryStore(), run, r, me, keep=wanted.__contains__)

        def keep(prep: Any) -> Any:
            sub = prep.signed.message
            if sub.worker in due:
                reveals[sub.worker] = reveal_bytes(prep.evidence, seed,
                                                   challenges.get(sub.worker, []), sub)
            prep.evidence.settle()
            return prep

        prepared: dict[int, Any] = {}
        for i in active:
            attack = self.byzantine.get(i)
            if attack in OMNISCIENT_ATTACKS:
                continue
            ctx = self._flipped if attack == "label_flip" else run
            prepared[i] = keep(prepare_submission(
                ctx, self.workers[i], r, self.base, self.base_hash, self.error_feedback[i],
                evidence=evidence_for(i),
                attack=attack if attack in ("free_rider", "sign_flip") else None,
                device=self.device))
        omniscient = [i for i in active if self.byzantine.get(i) in OMNISCIENT_ATTACKS]
        if omniscient:
            honest = torch.stack([p.delta for i, p in prepared.items()
                                  if i not in self.byzantine])
            by_attack: dict[str, list[int]] = {}
            for i in omniscient:
                by_attack.setdefault(self.byzantine[i], []).append(i)
            for attack, members in by_attack.items():
                rows = self._omniscient(attack, honest, len(members), r)
                for row, i in zip(rows, members, strict=True):
                    prepared[i] = keep(prepare_submission(
                        run, self.workers[i], r, self.base, self.base_hash,
                        self.error_feedback[i], evidence=evidence_for(i),
                        replace_delta=row.float()))
        candidates = [Candidate(p.signed, p.payload) for p in prepared.values()]
        self.payload_bytes = [len(p.payload or b"") for p in prepared.values()]
        if self.keep_updates:
            self.updates = {i: p.delta for i, p in prepared.items()}
        registered = {w.public_key.hex() for w in self.workers}
        banned = {w for w, until in self.banned_until.items() if until >= r}
        outcome = process_round(run, r, self.base_hash, self.base, self.outer, candidates,
                                registered, banned, seed, reveals=reveals,
                                device=self.device)
        for i, p in prepared.items():
            self.error_feedback[i] = p.error_feedback
        for v in outcome.verdicts:
            if v["reason"] in PENALIZED_REASONS:
                self.banned_until[v["worker"]] = r + run.spec.verification["ban_rounds"]
        self.base, self.outer = outcome.new_flat, outcome.new_outer
        self.base_hash = sha256_hex(run.encode_model(self.base))
        return outcome

    def train(self, rounds: int, *, on_round: Callable[[int, RoundOutcome], None] | None = None
              ) -> SwarmResult:
        started = time.monotonic()
        result = SwarmResult([], [], 0.0)
        for r in range(rounds):
            outcome = self.step(r)
            result.outcomes.append(outcome)
            result.eval_loss.append(outcome.eval_loss)
            for v in outcome.verdicts:
                if v["status"] == "rejected":
                    result.caught.setdefault(v["worker"], r)
            if on_round is not None:
                on_round(r, outcome)
        result.seconds = time.monotonic() - started
        return result
