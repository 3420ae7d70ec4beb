"""Whole rounds through a real LedgerStore, without torch: fake verdicts, real signatures.

``play_run`` registers workers, takes their signed submissions, closes each
round, posts the validators' beacon shares and signed, BLS-attested round
results (verdicts and scores made by :mod:`veritrain.protocol.scoring` from the
kinds of workers given), and so finalizes rounds with real quorum
certificates: the ledger rows an auditor checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from fakes import FakeRun, make_fake_run, make_submission
from veritrain.ledger.chain import (
    GENESIS_HASH,
    ChainRow,
    checkpoint_signing_root,
    compute_event_hash,
)
from veritrain.ledger.store import LedgerStore
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest
from veritrain.protocol.identity import Identity
from veritrain.protocol.rules import expected_samples

from veritrain.synthetic import (  # noqa: F401 (re-exported for the ledger tests)
    COPIER,
    FREE_RIDER,
    HONEST,
    REJECT_REASON,
    SPOT_FAIL,
    beacon_share,
    build_results,
    registration,
)


@dataclass
class Played:
    run: FakeRun
    store: LedgerStore
    workers: dict[str, str]  # pubkey -> kind
    rounds: int
    verified_work: dict[str, int] = field(default_factory=dict)


def register(store: LedgerStore, run: FakeRun, worker: Identity) -> None:
    store.register(registration(run, worker))


def _blob(store: LedgerStore, data: bytes, kind: str, run_id: str) -> str:
    digest = hashlib.sha256(data).hexdigest()
    store.record_blob(digest, len(data), kind, run_id)
    return digest


def finalize_round(store: LedgerStore, run: FakeRun, r: int, base: str,
                   subs: dict[str, str], kinds: dict[str, str],
                   quality: dict[str, float] | None = None) -> str:
    """Post beacon shares and a quorum of identical results for closed round ``r``."""
    spec = run.spec
    sealed = sealed_list_digest([hashlib.sha256(e).hexdigest()
                                 for e in store.sealed_submissions(spec.run_id, r)[0]])
    for v in run.validators[: spec.quorum]:
        store.post_beacon_share(beacon_share(run, v, r, sealed))
    with store.sessions() as s:
        from veritrain.ledger import schema as t

        beacon = s.get(t.Round, (spec.run_id, r)).beacon
    results, blobs = build_results(run, r, base, beacon_seed_of(beacon), subs, kinds, quality)
    for name, data in blobs.items():
        _blob(store, data, name, spec.run_id)
    for res in results:
        store.post_result(res)
    return res.message.certified["model_hash"]


def play_run(store: LedgerStore, run: FakeRun, kinds: list[str], rounds: int, *,
             quality: dict[int, float] | None = None,
             join_round: dict[int, int] | None = None,
             turns: dict[int, tuple[int, str]] | None = None) -> Played:
    """``rounds`` finalized rounds with one worker per entry of ``kinds``; worker ``i``
    registers in round ``join_round[i]`` (default 0), its updates keep ``quality[i]``,
    and from round ``turns[i][0]`` on it behaves as ``turns[i][1]``."""
    spec = run.spec
    _blob(store, run.dataset, "dataset", spec.run_id)
    _blob(store, run.genesis, "model", spec.run_id)
    store.create_run(run.signed)
    ids = [Identity.generate("worker") for _ in kinds]
    by_key = {w.public_key.hex(): k for w, k in zip(ids, kinds, strict=True)}
    joins = {w.public_key.hex(): (join_round or {}).get(i, 0) for i, w in enumerate(ids)}
    q_by_key = {w.public_key.hex(): (quality or {}).get(i, 1.0) for i, w in enumerate(ids)}
    base = spec.genesis_model_hash
    played = Played(run, store, by_key, rounds)
    banned_until: dict[str, int] = {}
    for r in range(rounds):
        now = dict(by_key)
        for i, (start, kind) in (turns or {}).items():
            if r >= start:
                now[ids[i].public_key.hex()] = kind
        subs: dict[str, str] = {}
        for w in ids:
            if joins[w.public_key.hex()] == r:
                register(store, run, w)
        for w in ids:
            payload = f"payload {r} {w.public_key.hex()}".encode()
            if joins[w.public_key.hex()] > r or banned_until.get(w.public_key.hex(), -1) >= r:
                continue  # banned after its failed spot check
            digest = hashlib.sha256(payload).hexdigest()
            store.record_blob(digest, len(payload), "payload", spec.run_id, r)
            signed = make_submission(run, w, payload, round_index=r, base=base)
            store.accept_submission(signed, digest, len(payload))
            subs[w.public_key.hex()] = signed.digest
        with store.sessions() as s:
            from veritrain.ledger import schema as t

            assert s.get(t.Round, (spec.run_id, r)).status == "closed", "round did not close"
        base = finalize_round(store, run, r, base, subs, now, q_by_key)
        for w in subs:
            if now[w] == SPOT_FAIL and spec.verification["ban_rounds"] > 0:
                banned_until[w] = r + spec.verification["ban_rounds"]
            if now[w] == HONEST:
                played.verified_work[w] = played.verified_work.get(w, 0) + expected_samples(spec)
    return played


def make_store(url: str) -> LedgerStore:
    return LedgerStore(url, Identity.generate("ledger"))


def quick_run(run_id: str = "audit-run", **overrides: Any) -> FakeRun:
    schedule = {"round_seconds": 3600.0, "min_submissions": 1, "max_rounds": 50}
    return make_fake_run(run_id, schedule=schedule, **overrides)


def rechain(rows: list[ChainRow], key: Identity) -> list[ChainRow]:
    """What a ledger operator can do with its own key: re-hash and re-sign every row."""
    out, prev = [], GENESIS_HASH
    for row in rows:
        h = compute_event_hash(prev, row.seq, row.kind, row.body)
        sig = (key.sign_ed25519(checkpoint_signing_root(row.run_id, row.seq, h)).hex()
               if row.checkpoint is not None else None)
        out.append(dataclasses.replace(row, prev_hash=prev, hash=h, checkpoint=sig))
        prev = h
    return out
