"""Robustness benchmark: final eval loss under Byzantine attacks, per aggregator.

Every cell is a full training run of the in-process swarm
(:class:`veritrain.swarm.Swarm`), i.e. the nodes' own code path: workers call
``prepare_submission`` (train, encode, sign) and the validator ``process_round``
(admit, decode, filter, ``build_aggregator(spec.aggregator)``, outer step,
evaluate).  16 workers, f of them Byzantine (the last f), under every attack of
the swarm:

* worker-side: ``sign_flip`` (sends -delta), ``label_flip`` (trains on y -> C-1-y),
  ``free_rider`` (noise of a plausible norm, no training);
* omniscient (see the round's honest updates, do not train): ``alie``, ``ipm``,
  ``gaussian``, ``zeros`` (a free rider sending nothing), ``mimic``, ``mimic_jitter``
  (mimic plus noise of ``MIMIC_JITTER`` = 0.3 of the honest spread per copy: the least
  that escapes the copy rule),
  ``optimal_alie``, ``optimal_ipm`` and ``optimal_sign`` (line-searched against the
  run's aggregator, and, where the probe filter is on, against that filter evaluated on
  a probe batch of the attacker's own: the largest scale that still passes; together the
  AGR-tailored attacks of Shejwalkar and Houmansadr in the std, unit and sign
  directions);
* the aggregator-agnostic optimization attacks of Shejwalkar and Houmansadr (NDSS
  2021): ``min_max_<p>`` and ``min_sum_<p>`` send mu - gamma p with the largest gamma
  whose row is no farther from the honest rows (max distance, resp. sum of squared
  distances) than the honest rows are from each other, for the perturbation
  directions p = ``unit`` (mu / ||mu||), ``sign`` (sign(mu)) and ``std`` (sigma);

against mean, CenteredClip (tau_rel 1, 10 iterations), CenteredClip with
bucketing (bucket size 2), Krum, trimmed mean, coordinate-wise median, geometric
median, and ``cc_probe``: the run default, the validator's probe filter
(``validators/probe.py``: updates whose implied model gains far less probe loss
than the round's median are rejected) followed by CenteredClip, at f = 3 and
f = 7.  Krum and trimmed mean get
``f`` as their parameter; Krum needs n > 2f + 2, so at f = 7 of 16 it runs with
f = 6, the largest it accepts.

Every other row isolates the aggregator: spot checks are off (``challenges_per_worker`` 0,
``binding_chunks`` 0 so no payload binding check, no
forced last segment, no full checks) and the validator's norm filter is off,
since otherwise the validator would simply reject or ban most attackers; the
codec is ``fp32`` so compression does not confound.  The spec caps
``norm_factor`` at 1e6 and the filter's lower bound (norm < median / factor)
rejects an all-zero update at any factor, so besides setting 1e6 each worker
process replaces ``validators.round.norm_outliers`` by a filter that flags no
one (otherwise ``zeros``, and ``optimal_ipm`` when its line search lands on 0,
would be rejected rather than aggregated). The probe filter is off in every row
but ``cc_probe``; the last line reports ``cc_probe``, the pipeline a run uses.

The reported number is the relative final eval loss ``final / clean - 1``, with
``clean`` the run of 16 honest workers under the plain mean on the same swarm seed.
Each aggregator's own clean run is reported beside it ("clean" column: the cost of
robustness, as opposed to the damage done by the attack).

Seeds (issue 24): every cell runs on ``--seeds`` swarm seeds (default 3: ``robustness``,
``robustness-1``, ``robustness-2``; the seed sets the worker and validator keys, hence
the data each worker trains on, the genesis, and the beacon's probe batches). The
tables give the worst and the median over the seeds; the last line the worst.

Filter accounting, counted in every round of every cell from the validator's
verdicts: the attackers' share of the rows that reached the aggregator (verdict
``accepted``) minus their share of the submissions (``max_attacker_share_gain``: the
largest over rounds and seeds, per cell and overall; > 0 means a filter helped the
attackers), and the honest submissions whose verdict was ``rejected`` (the worker
loses the round's pay: ``honest_lost_pay``) or ``excluded`` (a statistical filter kept
the row out of the aggregate, the worker is paid: ``honest_excluded``).

Sharing between cells (each is still a full, independent run): every worker
process uses one deterministic validator identity, so the validator's BLS beacon
share for round r (a pure function of key, run id and r) is signed once per
process, and one run bundle per aggregator setting; the honest round-0
submissions, identical in every cell (same genesis, data and worker keys), are
computed once per process.  Cells run in ``--jobs`` processes with one torch
thread each, longest first.

Outputs: the table on stdout and in ``bench-out/robustness.md`` (+ ``.json``),
a heatmap ``bench-out/robustness.png`` (``robustness-quick.*`` for ``--quick``),
and the last line::

    robustness: seeds=<k> worst_f7=<+x.x%> worst_f3=<+x.x%> honest_lost_pay=<k>/<n> honest_excluded=<k>/<n> max_attacker_share_gain=<x>

(worst_f*: the run default, ``cc_probe``, worst over attacks and seeds; CenteredClip
alone where ``cc_probe`` was not run.)

Measured (issue 24; ``--f 3,7 --aggregators cc_probe --jobs 1``, 3 seeds, 114 runs, 16.4
min on the shared 2-core machine with other jobs beside it)::

    robustness: seeds=3 worst_f7=+4.2% worst_f3=+1.0% honest_lost_pay=0/12840 honest_excluded=7/12840 max_attacker_share_gain=+0.000

Every target of issue 24 holds. The worst cell at f = 7 is ``mimic_jitter`` (+4.2%;
median over seeds +3.3%): seven copies of one honest update, each with its own noise of
``swarm.MIMIC_JITTER`` = 1.2 x ``COPY_RADIUS`` = 0.3 of the honest spread, the least
that escapes the copy rule (a scan found the damage largest just past the radius:
specs/aggregation.md, section 7), which no aggregator can tell from honest work at f
close to n / 2 (the heterogeneity lower bound; verification catches the copiers). With
the earlier copy radius of 1%, noise of 3% escaped and reached +7.0%. Every other attack
stays within +3.3% at f = 7 (sign flip); exact ``mimic`` went from +5.9% to +0.8% once
CenteredClip counts copies once (aggregation/copies.py), and the probe filter, which acts
only on a group (more than an eighth of the rows below its floor), excluded 7 honest rows
of 12,840 (was 43 of 11,520) and never raised the attackers' share of the aggregated rows.
The ``cc_probe`` cells do not depend on the other rows, so this last line is the full
grid's; the full grid (870 runs) is about 7.8 times this compute: about 60 min on 2
idle cores, 2 to 3 h on shared ones (specs/aggregation.md, section 7).

Run: ``.venv/bin/python bench/robustness.py [--quick] [--jobs 2] [--rounds R] [--seeds K]
[--f 3,7] [--aggregators cc_probe,...] [--attacks ...]``.
The model is sized for a 2-core machine: the ``tiny`` charlm preset (~35k
parameters), H = 10 inner steps of batch 8; ``--task-preset bench`` gives the
~1M-parameter scale where more time is available.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Every attack of the swarm, in table order.
#: The Shejwalkar-Houmansadr (NDSS 2021) aggregator-agnostic attacks, by direction.
SHEJWALKAR: tuple[str, ...] = tuple(f"{kind}_{direction}" for kind in ("min_max", "min_sum")
                                    for direction in ("unit", "sign", "std"))
ATTACKS: tuple[str, ...] = ("sign_flip", "label_flip", "free_rider", "zeros", "gaussian",
                            "mimic", "mimic_jitter", "ipm", "alie", "optimal_ipm",
                            "optimal_alie", "optimal_sign", *SHEJWALKAR)
#: Attacks whose Byzantine workers do not train (cheaper cells).
NON_TRAINING: frozenset[str] = frozenset({"free_rider", "zeros", "gaussian", "mimic",
                                          "mimic_jitter", "ipm",
                                          "alie", "optimal_ipm", "optimal_alie",
                                          "optimal_sign", *SHEJWALKAR})
#: Table rows: label -> (registry name, params before f is filled in).
AGGREGATORS: dict[str, tuple[str, dict[str, Any]]] = {
    "mean": ("mean", {}),
    "centered_clip": ("centered_clip", {"tau_rel": 1.0, "iterations": 10}),
    "cc_bucketing": ("centered_clip", {"tau_rel": 1.0, "iterations": 10, "bucket_size": 2}),
    "krum": ("krum", {"f": None}),
    "trimmed_mean": ("trimmed_mean", {"f": None}),
    "median": ("median", {}),
    "geometric_median": ("geometric_median", {}),
    "cc_probe": ("centered_clip", {"tau_rel": 1.0, "iterations": 10}),
}
#: Rows that keep the validator's probe filter on (validators/probe.py): the run default.
PROBED: frozenset[str] = frozenset({"cc_probe"})
DEFAULT_AGGREGATOR = "cc_probe"
QUICK_ATTACKS: tuple[str, ...] = ("sign_flip", "label_flip", "zeros", "ipm", "optimal_ipm")
QUICK_AGGREGATORS: tuple[str, ...] = ("mean", "centered_clip", "cc_probe")
SEED = "robustness"
#: Swarm seeds per cell by default (``--seeds``): seed 0 is :data:`SEED`, seed k > 0
#: ``f"{SEED}-{k}"`` (worker keys, data, genesis and the validator's beacon all change).
DEFAULT_SEEDS = 3


def swarm_seed(seed: int) -> str:
    """The swarm seed string of seed index ``seed`` (0: the bench's historical seed)."""
    return SEED if seed == 0 else f"{SEED}-{seed}"


def seed_key(key: str, seed: int) -> str:
    """A cell key on seed ``seed``: unchanged for seed 0 (older results stay valid)."""
    return key if seed == 0 else f"{key}/s{seed}"


# --- the grid ---------------------------------------------------------------------------


def aggregator_spec(label: str, f: int, n: int) -> dict[str, Any]:
    """The run spec's ``aggregator`` entry for a table row at f Byzantine of n."""
    name, params = AGGREGATORS[label]
    params = dict(params)
    if "f" in params:
        # Krum needs n > 2f + 2, trimmed mean n > 2f: the largest admissible f.
        limit = (n - 3) // 2 if name == "krum" else (n - 1) // 2
        params["f"] = min(f, limit)
    return {"name": name, "params": params}


@dataclass(frozen=True)
class Cell:
    """One training run: an aggregator row under ``attack`` (None: clean) by f workers.

    A clean run has f = 0 unless its aggregator's setting depends on f.
    """

    aggregator: str
    attack: str | None
    f: int
    spec: tuple[tuple[str, Any], ...]  # the aggregator entry, as hashable items
    seed: int = 0  # index of the swarm seed (:func:`swarm_seed`)

    @property
    def key(self) -> str:
        return seed_key(f"{self.aggregator}/{self.attack or 'clean'}/f{self.f}", self.seed)

    def spec_dict(self) -> dict[str, Any]:
        return {"name": dict(self.spec)["name"], "params": json.loads(dict(self.spec)["params"])}


def _frozen(spec: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return (("name", spec["name"]), ("params", json.dumps(spec["params"], sort_keys=True)))


def clean_key(label: str, f: int) -> str:
    return f"{label}/clean/f{f}"


def build_grid(aggregators: Sequence[str], attacks: Sequence[str], fs: Sequence[int],
               n: int, seeds: int = 1) -> tuple[list[Cell], dict[tuple[str, int], str]]:
    """The cells to run (each on ``seeds`` swarm seeds) and, per (aggregator, f), the key of
    its clean run on seed 0 (:func:`seed_key` gives it on another seed).

    A clean run is shared by every f where the aggregator's setting does not
    depend on f; the mean's clean run (the reference) is always included.
    """
    cells: list[Cell] = []
    clean_of: dict[tuple[str, int], str] = {}
    for seed in range(seeds):
        for label in [*aggregators, *([] if "mean" in aggregators else ["mean"])]:
            specs = {f: _frozen(aggregator_spec(label, f, n)) for f in [0, *fs]}
            per_f = len(set(specs.values())) > 1
            for f in fs if per_f else [0]:
                cells.append(Cell(label, None, f, specs[f], seed))
            if label not in aggregators:
                continue
            for f in fs:
                clean_of[(label, f)] = clean_key(label, f if per_f else 0)
                cells.extend(Cell(label, attack, f, specs[f], seed) for attack in attacks)
    return cells, clean_of


def estimated_cost(cell: Cell, n: int) -> float:
    """Relative cost of a cell: the workers that train, plus a fixed per-round overhead."""
    trainers = n - cell.f if cell.attack in NON_TRAINING else n
    extra = 2.0 if cell.attack and cell.attack.startswith("optimal") else 0.0
    return trainers + 3.0 + extra


def bench_settings(spec: Mapping[str, Any], *, task_preset: str, steps: int, batch: int,
                   rounds: int, probe: bool = False) -> dict[str, Any]:
    """Run settings of one cell: the task preset, verification off (but for the probe
    filter when ``probe``), fp32, ``spec``."""
    from veritrain.protocol.presets import run_preset

    settings = run_preset(task_preset)
    settings["aggregator"] = copy.deepcopy(dict(spec))
    settings["codec"] = {"name": "fp32", "params": {}}
    settings["inner"]["steps"] = steps
    settings["inner"]["batch_size"] = batch
    # one segment per round; nothing is challenged anyway
    settings["inner"]["trail_every"] = steps
    settings["schedule"]["max_rounds"] = rounds
    settings["verification"].update(challenges_per_worker=0.0, always_last=False, binding_chunks=0,
                                    spot_checks_per_round=0, norm_factor=1e6)
    if not probe:
        settings["verification"]["probe_factor"] = 0.0
    return settings


# --- running a cell (in a worker process) -------------------------------------------------


def round_shares(verdicts: Iterable[Mapping[str, Any]], attackers: Iterable[str]
                 ) -> dict[str, int]:
    """One round's counts: submissions and rows that reached the aggregator (verdict
    ``accepted``), each in all and by attackers; honest verdicts ``rejected`` (the worker
    loses the round's pay) and ``excluded`` (kept out of the aggregate by a statistical
    filter, paid)."""
    bad = set(attackers)
    counts = dict.fromkeys(("submitted", "attacker_submitted", "aggregated",
                            "attacker_aggregated", "honest_rejected", "honest_excluded"), 0)
    for v in verdicts:
        attacker = v["worker"] in bad
        counts["submitted"] += 1
        counts["attacker_submitted"] += attacker
        if v["status"] == "accepted":
            counts["aggregated"] += 1
            counts["attacker_aggregated"] += attacker
        elif not attacker and v["status"] in ("rejected", "excluded"):
            counts[f"honest_{v['status']}"] += 1
    return counts


def share_gain(counts: Mapping[str, int]) -> float:
    """The attackers' share of the aggregated rows minus their share of the submissions
    (> 0: the filters helped them; NaN for a round without submissions)."""
    if not counts["submitted"]:
        return math.nan
    aggregated = (counts["attacker_aggregated"] / counts["aggregated"]
                  if counts["aggregated"] else 0.0)
    return aggregated - counts["attacker_submitted"] / counts["submitted"]


def max_share_gain(rounds: Iterable[Mapping[str, int]]) -> float:
    """Largest :func:`share_gain` over the rounds with attackers (NaN if none)."""
    gains = [share_gain(c) for c in rounds if c["attacker_submitted"]]
    gains = [g for g in gains if not math.isnan(g)]
    return max(gains) if gains else math.nan

_PROCESS: dict[str, Any] = {}


def _init_process(threads: int) -> None:
    """Per-process state: one torch thread, a fixed validator, the round-0 memo."""
    import hashlib

    import torch
    import veritrain.validators.round as round_mod
    from veritrain.protocol import bls
    from veritrain.protocol.identity import Identity

    import veritrain.swarm as swarm_mod

    torch.set_num_threads(threads)
    # The norm filter off (see the module docstring): the aggregator alone faces the attacks.
    round_mod.norm_outliers = lambda norms, factor: {}
    seed = hashlib.sha256(f"veritrain/bench/robustness/{SEED}/validator".encode()).digest()
    validator = Identity("validator", seed, bls.keygen(seed))
    signed: dict[bytes, bytes] = {}
    sign_bls = validator.sign_bls

    def memo_sign(message: bytes) -> bytes:  # BLS signatures are deterministic
        if message not in signed:
            signed[message] = sign_bls(message)
        return signed[message]

    validator.sign_bls = memo_sign  # type: ignore[method-assign]
    original = swarm_mod.prepare_submission
    memo: dict[tuple[Any, ...], Any] = {}

    def prepare(run: Any, identity: Any, r: int, base_flat: Any, base_hash: str,
                error_feedback: Any, **kw: Any) -> Any:
        # Only honest round-0 work is shared: the same inputs in every cell.
        shareable = (r == 0 and kw.get("attack") is None and kw.get("replace_delta") is None
                     and not isinstance(run.task, swarm_mod.LabelFlipTask))
        if not shareable:
            return original(run, identity, r, base_flat, base_hash, error_feedback, **kw)
        ef_bytes = error_feedback.to_bytes()
        key = (run.spec.seed, run.spec.dataset_hash, json.dumps(run.spec.inner, sort_keys=True),
               json.dumps(run.spec.codec, sort_keys=True), identity.public_key.hex(), base_hash,
               hashlib.sha256(ef_bytes).hexdigest())
        if key not in memo:
            memo[key] = original(run, identity, r, base_flat, base_hash, error_feedback, **kw)
        p = memo[key]
        ef = type(p.error_feedback).from_bytes(p.error_feedback.to_bytes(), run.numel)
        # evidence is only read to answer checks, and nothing is challenged here
        return dataclasses.replace(p, error_feedback=ef)

    swarm_mod.prepare_submission = prepare
    _PROCESS.update(validator=validator, bundles={})


def run_cell(job: Mapping[str, Any]) -> dict[str, Any]:
    """Train one cell; plain data in, plain data out."""
    from unittest import mock

    from veritrain.protocol.identity import Identity

    import veritrain.swarm as swarm_mod

    if not _PROCESS:
        _init_process(int(job.get("threads", 1)))
    started = time.monotonic()
    out: dict[str, Any] = {"key": job["key"], "aggregator": job["aggregator"],
                           "attack": job["attack"], "f": job["f"], "spec": job["spec"],
                           "seed": int(job.get("seed", 0))}
    try:
        settings = job["settings"]
        n, f, attack = int(job["n_workers"]), int(job["f"]), job["attack"]
        byzantine = {n - 1 - i: attack for i in range(f)} if attack else {}
        bundles = _PROCESS["bundles"]
        seed = swarm_seed(int(job.get("seed", 0)))
        bkey = json.dumps([seed, settings], sort_keys=True)
        validator = _PROCESS["validator"]
        with mock.patch.object(Identity, "generate", staticmethod(lambda role: validator)):
            swarm = swarm_mod.Swarm(settings, n_workers=n, byzantine=byzantine, seed=seed,
                                    bundle=bundles.get(bkey))
        bundles[bkey] = swarm.bundle
        attackers = {swarm.workers[i].public_key.hex() for i in byzantine}
        losses: list[float] = []
        shares: list[dict[str, int]] = []
        out["rounds"] = shares  # per-round counts (round_shares), kept if the run diverges

        excluded: list[dict[str, Any]] = []
        out["excluded"] = excluded  # every excluded row: round, attacker or not, the filter's words

        def on_round(r: int, o: Any) -> None:
            losses.append(float(o.eval_loss))
            shares.append(round_shares(o.verdicts, attackers))
            excluded.extend({"round": r, "attacker": v["worker"] in attackers,
                             "reason": v["reason"], "detail": v["detail"]}
                            for v in o.verdicts if v["status"] == "excluded")

        try:
            result = swarm.train(int(job["rounds"]), on_round=on_round)
            rejected, train_seconds, diverged = len(result.caught), result.seconds, None
        except Exception as exc:  # a model gone non-finite makes the next round fail
            if not (losses and not math.isfinite(losses[-1])) and "NonFinite" not in repr(exc):
                raise
            rejected, train_seconds = 0, math.nan
            diverged = f"diverged after round {len(losses) - 1}: {type(exc).__name__}"
        final = losses[-1] if losses and not diverged else math.inf
        out.update(eval_loss=losses, final=final if math.isfinite(final) else math.inf,
                   rejected=rejected, train_seconds=train_seconds, diverged=diverged, error=None)
    except Exception as exc:  # a cell that fails is reported, not fatal
        out.update(eval_loss=[], final=math.nan, rejected=0, error=f"{type(exc).__name__}: {exc}")
    out["max_attacker_share_gain"] = max_share_gain(out.get("rounds", []))
    out["seconds"] = time.monotonic() - started
    return out


def make_jobs(cells: Iterable[Cell], *, n: int, rounds: int, task_preset: str, steps: int, batch: int,
              threads: int) -> list[dict[str, Any]]:
    jobs = []
    for cell in cells:
        spec = cell.spec_dict()
        jobs.append({
            "key": cell.key, "aggregator": cell.aggregator,
            "attack": cell.attack, "f": cell.f, "spec": spec, "seed": cell.seed,
            "settings": bench_settings(spec, task_preset=task_preset, steps=steps,
                                       batch=batch, rounds=rounds,
                                       probe=cell.aggregator in PROBED),
            "n_workers": n, "rounds": rounds, "threads": threads,
            "cost": estimated_cost(cell, n) * rounds,
        })
    return jobs


def run_jobs(jobs: Sequence[Mapping[str, Any]], *, processes: int, done: dict[str, Any],
             checkpoint: Path | None = None, config: Mapping[str, Any] | None = None
             ) -> dict[str, dict[str, Any]]:
    """Run the jobs not in ``done``, longest first, printing progress; return all results."""
    results = dict(done)
    todo = sorted((j for j in jobs if j["key"] not in results), key=lambda j: -j["cost"])
    total_cost = sum(j["cost"] for j in todo) or 1.0
    started, cost_done = time.monotonic(), 0.0
    print(f"running {len(todo)} cells ({len(results)} already done) in {processes} processes",
          flush=True)

    def report(res: dict[str, Any], cost: float) -> None:
        nonlocal cost_done
        results[res["key"]] = res
        cost_done += cost
        elapsed = time.monotonic() - started
        eta = elapsed * (total_cost - cost_done) / cost_done
        status = res["error"] or res.get("diverged") or f"final {res['final']:.4f}"
        print(f"  [{len(results)}/{len(jobs)}] {res['key']:<40} {status}  "
              f"({res['seconds']:.0f} s; elapsed {elapsed / 60:.1f} min, eta {eta / 60:.1f} min)",
              flush=True)
        if checkpoint is not None:
            checkpoint.write_text(json.dumps({"partial": True, "config": config,
                                              "results": results}, indent=1))

    costs = {j["key"]: j["cost"] for j in todo}
    if processes <= 1:
        for job in todo:
            report(run_cell(job), job["cost"])
        return results
    ctx = mp.get_context("spawn")
    with ctx.Pool(processes, initializer=_init_process, initargs=(todo[0]["threads"],)
                  if todo else (1,)) as pool:
        for res in pool.imap_unordered(run_cell, todo, chunksize=1):
            report(res, costs[res["key"]])
    return results


# --- tables, heatmap, summary ---------------------------------------------------------------


def relative_table(results: Mapping[str, Mapping[str, Any]], aggregators: Sequence[str],
                   attacks: Sequence[str], fs: Sequence[int],
                   clean_of: Mapping[tuple[str, int], str], seed: int = 0
                   ) -> dict[str, dict[str, float]]:
    """rel[aggregator][column] = final / clean(mean) - 1 on swarm seed ``seed`` (against
    that seed's own clean mean run); columns 'clean@f' and 'attack@f'.

    NaN where the cell failed or has not run; inf where the run diverged.
    """
    reference = results.get(seed_key(clean_key("mean", 0), seed), {}).get("final", math.nan)

    def rel(key: str) -> float:
        final = results.get(seed_key(key, seed), {}).get("final", math.nan)
        if final is None or math.isnan(final):
            return math.nan
        return final / reference - 1.0

    table: dict[str, dict[str, float]] = {}
    for label in aggregators:
        row: dict[str, float] = {}
        for f in fs:
            row[f"clean@{f}"] = rel(clean_of[(label, f)])
            for attack in attacks:
                row[f"{attack}@{f}"] = rel(f"{label}/{attack}/f{f}")
        table[label] = row
    return table


def over_seeds(tables: Sequence[Mapping[str, Mapping[str, float]]]
               ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Per cell, the worst (largest) and the median value over the seeds' tables (NaN
    values, cells that failed or did not run, left out; NaN if no seed has the cell)."""
    worst_t: dict[str, dict[str, float]] = {}
    median_t: dict[str, dict[str, float]] = {}
    for label in tables[0] if tables else ():
        worst_t[label], median_t[label] = {}, {}
        for col in tables[0][label]:
            vals = [t.get(label, {}).get(col, math.nan) for t in tables]
            vals = [v for v in vals if not math.isnan(v)]
            worst_t[label][col] = max(vals) if vals else math.nan
            median_t[label][col] = statistics.median(vals) if vals else math.nan
    return worst_t, median_t


def share_gain_table(results: Mapping[str, Mapping[str, Any]], aggregators: Sequence[str],
                     attacks: Sequence[str], fs: Sequence[int], seeds: int
                     ) -> dict[str, dict[str, float]]:
    """gain[aggregator]['attack@f']: the largest attacker share gain (:func:`share_gain`)
    over every round of the cell on every seed (NaN where no round ran)."""
    table: dict[str, dict[str, float]] = {}
    for label in aggregators:
        row: dict[str, float] = {}
        for f in fs:
            row[f"clean@{f}"] = math.nan  # no attackers
            for attack in attacks:
                vals = [results.get(seed_key(f"{label}/{attack}/f{f}", s), {})
                        .get("max_attacker_share_gain", math.nan) for s in range(seeds)]
                vals = [v for v in vals if v is not None and not math.isnan(v)]
                row[f"{attack}@{f}"] = max(vals) if vals else math.nan
        table[label] = row
    return table


def honest_verdicts(results: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Over every round of every cell: honest submissions, and those whose verdict was
    ``rejected`` (lost pay) or ``excluded`` (kept out of the aggregate, paid)."""
    total = dict.fromkeys(("honest", "honest_rejected", "honest_excluded"), 0)
    for res in results.values():
        for c in res.get("rounds") or ():
            total["honest"] += c["submitted"] - c["attacker_submitted"]
            total["honest_rejected"] += c["honest_rejected"]
            total["honest_excluded"] += c["honest_excluded"]
    return total


def fmt_gain(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.3f}"


def fmt_pct(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "+inf%" if x > 0 else "-inf%"
    return f"{100 * x:+.1f}%" if abs(x) < 100 else f"{100 * x:+.1e}%"


def worst(row: Mapping[str, float], f: int, attacks: Sequence[str]) -> float:
    """Largest relative loss over the attacks at f (inf if any diverged, nan if none ran)."""
    vals = [row.get(f"{a}@{f}", math.nan) for a in attacks]
    vals = [v for v in vals if not math.isnan(v)]
    return max(vals) if vals else math.nan


def markdown_table(table: Mapping[str, Mapping[str, float]], attacks: Sequence[str],
                   fs: Sequence[int], fmt: Any = fmt_pct, title: str = "") -> str:
    """One markdown table per f: rows aggregators, columns clean (own run) + attacks + worst."""
    parts = []
    for f in fs:
        cols = ["clean"] + list(attacks) + ["worst"]
        lines = [f"{title}f = {f}", "", "| aggregator | " + " | ".join(cols) + " |",
                 "|---|" + "---:|" * len(cols)]
        for label, row in table.items():
            cells = [fmt(row.get(f"clean@{f}", math.nan))]
            cells += [fmt(row.get(f"{a}@{f}", math.nan)) for a in attacks]
            cells.append(fmt(worst(row, f, attacks)))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write_heatmap(table: Mapping[str, Mapping[str, float]], attacks: Sequence[str],
                  fs: Sequence[int], path: Path, title: str) -> None:
    """One annotated panel per f: rows aggregators, columns clean + attacks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    rows = list(table)
    cols = ["clean"] + list(attacks)
    vmax = 0.2
    fig, axes = plt.subplots(len(fs), 1, squeeze=False, layout="constrained",
                             figsize=(2.5 + 0.75 * len(cols), 1.2 + (0.8 + 0.4 * len(rows)) * len(fs)))
    cmap = matplotlib.colormaps["RdYlGn_r"].copy()
    cmap.set_bad("#bbbbbb")
    norm = TwoSlopeNorm(vmin=-0.05, vcenter=0.0, vmax=vmax)
    image = None
    for ax, f in zip(axes[:, 0], fs, strict=True):
        data = np.array([[table[r].get(f"{c}@{f}", math.nan) for c in cols] for r in rows])
        shown = np.clip(np.where(np.isinf(data), vmax, data), -0.05, vmax)
        image = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
        for i in range(len(rows)):
            for j in range(len(cols)):
                v = data[i, j]
                ax.text(j, i, fmt_pct(v).replace("%", ""), ha="center", va="center", fontsize=7,
                        color="white" if (not math.isnan(v) and v > 0.6 * vmax) else "black")
        ax.set_xticks(range(len(cols)), cols, rotation=35, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_title(f"f = {f} Byzantine of 16 (clean: the row's own run without attack)",
                     fontsize=9)
    fig.suptitle(title, fontsize=10)
    if image is not None:
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), shrink=min(0.9, 0.5 * len(fs)))
        bar.set_label(f"loss / clean mean - 1 (colour clipped at +{100 * vmax:.0f}%)",
                      fontsize=8)
        bar.ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def summary_line(table: Mapping[str, Mapping[str, float]], attacks: Sequence[str], *,
                 seeds: int, honest: Mapping[str, int], max_gain: float) -> str:
    """The issue-24 line: the run default (probe filter + CenteredClip; CenteredClip alone
    when that row was not run), ``table`` its worst over seeds; honest verdicts that cost
    pay (rejected) or only kept the row out (excluded); the largest attacker share gain."""
    cc = table.get(DEFAULT_AGGREGATOR) or table.get("centered_clip", {})
    n = honest.get("honest", 0)
    return (f"robustness: seeds={seeds} worst_f7={fmt_pct(worst(cc, 7, attacks))} "
            f"worst_f3={fmt_pct(worst(cc, 3, attacks))} "
            f"honest_lost_pay={honest.get('honest_rejected', 0)}/{n} "
            f"honest_excluded={honest.get('honest_excluded', 0)}/{n} "
            f"max_attacker_share_gain={fmt_gain(max_gain)}")


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"f=3, {', '.join(QUICK_ATTACKS)} x {', '.join(QUICK_AGGREGATORS)}")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--f", default="3,7", help="comma-separated Byzantine counts")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--aggregators", default=",".join(AGGREGATORS))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                   help="swarm seeds per cell (worst and median over them are reported)")
    p.add_argument("--steps", type=int, default=10, help="inner steps H per round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--task-preset", default="tiny", choices=("tiny", "demo", "bench"))
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default=str(ROOT / "bench-out"))
    p.add_argument("--resume", action="store_true",
                   help="reuse the finished cells of a previous (partial) JSON with the same settings")
    args = p.parse_args(argv)
    if args.quick:
        args.f, args.attacks = "3", ",".join(QUICK_ATTACKS)
        args.aggregators = ",".join(QUICK_AGGREGATORS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # for the spawned processes
    fs = [int(x) for x in args.f.split(",") if x]
    attacks = [a for a in args.attacks.split(",") if a]
    aggregators = [a for a in args.aggregators.split(",") if a]
    for a in attacks:
        if a not in ATTACKS:
            raise SystemExit(f"unknown attack {a!r}; expected one of {ATTACKS}")
    for a in aggregators:
        if a not in AGGREGATORS:
            raise SystemExit(f"unknown aggregator {a!r}; expected one of {tuple(AGGREGATORS)}")
    n = args.workers
    if args.seeds < 1:
        raise SystemExit("--seeds must be at least 1")
    seeds = args.seeds
    cells, clean_of = build_grid(aggregators, attacks, fs, n, seeds)
    jobs = make_jobs(cells, n=n, rounds=args.rounds, task_preset=args.task_preset,
                     steps=args.steps, batch=args.batch, threads=args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "robustness-quick" if args.quick else "robustness"
    config = {"workers": n, "f": fs, "rounds": args.rounds, "steps": args.steps,
              "batch": args.batch, "task_preset": args.task_preset, "codec": "fp32",
              "verification": "off (challenges 0, no spot checks, norm filter off; probe "
                              "filter on only in cc_probe)",
              "byzantine_workers": "the last f", "seed": SEED, "seeds": seeds,
              "swarm_seeds": [swarm_seed(k) for k in range(seeds)]}
    done: dict[str, Any] = {}
    json_path, partial_path = out / f"{stem}.json", out / f"{stem}.partial.json"
    for path in (json_path, partial_path) if args.resume else ():
        if not path.exists():
            continue
        previous = json.loads(path.read_text())
        if {k: (previous.get("config") or {}).get(k) for k in ("workers", "rounds", "steps", "batch",
                                                          "task_preset")} == {
                k: config[k] for k in ("workers", "rounds", "steps", "batch", "task_preset")}:
            # a run where the validator rejected someone (made before the norm filter was
            # switched off) is run again; with nothing rejected it would be the same; so is
            # one without the per-round share counts (made before they were recorded)
            done.update((k, v) for k, v in previous.get("results", {}).items()
                        if not v.get("error") and not v.get("rejected") and "rounds" in v)
    print(f"robustness bench: charlm {args.task_preset}, {n} workers, H={args.steps}, "
          f"batch {args.batch}, {args.rounds} rounds, f in {fs}, {len(attacks)} attacks x "
          f"{len(aggregators)} aggregators x {seeds} seeds = {len(jobs)} runs (incl. clean); "
          "codec fp32; "
          "verification OFF (no spot checks, norm filter off; probe filter only in cc_probe) "
          "to isolate the aggregator",
          flush=True)
    started = time.monotonic()
    results = run_jobs(jobs, processes=max(1, min(args.jobs, len(jobs))), done=done,
                       checkpoint=partial_path, config=config)
    wall = time.monotonic() - started
    per_seed = [relative_table(results, aggregators, attacks, fs, clean_of, seed=k)
                for k in range(seeds)]
    table, median_table = over_seeds(per_seed)
    gains = share_gain_table(results, aggregators, attacks, fs, seeds)
    all_gains = [g for row in gains.values() for g in row.values() if not math.isnan(g)]
    max_gain = max(all_gains) if all_gains else math.nan
    honest = honest_verdicts(results)
    references = [results.get(seed_key(clean_key("mean", 0), k), {}).get("final", math.nan)
                  for k in range(seeds)]
    ran = [r for k, r in results.items() if k not in done]
    cell_seconds = [r["seconds"] for r in ran]
    timing = (f"wall {wall / 60:.1f} min for {len(ran)} runs in {args.jobs} processes; "
              f"per run mean {sum(cell_seconds) / max(1, len(cell_seconds)):.1f} s "
              f"(min {min(cell_seconds, default=0):.1f}, max {max(cell_seconds, default=0):.1f})")
    errors = {k: r["error"] for k, r in results.items() if r.get("error")}
    genesis_note = ("clean reference per seed: 16 honest workers, mean aggregator, final eval "
                    "loss " + ", ".join(f"{swarm_seed(k)} {x:.4f}"
                                        for k, x in enumerate(references)))
    notes = [
        genesis_note,
        f"cells: final eval loss / the same seed's clean reference - 1, worst and median over "
        f"{seeds} swarm seeds (lower is better; 'clean' = the row's own run without attack, "
        "i.e. the cost of robustness)",
        "attacker share gain: in each round, the attackers' share of the rows that reached "
        "the aggregator (verdict accepted) minus their share of the submissions; the table "
        "gives the largest over every round and seed (> 0: the filters helped the attackers)",
        f"honest verdicts over every round of every run: {honest['honest_rejected']} rejected "
        f"(lost pay), {honest['honest_excluded']} excluded (kept out, paid) of "
        f"{honest['honest']} honest submissions",
        "verification OFF in every run (challenges_per_worker 0, binding_chunks 0, always_last false, "
        "spot_checks_per_round 0, norm_factor 1e6 and the validator's norm filter patched "
        "out, as it rejects all-zero updates at any factor) so that the aggregator alone "
        "faces the attacks; the probe filter (validators/probe.py) is off in every row but "
        "cc_probe, the run default (probe filter + CenteredClip), which the last line "
        "reports; the optimal attacks line-search against that filter on a batch of their "
        "own; codec fp32",
        "Byzantine workers: the last f of 16; krum runs with f=min(f, 6) (needs n > 2f+2)",
        timing,
    ]
    md = (f"# Robustness: charlm {args.task_preset}, {n} workers, H={args.steps}, batch "
          f"{args.batch}, {args.rounds} rounds\n\n" + "\n".join(f"- {x}" for x in notes)
          + f"\n\n## worst over {seeds} seeds\n\n" + markdown_table(table, attacks, fs)
          + f"\n## median over {seeds} seeds\n\n" + markdown_table(median_table, attacks, fs)
          + "\n## attacker share gain (max over rounds and seeds)\n\n"
          + markdown_table(gains, attacks, fs, fmt=fmt_gain))
    if errors:
        md += "\nfailed runs:\n" + "\n".join(f"- {k}: {v}" for k, v in sorted(errors.items()))
        md += "\n"
    line = summary_line(table, attacks, seeds=seeds, honest=honest, max_gain=max_gain)
    md += f"\n`{line}`\n"
    (out / f"{stem}.md").write_text(md)
    json_path.write_text(json.dumps({
        "config": config, "reference_clean_mean": references, "relative": table,
        "relative_median": median_table, "relative_per_seed": per_seed,
        "attacker_share_gain": gains, "max_attacker_share_gain": max_gain,
        "honest_verdicts": honest,
        "results": results, "wall_seconds": wall}, indent=1, default=str))
    partial_path.unlink(missing_ok=True)
    write_heatmap(table, attacks, fs, out / f"{stem}.png",
                  f"charlm {args.task_preset}, {n} workers, {args.rounds} rounds, worst of "
                  f"{seeds} seeds: final eval loss vs clean mean run (verification off)")
    print()
    print(md.rstrip("\n").rsplit("\n", 1)[0])
    print(f"wrote {out / f'{stem}.md'}, {json_path.name}, {stem}.png")
    cc, mean = table.get(DEFAULT_AGGREGATOR, {}), table.get("mean", {})
    targets = []
    if 3 in fs and cc:
        targets.append(f"run default f=3 <= 2% (worst over seeds): {'met' if worst(cc, 3, attacks) <= 0.02 else 'NOT met'}")
    if 7 in fs and cc:
        targets.append(f"run default f=7 <= 5% (worst over seeds): {'met' if worst(cc, 7, attacks) <= 0.05 else 'NOT met'}")
    if 7 in fs and mean:
        targets.append(f"mean fails at f=7 (> 5%): {'yes' if worst(mean, 7, attacks) > 0.05 else 'no'}")
    targets.append(f"honest_lost_pay = 0: {'met' if honest['honest_rejected'] == 0 else 'NOT met'}")
    if not math.isnan(max_gain):
        targets.append(f"max_attacker_share_gain <= 0: {'met' if max_gain <= 0 else 'NOT met'}")
    if targets:
        print("targets: " + "; ".join(targets))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
