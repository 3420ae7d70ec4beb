"""The round and worker pages without a browser, on SQLite and PostgreSQL: the paged
views they are rendered from, and escaping (the browser test is test_ledger_web.py)."""

from __future__ import annotations

from ledger_backends import make_fixture
from ledger_scenarios import COPIER, FREE_RIDER, HONEST, SPOT_FAIL, make_store, play_run, quick_run
from veritrain.ledger.detail_pages import render_round, render_worker
from veritrain.ledger.queries import round_page, worker_page

ledger_url = make_fixture()
KINDS = [HONEST, HONEST, HONEST, FREE_RIDER, COPIER, SPOT_FAIL]


def test_detail_pages_escape_what_they_show_and_page_long_lists(ledger_url):
    store = make_store(ledger_url)
    played = play_run(store, quick_run("page-run"), KINDS, 1)
    with store.sessions() as s:
        first = round_page(s, "page-run", 0, limit=2)
        second = round_page(s, "page-run", 0, offset=2, limit=10)
        key = next(iter(played.workers))
        worker = worker_page(s, "page-run", key)
    assert len(first["verdicts"]) == 2 and first["next_offset"] == 2
    assert len(second["verdicts"]) == len(KINDS) - 2 and second["next_offset"] is None
    assert {v["worker"] for v in first["verdicts"] + second["verdicts"]} == set(played.workers)
    html = render_round(first)
    assert 'href="/runs/page-run/rounds/0?offset=2"' in html
    hostile = "<script>alert(1)</script>"
    first["verdicts"][0].update(status="rejected", reason=hostile, detail=hostile)
    first["verdicts"][0]["checks"] = [{"segment": 0, "start": None, "end": "7" * 64, "ef": None,
                                       "distance": None, "ok": False, "note": hostile}]
    worker["verdicts"][0].update(status="rejected", reason=hostile, detail=hostile)
    for html in (render_round(first), render_worker(worker)):
        assert hostile not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    store.engine.dispose()


def test_worker_page_counts_its_penalties_and_pages_its_rounds(ledger_url):
    store = make_store(ledger_url)
    played = play_run(store, quick_run("page-run"), [HONEST, HONEST, HONEST], 3,
                      turns={2: (2, SPOT_FAIL)})
    turned = list(played.workers)[2]
    with store.sessions() as s:
        first = worker_page(s, "page-run", turned, limit=2)
        rest = worker_page(s, "page-run", turned, offset=2, limit=2)
        round2 = round_page(s, "page-run", 2)
    store.engine.dispose()
    assert [v["round"] for v in first["verdicts"]] == [0, 1] and first["next_offset"] == 2
    assert [v["round"] for v in rest["verdicts"]] == [2] and rest["next_offset"] is None
    assert rest["verdicts"][0]["reason"] == "spot_check_failed"
    forfeited = sum(p["amount"] for p in first["penalties"] + rest["penalties"])
    assert first["totals"]["forfeited"] == forfeited > 0
    assert first["summary"]["accepted"] == 2 and first["summary"]["penalties"] == 1
    assert {p["worker"] for p in round2["penalties"]} == {turned}
    assert round2["accepted"] == 2 and round2["rejected"] == 1
