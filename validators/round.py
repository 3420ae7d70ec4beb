"""Processing one closed round: the validator's sans-IO core.

    admit -> decode -> spot checks -> norm filter -> probe filter -> robust aggregate
          -> compress the aggregate (error feedback) -> outer Nesterov step on what
          was sent -> eval loss -> verdicts and scores

The norm and probe filters are suspicion, not proof: an update they flag is
``excluded`` (kept out of the aggregate, its worker paid by its clip quality at
the aggregate), never ``rejected`` (protocol/rules.py ``FILTER_REASONS``).

Everything here is a function of its inputs (the run, the base model and
momentum, the sealed submissions and the beacon seed), so two honest
validators reach the same verdicts and the same model bytes, on whatever device
each recomputes its spot checks (``CERTIFIED_DEVICE``), and the node that feeds
it over HTTP stays thin.

Memory does not grow with the number of updates N: payloads and reveals may
be read one at a time from files (``BlobFiles``), each decoded update is
written to a row file of the round's scratch directory as soon as it is
decoded (only its norm stays), the probe reads one row back at a time, and
CenteredClip from the geometric median (the run default), Krum and the geometric
median stream over the accepted rows by column chunks: one Gram pass, then one
combination (``aggregation.aggregate_rows``).  Other rules, sharded and masked
rounds aggregate an in-memory stack of the rows.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from veritrain.aggregation import (
    RowFile,
    RowList,
    Rows,
    RowsAggregate,
    RowStore,
    TensorRows,
    aggregate_rows,
    clip_radius,
    resolve_radius,
    row_distances,
)
from veritrain.protocol.beacon import derive_seed
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.memory import release_free_memory
from veritrain.protocol.outer import OuterState, encode_update, outer_step
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.scoring import compute_scores, split_rewards
from veritrain.protocol.training import torch_threads

from .checks import Candidate, admit, group_by_worker, norm_outliers
from .probe import loss_regressions, probe_gains, probe_rows
from .spot_checks import RevealToCheck, check_reveals, failure_reason, failure_where

#: Where the floats that decide or are certified (the probe's gains, the eval loss) are
#: computed, whatever device the validator recomputes spot checks on: a CUDA forward pass
#: gives other last bits than a CPU one, and validators on either must sign one state.
#: Spot checks may run anywhere: they certify outcomes against a tolerance, not floats.
CERTIFIED_DEVICE = "cpu"


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


def clip_quality(updates: torch.Tensor | Rows, aggregate: torch.Tensor, tau: float | None
                 ) -> list[float]:
    """Share of each update that survives clipping at the aggregate: min(1, tau / ||x_i - v||)
    (distances chunk by chunk: no N x D temporary)."""
    rows = TensorRows(updates) if isinstance(updates, torch.Tensor) else updates
    if tau is None:
        return [1.0] * rows.n_rows
    dist = row_distances(rows, aggregate.to(rows.dtype))
    return [1.0 if d <= tau else float(tau / d) for d in dist.tolist()]


def round_challenges(run: RunContext, candidates: list[Candidate], beacon_seed: bytes
                     ) -> dict[str, list[int]]:
    """The segments each worker in the sealed list must reveal (same rule as the ledger)."""
    policy = ChallengePolicy.of_run(run.spec)
    return compute_challenges(beacon_seed, sorted({c.worker for c in candidates}), policy)


def resolve_aggregator_params(params: Mapping[str, Any], updates: torch.Tensor | Rows
                              ) -> dict[str, Any]:
    """Turn a scale-free ``tau_rel`` into this round's clipping radius.

    tau = tau_rel * lower_median_i ||x_i - GM(x)||, with GM the weighted geometric
    median (CenteredClip's start, from the rows' Gram matrix): the radius follows the
    size of the honest updates, which changes from round to round, and a Byzantine
    minority cannot inflate it.  ``aggregation.clip_radius``: the very radius
    the streamed CenteredClip resolves.
    """
    rows = TensorRows(updates) if isinstance(updates, torch.Tensor) else updates
    return resolve_radius(params, rows)


def update_norm(update: torch.Tensor, chunk: int = 1 << 20) -> float:
    """||u|| with float64 squares summed chunk by chunk: no float64 copy of the update."""
    total = 0.0
    for part in update.detach().reshape(-1).split(chunk):
        total += float(part.double().square_().sum())
    return total ** 0.5


class BlobFiles(Mapping[str, bytes]):
    """Blobs kept in files of a directory and read back one at a time: key -> bytes.

    A validator's payloads and reveals each take about as much memory as an
    update; kept here, only the one being checked is in memory.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._paths: dict[str, Path] = {}

    def put(self, key: str, data: bytes) -> None:
        path = self.directory / f"{len(self._paths)}.blob"
        path.write_bytes(data)
        self._paths[key] = path

    def __getitem__(self, key: str) -> bytes:
        return self._paths[key].read_bytes()

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


class ScratchDir:
    """A temporary directory removed by ``close()``, or when garbage-collected."""

    def __init__(self, prefix: str = "veritrain-rows-") -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self._remove = weakref.finalize(self, shutil.rmtree, self.path, True)

    def close(self) -> None:
        self._remove()


class StoredRows(Mapping[str, torch.Tensor]):
    """Worker -> its decoded update, read back from a ``RowStore`` when asked for (the
    probe filter looks at one update at a time)."""

    def __init__(self, store: RowStore, index: Mapping[str, int]) -> None:
        self.store = store
        self.index = dict(index)

    def __getitem__(self, worker: str) -> torch.Tensor:
        return self.store.row(self.index[worker])

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


@dataclass
class FilteredRound:
    """A round after every per-update check: who is rejected or excluded, and the rows to
    aggregate.

    ``accepted`` is sorted by worker; their decoded updates, in that order, are
    ``rows`` (read by column chunks, e.g. from the round's row file) or, for
    sharded and masked rounds, the in-memory ``stacked``.  ``params`` are the
    aggregator's parameters; ``tau_rel`` is resolved to this round's ``tau``
    where ``stacked`` is set, and by the aggregation itself for ``rows``
    (``aggregate_locally``).  ``close()`` removes the files behind ``rows``
    when the round owns them.
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
    rows: Rows | None = None
    scratch: ScratchDir | None = None
    #: Workers a statistical filter kept out of the aggregate (verdict ``excluded``), sorted,
    #: and their decoded updates in that order: they are paid by their clip quality at the
    #: round's aggregate, as if aggregated (specs/scoring.md, "Excluded updates").
    excluded: list[str] = field(default_factory=list)
    excluded_rows: Rows | None = None
    #: Excluded workers with no row of their own (a masked bucket dropped for another
    #: member's fault): the quality each is paid at.
    excluded_quality: dict[str, float] = field(default_factory=dict)

    @property
    def tau(self) -> float | None:
        return self.params.get("tau")

    def source(self) -> Rows | None:
        """The accepted rows (None when nothing was accepted)."""
        if self.rows is not None:
            return self.rows
        return None if self.stacked is None else TensorRows(self.stacked)

    def close(self) -> None:
        """Remove the scratch files this round owns (none when given a directory)."""
        if self.scratch is not None:
            self.scratch.close()

    def row_index(self) -> dict[str, int]:
        """Accepted worker -> its row of ``source()``."""
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
    payloads: Mapping[str, bytes] | None = None,
    device: str = "cpu",
    scratch: str | Path | None = None,
    rows_in_memory: bool = False,
) -> FilteredRound:
    """Admit, decode, spot-check, norm- and probe-filter one closed round's submissions.

    ``reveals`` maps each worker to the reveal file it sent for the round's checks
    (:func:`round_challenges` and the binding; protocol/reveal.py). ``payloads``, when
    given, maps submission digests to payload bytes in place of ``Candidate.payload``
    (a lazy mapping such as ``BlobFiles`` keeps one in memory at a time). Each decoded
    update goes to a row file in ``scratch`` (default: a temporary directory the
    returned round owns until ``close()``), or stays in memory with
    ``rows_in_memory``; either way the same rows reach the aggregator.
    """
    spec = run.spec
    reveals = reveals or {}
    verdicts: dict[str, dict[str, Any]] = {}
    owned: ScratchDir | None = None
    store: RowStore
    if rows_in_memory:
        store = RowList(run.numel)
    else:
        if scratch is None:
            owned = ScratchDir()
            scratch = owned.path
        fd, name = tempfile.mkstemp(prefix=f"round-{round_index}-", suffix=".rows", dir=scratch)
        os.close(fd)
        store = RowFile(Path(name), run.numel)
    index: dict[str, int] = {}  # worker -> its row in the store
    norms: dict[str, float] = {}

    def payload_of(c: Candidate) -> bytes | None:
        return c.payload if payloads is None else payloads.get(c.signed.digest)

    def reject(c: Candidate, reason: str, detail: str, **extra: Any) -> None:
        verdicts[c.worker] = {
            "worker": c.worker, "submission_digest": c.signed.digest, "status": "rejected",
            "reason": reason, "detail": detail[:500], "spot_checked": False, "distance": None,
            "checks": [], **extra,
        }
        index.pop(c.worker, None)

    excluded_index: dict[str, int] = {}  # worker -> its row, kept for its clip quality

    def exclude(c: Candidate, reason: str, detail: str) -> None:
        """A statistical filter's suspicion (``FILTER_REASONS``): out of the aggregate, not
        rejected; the checks it passed stay in its verdict."""
        verdicts[c.worker] = {
            "worker": c.worker, "submission_digest": c.signed.digest, "status": "excluded",
            "reason": reason, "detail": detail[:500], "spot_checked": bool(checks.get(c.worker)),
            "distance": None, "checks": checks.get(c.worker, []),
        }
        excluded_index[c.worker] = index.pop(c.worker)
    by_worker, repeated = group_by_worker(candidates)
    for worker, c in by_worker.items():
        if worker in repeated:
            reject(c, "duplicate", "the sealed list holds more than one submission from this worker")
            continue
        try:
            update = admit(Candidate(c.signed, payload_of(c)), run, round_index,
                           base_model_hash, registered, banned)
        except RejectedInput as exc:
            reject(c, exc.reason, str(exc))
            continue
        norms[worker] = update_norm(update)
        index[worker] = store.append(update.to(torch.float32))
        del update
        release_free_memory()  # the codec's temporaries, before the next payload

    challenges = round_challenges(run, candidates, beacon_seed)
    distances: dict[str, float] = {}
    checks: dict[str, list[dict[str, Any]]] = {}
    to_check = [RevealToCheck(by_worker[w].signed.message, challenges.get(w, []),
                              functools.partial(reveals.get, w),
                              functools.partial(payload_of, by_worker[w]))
                for w in sorted(index)]
    checked = check_reveals(run, base_flat, to_check, beacon_seed, device=device)
    release_free_memory()  # the recomputation's gradients and activations, the codec's work
    for worker, results in checked.items():
        c = by_worker[worker]
        checks[worker] = [x.to_json() for x in results]
        finite = [x.distance for x in results if x.distance is not None]
        if finite:
            distances[worker] = min(max(finite), 1e300)
        failed = [x for x in results if not x.ok]
        if failed:
            reject(c, failure_reason(results),
                   f"{failure_where(failed[0])}: {failed[0].note}",
                   spot_checked=True, checks=checks[worker])

    kept_norms = {w: norms[w] for w in index}
    for worker, detail in norm_outliers(kept_norms, spec.verification["norm_factor"]).items():
        exclude(by_worker[worker], "norm_outlier", detail)

    probe_examples, probe_factor = spec.probe
    if probe_examples > 0 and probe_factor > 0:
        rows = probe_rows(run, beacon_seed, round_index, probe_examples)
        # On the CPU whatever ``device`` is: the gains decide exclusions, and a CUDA
        # forward pass gives other last bits than a CPU one (CERTIFIED_DEVICE).
        gains = probe_gains(run, base_flat, StoredRows(store, index), rows,
                            device=CERTIFIED_DEVICE)
        for worker, detail in loss_regressions(gains, probe_factor).items():
            exclude(by_worker[worker], "loss_regression", detail)

    accepted = sorted(index)
    source = store.rows([index[w] for w in accepted]) if accepted else None
    excluded = sorted(excluded_index)
    excluded_rows = (store.rows([excluded_index[w] for w in excluded]) if excluded
                     else None)
    params = dict(spec.aggregator["params"])
    stacked = None
    if spec.shards and source is not None:  # shards are cut from the in-memory stack
        stacked = source.read(0, source.numel)
        params = resolve_aggregator_params(params, stacked)
    return FilteredRound(round_index, verdicts, by_worker, checks, distances, accepted,
                         stacked, params, rows=source, scratch=owned, excluded=excluded,
                         excluded_rows=excluded_rows)


def aggregate_locally(run: RunContext, filtered: FilteredRound, beacon_seed: bytes
                      ) -> RowsAggregate | None:
    """The run's aggregator over the accepted rows, computed by this validator alone.

    ``aggregation.aggregate_rows``: CenteredClip from the geometric median streams over
    the rows (resolving ``tau_rel`` on the way) and returns its radius and clip factors.
    """
    source = filtered.source()
    if source is None:
        return None
    weights = (None if filtered.weights is None
               else torch.tensor(filtered.weights, dtype=torch.float64))
    out = aggregate_rows(run.spec.aggregator["name"], filtered.params, source, weights,
                         seed=derive_seed(beacon_seed, "aggregate", filtered.round_index))
    return replace(out, aggregate=out.aggregate.to(torch.float32))


@dataclass
class OuterStepped:
    """A round's aggregate applied: the broadcast payload, the new model and outer state,
    and each accepted worker's clip quality (``step_round``)."""

    aggregate: torch.Tensor
    update_payload: bytes
    new_flat: torch.Tensor
    new_outer: OuterState
    quality: dict[str, float]


def step_round(
    run: RunContext,
    filtered: FilteredRound,
    aggregate: torch.Tensor | RowsAggregate | None,
    base_flat: torch.Tensor,
    outer: OuterState,
) -> OuterStepped:
    """Compress the round's aggregate (error feedback) and take the outer step on what was
    sent; the clip qualities min(1, tau / ||x_i - v||) come with an aggregate from
    ``aggregate_locally``, otherwise (a sharded aggregate) from the rows. An excluded
    update's quality is the same formula at the same ``tau`` and ``v``, from its row.

    ``aggregate`` is None when no update was accepted (the outer step then applies
    momentum alone). Nothing returned refers to ``base_flat`` or ``outer``; an ``outer``
    the caller does not keep (passed as a temporary) loses its residual before the outer
    step allocates the new model.
    """
    spec = run.spec
    source = filtered.source()
    vector = aggregate.aggregate if isinstance(aggregate, RowsAggregate) else aggregate
    if vector is not None and source is not None:
        if isinstance(aggregate, RowsAggregate) and aggregate.clip_factors is not None:
            per_row = [float(f) for f in aggregate.clip_factors.tolist()]
            tau = aggregate.tau
        else:
            tau = aggregate.tau if isinstance(aggregate, RowsAggregate) else filtered.tau
            if tau is None and "tau_rel" in filtered.params:
                tau = clip_radius(source, filtered.params["tau_rel"])
            per_row = clip_quality(source, vector, tau)
        quality = {w: per_row[i] for w, i in filtered.row_index().items()}
        if filtered.excluded_rows is not None:  # paid as if aggregated (scoring.md)
            quality.update(zip(filtered.excluded,
                               clip_quality(filtered.excluded_rows, vector, tau), strict=True))
    else:
        vector = torch.zeros_like(base_flat)
        quality = {}
    quality.update(filtered.excluded_quality)
    momentum = outer.momentum
    update_payload, sent, residual = encode_update(
        run.codec, vector, outer.residual, seed=run.update_seed(filtered.round_index))
    del outer  # the old residual is done with: freed now if the caller kept no reference
    new_flat, new_momentum = outer_step(
        base_flat, momentum, sent, lr=spec.outer["lr"], mu=spec.outer["momentum"],
        nesterov=spec.outer["nesterov"],
    )
    return OuterStepped(vector, update_payload, new_flat, OuterState(new_momentum, residual),
                        quality)


def conclude_round(run: RunContext, filtered: FilteredRound, stepped: OuterStepped
                   ) -> RoundOutcome:
    """The new model's eval loss (on ``CERTIFIED_DEVICE``: it is certified), the verdicts
    and the scores."""
    spec = run.spec
    verdicts = dict(filtered.verdicts)
    by_worker, checks = filtered.by_worker, filtered.checks
    accepted = filtered.accepted
    quality = stepped.quality
    # The run's thread count too: the loss is certified, and a CPU reduction may round
    # differently with another number of threads.
    with torch_threads(int(spec.verification.get("recompute_threads", 1))):
        eval_loss = run.evaluate(stepped.new_flat, device=CERTIFIED_DEVICE)

    for worker in accepted:
        c = by_worker[worker]
        verdicts[worker] = {
            "worker": worker, "submission_digest": c.signed.digest, "status": "accepted",
            "reason": "", "detail": "", "spot_checked": bool(checks.get(worker)),
            "distance": None, "checks": checks.get(worker, []),
        }
    kept = set(accepted) | set(filtered.excluded)  # excluded: verified work, paid
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
        new_flat=stepped.new_flat,
        new_outer=stepped.new_outer,
        update_payload=stepped.update_payload,
        eval_loss=eval_loss,
        aggregate=stepped.aggregate,
        spot_checked=sorted(checks),
    )


def finish_round(
    run: RunContext,
    filtered: FilteredRound,
    aggregate: torch.Tensor | RowsAggregate | None,
    base_flat: torch.Tensor,
    outer: OuterState,
) -> RoundOutcome:
    """From the round's aggregate to the next model, eval loss, verdicts and scores:
    ``step_round`` then ``conclude_round`` (the node runs the two apart, dropping the
    base model and outer state in between)."""
    stepped = step_round(run, filtered, aggregate, base_flat, outer)
    return conclude_round(run, filtered, stepped)


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
    scratch: str | Path | None = None,
    rows_in_memory: bool = False,
) -> RoundOutcome:
    """Verdicts, scores and the next model for one closed round, aggregated locally.

    ``filter_round``, then ``aggregate_locally``, then ``finish_round``; a sharded
    run replaces the middle step with the validators' exchange
    (validators/sharded.py). The round's row file is removed before returning.
    """
    filtered = filter_round(run, round_index, base_model_hash, base_flat, candidates,
                            registered, banned, beacon_seed, reveals=reveals, device=device,
                            scratch=scratch, rows_in_memory=rows_in_memory)
    try:
        aggregate = aggregate_locally(run, filtered, beacon_seed)
        return finish_round(run, filtered, aggregate, base_flat, outer)
    finally:
        filtered.close()
