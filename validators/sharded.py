"""Sharded aggregation for a validator: its own shard, and settling everyone else's.

A sharded run (``aggregator.shards = V``, one shard per validator) replaces the
local aggregation step of a round (validators/round.py) with:

1. ``compute_own_shard``: the CenteredClip fixed point on this validator's
   coordinates (``aggregation.secure.aggregate_shard``), published with
   ``encode_shard_result``;
2. one signed list of the verified publications (``ShardedRound``, at most one list per
   round: protocol/board.py ``SignedOnce``), then the fixed list and its check seed,
   recomputed from a quorum of signed shares (``verified_check``), never as served;
3. ``settle_shards``: a dense check of every coordinate of every other listed result
   (``dense_check``: the stationarity residual's norm and the exact distances), an exact
   recomputation of what fails (the exact check decides whether its publisher is at
   fault), and the full aggregate. With ``aggregator.shard_checkers = k`` below V - 1
   (threshold-beacon runs), a validator checks only the k shards the round's beacon draws
   it for (``beacon.shard_checkers``), signs an ``ok`` finding for each that passes, and takes
   every other result on the word of all its checkers; one doubt, a missing verdict by
   ``shard_wait`` or a non-ok finding, and it checks that shard itself.

Everything but ``ShardedRound`` is a function of its inputs. specs/secure-averaging.md,
sections A and E.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from veritrain.aggregation.secure import (
    NonFiniteShardError,
    ShardFinding,
    ShardResult,
    aggregate_shard,
    assemble_shards,
    recompute_shard,
    shard_bounds,
    shard_tau,
)
from veritrain.aggregation.secure.sharding import (
    ETA_D,
    ETA_V,
    TINY,
    fixed_point_coefficients,
    malformation,
)
from veritrain.ledger.client import LedgerRefused
from veritrain.protocol.beacon import shard_check_body, shard_check_root, shard_checkers
from veritrain.protocol.board import BoardFault, SignedOnce, members_posts, quorum_seed
from veritrain.protocol.errors import OversizedError, PayloadError, RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    RunSpec,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    max_shard_file_bytes,
    sign,
)
from veritrain.protocol.tensors import canonical_safetensors, sha256_hex

from .round import FilteredRound

log = logging.getLogger("veritrain.validator")

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


#: Columns per step of the dense check: an [N, 8192] float64 block stays in cache.
DENSE_CHUNK = 8192


@dataclass(frozen=True)
class DenseCheck:
    """One dense check of a published shard result (``dense_check``).

    ``worst_stationarity``: ``||v - X^T a(d)|| / R`` (> 1 fails); ``worst_distance``: max
    over rows of the (V1) deviation over its tolerance (> 1 fails); ``suspect_rows``: the
    rows whose published distance is wrong."""

    ok: bool
    shard: int
    publisher: int
    reason: str
    worst_stationarity: float = 0.0
    worst_distance: float = 0.0
    suspect_rows: tuple[int, ...] = ()


def dense_check(result: ShardResult, updates: torch.Tensor, *, num_shards: int,
                tau: float) -> DenseCheck:
    """Check a published shard result on every coordinate in one pass; never raises for a
    bad result (specs/secure-averaging.md A.5).

    With ``a = a(d)`` from the published distances, the stationarity residual
    ``delta = v - X^T a`` is computed on every coordinate (float64) and its norm held to
    ``R = ETA_V sum_i a_i ||x_i|| + 2^-149 sqrt(n)``, which every result satisfying (V2)
    meets (``||t||_2 <= R`` for the per-coordinate tolerances t, Minkowski): no false
    alarm, and every deviation of norm above R (about 1e-6 of the rows' norms) is caught
    with certainty, whatever the check seed. The distances are recomputed exactly in the
    same pass (``||x_i||^2 - 2 x_i . v + ||v||^2``) and held to (V1), so understated or
    overstated distances (hence clip weights) are caught exactly too. Cost: one float64
    pass over the shard's rows (two matrix-vector products and the row norms).
    """
    n_rows, dim = updates.shape
    shard = result.shard if isinstance(result, ShardResult) else -1
    publisher = result.publisher if isinstance(result, ShardResult) else -1
    why = malformation(result, n_rows, shard, num_shards, dim, tau, scan_aggregate=False)
    if why is not None:
        return DenseCheck(False, shard, publisher, f"malformed: {why}")
    start, stop = shard_bounds(dim, num_shards)[shard]
    xs, v = updates[:, start:stop], result.aggregate
    a = fixed_point_coefficients(result.distances, torch.ones(n_rows, dtype=torch.float64), tau)
    xv = torch.zeros(n_rows, dtype=torch.float64)
    xx = torch.zeros(n_rows, dtype=torch.float64)
    rr = vv = 0.0
    for s in range(0, stop - start, DENSE_CHUNK):
        c = xs[:, s:s + DENSE_CHUNK].to(torch.float64)
        vc = v[s:s + DENSE_CHUNK].to(torch.float64)
        xv += c @ vc
        r = vc - a @ c
        rr += float(r @ r)
        vv += float(vc @ vc)
        xx += (c * c).sum(1)
    norms = xx.sqrt()
    bound = ETA_V * float(a @ norms) + TINY * math.sqrt(stop - start)
    worst_v = math.sqrt(rr) / bound if math.isfinite(rr) else math.inf
    v_norm = math.sqrt(vv) if math.isfinite(vv) else math.inf
    true_d = (xx - 2 * xv + vv).clamp(min=0.0).sqrt()
    tol_d = ETA_D * (true_d.clamp(min=tau) + float(norms.max()) + v_norm)
    ratio_d = ((result.distances - true_d).abs() / tol_d).nan_to_num(nan=math.inf)
    rows = tuple(int(i) for i in torch.nonzero(~(ratio_d <= 1)).flatten())
    reason = "stationarity" if not worst_v <= 1 else "distance" if rows else "ok"
    return DenseCheck(reason == "ok", shard, publisher, reason, worst_v,
                      float(ratio_d.max()), rows)


@dataclass(frozen=True)
class Dispute:
    """How one shard other than this validator's own was settled.

    ``reason`` is the exact check's (``ok`` for a dense check that the exact one clears),
    ``malformed: ...`` for a signed publication whose file is unusable (the publisher's
    fault), ``missing`` when the verified list or the board has no usable result (nobody is
    blamed: the ledger may have left it out), or ``inputs_differ: ...`` when the result
    fails on rows other than the ones its publisher says it aggregated (its inputs, not
    its arithmetic, are in question: not blamed); ``faulty`` blames the publisher;
    ``replacement`` is what this validator used instead (None: the published result
    stands).
    """

    shard: int
    publisher: int
    faulty: bool
    reason: str
    published_digest: bytes | None
    replacement: ShardResult | None
    max_abs_deviation: float | None
    check: DenseCheck | None = None


@dataclass(frozen=True)
class Settlement:
    """The assembled aggregate, every dense check made and every dispute settled."""

    aggregate: torch.Tensor
    checks: list[DenseCheck]
    disputes: list[Dispute]
    used: list[ShardResult]


def _from_finding(finding: ShardFinding, replacement: ShardResult, check: DenseCheck | None,
                  *, inputs_differ: bool = False) -> Dispute:
    faulty = finding.faulty and not inputs_differ
    reason = f"inputs_differ: {finding.reason}" if finding.faulty and inputs_differ else (
        finding.reason)
    return Dispute(finding.shard, finding.publisher, faulty, reason,
                   finding.published_digest or None,
                   replacement if finding.faulty else None, finding.max_abs_deviation, check)


def settle_shards(
    filtered: FilteredRound,
    own: ShardResult,
    published: Mapping[int, ShardResult | str | None],
    *,
    num_shards: int,
    me: int,
    inputs_differ: frozenset[int] | set[int] = frozenset(),
    trusted: frozenset[int] | set[int] = frozenset(),
) -> Settlement:
    """Check the other shards densely, recompute what fails, assemble the aggregate.

    ``trusted``: shards taken as given without a dense check (well-formed results only):
    in a round that delegates checking, the shards drawn for others to check (their
    verdicts are awaited afterwards, and a doubted one settled again without it), and
    results this validator settled already.

    ``published`` maps each other shard to its decoded result, to the reason its signed
    file is unusable (``str``: the publisher's fault), or to None when the verified list
    or the board has none (recomputed, nobody blamed). Every coordinate of every result is
    checked (``dense_check``): honest results pass; a failed check is settled by
    ``recompute_shard``, whose exact check blames the publisher only if its result is
    really wrong on the rows it says it aggregated (``inputs_differ``: shards whose
    publication names other inputs than this validator's, never blamed). Deterministic
    given the inputs, so honest validators settle alike.
    """
    assert filtered.stacked is not None
    xs = filtered.stacked
    dim = xs.shape[1]
    used: dict[int, ShardResult] = {me: own}
    checks: list[DenseCheck] = []
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
            blamed = result is not None
            reason = f"malformed: {result}" if blamed else "missing"
            disputes.append(Dispute(k, k, blamed, reason, None, replacement, None))
            used[k] = replacement
            continue
        used[k] = result
        if k in trusted:
            continue
        check = dense_check(result, xs, num_shards=num_shards, tau=tau_k)
        checks.append(check)
        if not check.ok:
            replacement, finding = recompute_shard(result, xs, num_shards=num_shards, tau=tau_k,
                                                   recomputed_by=me, trigger=check)
            disputes.append(_from_finding(finding, replacement, check,
                                          inputs_differ=k in inputs_differ))
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
            disputes.append(_from_finding(finding, replacement, None,
                                          inputs_differ=k in inputs_differ))
            ordered[k] = replacement
        aggregate = assemble_shards(ordered, dim)
    return Settlement(aggregate, checks, disputes, ordered)


def shard_aggregate_digest(result: ShardResult) -> str:
    """SHA-256 over a shard aggregate's float32 values (little endian), in its own domain:
    the same for every validator that computed the same values, whoever published them."""
    h = hashlib.sha256(b"veritrain/v1/secure/shard-aggregate")
    values = result.aggregate.detach().to(torch.float32).cpu().contiguous()
    h.update(memoryview(values.numpy()).cast("B"))
    return h.hexdigest()


def shard_sources(settled: Settlement, listed: list[str | None]) -> list[dict[str, Any]]:
    """What the certified state names of the assembled aggregate (``CertifiedState.shards``):
    per shard the verified list's digest when the result used is exactly the listed
    publication, null when it was recomputed (missing, malformed or proven faulty), and the
    digest of the values used. The audit checks every null against a proven fault or an
    empty list entry (specs/secure-averaging.md E.1)."""
    out: list[dict[str, Any]] = []
    for k, used in enumerate(settled.used):
        taken = listed[k] is not None and used.digest().hex() == listed[k]
        out.append({"shard": k, "result": listed[k] if taken else None,
                    "aggregate": shard_aggregate_digest(used)})
    return out


# --------------------------------------------------------------------- the board


def verified_publications(wires: Any, spec: RunSpec, r: int, faults: list[str]
                          ) -> dict[int, list[ShardPublication]]:
    """Each shard's publications that check out (board rule 1): signed in the
    ``shard_result`` domain by the validator assigned the shard (validator k publishes
    shard k), for this run and round; the rest is skipped with its reason in ``faults``."""
    posts = members_posts(wires, ShardPublication, member_field="validator",
                          members=[v["ed25519"] for v in spec.validators], run_id=spec.run_id,
                          round_index=r, faults=faults)
    out: dict[int, list[ShardPublication]] = {}
    for k, signed in posts.items():
        for p in signed:
            if p.message.shard != k:
                faults.append(f"validator {k}'s shard_result post is for shard "
                              f"{p.message.shard}")
                continue
            out.setdefault(k, []).append(p.message)
    return out


def verified_check(check: Any, share_wires: Any, spec: RunSpec, r: int,
                   faults: list[str]) -> tuple[list[str | None], bytes]:
    """The fixed list of shard results and its check seed, recomputed from the signed
    shares it comes from (board rule 2), never taken as served: a quorum of the run's
    validators, each with its own signed ``ShardCheckShare`` over exactly that list, each
    share a valid BLS signature of its ``shard_check_root``. :class:`BoardFault` otherwise;
    a served seed that differs from the recomputed one is recorded in ``faults``."""
    results = check.get("results") if isinstance(check, dict) else None
    if not isinstance(results, list) or len(results) != spec.shards or any(
            d is not None and not isinstance(d, str) for d in results):
        raise BoardFault(f"the fixed shard list is not {spec.shards} result digests")
    try:
        root = shard_check_root(spec.run_id, r, results)
    except ValueError as exc:
        raise BoardFault(f"the fixed shard list does not encode: {exc}") from exc
    posts = members_posts(share_wires, ShardCheckShare, member_field="validator",
                          members=[v["ed25519"] for v in spec.validators],
                          run_id=spec.run_id, round_index=r, faults=faults, results=results)
    seed = quorum_seed(check, posts, bls_keys=[v["bls"] for v in spec.validators],
                       quorum=spec.quorum, root=root)
    if check.get("seed") != seed.hex():
        faults.append("the served check seed differs from the one its shares give")
    return list(results), seed


def list_to_sign(fixed: Any, pubs: Mapping[int, list[ShardPublication]], num_shards: int,
                 *, complete: bool) -> list[str | None] | None:
    """The shard list this validator may sign now, or None (wait): the list the board says
    is fixed if each of its digests is a verified publication of that shard's validator;
    else, once ``complete`` (every shard published or the wait is over), the verified
    publications (the first of each validator). Never a digest nobody signed."""
    if isinstance(fixed, list):
        if len(fixed) == num_shards and all(
                d is None or any(p.result_digest == d for p in pubs.get(k, ()))
                for k, d in enumerate(fixed)):
            return list(fixed)
        return None
    if not complete and len(pubs) < num_shards:
        return None
    return [pubs[k][0].result_digest if k in pubs else None for k in range(num_shards)]


def vouched_shards(posts: Mapping[int, list[Any]], listed: list[str | None],
                   checkers: list[tuple[int, ...]], delegated: set[int]
                   ) -> tuple[set[int], set[int]]:
    """``(vouched, decided)`` among the ``delegated`` shards, from the verified findings
    ``posts`` (``members_posts``: validator index -> its signed ``ShardFindingReport``s).

    A shard is vouched for when every one of its drawn ``checkers`` has an ``ok`` finding
    (not faulty, reason ``ok``) about exactly the listed digest and nothing else; decided
    when vouched, or doubted: some checker posted anything else about it (a faulty
    finding, another digest, a second post). Findings of validators not drawn for the
    shard count for nothing."""
    verdicts: dict[int, dict[int, bool]] = {}  # shard -> checker -> all its posts ok
    for checker, signed in posts.items():
        for post in signed:
            f = post.message
            if f.shard not in delegated or checker not in checkers[f.shard]:
                continue
            ok = (not f.faulty and f.reason == "ok" and f.published_digest == listed[f.shard]
                  and f.replacement_digest == listed[f.shard])
            seen = verdicts.setdefault(f.shard, {})
            seen[checker] = ok and checker not in seen
    vouched = {k for k in delegated
               if len(verdicts.get(k, {})) == len(checkers[k]) and all(verdicts[k].values())}
    doubted = {k for k in delegated if not all(verdicts.get(k, {}).values())}
    return vouched, vouched | doubted


def list_digest(results: list[str | None]) -> str:
    """What ``SignedOnce`` records for a signed shard list: its ``shard_check_body``."""
    return shard_check_body([bytes.fromhex(d) if d else b"" for d in results]).hex()


@dataclass
class ShardedRound:
    """A validator's side of a sharded round over the ledger's board (the network part of
    ``settle_shards``): publish, sign one list, verify the list and seed from a quorum of
    signed shares, fetch the verified publications' files, settle, post findings.

    ``once`` remembers the list signed per round (at most one, across restarts);
    ``skipped`` collects the board posts that did not check out (recorded, never fatal)."""

    client: Any
    identity: Identity
    once: SignedOnce
    poll_seconds: float = 0.5
    shard_wait: float = 120.0
    attack: str | None = None
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def _record(self, r: int, faults: list[str]) -> None:
        for detail in faults:
            log.warning("round %d: shard board post skipped: %s", r, detail)
            self.skipped.append({"round": r, "reason": "board_fault", "detail": detail[:300]})
        faults.clear()

    async def aggregate(self, spec: RunSpec, filtered: FilteredRound,
                        beacon_seed: bytes | None = None
                        ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Publish this validator's shard, fix and verify the list and seed, settle the rest.
        Returns the aggregate and where each shard of it came from (``shard_sources``).
        ``beacon_seed``: the round's (threshold) beacon seed, which draws the checkers when
        ``spec.shard_checkers`` is below V - 1."""
        r = filtered.round_index
        me = spec.validator_index(self.identity.public_key.hex())
        assert me is not None
        path = f"/v1/runs/{spec.run_id}/rounds/{r}/shards"
        own = await asyncio.to_thread(compute_own_shard, filtered, spec.shards, me)
        mine = await self._publish(spec, r, me, own, inputs_digest(filtered), path)
        faults: list[str] = []
        view = await self._sign_list(spec, r, path, faults)
        while view.get("check") is None:
            await asyncio.sleep(self.poll_seconds)
            view = await self.client.get_json(path)
            if view.get("check") is None and (await self.client.get_json(
                    f"/v1/runs/{spec.run_id}/rounds/{r}"))["status"] in ("finalized", "voided"):
                raise LedgerRefused(409, "round_finalized", "finalized before the check seed")
        pubs = verified_publications(view.get("results"), spec, r, faults)
        try:
            listed, _seed = verified_check(view["check"], view.get("check_shares"), spec, r,
                                            faults)
        finally:
            self._record(r, faults)
        others: dict[int, ShardResult | str | None] = {}
        differ: set[int] = set()
        limit = max_shard_file_bytes(spec.num_params, spec.shards)
        for k in range(spec.shards):
            if k == me:
                continue
            p = next((p for p in pubs.get(k, ()) if p.result_digest == listed[k]), None)
            if p is None:
                if listed[k] is not None:
                    faults.append(f"the listed result of shard {k} has no verified "
                                  "publication on the board")
                others[k] = None
                continue
            if p.inputs_digest != mine.inputs_digest:
                log.warning("round %d: validator %d aggregated other rows than this one", r, k)
                differ.add(k)
            others[k] = await self._fetch(p, limit, faults)
        self._record(r, faults)
        delegating = spec.shard_checkers < spec.shards - 1
        if delegating and beacon_seed is None:
            raise ValueError("delegated shard checking draws its checkers from the round's "
                             "beacon seed")
        # The round's threshold beacon: unique, so neither the ledger nor any quorum can
        # grind the draw (the check seed above is a quorum of individual shares the ledger
        # picks among; specs/secure-averaging.md E.1, step 4a).
        checkers = shard_checkers(beacon_seed or b"", spec.shards, spec.shard_checkers)
        to_check = {k for k in range(spec.shards) if me in checkers[k]}
        # Results computed on other rows than this validator's are checked here (a checker's
        # ok does not say which rows it checked them on).
        delegated = ({k for k, res in others.items() if isinstance(res, ShardResult)}
                     - to_check - differ)
        settled = await asyncio.to_thread(settle_shards, filtered, own, others,
                                          num_shards=spec.shards, me=me, inputs_differ=differ,
                                          trusted=delegated)
        delegated -= {d.shard for d in settled.disputes}  # already replaced here
        # Where checking is delegated, the others wait for this validator's word on the
        # shards it was drawn to check: an ok finding for each that passed.
        vouch = ({k for k in to_check if isinstance(others.get(k), ShardResult)}
                 if delegating else set())
        await self._post_findings(spec, r, settled, listed, vouch=vouch)
        if delegated:
            vouched = await self._vouched(spec, r, path, listed, checkers, delegated, faults)
            doubted = delegated - vouched
            if doubted:
                log.info("round %d: shards %s not vouched for by all their checkers; checking "
                         "them here", r, sorted(doubted))
                known: dict[int, ShardResult | str | None] = {
                    k: settled.used[k] for k in range(spec.shards) if k != me}
                again = await asyncio.to_thread(
                    settle_shards, filtered, own, known, num_shards=spec.shards, me=me,
                    inputs_differ=differ, trusted=set(known) - doubted)
                await self._post_findings(spec, r, again, listed)
                settled = Settlement(again.aggregate, settled.checks + again.checks,
                                     settled.disputes + again.disputes, again.used)
        return settled.aggregate, await asyncio.to_thread(shard_sources, settled, listed)

    async def _vouched(self, spec: RunSpec, r: int, path: str, listed: list[str | None],
                       checkers: list[tuple[int, ...]], delegated: set[int],
                       faults: list[str]) -> set[int]:
        """``vouched_shards`` over the board's findings, read until every delegated shard
        is decided or ``shard_wait`` runs out (a round finalized meanwhile ends the wait
        like the check seed's: ``round_finalized``)."""
        deadline = time.monotonic() + self.shard_wait
        while True:
            view = await self.client.get_json(path)
            posts = members_posts(view.get("findings"), ShardFindingReport,
                                  member_field="validator",
                                  members=[v["ed25519"] for v in spec.validators],
                                  run_id=spec.run_id, round_index=r, faults=faults)
            self._record(r, faults)
            vouched, decided = vouched_shards(posts, listed, checkers, delegated)
            if decided == delegated or time.monotonic() >= deadline:
                return vouched
            if (await self.client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}"))[
                    "status"] in ("finalized", "voided"):
                raise LedgerRefused(409, "round_finalized", "finalized before the checkers' "
                                    "verdicts")
            await asyncio.sleep(self.poll_seconds)

    async def _publish(self, spec: RunSpec, r: int, me: int, own: ShardResult, inputs: str,
                       path: str) -> ShardPublication:
        published = own
        if self.attack == "shard_shift":
            published = replace(own, aggregate=own.aggregate * (1 + 1e-3))
        blob = encode_shard_result(published)
        pub = ShardPublication(run_id=spec.run_id, round=r,
                               validator=self.identity.public_key.hex(), shard=me,
                               inputs_digest=inputs, result_digest=published.digest().hex(),
                               result_hash=sha256_hex(blob), result_bytes=len(blob))
        try:
            await self.client.post_multipart(path, [
                ("publication", sign(self.identity, pub).encode(), "application/json"),
                ("result", blob, "application/octet-stream")])
        except LedgerRefused as exc:
            if exc.reason == "shard_list_fixed":
                log.warning("round %d: shard %d was late, the others recompute it", r, me)
            elif exc.reason == "duplicate":
                # The ledger holds another publication of this shard by this key (one sent
                # before a restart, or a racing resend): the list takes the stored one, the
                # others check it, and this validator goes on like a late one.
                log.warning("round %d: the ledger already holds a publication of shard %d "
                            "(%s); the stored one stands", r, me, exc.detail)
            else:
                raise
        return pub

    async def _sign_list(self, spec: RunSpec, r: int, path: str, faults: list[str]
                         ) -> dict[str, Any]:
        """Sign one list of verified publications (``list_to_sign``), at most one per round
        (``once``): wait for every shard or ``shard_wait``; after a refusal (another list
        was fixed first) sign nothing more and wait for the others' quorum."""
        deadline = time.monotonic() + self.shard_wait
        while True:
            view = await self.client.get_json(path)
            if view.get("check") is not None:
                return view
            pubs = verified_publications(view.get("results"), spec, r, faults)
            self._record(r, faults)
            held = self.once.signed("shard_check", spec.run_id, r)
            results = list_to_sign(view.get("list"), pubs, spec.shards,
                                   complete=time.monotonic() >= deadline)
            if results is not None:
                if held in (None, list_digest(results)):
                    break
                log.warning("round %d: shown another shard list than the one this validator "
                            "signed; it signs no other and waits for the quorum", r)
                return view
            await asyncio.sleep(self.poll_seconds)
        self.once.claim("shard_check", spec.run_id, r, list_digest(results))
        signed_root = await asyncio.to_thread(self.identity.sign_bls,
                                              shard_check_root(spec.run_id, r, results))
        share = ShardCheckShare(run_id=spec.run_id, round=r,
                                validator=self.identity.public_key.hex(), results=results,
                                share=signed_root.hex())
        try:
            await self.client.post_message(path + "/check", sign(self.identity, share).to_wire())
        except LedgerRefused as exc:
            if exc.reason != "shard_list_fixed":
                raise
            log.warning("round %d: another shard list was fixed first (%s); this validator "
                        "signed its list and waits for the others' quorum", r, exc.detail)
        return await self.client.get_json(path)

    async def _fetch(self, p: ShardPublication, limit: int, faults: list[str]
                     ) -> ShardResult | str | None:
        """The file of a verified publication: its decoded result, why the file its
        publisher signed is unusable (its fault), or None when the board does not serve it
        (the ledger's: nobody is blamed)."""
        try:
            data = await self.client.get_blob(p.result_hash, max_bytes=min(p.result_bytes,
                                                                           limit))
        except (LedgerRefused, RejectedInput) as exc:
            faults.append(f"shard {p.shard}'s file unavailable: {exc}")
            return None
        try:
            result = decode_shard_result(data, max_bytes=limit)
        except RejectedInput as exc:
            return str(exc)[:200]
        if result.digest().hex() != p.result_digest:
            return "the file's digest differs from the published one"
        return result

    async def _post_findings(self, spec: RunSpec, r: int, settled: Settlement,
                             listed: list[str | None], *, vouch: set[int] | None = None
                             ) -> None:
        """Post a finding for every dispute, and an ``ok`` one for each shard of ``vouch``
        (the ones this validator was drawn to check) whose dense check passed: the others
        take those results on the word of all their checkers."""
        disputed = {d.shard for d in settled.disputes}
        for k in sorted((vouch or set()) - disputed):
            report = ShardFindingReport(
                run_id=spec.run_id, round=r, validator=self.identity.public_key.hex(),
                shard=k, publisher=spec.validators[k]["ed25519"], faulty=False, reason="ok",
                published_digest=listed[k], replacement_digest=settled.used[k].digest().hex(),
                max_abs_deviation=None)
            await self._post_finding(spec, r, report)
        for d in settled.disputes:
            if d.replacement is None and not d.faulty:
                log.info("round %d: shard %d failed the dense check but is exact (%s)", r,
                         d.shard, d.reason)
            replacement = d.replacement or settled.used[d.shard]
            report = ShardFindingReport(
                run_id=spec.run_id, round=r, validator=self.identity.public_key.hex(),
                shard=d.shard, publisher=spec.validators[d.shard]["ed25519"], faulty=d.faulty,
                reason=d.reason[:200], published_digest=listed[d.shard],
                replacement_digest=replacement.digest().hex(),
                max_abs_deviation=(d.max_abs_deviation if d.max_abs_deviation is not None
                                   and d.max_abs_deviation < 1e300 else None))
            if d.faulty:
                log.warning("round %d: shard %d of validator %d is faulty (%s); recomputed", r,
                            d.shard, d.publisher, d.reason)
            await self._post_finding(spec, r, report)

    async def _post_finding(self, spec: RunSpec, r: int, report: ShardFindingReport) -> None:
        try:
            await self.client.post_message(
                f"/v1/runs/{spec.run_id}/rounds/{r}/shards/findings",
                sign(self.identity, report).to_wire())
        except LedgerRefused as exc:
            log.warning("round %d: finding on shard %d refused: %s", r, report.shard, exc)
