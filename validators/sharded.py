"""Sharded aggregation for a validator: its own shard, and settling everyone else's.

A sharded run (``aggregator.shards = V``, one shard per validator) replaces the
local aggregation step of a round (validators/round.py) with:

1. ``compute_own_shard``: the CenteredClip fixed point on this validator's
   coordinates (``aggregation.secure.aggregate_shard``), published with
   ``encode_shard_result``;
2. once the ledger fixed the list of published results and a quorum's BLS
   shares fixed the check seed, ``settle_shards``: check every other listed
   result on the blocks every checker draws (the union, so that all honest
   validators decide alike), settle each failed check, missing, misplaced or
   undecodable result by recomputing the shard (the exact check decides whether
   its publisher is at fault), and assemble the full aggregate.

Everything here is a function of its inputs; the node (validators/node.py)
does the posting and waiting. specs/secure-averaging.md, sections A and E.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from veritrain.aggregation.secure import (
    NonFiniteShardError,
    ShardCheck,
    ShardFinding,
    ShardResult,
    aggregate_shard,
    assemble_shards,
    check_shard_result,
    recompute_shard,
    shard_bounds,
    shard_tau,
)
from veritrain.aggregation.secure.sharding import malformation
from veritrain.protocol.errors import OversizedError, PayloadError
from veritrain.protocol.tensors import canonical_safetensors

from .round import FilteredRound

#: Names of the tensors in a shard result file.
SHARD_TENSORS = {"aggregate": torch.float32, "distances": torch.float64,
                 "heavy_blocks": torch.int64}
#: Metadata fields of a shard result file (decimal integers, tau as float.hex()).
SHARD_FIELDS = ("shard", "publisher", "start", "stop", "iterations", "tau")


def inputs_digest(filtered: FilteredRound) -> str:
    """What a validator aggregated: sha256 over the accepted submissions' digests (in row
    order) and the radius tau, so validators see at once whether they agree on the rows."""
    h = hashlib.sha256(b"veritrain/v1/secure/shard-inputs")
    for worker in filtered.accepted:
        h.update(bytes.fromhex(filtered.by_worker[worker].signed.digest))
    h.update(float(filtered.tau or 0.0).hex().encode())
    return h.hexdigest()


def shard_radius(filtered: FilteredRound, dim: int, num_shards: int, shard: int) -> float:
    """``tau_j = tau sqrt(n_j / D)``: the round's radius scaled to shard j's coordinates."""
    if filtered.tau is None:
        raise ValueError("sharded aggregation needs the round's clipping radius")
    return shard_tau(float(filtered.tau), dim, shard_bounds(dim, num_shards)[shard])


def compute_own_shard(filtered: FilteredRound, num_shards: int, me: int) -> ShardResult:
    """This validator's shard result over the round's accepted rows."""
    assert filtered.stacked is not None
    dim = filtered.stacked.shape[1]
    return aggregate_shard(filtered.stacked, shard=me, num_shards=num_shards,
                           tau=shard_radius(filtered, dim, num_shards, me), publisher=me)


def encode_shard_result(result: ShardResult) -> bytes:
    """A safetensors file: the three tensors, the header fields as metadata (never pickle),
    the same bytes for the same result in every process (a validator that restarts
    resends exactly what it published)."""
    meta = {"shard": str(result.shard), "publisher": str(result.publisher),
            "start": str(result.start), "stop": str(result.stop),
            "iterations": str(result.iterations), "tau": float(result.tau).hex()}
    tensors = {"aggregate": result.aggregate.detach().to(torch.float32).cpu().contiguous(),
               "distances": result.distances.detach().to(torch.float64).cpu().contiguous(),
               "heavy_blocks": result.heavy_blocks.detach().to(torch.int64).cpu().contiguous()}
    return canonical_safetensors(st_save(tensors, metadata=meta))


def decode_shard_result(data: bytes, *, max_bytes: int) -> ShardResult:
    """Parse a shard result file; its fields are judged by the checks, not trusted here.

    Refuses files over ``max_bytes`` before parsing, other tensor names or
    dtypes, and header fields that are not integers (tau: a float's hex form).
    """
    if len(data) > max_bytes:
        raise OversizedError(f"shard result file of {len(data)} bytes exceeds {max_bytes}")
    if len(data) < 8:
        raise PayloadError("shard result file shorter than its header length")
    header_len = int.from_bytes(data[:8], "little")
    if 8 + header_len > len(data):
        raise PayloadError("shard result file header runs past its end")
    try:
        header = json.loads(data[8:8 + header_len])
        tensors = st_load(bytes(data))
    except Exception as exc:  # the parser reports malformed files with its own types
        raise PayloadError(f"shard result file does not parse: {exc}") from exc
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or set(meta) != set(SHARD_FIELDS):
        raise PayloadError(f"shard result metadata must hold exactly {list(SHARD_FIELDS)}")
    if set(tensors) != set(SHARD_TENSORS) or any(
            tensors[name].dtype != dtype or tensors[name].ndim != 1
            for name, dtype in SHARD_TENSORS.items()):
        raise PayloadError("shard result tensors must be 1-D aggregate (float32), "
                           "distances (float64) and heavy_blocks (int64)")
    try:
        ints = {k: int(meta[k]) for k in SHARD_FIELDS if k != "tau"}
        tau = float.fromhex(meta["tau"])
    except (ValueError, TypeError) as exc:
        raise PayloadError(f"shard result metadata: {exc}") from exc
    return ShardResult(ints["shard"], ints["publisher"], ints["start"], ints["stop"], tau,
                       tensors["aggregate"], tensors["distances"], tensors["heavy_blocks"],
                       ints["iterations"])


@dataclass(frozen=True)
class Dispute:
    """How one shard other than this validator's own was settled.

    ``reason`` is the finding's (``ok`` for a false alarm), or ``missing`` /
    ``malformed: ...`` when nothing usable was published; ``faulty`` blames the
    publisher; ``replacement`` is what this validator used instead (None: the
    published result stands).
    """

    shard: int
    publisher: int
    faulty: bool
    reason: str
    published_digest: bytes | None
    replacement: ShardResult | None
    max_abs_deviation: float | None
    check: ShardCheck | None = None


@dataclass(frozen=True)
class Settlement:
    """The assembled aggregate, every sampled check made and every dispute settled."""

    aggregate: torch.Tensor
    checks: list[ShardCheck]
    disputes: list[Dispute]
    used: list[ShardResult]


def _from_finding(finding: ShardFinding, replacement: ShardResult, check: ShardCheck | None
                  ) -> Dispute:
    return Dispute(finding.shard, finding.publisher, finding.faulty, finding.reason,
                   finding.published_digest or None,
                   replacement if finding.faulty else None, finding.max_abs_deviation, check)


def settle_shards(
    filtered: FilteredRound,
    own: ShardResult,
    published: Mapping[int, ShardResult | str | None],
    *,
    num_shards: int,
    me: int,
    check_seed: bytes,
) -> Settlement:
    """Check the other shards, recompute what fails, assemble the aggregate.

    ``published`` maps each other shard to its decoded result, to the reason it
    could not be decoded (``str``), or to None when the fixed list has none.
    Honest results pass; a failed sampled check is settled by ``recompute_shard``,
    whose exact check blames the publisher only if its result is really wrong.
    """
    assert filtered.stacked is not None
    xs = filtered.stacked
    dim = xs.shape[1]
    used: dict[int, ShardResult] = {me: own}
    checks: list[ShardCheck] = []
    disputes: list[Dispute] = []
    for k in range(num_shards):
        if k == me:
            continue
        tau_k = shard_radius(filtered, dim, num_shards, k)
        result = published.get(k)
        if isinstance(result, ShardResult):
            problem = malformation(result, xs.shape[0], k, num_shards, dim, tau_k,
                                   scan_aggregate=False)
            if problem is not None:
                result = problem
        if not isinstance(result, ShardResult):
            replacement = aggregate_shard(xs, shard=k, num_shards=num_shards, tau=tau_k,
                                          publisher=me)
            reason = "missing" if result is None else f"malformed: {result}"
            disputes.append(Dispute(k, k, True, reason, None, replacement, None))
            used[k] = replacement
            continue
        # Every checker's sample, not only this validator's: honest validators then
        # reach the same decision (and the union is what the soundness bound counts).
        shard_checks = [check_shard_result(result, xs, num_shards=num_shards, tau=tau_k,
                                           check_seed=check_seed, checker=c)
                        for c in range(num_shards) if c != k]
        checks.extend(shard_checks)
        used[k] = result
        failed = next((c for c in shard_checks if not c.ok), None)
        if failed is not None:
            replacement, finding = recompute_shard(result, xs, num_shards=num_shards, tau=tau_k,
                                                   recomputed_by=me, trigger=failed)
            disputes.append(_from_finding(finding, replacement, failed))
            if finding.faulty:
                used[k] = replacement
    ordered = [used[k] for k in range(num_shards)]
    try:
        aggregate = assemble_shards(ordered, dim)
    except NonFiniteShardError as exc:
        for k in exc.shards:
            replacement, finding = recompute_shard(
                ordered[k], xs, num_shards=num_shards,
                tau=shard_radius(filtered, dim, num_shards, k), recomputed_by=me)
            disputes.append(_from_finding(finding, replacement, None))
            ordered[k] = replacement
        aggregate = assemble_shards(ordered, dim)
    return Settlement(aggregate, checks, disputes, ordered)
