"""The ledger's web page: the runs (``/``) and one run at a glance (``/runs/{run_id}``).

Server-rendered HTML with inline SVG charts (charts.py) and one local
stylesheet and script from ``ledger/static/``: nothing is loaded from
elsewhere. The numbers come from the same views as the audit API.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session
from veritrain.protocol.errors import RejectedInput

from . import lists, queries
from . import schema as t
from .api_base import LEDGER
from .charts import loss_chart, verdict_chart

STATIC = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".css": "text/css", ".js": "text/javascript"}
WORKERS_SHOWN = 200
routes = web.RouteTableDef()


def page_data(s: Session, run_id: str) -> dict[str, Any]:
    run = s.get(t.Run, run_id)
    if run is None:
        raise RejectedInput(f"no run {run_id!r}", "not_found")
    accepted = func.sum(case((t.Verdict.status == "accepted", 1), else_=0))
    counts = {r: (int(a or 0), int(n) - int(a or 0)) for r, a, n in s.execute(
        select(t.Verdict.round, accepted, func.count()).where(t.Verdict.run_id == run_id)
        .group_by(t.Verdict.round)).all()}
    rounds = [{"round": rnd.round, "status": rnd.status, "eval_loss": rnd.eval_loss,
               "accepted": counts.get(rnd.round, (0, 0))[0],
               "rejected": counts.get(rnd.round, (0, 0))[1], "extensions": rnd.extensions}
              for rnd in s.execute(select(t.Round).where(t.Round.run_id == run_id)
                                   .order_by(t.Round.round)).scalars()]
    n_workers = s.execute(select(func.count()).select_from(t.Participant).where(
        t.Participant.run_id == run_id, t.Participant.role == "worker")).scalar_one()
    workers = lists.totals_page(s, run_id, None, 0, WORKERS_SHOWN)["workers"]
    workers.sort(key=lambda w: (-w["reward"], -w["score"], w["worker"]))
    events = s.execute(select(func.max(t.Event.seq)).where(t.Event.run_id == run_id)).scalar()
    checkpoint = s.execute(select(func.max(t.Checkpoint.seq)).where(
        t.Checkpoint.run_id == run_id)).scalar()
    door = s.execute(select(func.count()).select_from(t.Rejection).where(
        t.Rejection.run_id == run_id)).scalar_one()
    return {"run_id": run_id, "status": run.status, "rounds": rounds, "workers": workers,
            "n_workers": n_workers, "chain_rows": 0 if events is None else events + 1,
            "checkpoint": checkpoint, "door_rejections": door}


def _short(key: str) -> str:
    return escape(key[:12]) + "&hellip;"


def _page(title: str, body: str, refresh: bool = False) -> str:
    refresh_attr = ' data-refresh="15"' if refresh else ""
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title>"
            "<link rel=\"stylesheet\" href=\"/static/style.css\">"
            "<script src=\"/static/page.js\" defer></script></head>"
            f"<body{refresh_attr}>"
            "<header><a class=\"brand\" href=\"/\">veritrain ledger</a>"
            "<nav><a href=\"/openapi.json\">API</a> <a href=\"/metrics\">metrics</a></nav>"
            f"</header><main>{body}</main></body></html>")


def render_run(d: dict[str, Any]) -> str:
    rounds = d["rounds"]
    final = [r for r in rounds if r["status"] == "finalized"]
    losses = [(r["round"], r["eval_loss"]) for r in final if r["eval_loss"] is not None]
    verdicts = [(r["round"], r["accepted"], r["rejected"]) for r in rounds
                if r["accepted"] or r["rejected"]]
    total_reward = sum(w["reward"] for w in d["workers"])
    cards = [("status", escape(d["status"])), ("rounds finalized", str(len(final))),
             ("workers", str(d["n_workers"])),
             ("last eval loss", f"{losses[-1][1]:.4f}" if losses else "&ndash;"),
             ("rewards paid", f"{total_reward:.2f}"),
             ("refused at the door", str(d["door_rejections"])),
             ("chain rows", str(d["chain_rows"])),
             ("last checkpoint", "&ndash;" if d["checkpoint"] is None
              else f"row {d['checkpoint']}")]
    card_html = "".join(f'<div class="card"><div class="label">{k}</div>'
                        f'<div class="value" data-card="{escape(k)}">{v}</div></div>'
                        for k, v in cards)
    top = max((w["reward"] for w in d["workers"]), default=0.0) or 1.0
    rows = []
    for w in d["workers"]:
        banned = (f'<span class="tag banned">banned to r{w["banned_until_round"]}</span>'
                  if w["banned_until_round"] >= 0 else "")
        rows.append(
            f'<tr class="worker" data-worker="{escape(w["worker"])}">'
            f'<td class="key" title="{escape(w["worker"])}">{_short(w["worker"])}</td>'
            f'<td class="num">{w["accepted"]}</td><td class="num">{w["rejected"]}</td>'
            f'<td class="num">{w["spot_checked"]}</td>'
            f'<td class="num penalties">{w["penalties"]} {banned}</td>'
            f'<td class="num">{w["samples"]}</td><td class="num">{w["score"]:.1f}</td>'
            f'<td class="num reward">{w["reward"]:.2f}</td>'
            f'<td class="share"><span class="bar" style="width:{100 * w["reward"] / top:.1f}%">'
            f"</span></td></tr>")
    more = (f'<p class="note">Showing {len(d["workers"])} of {d["n_workers"]} workers; '
            f'all of them: <a href="/v1/runs/{escape(d["run_id"])}/scores.csv">scores.csv</a>'
            "</p>" if d["n_workers"] > len(d["workers"]) else "")
    run = escape(d["run_id"])
    body = (f'<h1>Run <span class="run-id">{run}</span></h1>'
            f'<section class="cards">{card_html}</section>'
            f'<section class="charts">{loss_chart(losses)}{verdict_chart(verdicts)}</section>'
            '<section><h2>Workers</h2><table class="workers"><thead><tr><th>worker</th>'
            "<th>accepted</th><th>rejected</th><th>spot-checked</th><th>penalties</th>"
            "<th>verified samples</th><th>score</th><th>reward</th><th>share</th></tr></thead>"
            f'<tbody>{"".join(rows)}</tbody></table>{more}</section>'
            f'<section class="downloads"><h2>Audit it yourself</h2><ul>'
            f'<li><a href="/v1/runs/{run}/export">signed export (JSON lines)</a>: '
            f"<code>veritrain audit verify --export FILE</code></li>"
            f'<li><a href="/v1/runs/{run}/verdicts.csv">verdicts.csv</a>, '
            f'<a href="/v1/runs/{run}/verdicts.json">verdicts.json</a>, '
            f'<a href="/v1/runs/{run}/scores.csv">scores.csv</a>, '
            f'<a href="/v1/runs/{run}/scores.json">scores.json</a></li></ul></section>')
    return _page(f"veritrain run {d['run_id']}", body, refresh=d["status"] == "active")


def render_index(runs: list[dict[str, Any]]) -> str:
    items = "".join(f'<li><a class="run-link" href="/runs/{escape(r["run_id"])}">'
                    f'{escape(r["run_id"])}</a> <span class="tag">{escape(r["status"])}</span>'
                    f"</li>" for r in runs)
    body = ("<h1>Runs</h1>" + (f'<ul class="runs">{items}</ul>' if runs
                               else "<p>No run on this ledger yet.</p>"))
    return _page("veritrain ledger", body)


def _html(text: str) -> web.Response:
    return web.Response(text=text, content_type="text/html", charset="utf-8")


@routes.get("/")
async def index(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return _html(render_index(await ledger.read(queries.list_runs)))


@routes.get("/runs/{run_id}")
async def run_page(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return _html(render_run(await ledger.read(page_data, request.match_info["run_id"])))


@routes.get("/static/{name}")
async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    path = STATIC / name
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{0,63}", name) or not path.is_file():
        raise RejectedInput(f"no static file {name!r}", "not_found")
    return web.FileResponse(path, headers={"Content-Type": STATIC_TYPES.get(
        path.suffix, "application/octet-stream"), "Cache-Control": "public, max-age=300"})
