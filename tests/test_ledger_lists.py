"""Audit lists: pagination, filters (worker, round, status), CSV and JSON exports."""

from __future__ import annotations

import csv
import io
import json

from ledger_backends import make_fixture
from ledger_harness import run_api
from ledger_scenarios import COPIER, FREE_RIDER, HONEST, make_store, play_run, quick_run

ledger_url = make_fixture()
KINDS = [HONEST, HONEST, FREE_RIDER, COPIER]
ROUNDS = 2


async def text(api, path: str) -> tuple[int, str, str]:
    async with api.session.get(api.url + path) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


def test_pages_filters_and_exports_agree(tmp_path, ledger_url):
    store = make_store(ledger_url)
    played = play_run(store, quick_run("list-run"), KINDS, ROUNDS)
    store.engine.dispose()
    honest = sorted(w for w, k in played.workers.items() if k == HONEST)

    async def scenario(api):
        base = "/v1/runs/list-run"
        # Paging through everything, three at a time, gives every row once, in order.
        rows, offset = [], 0
        while offset is not None:
            page = (await api.get(f"{base}/verdicts?offset={offset}&limit=3"))[1]
            assert page["limit"] == 3 and len(page["verdicts"]) <= 3
            rows += page["verdicts"]
            offset = page["next_offset"]
        assert len(rows) == len(KINDS) * ROUNDS
        assert rows == sorted(rows, key=lambda v: (v["round"], v["worker"]))

        one = (await api.get(f"{base}/verdicts?worker={honest[0]}"))[1]["verdicts"]
        assert [v["round"] for v in one] == list(range(ROUNDS))
        assert {v["worker"] for v in one} == {honest[0]}
        r1 = (await api.get(f"{base}/verdicts?round=1&status=rejected"))[1]["verdicts"]
        assert len(r1) == 2 and {v["status"] for v in r1} == {"rejected"}
        assert {v["reason"] for v in r1} == {"norm_outlier", "duplicate"}

        status, ctype, body = await text(api, f"{base}/verdicts.csv?status=accepted")
        assert status == 200 and ctype.startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(body)))
        assert len(table) == 2 * ROUNDS and {r["status"] for r in table} == {"accepted"}
        assert sum(float(r["reward"]) for r in table) == sum(v["reward"] for v in rows)
        as_json = json.loads((await text(api, f"{base}/verdicts.json"))[2])
        assert as_json == rows

        totals = (await api.get(f"{base}/scores?limit=2"))[1]
        assert len(totals["workers"]) == 2 and totals["next_offset"] == 2
        everyone = json.loads((await text(api, f"{base}/scores.json"))[2])
        assert len(everyone) == len(KINDS)
        scores_csv = list(csv.DictReader(io.StringIO((await text(api, f"{base}/scores.csv"))[2])))
        assert [r["worker"] for r in scores_csv] == [w["worker"] for w in everyone]
        for w in everyone:
            mine = [v for v in rows if v["worker"] == w["worker"]]
            assert w["rounds"] == len(mine) and w["reward"] == sum(v["reward"] for v in mine)

        subs = (await api.get(f"{base}/submissions?round=1&limit=10"))[1]
        assert len(subs["submissions"]) == len(KINDS) and subs["next_offset"] is None
        only = (await api.get(f"{base}/submissions?worker={honest[1]}"))[1]["submissions"]
        assert [s["round"] for s in only] == list(range(ROUNDS))

        # The worker history endpoint pages too.
        hist = (await api.get(f"{base}/workers/{honest[0]}?offset=1&limit=1"))[1]
        assert [v["round"] for v in hist["verdicts"]] == [1]

    run_api(tmp_path, scenario, db_url=ledger_url, identity=store.identity)


def test_invalid_list_parameters_are_refused(tmp_path, ledger_url):
    async def scenario(api):
        for path, reason in [("/v1/runs/x/verdicts?status=maybe", "malformed"),
                             ("/v1/runs/x/verdicts?round=-3", "malformed"),
                             ("/v1/runs/x/verdicts?limit=ten", "malformed"),
                             ("/v1/runs/x/scores?worker=not%20hex!", "malformed"),
                             ("/v1/runs/x/verdicts", "not_found"),
                             ("/v1/runs/x/verdicts.csv", "not_found"),
                             ("/v1/runs/x/export", "not_found"),
                             ("/runs/x", "not_found"),
                             ("/static/..%2fserver.py", "not_found")]:
            status, body = await api.get(path)
            assert body["reason"] == reason, (path, body)
            assert status == (404 if reason == "not_found" else 400)

    run_api(tmp_path, scenario, db_url=ledger_url)
