"""Compression benchmark: payload codecs side by side.

Micro part (always): for each codec configuration, on a float32 vector that
looks like a pseudo-gradient (Gaussian with a log-normal scale per block of
1024 elements, and rounds correlated through a shared component):

* ``ratio``: float32 bytes / payload bytes (header included);
* ``rel_l2``: ||decode(encode(x)) - x|| / ||x|| for one update;
* ``enc_MBps``, ``dec_MBps``, ``encdec_MBps``: MB of float32 input per second,
  medians over repeats, ``torch.set_num_threads(1)``;
* ``ef_err``: with error feedback over ``steps`` rounds,
  ||sum(decoded) - sum(true)|| / ||sum(true)|| (equals ||e|| / ||sum(true)||);
* ``noef_err``: the same without error feedback, for contrast.

End-to-end part (``--end-to-end``): the in-process swarm (the nodes' code path:
workers encode with error feedback, the validator decodes, aggregates and
broadcasts the compressed aggregate with its own residual) trains the charlm
``--preset`` (default ``bench``, 1.03M parameters, H = 30) with ``--workers``
workers for ``--rounds`` rounds with each codec and with fp32 payloads, same
seeds; reported: final eval loss against fp32, bytes per worker per round up
(payload) and down (the broadcast aggregate), and both against data-parallel
training of the same samples (float32 gradients every inner step). Two fp32
runs with different swarm seeds end about 1% apart, so a 1% target needs
``--seeds K``: each codec then runs on K seeds, paired with fp32 on the same
seed, and the table gives the mean paired ratio with its range.

The last line is the one the issue tracks::

    compression: default=<codec> ratio_vs_fp32=<R> loss_vs_uncompressed=<+x.x%> encode_decode_MBps=<M> bytes_vs_data_parallel=<1/x>

Run: ``.venv/bin/python bench/compression.py [--numel N] [--repeats R] [--steps S] [--end-to-end [--workers W] [--rounds R] [--seeds K] [--only LABELS] [--outer JSON]]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from veritrain.protocol.codecs import (
    DEFAULT_CODEC,
    DEFAULT_CODEC_PARAMS,
    MODEL_LAYOUT,
    Codec,
    ErrorFeedback,
    get_codec,
)
from veritrain.protocol.errors import EncodingError
from veritrain.protocol.messages import OUTER
from veritrain.protocol.presets import run_preset

#: ``lowrank`` configs say ``"layout": "model"`` as a run spec would: the end-to-end
#: runs bind it to the trained model (the run context does), the micro benchmark to a
#: synthetic GPT-like layout of its flat vector (:func:`synthetic_layout`).

#: (label, codec name, params) benchmarked by default; the run default is marked in the table.
CONFIGS: list[tuple[str, str, dict[str, object]]] = [
    ("fp32", "fp32", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8 block64", "int8", {"block": 64}),
    ("int4 block64", "int4", {"block": 64}),
    ("lloyd 3b block128", "lloyd", {"bits": 3, "block": 128}),
    ("lloyd 2b block128", "lloyd", {"bits": 2, "block": 128}),
    ("topk 64/4096 1b", "topk", {"chunk": 4096, "k": 64, "value_bits": 1}),
    ("topk 64/4096 2b", "topk", {"chunk": 4096, "k": 64, "value_bits": 2}),
    ("topk 32/4096 1b", "topk", {"chunk": 4096, "k": 32, "value_bits": 1}),
    ("topk 96/4096 1b", "topk", {"chunk": 4096, "k": 96, "value_bits": 1}),
    ("topk+dct64 64/4096 1b", "topk", {"chunk": 4096, "k": 64, "value_bits": 1, "dct_block": 64}),
    ("cocktail 1/8 96 4b", "cocktail", {"chunk": 4096, "sample": 8, "k": 96, "value_bits": 4}),
    ("cocktail 1/4 48 1b", "cocktail", {"chunk": 4096, "sample": 4, "k": 48, "value_bits": 1}),
    ("lowrank r6 4b", "lowrank", {"rank": 6, "bits": 4, "layout": MODEL_LAYOUT}),
]


def synthetic_layout(numel: int) -> str:
    """A GPT-like ``lowrank`` layout for the micro benchmark's flat vector: blocks of
    [384x128, 128x128, 512x128, 128x512] matrices, the rest (under 1 block) a vector."""
    block = ["384x128", "128x128", "512x128", "128x512"]
    n = numel // 196_608
    rest = numel - 196_608 * n
    return ",".join(block * n + ([str(rest)] if rest else []))


def resolve_layout(params: Mapping[str, object], layout: Callable[[], str]) -> dict[str, object]:
    """``params`` with a ``"model"`` layout replaced by ``layout()`` (for a bare flat vector)."""
    out = dict(params)
    if out.get("layout") == MODEL_LAYOUT:
        out["layout"] = layout()
    return out


def pseudo_gradients(
    numel: int, steps: int, *, seed: int = 0, block: int = 1024
) -> list[torch.Tensor]:
    """``steps`` correlated, heavy-tailed float32 updates (consecutive cosine about 0.36)."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = -(-numel // block)
    scale = torch.exp(1.0 * torch.randn(n_blocks, generator=gen)).repeat_interleave(block)[:numel]
    scale = scale * 1e-3
    shared = torch.randn(numel, generator=gen) * scale
    return [
        (0.6 * shared + 0.8 * torch.randn(numel, generator=gen) * scale).float()
        for _ in range(steps)
    ]


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_codec(codec: Codec, updates: Sequence[torch.Tensor], *, repeats: int) -> dict[str, Any]:
    """Micro figures of one codec (see the module docstring)."""
    x = updates[0]
    numel = x.numel()
    mb = 4 * numel / 1e6
    payload = codec.encode(x, seed=1)
    decoded = codec.decode(payload, numel, seed=1)
    t_enc = _median_seconds(lambda: codec.encode(x, seed=1), repeats)
    t_dec = _median_seconds(lambda: codec.decode(payload, numel, seed=1), repeats)

    ef = ErrorFeedback(numel)
    sum_true = torch.zeros(numel, dtype=torch.float64)
    sum_ef = torch.zeros(numel, dtype=torch.float64)
    sum_noef = torch.zeros(numel, dtype=torch.float64)
    for step, delta in enumerate(updates):
        _, dec = ef.step(codec, delta, seed=step)
        sum_true += delta.double()
        sum_ef += dec.double()
        sum_noef += codec.decode(codec.encode(delta, seed=step), numel, seed=step).double()
    return {
        "codec": codec.name,
        "params": codec.params(),
        "bytes": len(payload),
        "ratio": 4 * numel / len(payload),
        "rel_l2": _rel(decoded, x),
        "enc_MBps": mb / t_enc,
        "dec_MBps": mb / t_dec,
        "encdec_MBps": mb / (t_enc + t_dec),
        "ef_err": _rel(sum_ef, sum_true),
        "noef_err": _rel(sum_noef, sum_true),
        "steps": len(updates),
    }


def run_microbench(
    configs: Sequence[tuple[str, str, Mapping[str, object]]] = CONFIGS,
    *,
    numel: int = 4_000_000,
    repeats: int = 5,
    steps: int = 20,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per configuration (plus the run default if absent), 1 torch thread."""
    torch.set_num_threads(1)
    updates = pseudo_gradients(numel, steps, seed=seed)
    default = get_codec(DEFAULT_CODEC, DEFAULT_CODEC_PARAMS)
    rows = []
    seen_default = False
    for label, name, params in configs:
        codec = get_codec(name, resolve_layout(params, lambda: synthetic_layout(numel)))
        row = bench_codec(codec, updates, repeats=repeats)
        row["label"] = label
        row["default"] = codec == default
        seen_default |= row["default"]
        rows.append(row)
    if not seen_default:
        row = bench_codec(default, updates, repeats=repeats)
        row.update(label=f"{DEFAULT_CODEC} (default)", default=True)
        rows.append(row)
    return rows


#: Codecs trained end to end (``--end-to-end``), beside the fp32 reference.
E2E_CODECS: list[tuple[str, str, dict[str, object]]] = [
    ("int8 block64", "int8", {"block": 64}),
    ("int4 block64", "int4", {"block": 64}),
    ("lloyd 3b block128", "lloyd", {"bits": 3, "block": 128}),
    ("lloyd 2b block128", "lloyd", {"bits": 2, "block": 128}),
    ("topk 64/4096 1b", "topk", {"chunk": 4096, "k": 64, "value_bits": 1}),
    ("topk+dct64 64/4096 1b", "topk", {"chunk": 4096, "k": 64, "value_bits": 1, "dct_block": 64}),
    ("cocktail 1/4 48 1b", "cocktail", {"chunk": 4096, "sample": 4, "k": 48, "value_bits": 1}),
    ("lowrank r6 4b", "lowrank", {"rank": 6, "bits": 4, "layout": MODEL_LAYOUT}),
    ("lowrank r6 4b decay.5", "lowrank", {"rank": 6, "bits": 4, "layout": MODEL_LAYOUT}),
]

#: Run-spec ``inner`` overrides of some end-to-end configurations, by label.
E2E_INNER: dict[str, dict[str, object]] = {"lowrank r6 4b decay.5": {"feedback_decay": 0.5}}


def _e2e_run(job: tuple[str, str, dict[str, object], int, int, str, str, dict[str, object]]
             ) -> dict[str, Any]:
    """One swarm training run with one codec and swarm seed (in a worker process, one
    torch thread); the last item overrides the preset's outer step."""
    from veritrain.swarm import Swarm

    label, name, params, workers, rounds, preset, seed, outer = job
    torch.set_num_threads(1)
    settings = run_preset(preset)
    settings["codec"] = {"name": name, "params": dict(params)}
    settings["outer"].update(outer)
    settings["inner"].update(E2E_INNER.get(label, {}))
    # Spot checks cost time and change nothing here: every worker is honest.
    settings["verification"].update(challenges_per_worker=0.0, always_last=False, binding_chunks=0,
                                    spot_checks_per_round=0)
    settings["schedule"]["max_rounds"] = rounds
    swarm = Swarm(settings, n_workers=workers, seed=seed)
    up: list[int] = []
    down: list[int] = []

    def on_round(_: int, outcome: Any) -> None:
        up.extend(swarm.payload_bytes)
        down.append(len(outcome.update_payload))

    started = time.monotonic()
    result = swarm.train(rounds, on_round=on_round)
    inner = swarm.run.spec.inner
    rejected = [f"r{r}:{v['reason']}" for r, o in enumerate(result.outcomes)
                for v in o.verdicts if v["status"] == "rejected"]
    return {"label": label, "codec": name, "params": params, "seed": seed,
            "final": result.eval_loss[-1],
            "losses": result.eval_loss, "up_bytes": statistics.mean(up),
            "down_bytes": statistics.mean(down), "numel": swarm.run.numel,
            "steps": inner["steps"], "rejected": rejected,
            "seconds": time.monotonic() - started}


def e2e_seeds(count: int) -> list[str]:
    """Swarm seeds of the end-to-end runs: the first is the one single runs always used."""
    return ["compression", *[f"compression-{k}" for k in range(1, count)]]


def run_end_to_end(codecs: Sequence[tuple[str, str, Mapping[str, object]]], *,
                   workers: int = 4, rounds: int = 10, preset: str = "bench",
                   jobs: int = 2, seeds: int = 1,
                   outer: Mapping[str, object] | None = None) -> dict[str, Any]:
    """Eval loss after ``rounds`` rounds of the ``preset`` charlm swarm per codec, against
    fp32 payloads with the same seeds, and bytes per worker per round in each direction
    against data-parallel training of the same samples (a float32 gradient sent and an
    averaged one received at every inner step: ``steps * 4 * numel`` each way).

    With ``seeds`` > 1 every codec and fp32 run once per swarm seed, and
    ``loss_vs_uncompressed`` is the mean over seeds of the paired ratio
    ``final(codec, seed) / final(fp32, seed) - 1`` (pairs share data order and
    initialisation, so the seed-to-seed spread of about 1% largely cancels);
    ``spread`` gives its smallest and largest value."""
    import multiprocessing as mp

    todo = [("fp32", "fp32", {}), *[(lbl, n, dict(p)) for lbl, n, p in codecs]]
    jobs_list = [(lbl, n, p, workers, rounds, preset, seed, dict(outer or {}))
                 for lbl, n, p in todo for seed in e2e_seeds(seeds)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        single = pool.map(_e2e_run, jobs_list)
    reference = {r["seed"]: r["final"] for r in single if r["label"] == "fp32"}
    runs = []
    for lbl, _, _ in todo:
        mine = [r for r in single if r["label"] == lbl]
        paired = [r["final"] / reference[r["seed"]] - 1 for r in mine]
        r = dict(mine[0])
        dp = r["steps"] * 4 * r["numel"]
        r["final"] = statistics.mean(x["final"] for x in mine)
        r["up_bytes"] = statistics.mean(x["up_bytes"] for x in mine)
        r["down_bytes"] = statistics.mean(x["down_bytes"] for x in mine)
        r["seconds"] = sum(x["seconds"] for x in mine)
        r["rejected"] = [f"{x['seed']}/{v}" if seeds > 1 else v
                         for x in mine for v in x["rejected"]]
        r["loss_vs_uncompressed"] = statistics.mean(paired)
        r["spread"] = (min(paired), max(paired))
        r["up_ratio"] = 4 * r["numel"] / r["up_bytes"]
        r["down_ratio"] = 4 * r["numel"] / r["down_bytes"]
        r["bytes_vs_data_parallel"] = (r["up_bytes"] + r["down_bytes"]) / (2 * dp)
        runs.append(r)
    return {"runs": runs, "workers": workers, "rounds": rounds, "preset": preset,
            "seeds": seeds, "outer": dict(outer or {})}


def format_e2e(e2e: Mapping[str, Any]) -> str:
    head = (f"{'codec':<24}{'final loss':>11}{'vs fp32':>9}{'up B/round':>12}{'up x':>8}"
            f"{'down B/round':>14}{'down x':>8}{'vs DP':>9}{'rejected':>9}{'s':>6}")
    seeds = e2e.get("seeds", 1)
    lines = [f"end to end: charlm {e2e['preset']}, {e2e['workers']} workers x {e2e['rounds']} "
             f"rounds, same seeds ({seeds} swarm seed{'s' if seeds > 1 else ''}: mean final "
             "loss, mean paired ratio to fp32 [min, max]); x = float32 bytes / bytes sent; "
             "vs DP = bytes both ways / data-parallel's"
             + (f"; outer step overridden: {json.dumps(e2e['outer'])}" if e2e.get("outer") else ""),
             head, "-" * len(head)]
    for r in e2e["runs"]:
        lines.append(
            f"{r['label']:<24}{r['final']:>11.4f}{100 * r['loss_vs_uncompressed']:>+8.2f}%"
            f"{r['up_bytes']:>12.0f}{r['up_ratio']:>7.1f}x{r['down_bytes']:>14.0f}"
            f"{r['down_ratio']:>7.1f}x{'1/' + format(1 / r['bytes_vs_data_parallel'], '.0f'):>9}"
            f"{len(r['rejected']):>9}{r['seconds']:>6.0f}"
            + (f"  [{100 * r['spread'][0]:+.2f}%, {100 * r['spread'][1]:+.2f}%]"
               if seeds > 1 else "")
            + f"  {' '.join(r['rejected'])}")
    return "\n".join(lines)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (
        f"{'codec':<22}{'bytes':>11}{'ratio':>9}{'rel_l2':>8}{'enc MB/s':>10}"
        f"{'dec MB/s':>10}{'e+d MB/s':>10}{'ef_err':>8}{'noef':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "*" if r["default"] else " "
        lines.append(
            f"{mark}{r['label']:<21}{r['bytes']:>11}{r['ratio']:>8.1f}x{r['rel_l2']:>8.3f}"
            f"{r['enc_MBps']:>10.0f}{r['dec_MBps']:>10.0f}{r['encdec_MBps']:>10.0f}"
            f"{r['ef_err']:>8.3f}{r['noef_err']:>7.3f}"
        )
    return "\n".join(lines)


def summary_line(rows: Sequence[Mapping[str, Any]], e2e: Mapping[str, Any] | None) -> str:
    d = next(r for r in rows if r["default"])
    loss = "n/a"
    dp = "n/a"
    run = None
    if e2e:
        run = next((r for r in e2e["runs"] if r["codec"] == d["codec"]
                    and dict(r["params"]) == dict(d["params"])), None)
    if run is not None:
        loss = f"{100 * float(run['loss_vs_uncompressed']):+.1f}%"
        dp = f"1/{1 / float(run['bytes_vs_data_parallel']):.0f}"
    return (
        f"compression: default={d['codec']} ratio_vs_fp32={d['ratio']:.1f} "
        f"loss_vs_uncompressed={loss} encode_decode_MBps={d['encdec_MBps']:.0f} "
        f"bytes_vs_data_parallel={dp}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="error-feedback rounds")
    ap.add_argument(
        "--end-to-end", action="store_true", help="also run the charlm swarm comparison"
    )
    ap.add_argument("--workers", type=int, default=4, help="end to end: swarm workers")
    ap.add_argument("--rounds", type=int, default=10, help="end to end: rounds")
    ap.add_argument("--preset", default="bench", help="end to end: run preset (charlm size)")
    ap.add_argument("--jobs", type=int, default=2, help="end to end: parallel runs")
    ap.add_argument("--seeds", type=int, default=1,
                    help="end to end: swarm seeds per codec (paired with fp32's)")
    ap.add_argument("--only", default="",
                    help="end to end: comma-separated labels of the codecs to train "
                    "(default all; fp32 always runs)")
    ap.add_argument("--outer", type=json.loads, default={},
                    help='end to end: JSON overriding the preset outer step for every run, '
                    'fp32 included, e.g. \'{"momentum": 0.5}\'')
    args = ap.parse_args(argv)
    try:
        if not isinstance(args.outer, dict):
            raise EncodingError("--outer: expected an object")
        OUTER({**run_preset(args.preset)["outer"], **args.outer}, "--outer")
    except EncodingError as exc:
        ap.error(f"{exc} (e.g. '{{\"momentum\": 0.5}}')")
    rows = run_microbench(numel=args.numel, repeats=args.repeats, steps=args.steps)
    print(
        f"numel={args.numel} float32 ({4 * args.numel / 1e6:.0f} MB), 1 thread, medians of "
        f"{args.repeats}; ef/noef over {args.steps} correlated rounds; * = default "
        f"{DEFAULT_CODEC} {dict(DEFAULT_CODEC_PARAMS)}"
    )
    print(format_table(rows))
    e2e = None
    if args.end_to_end:
        chosen = E2E_CODECS
        if args.only:
            labels = [x.strip() for x in args.only.split(",") if x.strip()]
            unknown = sorted(set(labels) - {lbl for lbl, _, _ in E2E_CODECS})
            if unknown:
                ap.error(f"--only: unknown labels {unknown}; known: "
                         + ", ".join(lbl for lbl, _, _ in E2E_CODECS))
            chosen = [c for c in E2E_CODECS if c[0] in labels]
        e2e = run_end_to_end(chosen, workers=args.workers, rounds=args.rounds,
                             preset=args.preset, jobs=args.jobs, seeds=args.seeds,
                             outer=args.outer)
        print(format_e2e(e2e))
    print(summary_line(rows, e2e))


if __name__ == "__main__":
    main()
