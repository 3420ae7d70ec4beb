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

End-to-end part (``--end-to-end``): eval loss of a charlm training run with
each codec versus uncompressed and bytes versus data-parallel; it needs
``veritrain.protocol.swarm`` and is skipped with a note until that exists.

The last line is the one the issue tracks::

    compression: default=<codec> ratio_vs_fp32=<R> loss_vs_uncompressed=<+x.x%> encode_decode_MBps=<M> bytes_vs_data_parallel=<1/x>

Run: ``.venv/bin/python bench/compression.py [--numel N] [--repeats R] [--steps S] [--end-to-end]``
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from veritrain.protocol.codecs import (
    DEFAULT_CODEC,
    DEFAULT_CODEC_PARAMS,
    Codec,
    ErrorFeedback,
    get_codec,
)

#: (label, codec name, params) benchmarked by default; the run default is marked in the table.
CONFIGS: list[tuple[str, str, dict[str, object]]] = [
    ("fp32", "fp32", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8 block64", "int8", {"block": 64}),
    ("int4 block64", "int4", {"block": 64}),
    ("topk 64/4096 1b", "topk", {"chunk": 4096, "k": 64, "value_bits": 1}),
    ("topk 64/4096 2b", "topk", {"chunk": 4096, "k": 64, "value_bits": 2}),
    ("topk 32/4096 1b", "topk", {"chunk": 4096, "k": 32, "value_bits": 1}),
    ("topk 96/4096 1b", "topk", {"chunk": 4096, "k": 96, "value_bits": 1}),
    ("topk+dct64 64/4096 1b", "topk", {"chunk": 4096, "k": 64, "value_bits": 1, "dct_block": 64}),
    ("cocktail 1/8 96 4b", "cocktail", {"chunk": 4096, "sample": 8, "k": 96, "value_bits": 4}),
    ("cocktail 1/4 48 1b", "cocktail", {"chunk": 4096, "sample": 4, "k": 48, "value_bits": 1}),
]


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
        codec = get_codec(name, params)
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


def run_end_to_end(codecs: Sequence[tuple[str, Mapping[str, object]]]) -> dict[str, Any] | None:
    """End-to-end hook: charlm eval loss per codec vs uncompressed, bytes vs data-parallel.

    Wired by the swarm's owner: ``veritrain.protocol.swarm`` is expected to
    provide ``compression_end_to_end(codecs) -> dict`` returning at least
    ``loss_vs_uncompressed`` (relative, e.g. 0.012 for +1.2%) and
    ``bytes_vs_data_parallel`` (e.g. 1/400) for the default codec. Never
    raises: problems are printed and ``None`` is returned.
    """
    if importlib.util.find_spec("veritrain.protocol.swarm") is None:
        print("end-to-end: skipped, veritrain.protocol.swarm does not exist yet")
        return None
    try:
        swarm = importlib.import_module("veritrain.protocol.swarm")
        fn = getattr(swarm, "compression_end_to_end", None)
        if fn is None:
            print("end-to-end: skipped, veritrain.protocol.swarm has no compression_end_to_end()")
            return None
        result = fn(list(codecs))
        return dict(result) if result is not None else None
    except Exception as exc:  # a benchmark hook reports, it does not crash the micro figures
        print(f"end-to-end: failed: {type(exc).__name__}: {exc}")
        return None


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
    if e2e:
        if e2e.get("loss_vs_uncompressed") is not None:
            loss = f"{100 * float(e2e['loss_vs_uncompressed']):+.1f}%"
        if e2e.get("bytes_vs_data_parallel"):
            dp = f"1/{1 / float(e2e['bytes_vs_data_parallel']):.0f}"
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
    args = ap.parse_args(argv)
    rows = run_microbench(numel=args.numel, repeats=args.repeats, steps=args.steps)
    print(
        f"numel={args.numel} float32 ({4 * args.numel / 1e6:.0f} MB), 1 thread, medians of "
        f"{args.repeats}; ef/noef over {args.steps} correlated rounds; * = default "
        f"{DEFAULT_CODEC} {dict(DEFAULT_CODEC_PARAMS)}"
    )
    print(format_table(rows))
    e2e = None
    if args.end_to_end:
        e2e = run_end_to_end([(r["codec"], r["params"]) for r in rows])
    print(summary_line(rows, e2e))


if __name__ == "__main__":
    main()
