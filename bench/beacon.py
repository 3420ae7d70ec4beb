"""Threshold-beacon benchmark (issue #26): the DKG and the per-round beacon at n validators.

For each n (default 4, 16 and 64; quorum ceil(2n/3), the run default) the validators'
real code runs the whole DKG over the ledger's board (validators/dkg.py ``DkgNode``
phase by phase, ledger/dkg.py ``DkgBoard``), in this one process (marked "in
process": no HTTP), then one round's beacon. Reported:

* **DKG time**: each validator's CPU seconds in each phase (its own posts and its
  checks of everybody else's), and the DKG's critical path, the sum over phases of
  the slowest validator's time in that phase: what the DKG takes when every
  validator runs on its own machine, before the ledger's round trips. A validator
  decodes and validates every deal's commitments once (a per-process cache); here
  validator 0 gets a cache of its own, the others share one, so validator 0's time
  is one machine's and the others' decoding is paid once (their work is the same).
  ``--all-cold`` gives every validator its own cache (slow at n = 64).
* **DKG bytes per validator**: the canonical bytes of its own posts (up) and of the
  posts it reads from the board to compute the next one (down), averaged over the
  validators.
* **per round**: a validator's partial signature (``DkgNode.partial_post``), one
  partial's verification (what the ledger does for each partial it stores), the
  combination of a quorum, and what a validator runs to take a round's beacon
  (``beacon_seed_from_partials``: every partial bound to its member and the list, the
  first quorum combined, the group signature verified; the partials are verified one
  by one only if that fails) in milliseconds.
* **one seed**: ``--quorums`` random quorums of the round's partials (the first is the
  lowest-indexed one) each combined to a group signature: the number of distinct seeds
  (1: the ledger's choice of quorum cannot choose the seed).

* **over HTTP** (``--http-sizes``, default 4 and 16): a ledger process
  (``veritrain ledger serve``) and one spawned process per validator, each running
  ``ValidatorNode.run_dkg`` against the ledger as a validator node does: the DKG's
  wall time from the last validator's start to the last one holding the group key,
  each validator's CPU seconds, and the bytes each moved through its client (its
  posts and every poll of the board), up and down. The processes share this
  machine's cores, so the wall time is an upper bound for validators on machines
  of their own.

Last line (one per n, the largest last)::

    beacon: n=<n> quorum=<q> seeds_over_quorums=<k distinct> dkg_s=<x> dkg_bytes_per_validator=<x> round_ms=<x>

Run: ``.venv/bin/python bench/beacon.py [--sizes 4,16,64] [--quorums 20] [--all-cold]
[--http-sizes 4,16]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from veritrain.ledger.dkg import DkgBoard
from veritrain.protocol import dkg
from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.identity import Identity
from veritrain.validators.dkg import DkgNode, beacon_seed_from_partials

RUN = "beacon-bench"
ROUND = 1
SEALED = "5e" * 32
PHASES = ("dkg_keys", "dkg_deal", "dkg_complaint", "dkg_justification", "dkg_result")


def default_quorum(n: int) -> int:
    """The run default (protocol/organiser.py): ceil(2n / 3)."""
    return -(-2 * n // 3)


def bench_spec(validators: list[Identity], quorum: int) -> Any:
    """What DkgNode and DkgBoard read of a run spec."""
    keys = [{"ed25519": v.public_key.hex(), "bls": v.public.bls} for v in validators]
    index = {k["ed25519"]: i for i, k in enumerate(keys)}
    return types.SimpleNamespace(run_id=RUN, quorum=quorum, validators=keys,
                                 validator_index=index.get)


def wire_bytes(wires: list[Any]) -> int:
    return sum(len(encode_canonical(w)) for w in wires)


class Caches:
    """Per-"machine" caches of decoded deal commitments (protocol/dkg.py ``_POINTS``):
    validator 0 (or every validator, ``all_cold``) keeps its own."""

    def __init__(self, n: int, all_cold: bool) -> None:
        shared: dict[tuple[str, ...], list[Any]] = {}
        self.of = [{} if (all_cold or i == 0) else shared for i in range(n)]

    def run(self, i: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` as validator ``i``'s machine runs it: its CPU seconds."""
        dkg._POINTS = self.of[i]
        start = time.process_time()
        out = fn(*args)
        return out, time.process_time() - start


def phase_post(node: DkgNode, kind: str, served: list[Any]) -> Any:
    """``node``'s post for phase ``kind`` from the previous phase's ``served`` posts."""
    if kind == "dkg_keys":
        return node.keys_post()
    return {"dkg_deal": node.deal_post, "dkg_complaint": node.complaint_post,
            "dkg_justification": node.justification_post,
            "dkg_result": node.result_post}[kind](served)


def run_dkg(validators: list[Identity], quorum: int, all_cold: bool
            ) -> tuple[list[DkgNode], DkgBoard, dict[str, list[float]], list[int], list[int]]:
    """Every phase of the DKG for every validator, over one board: the nodes, the board
    (its group fixed), each phase's CPU seconds by validator, and each validator's bytes
    up and down."""
    spec = bench_spec(validators, quorum)
    n = len(validators)
    board = DkgBoard(spec)
    nodes = [DkgNode(v, spec) for v in validators]
    caches = Caches(n, all_cold)
    seconds: dict[str, list[float]] = {kind: [0.0] * n for kind in PHASES}
    up, down = [0] * n, [0] * n
    reads = {"dkg_keys": None, "dkg_deal": "dkg_keys", "dkg_complaint": "dkg_deal",
             "dkg_justification": "dkg_complaint", "dkg_result": "dkg_justification"}
    for kind in PHASES:
        served = board.served(reads[kind]) if reads[kind] else []
        wires = []
        for i, node in enumerate(nodes):
            wire, seconds[kind][i] = caches.run(i, phase_post, node, kind, served)
            down[i] += wire_bytes(served)
            if wire is not None:
                up[i] += wire_bytes([wire])
                wires.append(wire)
        for wire in wires:
            board.post(wire)
    results = board.served("dkg_result")
    for i, node in enumerate(nodes):
        _, spent = caches.run(i, node.adopt, results)
        seconds["dkg_result"][i] += spent
        down[i] += wire_bytes(results)
    board.fix_group()
    dkg._POINTS = {}
    return nodes, board, seconds, up, down


def seeds_over_quorums(partials: dict[int, bytes], quorum: int, count: int,
                       rng: random.Random) -> tuple[int, float]:
    """Distinct seeds over ``count`` quorums of ``partials`` (the lowest-indexed first,
    then random ones); the median seconds of one combination."""
    indices = sorted(partials)
    chosen = [indices[:quorum]] + [sorted(rng.sample(indices, quorum))
                                   for _ in range(count - 1)]
    seeds, times = set(), []
    for quorum_set in chosen:
        start = time.perf_counter()
        sig = dkg.combine({j: partials[j] for j in quorum_set}, quorum)
        times.append(time.perf_counter() - start)
        seeds.add(dkg.threshold_seed(sig))
    return len(seeds), statistics.median(times)


def bench_n(n: int, args: argparse.Namespace) -> str:
    quorum = default_quorum(n)
    started = time.perf_counter()
    validators = [Identity.generate("validator") for _ in range(n)]
    print(f"\n== n={n} validators, quorum {quorum} (in process; keys made in "
          f"{time.perf_counter() - started:.1f}s) ==", flush=True)
    nodes, board, seconds, up, down = run_dkg(validators, quorum, args.all_cold)
    assert board.result is not None
    agreed = {node.result.group_key for node in nodes if node.result is not None}
    if agreed != {board.result.group_key} or any(node.share is None for node in nodes):
        raise SystemExit(f"n={n}: the validators did not all adopt one group key")
    critical = sum(max(seconds[kind]) for kind in PHASES)
    print(f"{'phase':<20} {'validator 0 (own cache)':>24} {'slowest':>9} {'median':>9}  CPU s")
    for kind in PHASES:
        print(f"{kind:<20} {seconds[kind][0]:>24.3f} {max(seconds[kind]):>9.3f} "
              f"{statistics.median(seconds[kind]):>9.3f}")
    print(f"DKG critical path (slowest validator per phase, summed): {critical:.1f} s CPU; "
          f"validator 0 alone {sum(seconds[k][0] for k in PHASES):.1f} s")
    per_validator = (sum(up) + sum(down)) / n
    print(f"DKG bytes per validator: up {statistics.mean(up) / 1e3:.1f} kB, down "
          f"{statistics.mean(down) / 1e3:.1f} kB, total {per_validator / 1e3:.1f} kB")

    spec = bench_spec(validators, quorum)
    result = board.result
    root = dkg.threshold_beacon_root(RUN, ROUND, SEALED, EVERY_WORKER_ADMITTED)
    sign_times, wires = [], []
    for node in nodes:
        start = time.perf_counter()
        wires.append(node.partial_post(ROUND, SEALED, EVERY_WORKER_ADMITTED))
        sign_times.append(time.perf_counter() - start)
    partials = {j: bytes.fromhex(w["body"]["partial"]) for j, w in enumerate(wires)}
    start = time.perf_counter()
    ok = dkg.partial_verifies(result.public_shares[0], root, partials[0])
    verify_s = time.perf_counter() - start
    if not ok:
        raise SystemExit(f"n={n}: an honest partial does not verify")
    rng = random.Random(f"beacon-bench/{n}")
    offered = [wires[j] for j in sorted(rng.sample(range(n), quorum))]
    start = time.perf_counter()
    seed = beacon_seed_from_partials(result, spec, ROUND, SEALED, EVERY_WORKER_ADMITTED, offered)
    take_s = time.perf_counter() - start
    distinct, combine_s = seeds_over_quorums(partials, quorum, args.quorums, rng)
    if dkg.threshold_seed(dkg.combine(dict(sorted(partials.items())[:quorum]), quorum)) != seed:
        raise SystemExit(f"n={n}: the validators' beacon differs from the combined one")
    round_s = statistics.median(sign_times) + take_s
    print(f"per round: sign a partial {1e3 * statistics.median(sign_times):.0f} ms, verify one "
          f"{1e3 * verify_s:.0f} ms, combine {quorum} {1e3 * combine_s:.0f} ms; a validator's "
          f"beacon (bind {quorum} partials, combine, verify the group signature) "
          f"{1e3 * take_s:.0f} ms; sign + beacon {1e3 * round_s:.0f} ms")
    print(f"seeds over {args.quorums} quorums of the {n} partials: {distinct} distinct "
          f"({time.perf_counter() - started:.0f}s for this n)", flush=True)
    return (f"beacon: n={n} quorum={quorum} seeds_over_quorums={distinct} dkg_s={critical:.1f} "
            f"dkg_bytes_per_validator={per_validator:.0f} round_ms={1e3 * round_s:.0f}")


def dkg_node_process(url: str, run_id: str, key_path: str, state_dir: str,
                     poll_seconds: float) -> dict[str, Any]:
    """One validator's DKG in a process of its own (``--dkg-node``): what ``veritrain
    validator`` runs first in a threshold-beacon run."""
    import asyncio
    from pathlib import Path

    from veritrain.ledger.client import LedgerClient, fetch_run
    from veritrain.protocol.identity import read_key_file
    from veritrain.validators.node import ValidatorConfig, ValidatorNode

    identity = read_key_file(Path(key_path))
    node = ValidatorNode(ValidatorConfig(ledger_url=url, run_id=run_id,
                                         poll_seconds=poll_seconds,
                                         state_dir=Path(state_dir)), identity)

    async def go() -> dict[str, Any]:
        async with LedgerClient(url, retry_for=120.0) as client:
            spec = await fetch_run(client, run_id)
            started, cpu = time.time(), time.process_time()
            result = await node.run_dkg(client, spec)
            return {"started": started, "ended": time.time(),
                    "cpu": time.process_time() - cpu, "group": result.group_key,
                    "share": node.dkg_node is not None and node.dkg_node.share is not None,
                    "up": sum(client.traffic.up.values()),
                    "down": sum(client.traffic.down.values())}

    return asyncio.run(go())


def bench_http(n: int, poll_seconds: float) -> str:
    """The DKG among ``n`` validator processes over a ledger process (see the docstring)."""
    import asyncio
    import tempfile
    from pathlib import Path

    from veritrain.ledger.client import publish_run
    from veritrain.protocol.identity import write_key_file
    from veritrain.protocol.presets import run_preset

    from veritrain.local import LocalProcesses
    from veritrain.synthetic import make_synthetic_run

    quorum = default_quorum(n)
    validators = [Identity.generate("validator") for _ in range(n)]
    verification = {**run_preset("tiny")["verification"], "beacon": "threshold"}
    run = make_synthetic_run(RUN, validators, quorum=quorum, verification=verification,
                             schedule={"round_seconds": 600.0, "min_submissions": 1,
                                       "max_rounds": 1})
    print(f"\n== n={n} validators, quorum {quorum}: over HTTP, a ledger process and {n} "
          f"validator processes ==", flush=True)
    with tempfile.TemporaryDirectory(prefix="beacon-http-") as tmp:
        root = Path(tmp)
        for i, v in enumerate(validators):
            write_key_file(root / f"v{i}.key", v)
        procs = LocalProcesses(root / "logs")
        nodes: list[subprocess.Popen[str]] = []
        try:
            url = procs.start_ledger(root / "ledger")
            asyncio.run(publish_run(url, run))
            # Each validator a process of its own, as `veritrain validator` runs.
            nodes = [subprocess.Popen(
                [sys.executable, __file__, "--dkg-node", json.dumps(
                    [url, RUN, str(root / f"v{i}.key"), str(root / f"state{i}"),
                     poll_seconds])], stdout=subprocess.PIPE, text=True)
                for i in range(n)]
            outs = []
            for node in nodes:
                out, _ = node.communicate(timeout=1800)
                if node.returncode != 0:
                    raise SystemExit(f"n={n}: a validator process failed ({node.returncode})")
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
            procs.stop_all()
    if len({o["group"] for o in outs}) != 1 or not all(o["share"] for o in outs):
        raise SystemExit(f"n={n}: the validator processes did not all hold one group key")
    wall = max(o["ended"] for o in outs) - max(o["started"] for o in outs)
    cpu = [o["cpu"] for o in outs]
    up = statistics.mean(o["up"] for o in outs)
    down = statistics.mean(o["down"] for o in outs)
    print(f"DKG wall (last start to last group key) {wall:.1f} s; CPU per validator median "
          f"{statistics.median(cpu):.1f} s, max {max(cpu):.1f} s; bytes per validator up "
          f"{up / 1e3:.1f} kB, down {down / 1e3:.1f} kB (polls every {poll_seconds:g} s)",
          flush=True)
    return (f"beacon_http: n={n} quorum={quorum} dkg_wall_s={wall:.1f} "
            f"dkg_cpu_s_max={max(cpu):.1f} dkg_bytes_per_validator={up + down:.0f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--dkg-node"]:  # one validator process of bench_http
        print(json.dumps(dkg_node_process(*json.loads(argv[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="4,16,64", help="validator counts (default 4,16,64)")
    parser.add_argument("--quorums", type=int, default=20,
                        help="random quorums combined per n (default 20)")
    parser.add_argument("--all-cold", action="store_true",
                        help="every validator decodes the deals itself (slow at n = 64)")
    parser.add_argument("--http-sizes", default="4,16",
                        help="validator counts for the DKG over HTTP with real processes "
                        "(default 4,16; empty: none)")
    parser.add_argument("--poll-seconds", type=float, default=0.5,
                        help="how often an HTTP validator polls the board (the node default)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    http_sizes = [int(x) for x in args.http_sizes.split(",") if x]
    if not sizes or min(sizes + http_sizes) < 2:
        parser.error("--sizes and --http-sizes take validator counts of 2 or more")
    if args.quorums < 1:
        parser.error("--quorums must be 1 or more")
    lines = [bench_http(n, args.poll_seconds) for n in http_sizes]
    lines += [bench_n(n, args) for n in sizes]
    print()
    for line in lines:
        print(line)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
