"""Speed of the aggregation rules relative to a plain ``updates.mean(0)``.

    .venv/bin/python bench/aggregation_speed.py [--n 16] [--d 4000000] [--repeats 5]

For every rule: the median (and the minimum) wall time over ``--repeats``
calls, divided by the median (minimum) time of ``updates.mean(0)`` measured in
the same run, interleaved with the rules so that machine load affects both
alike; the peak memory a call adds (measured in a fresh subprocess: VmHWM from
/proc/self/status after a reset through /proc/self/clear_refs, with glibc told
to return large blocks to the system so resident memory tracks live
tensors); and, with ``--check``, the error relative to a straightforward
float64 implementation.

The last line is machine-readable:

    aggregation_speed: centered_clip=<x>x krum=<x>x geometric_median=<x>x trimmed_mean=<x>x median=<x>x

(ratios of medians).  Every headline rule is its production path: exactly the
call ``process_round`` makes (``validators.round.aggregate_locally``), that is
``aggregation.aggregate_rows(name, params, rows)`` over ``TensorRows`` of the
input, with the run presets' aggregator (``centered_clip`` with ``tau_rel`` and
``iterations``: radius resolution included) and, for the other rules, the
registry parameters given below (``f`` for Krum and the trimmed mean).
``HEADLINE_SPECS`` holds these (name, params); ``tests/test_aggregation_speed_bench.py``
fails if they and what ``process_round`` runs ever diverge.

Other configurations stay in the table, labelled:

* ``centered_clip_file``: the headline over ``FileRows`` of a row file written
  once beforehand (what a validator node reads; page-cache reads included);
* ``cc_median_start``: the presets' CenteredClip from the coordinate median
  (``start="median"``, the default before issue #19);
* ``cc_zero_start_fixed_tau``: ``CenteredClip(tau, start="zero")``, 10 forced
  iterations from the origin with a fixed radius (the reference implementations'
  configuration, and this table's headline before issue #19);
* ``cc_previous_in_memory``: the in-memory path validators ran before streaming
  (torch's median for the radius, then ``CenteredClip`` from the median);
* ``bucketing2_centered_clip``: the presets' CenteredClip with buckets of 2.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from veritrain.aggregation import (
    CenteredClip,
    GeometricMedian,
    RowFile,
    Rows,
    TensorRows,
    aggregate_rows,
)
from veritrain.protocol.presets import run_preset

Fn = Callable[[torch.Tensor], torch.Tensor]
HEADLINE = ["centered_clip", "krum", "geometric_median", "trimmed_mean", "median"]

#: The run presets' aggregator (every preset has the same: checked by the tests).
PRESET_AGGREGATOR: dict[str, Any] = run_preset("demo")["aggregator"]
PRESET_PARAMS: dict[str, Any] = dict(PRESET_AGGREGATOR["params"])


def make_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Pseudo-gradients sharing a common direction plus per-worker noise."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=gen)
    return common + torch.randn(n, d, generator=gen)


def headline_specs(f: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Table name -> (registry name, params) of every rule timed on its production path."""
    return {
        "mean": ("mean", {}),
        "centered_clip": (PRESET_AGGREGATOR["name"], dict(PRESET_PARAMS)),
        "krum": ("krum", {"f": f}),
        "multi_krum": ("multi_krum", {"f": f}),
        "geometric_median": ("geometric_median", {}),
        "trimmed_mean": ("trimmed_mean", {"f": f}),
        "median": ("median", {}),
    }


def production_rule(name: str, params: Mapping[str, Any], rows_of: Callable[[torch.Tensor], Rows]
                    = TensorRows) -> Fn:
    """``process_round``'s aggregation call for (name, params): ``aggregate_rows`` over the rows."""

    def rule(x: torch.Tensor) -> torch.Tensor:
        return aggregate_rows(name, params, rows_of(x)).aggregate

    return rule


def file_rows_of(x: torch.Tensor, directory: str) -> Callable[[torch.Tensor], Rows]:
    """Row source over a row file holding ``x`` (written here, once); other shapes (the
    warm-up slices) stay in memory."""
    store = RowFile(Path(directory) / f"rows-{x.shape[0]}x{x.shape[1]}.f32", x.shape[1])
    for row in x:
        store.append(row)
    full = store.rows()
    return lambda t: full if t.shape == x.shape else TensorRows(t)


def previous_validator_rule(x: torch.Tensor) -> torch.Tensor:
    """The in-memory path validators ran before streaming: torch's median for the radius,
    then CenteredClip from the coordinate median."""
    center = x.median(dim=0).values
    spread = torch.linalg.vector_norm((x - center).double(), dim=1).median()
    tau = max(float(PRESET_PARAMS["tau_rel"]) * float(spread), 1e-12)
    return CenteredClip(tau, iterations=int(PRESET_PARAMS["iterations"]), start="median")(x)


def make_rules(
    d: int, f: int, x: torch.Tensor | None = None, directory: str | None = None
) -> dict[str, Fn]:
    tau = math.sqrt(d)  # about half the typical distance between rows: clipping is active
    rules = {k: production_rule(*spec) for k, spec in headline_specs(f).items()}
    cc_name = PRESET_AGGREGATOR["name"]
    if x is not None and directory is not None:
        rules["centered_clip_file"] = production_rule(
            cc_name, PRESET_PARAMS, file_rows_of(x, directory))
    rules.update({
        "cc_median_start": production_rule(cc_name, {**PRESET_PARAMS, "start": "median"}),
        "cc_zero_start_fixed_tau": CenteredClip(tau, iterations=10, tol=0.0, start="zero"),
        "cc_previous_in_memory": previous_validator_rule,
        "bucketing2_centered_clip": production_rule(cc_name, {**PRESET_PARAMS, "bucket_size": 2}),
    })
    return rules


# --- memory -----------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def probe_memory(args: argparse.Namespace) -> None:
    """Child process: print the peak MiB that one call of ``args.probe`` adds."""
    x = make_inputs(args.n, args.d, args.seed)
    with tempfile.TemporaryDirectory(prefix="aggregation-speed-") as tmp:
        file_rows = args.probe == "centered_clip_file"
        fn = make_rules(args.d, args.f, x if file_rows else None, tmp)[args.probe]
        _probe_call(fn, x, args.d)


def _probe_call(fn: Fn, x: torch.Tensor, d: int) -> None:
    fn(x[:, : min(d, 1 << 16)].contiguous())  # warm up (thread pool, caches)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    fn(x)
    print(max(_status_kib("VmHWM") - before, 0) / 1024)


def peak_extra_mib(args: argparse.Namespace, rule: str) -> float | None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    cmd = [
        sys.executable,
        __file__,
        "--probe",
        rule,
        "--n",
        str(args.n),
        "--d",
        str(args.d),
        "--f",
        str(args.f),
        "--seed",
        str(args.seed),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return float(done.stdout.strip().splitlines()[-1])


# --- straightforward float64 references (for --check) -------------------------------


def ref_centered_clip_zero(x: torch.Tensor, tau: float, iterations: int) -> torch.Tensor:
    v = torch.zeros(x.shape[1], dtype=torch.float64)
    for _ in range(iterations):
        diff = x - v
        norm = diff.norm(dim=1)
        clip = torch.where(norm > tau, tau / norm.clamp(min=tau), torch.ones_like(norm))
        v = v + (clip / x.shape[0]) @ diff
        del diff
    return v


def _lower_median(values: torch.Tensor) -> float:
    return float(values.sort().values[(values.numel() - 1) // 2])


def ref_geometric_median_start(x: torch.Tensor) -> torch.Tensor:
    """Weiszfeld in D dimensions from the mean of the half of the rows nearest the medoid
    (medoid: lowest lower-median distance to the others), as ``geometric_median_coef``."""
    n = x.shape[0]
    dist = torch.stack([(x - x[i]).norm(dim=1) for i in range(n)])
    masked = dist + torch.diag(torch.full((n,), math.inf, dtype=x.dtype))
    best = int(torch.argmin(masked.sort(dim=1).values[:, (n - 2) // 2])) if n > 1 else 0
    v = x[dist[best].sort(stable=True).indices[: n - (n - 1) // 2]].mean(0)
    d = (x - v).norm(dim=1)
    eps = max(1e-9 * _lower_median(d), 1e-300)
    for _ in range(100):
        beta = 1.0 / d.clamp(min=eps)
        new = (beta / beta.sum()) @ x
        step, scale = float((new - v).norm()), _lower_median(d)
        v = new
        d = (x - v).norm(dim=1)
        if step <= 1e-6 * scale:
            break
    return v


def ref_centered_clip(x: torch.Tensor, tau_rel: float, iterations: int,
                      start: str = "geometric_median") -> torch.Tensor:
    """From the geometric median (or the coordinate median), tau = tau_rel * lower median
    of ||x_i - GM||, stopping like CenteredClip (step <= 1e-6 tau), in float64."""
    n = x.shape[0]
    gm = ref_geometric_median_start(x)
    tau = tau_rel * _lower_median((x - gm).norm(dim=1))
    if start == "median":
        s = x.sort(dim=0).values
        v = (s[(n - 1) // 2] + s[n // 2]) / 2
        del s
    else:
        v = gm
    for _ in range(int(iterations)):
        diff = x - v
        norm = diff.norm(dim=1)
        clip = torch.where(norm > tau, tau / norm.clamp(min=tau), torch.ones_like(norm))
        step = (clip / n) @ diff
        v = v + step
        del diff
        if float(step.norm()) <= 1e-6 * tau:
            break
    return v


def ref_krum(x: torch.Tensor, f: int) -> torch.Tensor:
    n = x.shape[0]
    d = torch.stack([((x - x[i]) ** 2).sum(dim=1) for i in range(n)])
    d.fill_diagonal_(float("inf"))
    scores = d.sort(dim=1).values[:, : n - f - 2].sum(dim=1)
    return x[int(torch.argmin(scores))]


def ref_geometric_median(x: torch.Tensor, iterations: int, tol: float, eps: float) -> torch.Tensor:
    w = torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=torch.float64)
    v = w @ x
    for _ in range(iterations):
        dist = (x - v).norm(dim=1)
        beta = w / dist.clamp(min=eps)
        new = (beta / beta.sum()) @ x
        step = float((new - v).norm())
        v = new
        if step <= tol * float(dist.sort().values[(x.shape[0] - 1) // 2]):
            break
    return v


def ref_sorted(x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    out = torch.empty(x.shape[1], dtype=torch.float64)
    for a in range(0, x.shape[1], 1 << 18):
        out[a : a + (1 << 18)] = reduce(x[:, a : a + (1 << 18)].sort(dim=0).values)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-300))


def check_errors(x: torch.Tensor, rules: dict[str, Fn], f: int) -> dict[str, float]:
    n, d = x.shape
    x64 = x.double()
    gm = GeometricMedian()
    refs: dict[str, Callable[[], torch.Tensor]] = {
        "mean": lambda: x64.mean(0),
        "cc_zero_start_fixed_tau": lambda: ref_centered_clip_zero(x64, math.sqrt(d), 10),
        "centered_clip": lambda: ref_centered_clip(x64, **PRESET_PARAMS),
        "centered_clip_file": lambda: ref_centered_clip(x64, **PRESET_PARAMS),
        "cc_median_start": lambda: ref_centered_clip(x64, **PRESET_PARAMS, start="median"),
        "krum": lambda: ref_krum(x64, f),
        "geometric_median": lambda: ref_geometric_median(x64, gm.iterations, gm.tol, gm.eps),
        "trimmed_mean": lambda: ref_sorted(x64, lambda s: s[f : n - f].mean(0)),
        "median": lambda: ref_sorted(x64, lambda s: (s[(n - 1) // 2] + s[n // 2]) / 2),
    }
    return {name: rel_error(rules[name](x), ref()) for name, ref in refs.items() if name in rules}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16, help="rows (workers)")
    parser.add_argument("--d", type=int, default=4_000_000, help="columns (parameters)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--f", type=int, default=3, help="Byzantine rows for Krum/trimmed mean")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare with straightforward float64 implementations",
    )
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure peak extra memory (one subprocess per rule)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        probe_memory(args)
        return

    x = make_inputs(args.n, args.d, args.seed)
    scratch = tempfile.TemporaryDirectory(prefix="aggregation-speed-")
    rules = make_rules(args.d, args.f, x, scratch.name)
    baseline: Fn = lambda t: t.mean(0)  # noqa: E731
    for fn in [baseline, *rules.values()]:  # warm up (allocator, thread pool)
        fn(x[:, : min(args.d, 1 << 16)].contiguous())
    times: dict[str, list[float]] = {name: [] for name in rules}
    base_times: list[float] = []
    for _ in range(args.repeats):
        for name, fn in rules.items():
            start = time.perf_counter()
            baseline(x)
            base_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    base_med, base_min = statistics.median(base_times), min(base_times)

    errors = check_errors(x, rules, args.f) if args.check else {}
    input_mib = x.numel() * x.element_size() / 2**20
    print(
        f"aggregation speed: N={args.n} D={args.d} float32 ({input_mib:.0f} MiB), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} repeats"
    )
    print(f"baseline updates.mean(0): median {base_med * 1e3:.1f} ms, min {base_min * 1e3:.1f} ms")
    print(
        f"{'rule':<28}{'median ms':>10}{'x mean':>8}{'min ms':>8}{'x mean':>8}"
        f"{'peak extra MiB':>16}{'B/param':>9}{'rel err vs f64':>16}"
    )
    ratios: dict[str, float] = {}
    for name in rules:
        med, low = statistics.median(times[name]), min(times[name])
        ratios[name] = med / base_med
        peak = peak_extra_mib(args, name) if args.memory else None
        peak_s = "-" if peak is None else f"{peak:.0f}"
        per_param = "-" if peak is None else f"{peak * 2**20 / args.d:.1f}"
        err_s = f"{errors[name]:.1e}" if name in errors else "-"
        print(
            f"{name:<28}{med * 1e3:>10.1f}{ratios[name]:>8.2f}{low * 1e3:>8.1f}"
            f"{low / base_min:>8.2f}{peak_s:>16}{per_param:>9}{err_s:>16}"
        )
    print(
        f"(extra memory limit: one more copy of the input = {input_mib:.0f} MiB; "
        f"the result alone is {input_mib / args.n:.0f} MiB)"
    )
    scratch.cleanup()
    print("aggregation_speed: " + " ".join(f"{k}={ratios[k]:.2f}x" for k in HEADLINE))


if __name__ == "__main__":
    main()
