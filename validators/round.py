"""Processing one closed round: the validator's sans-IO core.

    admit -> decode -> spot checks -> norm filter -> probe filter -> robust aggregate
          -> compress the aggregate (error feedback) -> outer Nesterov step on what
          was sent -> eval loss -> verdicts and scores

Everything here is a function of its inputs (the run, the base model and
momentum, the sealed submissions and the beacon seed), so two honest
validators reach the same verdicts and the same model bytes, and the node
that feeds it over HTTP stays thin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from veritrain.aggregation import build_aggregator
from veritrain.protocol.beacon import derive_seed
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.outer import OuterState, encode_update, outer_step
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.scoring import compute_scores, split_rewards

from .checks import Candidate, admit, group_by_worker, norm_outliers
from .probe import loss_regressions, probe_gains, probe_rows
from .spot_checks import check_reveal, failure_reason, failure_where


@dataclass
class RoundOutcome:
    verdicts: list[dict[str, Any]]
    scores: list[dict[str, Any]]
    new_flat: torch.Tensor
    new_outer: OuterState
    update_payload: bytes  # the compressed aggregate every worker applies itself
    eval_loss: float
    aggregate: torch.Tensor
    spot_checked: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> list[str]:
        return [v["worker"] for v in self.verdicts if v["status"] == "accepted"]


def clip_quality(updates: torch.Tensor, aggregate: torch.Tensor, tau: float | None) -> list[float]:
    """Share of each update that survives clipping at the aggregate: min(1, tau / ||x_i - v||)."""
    if tau is None:
        return [1.0] * updates.shape[0]
    dist = torch.linalg.vector_norm((updates - aggregate).double(), dim=1)
    return [1.0 if d <= tau else float(tau / d) for d in dist.tolist()]


def round_challenges(run: RunContext, candidates: list[Candidate], beacon_seed: bytes
                     ) -> dict[str, list[int]]:
    """The segments each worker in the sealed list must reveal (same rule as the ledger)."""
    policy = ChallengePolicy.from_spec(run.spec.inner, run.spec.verification,
                                       masked=run.spec.masked is not None)
    return compute_challenges(beacon_seed, sorted({c.worker for c in candidates}), policy)


def resolve_aggregator_params(params: dict[str, Any], updates: torch.Tensor) -> dict[str, Any]:
    """Turn a scale-free ``tau_rel`` into this round's clipping radius.

    tau = tau_rel * median_i ||x_i - med(x)||, with med the coordinate-wise
    median: the radius follows the size of the honest updates, which
    changes from round to round, and a Byzantine minority cannot inflate it.
    """
    out = dict(params)
    tau_rel = out.pop("tau_rel", None)
    if tau_rel is not None:
        center = updates.median(dim=0).values
        spread = torch.linalg.vector_norm((updates - center).double(), dim=1).median()
        out["tau"] = max(float(tau_rel) * float(spread), 1e-12)
    return out


@dataclass
class FilteredRound:
    """A round after every per-update check: who is rejected, and the rows to aggregate.

    ``accepted`` is sorted by worker and ``stacked`` holds their decoded updates in
    that order; ``params`` are the aggregator's parameters with ``tau_rel``
    resolved to this round's ``tau``.
    """

    round_index: int
    verdicts: dict[str, dict[str, Any]]
    by_worker: dict[str, Candidate]
    checks: dict[str, list[dict[str, Any]]]
    #: Each checked worker's largest recomputation distance: for the node's logs and stats
    #: only (floats differ between validators; certified verdicts carry outcomes).
    distances: dict[str, float]
    accepted: list[str]
    stacked: torch.Tensor | None
    params: dict[str, Any]
    #: Masked rounds: ``stacked`` holds bucket means, ``weights`` their member counts and
    #: ``rows_of`` the row each accepted worker's update is summed into.
    weights: list[int] | None = None
    rows_of: dict[str, int] | None = None

    @property
    def tau(self) -> float | None:
        return self.params.get("tau")

    def row_index(self) -> dict[str, int]:
        """Accepted worker -> its row of ``stacked``."""
        if self.rows_of is not None:
            return self.rows_of
        return {w: i for i, w in enumerate(self.accepted)}


def filter_round(
    run: RunContext,
    round_index: int,
    base_model_hash: str,
    base_flat: torch.Tensor,
    candidates: list[Candidate],
    registered: set[str],
    banned: set[str],
    beacon_seed: bytes,
    *,
    reveals: Mapping[str, bytes | None] | None = None,
    device: str = "cpu",
) -> FilteredRound:
    """Admit, decode, spot-check, norm- and probe-filter one closed round's submissions.

    ``reveals`` maps each worker to the reveal file it sent for the round's checks
    (:func:`round_challenges` and the binding; protocol/reveal.py).
    """
    spec = run.spec
    reveals = reveals or {}
    verdicts: dict[str, dict[str, Any]] = {}
    decoded: dict[str, torch.Tensor] = {}

    def reject(c: Candidate, reason: str, detail: str, **extra: Any) -> None:
        verdicts[c.worker] = {
            "worker": c.worker, "submission_digest": c.signed.digest, "status": "rejected",
            "reason": reason, "detail": detail[:500], "spot_checked": False, "distance": None,
            "checks": [], **extra,
        }
    by_worker, repeated = group_by_worker(candidates)
    for worker, c in by_worker.items():
        if worker in repeated:
            reject(c, "duplicate", "the sealed list holds more than one submission from this worker")
            continue
        try:
            decoded[worker] = admit(c, run, round_index, base_model_hash, registered, banned)
        except RejectedInput as exc:
            reject(c, exc.reason, str(exc))

    challenges = round_challenges(run, candidates, beacon_seed)
    distances: dict[str, float] = {}
    checks: dict[str, list[dict[str, Any]]] = {}
    for worker in sorted(decoded):
        sub = by_worker[worker].signed.message
        results = check_reveal(run, base_flat, sub, by_worker[worker].payload,
                               challenges.get(worker, []), reveals.get(worker), beacon_seed,
                               device=device)
        checks[worker] = [x.to_json() for x in results]
        finite = [x.distance for x in results if x.distance is not None]
        if finite:
            distances[worker] = min(max(finite), 1e300)
        failed = [x for x in results if not x.ok]
        if failed:
            reject(by_worker[worker], failure_reason(results),
                   f"{failure_where(failed[0])}: {failed[0].note}",
                   spot_checked=True, checks=checks[worker])
            del decoded[worker]

    norms = {w: float(torch.linalg.vector_norm(u.double())) for w, u in decoded.items()}
    for worker, detail in norm_outliers(norms, spec.verification["norm_factor"]).items():
        reject(by_worker[worker], "norm_outlier", detail,
               spot_checked=bool(checks.get(worker)), checks=checks.get(worker, []))
        del decoded[worker]

    probe_examples, probe_factor = spec.probe
    if probe_examples > 0 and probe_factor > 0:
        rows = probe_rows(run, beacon_seed, round_index, probe_examples)
        gains = probe_gains(run, base_flat, decoded, rows, device=device)
        for worker, detail in loss_regressions(gains, probe_factor).items():
            reject(by_worker[worker], "loss_regression", detail,
                   spot_checked=bool(checks.get(worker)), checks=checks.get(worker, []))
            del decoded[worker]

    accepted = sorted(decoded)
    stacked = torch.stack([decoded[w] for w in accepted]) if accepted else None
    params = (resolve_aggregator_params(spec.aggregator["params"], stacked)
              if stacked is not None else dict(spec.aggregator["params"]))
    return FilteredRound(round_index, verdicts, by_worker, checks, distances, accepted,
                         stacked, params)


def aggregate_locally(run: RunContext, filtered: FilteredRound, beacon_seed: bytes
                      ) -> torch.Tensor | None:
    """The run's aggregator over the accepted rows, computed by this validator alone."""
    if filtered.stacked is None:
        return None
    agg = build_aggregator(
        run.spec.aggregator["name"], filtered.params,
        seed=derive_seed(beacon_seed, "aggregate", filtered.round_index),
    )
    if filtered.weights is not None:
        weights = torch.tensor(filtered.weights, dtype=torch.float64)
        return agg(filtered.stacked, weights=weights).to(torch.float32)
    return agg(filtered.stacked).to(torch.float32)


def finish_round(
    run: RunContext,
    filtered: FilteredRound,
    aggregate: torch.Tensor | None,
    base_flat: torch.Tensor,
    outer: OuterState,
    *,
    device: str = "cpu",
) -> RoundOutcome:
    """From the round's aggregate to the next model, eval loss, verdicts and scores.

    ``aggregate`` is None when no update was accepted (the outer step then
    applies momentum alone).
    """
    spec = run.spec
    verdicts = dict(filtered.verdicts)
    by_worker, checks = filtered.by_worker, filtered.checks
    accepted = filtered.accepted
    if aggregate is not None and filtered.stacked is not None:
        per_row = clip_quality(filtered.stacked, aggregate, filtered.tau)
        quality = {w: per_row[i] for w, i in filtered.row_index().items()}
    else:
        aggregate = torch.zeros_like(base_flat)
        quality = {}
    update_payload, sent, residual = encode_update(
        run.codec, aggregate, outer.residual, seed=run.update_seed(filtered.round_index))
    new_flat, new_momentum = outer_step(
        base_flat, outer.momentum, sent, lr=spec.outer["lr"], mu=spec.outer["momentum"],
        nesterov=spec.outer["nesterov"],
    )
    eval_loss = run.evaluate(new_flat, device=device)

    for worker in accepted:
        c = by_worker[worker]
        verdicts[worker] = {
            "worker": worker, "submission_digest": c.signed.digest, "status": "accepted",
            "reason": "", "detail": "", "spot_checked": bool(checks.get(worker)),
            "distance": None, "checks": checks.get(worker, []),
        }
    kept = set(accepted)
    samples = {w: (by_worker[w].signed.message.samples if w in kept else 0) for w in verdicts}
    scores = compute_scores(samples, quality)
    rewards = split_rewards(scores, spec.rewards["per_round"])
    score_rows = [
        {"worker": w, "samples": samples[w], "quality": round(min(1.0, quality.get(w, 0.0)), 9),
         "score": scores[w], "reward": rewards[w]}
        for w in sorted(verdicts)
    ]
    return RoundOutcome(
        verdicts=[verdicts[w] for w in sorted(verdicts)],
        scores=score_rows,
        new_flat=new_flat,
        new_outer=OuterState(new_momentum, residual),
        update_payload=update_payload,
        eval_loss=eval_loss,
        aggregate=aggregate,
        spot_checked=sorted(checks),
    )


def process_round(
    run: RunContext,
    round_index: int,
    base_model_hash: str,
    base_flat: torch.Tensor,
    outer: OuterState,
    candidates: list[Candidate],
    registered: set[str],
    banned: set[str],
    beacon_seed: bytes,
    *,
    reveals: Mapping[str, bytes | None] | None = None,
    device: str = "cpu",
) -> RoundOutcome:
    """Verdicts, scores and the next model for one closed round, aggregated locally.

    ``filter_round``, then ``aggregate_locally``, then ``finish_round``; a sharded
    run replaces the middle step with the validators' exchange
    (validators/sharded.py).
    """
    filtered = filter_round(run, round_index, base_model_hash, base_flat, candidates,
                            registered, banned, beacon_seed, reveals=reveals, device=device)
    aggregate = aggregate_locally(run, filtered, beacon_seed)
    return finish_round(run, filtered, aggregate, base_flat, outer, device=device)
