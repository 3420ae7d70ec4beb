"""How much the workers of one round agree, and what fewer of them would miss.

Compression schemes that split the coordinates among the workers (each sends its
own 1/P of them at P times the bits per value) learn every coordinate from only
n/P workers' data; this measures that sampling error on the charlm swarm
(uncompressed payloads, every worker honest), round by round:

* ``pair_cos``: the mean cosine between two workers' updates;
* ``subset_k``: ``||mean(k workers) - mean(all n)|| / ||mean(all n)||``, averaged
  over the n/k disjoint groups of k consecutive workers (k < n dividing n).

The last line gives each figure's range over the rounds::

    agreement: workers=<n> rounds=<R> pair_cos=<lo>..<hi> subset_1=<lo>..<hi> ...

``python bench/compression.py --end-to-end --workers <n/P>`` gives the loss such a
sampling error costs (specs/codecs.md, lowrank).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from veritrain.protocol.presets import run_preset

from veritrain.swarm import Swarm


def round_agreement(updates: torch.Tensor, sizes: Sequence[int]) -> dict[str, float]:
    """``pair_cos`` and ``subset_<k>`` (module docstring) of one round's ``n x D`` updates."""
    n = updates.shape[0]
    unit = updates / updates.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    out = {"pair_cos": float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1)))}
    mean = updates.mean(0)
    for k in sizes:
        groups = [updates[s:s + k].mean(0) for s in range(0, n - k + 1, k)]
        distances = [float((g - mean).norm() / mean.norm()) for g in groups]
        out[f"subset_{k}"] = sum(distances) / len(distances)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--preset", default="bench", help="run preset (charlm size)")
    ap.add_argument("--seed", default="compression", help="swarm seed")
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error("--workers: at least 2")
    torch.set_num_threads(1)
    settings = run_preset(args.preset)
    settings["codec"] = {"name": "fp32", "params": {}}
    settings["verification"].update(challenges_per_worker=0.0, always_last=False, binding_chunks=0,
                                    spot_checks_per_round=0)
    swarm = Swarm(settings, n_workers=args.workers, seed=args.seed, keep_updates=True)
    sizes = [k for k in range(1, args.workers) if args.workers % k == 0]
    rows = []
    for r in range(args.rounds):
        swarm.step(r)
        row = round_agreement(torch.stack([swarm.updates[i] for i in sorted(swarm.updates)]),
                              sizes)
        rows.append(row)
        print(f"round {r}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    spans = " ".join(f"{k}={min(r[k] for r in rows):.2f}..{max(r[k] for r in rows):.2f}"
                     for k in rows[0])
    print(f"agreement: workers={args.workers} rounds={args.rounds} {spans}")


if __name__ == "__main__":
    main()
