"""Rewards follow verified work: honest workers are paid in proportion to it (within 5%),
free riders and copiers earn nothing; the per-worker totals the API serves are the sums
of the certified rows, and the audit recomputes the same totals from the chain."""

from __future__ import annotations

import math

from ledger_backends import make_fixture
from ledger_harness import run_api
from ledger_scenarios import COPIER, FREE_RIDER, HONEST, make_store, play_run, quick_run
from veritrain.ledger.audit import fetch_and_verify
from veritrain.ledger.client import LedgerClient

ledger_url = make_fixture()
KINDS = [HONEST, HONEST, HONEST, HONEST, FREE_RIDER, COPIER, HONEST]
QUALITY = {0: 1.0, 1: 0.98, 2: 0.96, 3: 1.0, 6: 0.99}  # close to the consensus
JOIN = {6: 2}  # the last honest worker joins in round 2
ROUNDS = 4


def test_rewards_are_proportional_to_verified_work(tmp_path, ledger_url):
    store = make_store(ledger_url)
    played = play_run(store, quick_run("reward-run"), KINDS, ROUNDS, quality=QUALITY,
                      join_round=JOIN)
    store.engine.dispose()
    per_round = played.run.spec.rewards["per_round"]

    async def scenario(api):
        scores = (await api.get("/v1/runs/reward-run/scores?limit=1000"))[1]["workers"]
        verdicts = []
        for r in range(ROUNDS):
            verdicts += (await api.get(f"/v1/runs/reward-run/verdicts?round={r}"))[1]["verdicts"]
        async with LedgerClient(api.url) as client:
            audit = await fetch_and_verify(client, "reward-run")
        return scores, verdicts, audit

    scores, verdicts, audit = run_api(tmp_path, scenario, db_url=ledger_url,
                                      identity=store.identity)
    assert audit.ok, audit.problem
    by_worker = {w["worker"]: w for w in scores}
    kinds = played.workers

    # Round by round: each honest worker's share of the round's reward is its share of the
    # round's verified work, within 5%; everyone else gets exactly nothing.
    for r in range(ROUNDS):
        rows = [v for v in verdicts if v["round"] == r]
        work = {v["worker"]: v["samples"] for v in rows if v["status"] == "accepted"}
        assert math.isclose(sum(v["reward"] for v in rows), per_round)
        for v in rows:
            if kinds[v["worker"]] == HONEST:
                expected = per_round * work[v["worker"]] / sum(work.values())
                assert abs(v["reward"] - expected) <= 0.05 * expected, (r, v)
            else:
                assert v["reward"] == 0.0 and v["score"] == 0.0 and v["status"] == "rejected"

    # Over the run: totals are the sums of the rows, verified work is what was certified.
    for worker, kind in kinds.items():
        total = by_worker[worker]
        assert total["samples"] == played.verified_work.get(worker, 0)
        assert math.isclose(total["reward"], sum(v["reward"] for v in verdicts
                                                 if v["worker"] == worker))
        assert audit.totals[worker]["samples"] == total["samples"]
        assert math.isclose(audit.totals[worker]["reward"], total["reward"])
        if kind != HONEST:
            assert total["reward"] == 0.0 and total["samples"] == 0
    # Workers present in every round did the same work and are paid alike (within 5%).
    full = [by_worker[w]["reward"] for w, k in kinds.items() if k == HONEST
            and by_worker[w]["rounds"] == ROUNDS]
    assert len(full) == 4 and max(full) <= 1.05 * min(full)
    late = next(w for w in kinds if by_worker[w]["registered_round"] == JOIN[6])
    assert by_worker[late]["rounds"] == ROUNDS - JOIN[6]
    assert by_worker[late]["samples"] == played.verified_work[late]
