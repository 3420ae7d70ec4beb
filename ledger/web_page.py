"""The ledger's web site: the runs (``/``), one run at a glance (``/runs/{run_id}``),
and a page per round and per worker (``/runs/{run_id}/rounds/{r}``,
``/runs/{run_id}/workers/{key}``: detail_pages.py) linked from it.

Server-rendered HTML with inline SVG charts (charts.py) and one local
stylesheet and script from ``ledger/static/``: nothing is loaded from
elsewhere. The numbers come from the same views as the audit API; every list
is one page of rows.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session
from veritrain.protocol.errors import EncodingError, RejectedInput

from . import lists, queries
from . import schema as t
from .api_base import LEDGER, int_param, path_round
from .charts import loss_chart, verdict_chart
from .detail_pages import render_round, render_worker
from .html_layout import cards, html_response, page, round_link, status_tag, worker_link

STATIC = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".css": "text/css", ".js": "text/javascript"}
WORKERS_SHOWN = 200
ROUNDS_SHOWN = 100
routes = web.RouteTableDef()


def page_data(s: Session, run_id: str) -> dict[str, Any]:
    run = s.get(t.Run, run_id)
    if run is None:
        raise RejectedInput(f"no run {run_id!r}", "not_found")
    accepted = func.sum(case((t.Verdict.status == "accepted", 1), else_=0))
    excluded = func.sum(case((t.Verdict.status == "excluded", 1), else_=0))
    counts = {r: (int(a or 0), int(n) - int(a or 0) - int(e or 0), int(e or 0))
              for r, a, e, n in s.execute(
        select(t.Verdict.round, accepted, excluded, func.count())
        .where(t.Verdict.run_id == run_id).group_by(t.Verdict.round)).all()}
    rounds = [{"round": rnd.round, "status": rnd.status, "eval_loss": rnd.eval_loss,
               "accepted": counts.get(rnd.round, (0, 0, 0))[0],
               "rejected": counts.get(rnd.round, (0, 0, 0))[1],
               "excluded": counts.get(rnd.round, (0, 0, 0))[2], "extensions": rnd.extensions}
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
    reasons = [{"reason": reason, "count": int(n), "workers": int(w), "first_round": lo,
                "last_round": hi} for reason, n, w, lo, hi in s.execute(
        select(t.Verdict.reason, func.count(), func.count(t.Verdict.worker.distinct()),
               func.min(t.Verdict.round), func.max(t.Verdict.round))
        .where(t.Verdict.run_id == run_id, t.Verdict.status == "rejected")
        .group_by(t.Verdict.reason).order_by(func.count().desc(), t.Verdict.reason)).all()]
    # A statistical filter's suspicion, shown apart: left out of the aggregate, still paid.
    exclusions = [{"reason": reason, "count": int(n), "workers": int(w), "first_round": lo,
                   "last_round": hi, "reward": float(paid or 0.0)}
                  for reason, n, w, lo, hi, paid in s.execute(
        select(t.Verdict.reason, func.count(), func.count(t.Verdict.worker.distinct()),
               func.min(t.Verdict.round), func.max(t.Verdict.round), func.sum(t.Verdict.reward))
        .where(t.Verdict.run_id == run_id, t.Verdict.status == "excluded")
        .group_by(t.Verdict.reason).order_by(func.count().desc(), t.Verdict.reason)).all()]
    admission, bonds = queries.bonds(s, run, [w["worker"] for w in workers])
    return {"admission": admission, "bonds": bonds,
            "run_id": run_id, "status": run.status, "rounds": rounds, "workers": workers,
            "n_workers": n_workers, "chain_rows": 0 if events is None else events + 1,
            "checkpoint": checkpoint, "door_rejections": door, "reasons": reasons,
            "exclusions": exclusions}


def render_run(d: dict[str, Any]) -> str:
    rounds = d["rounds"]
    final = [r for r in rounds if r["status"] == "finalized"]
    losses = [(r["round"], r["eval_loss"]) for r in final if r["eval_loss"] is not None]
    verdicts = [(r["round"], r["accepted"], r["rejected"], r.get("excluded", 0))
                for r in rounds if r["accepted"] or r["rejected"] or r.get("excluded")]
    total_reward = sum(w["reward"] for w in d["workers"])
    figures = [("status", escape(d["status"])), ("rounds finalized", str(len(final))),
             ("workers", str(d["n_workers"])),
             ("last eval loss", f"{losses[-1][1]:.4f}" if losses else "&ndash;"),
             ("rewards paid", f"{total_reward:.2f}"),
             ("refused at the door", str(d["door_rejections"])),
             ("chain rows", str(d["chain_rows"])),
             ("last checkpoint", "&ndash;" if d["checkpoint"] is None
              else f"row {d['checkpoint']}")]
    top = max((w["reward"] for w in d["workers"]), default=0.0) or 1.0
    rows = []
    for w in d["workers"]:
        banned = (f'<span class="tag banned">banned to r{w["banned_until_round"]}</span>'
                  if w["banned_until_round"] >= 0 else "")
        rows.append(
            f'<tr class="worker" data-worker="{escape(w["worker"])}">'
            f'<td class="key">{worker_link(d["run_id"], w["worker"])}</td>'
            f'<td class="num">{w["accepted"]}</td><td class="num">{w["rejected"]}</td>'
            f'<td class="num excluded">{w.get("excluded", 0)}</td>'
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
    body = (f'<h1>Run <span class="run-id">{run}</span></h1>{cards(figures)}'
            f'<section class="charts">{loss_chart(losses)}{verdict_chart(verdicts)}</section>'
            f"{_reasons_table(d)}{_exclusions_table(d)}"
            '<section><h2>Workers</h2><table class="workers"><thead><tr><th>worker</th>'
            "<th>accepted</th><th>rejected</th><th>excluded (paid)</th><th>spot-checked</th>"
            "<th>penalties</th>"
            "<th>verified samples</th><th>score</th><th>reward</th><th>share</th></tr></thead>"
            f'<tbody>{"".join(rows)}</tbody></table>{more}</section>{_bonds_table(d)}'
            f'{_rounds_table(d)}'
            f'<section class="downloads"><h2>Audit it yourself</h2><ul>'
            f'<li><a href="/v1/runs/{run}/export">signed export (JSON lines)</a>: '
            f"<code>veritrain audit verify --export FILE</code></li>"
            f'<li><a href="/v1/runs/{run}/verdicts.csv">verdicts.csv</a>, '
            f'<a href="/v1/runs/{run}/verdicts.json">verdicts.json</a>, '
            f'<a href="/v1/runs/{run}/scores.csv">scores.csv</a>, '
            f'<a href="/v1/runs/{run}/scores.json">scores.json</a></li></ul></section>')
    return page(f"veritrain run {d['run_id']}", body, refresh=d["status"] == "active")


NOT_ADMITTED = '<span class="tag banned">no</span>'


def _bonds_table(d: dict[str, Any]) -> str:
    """Each worker's bond, slashes and admission now (runs with an admission policy only):
    folded from the chain's signed membership rows, as ``veritrain audit verify`` does."""
    admission = d.get("admission")
    if not admission:
        return ""
    rows = []
    for w in d["workers"]:
        b = d["bonds"].get(w["worker"])
        if b is None:
            continue
        slashes = ", ".join(f'{round_link(d["run_id"], x["round"])}: &minus;{x["amount"]}'
                            for x in b["slashes"])
        rows.append(
            f'<tr class="bond" data-worker="{escape(w["worker"])}">'
            f'<td class="key">{worker_link(d["run_id"], w["worker"])}</td>'
            f'<td class="num bond-balance">{b["bond"]}</td><td class="num">{b["deposited"]}</td>'
            f'<td class="num slashed">{b["slashed"]}</td><td class="num">{b["withdrawn"]}</td>'
            f"<td>{'yes' if b['admitted'] else NOT_ADMITTED}</td>"
            f"<td>{slashes}</td></tr>")
    terms = (f'bond of at least {admission.get("min_bond")} units; a failed check slashes '
             f'{admission.get("slash_share", 0.5):.0%} of it'
             if admission.get("policy") == "bond" else
             "an admission ticket from the organiser; a failed check voids it")
    return (f'<section><h2>Admission: {escape(str(admission.get("policy")))}</h2>'
            f'<p class="note">Workers need {escape(terms)}.</p>'
            '<table class="data bonds"><thead><tr><th>worker</th><th>bond</th>'
            "<th>deposited</th><th>slashed</th><th>withdrawn</th><th>admitted</th>"
            f'<th>slashes</th></tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def _rounds_table(d: dict[str, Any]) -> str:
    """The newest rounds, each linked to its page."""
    shown = d["rounds"][::-1][:ROUNDS_SHOWN]
    if not shown:
        return ""
    rows = "".join(
        f'<tr class="round" data-round="{r["round"]}"><td>{round_link(d["run_id"], r["round"])}'
        f'</td><td>{status_tag(r["status"])}</td><td class="num">'
        f'{"&ndash;" if r["eval_loss"] is None else format(r["eval_loss"], ".4f")}</td>'
        f'<td class="num">{r["accepted"]}</td><td class="num">{r["rejected"]}</td>'
        f'<td class="num excluded">{r.get("excluded", 0)}</td></tr>'
        for r in shown)
    more = (f'<p class="note">The newest {len(shown)} of {len(d["rounds"])} rounds; every '
            f'round has its page at /runs/{escape(d["run_id"])}/rounds/R.</p>'
            if len(d["rounds"]) > len(shown) else "")
    return ('<section><h2>Rounds</h2><table class="data rounds"><thead><tr><th>round</th>'
            "<th>status</th><th>eval loss</th><th>accepted</th><th>rejected</th>"
            "<th>excluded</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>{more}</section>")


def _reasons_table(d: dict[str, Any]) -> str:
    """Why submissions were rejected: each reason, how often, whom and when."""
    if not d["reasons"]:
        return ""
    rows = "".join(
        f'<tr class="reject-reason" data-reason="{escape(x["reason"])}">'
        f'<td class="reason">{escape(x["reason"])}</td><td class="num">{x["count"]}</td>'
        f'<td class="num">{x["workers"]}</td><td>{round_link(d["run_id"], x["first_round"])}'
        f' &ndash; {round_link(d["run_id"], x["last_round"])}</td></tr>' for x in d["reasons"])
    return ('<section><h2>Why submissions were rejected</h2><table class="data reasons">'
            "<thead><tr><th>reason</th><th>submissions</th><th>workers</th><th>rounds</th>"
            f"</tr></thead><tbody>{rows}</tbody></table><p class=\"note\">Each round's page "
            "gives every verdict's reason and the evidence of its spot checks.</p></section>")


def _exclusions_table(d: dict[str, Any]) -> str:
    """Updates a statistical filter kept out of the aggregate: suspicion, not proof, so the
    workers were paid (specs/scoring.md); apart from the rejections."""
    if not d.get("exclusions"):
        return ""
    rows = "".join(
        f'<tr class="exclude-reason" data-reason="{escape(x["reason"])}">'
        f'<td class="reason excluded">{escape(x["reason"])}</td>'
        f'<td class="num">{x["count"]}</td><td class="num">{x["workers"]}</td>'
        f'<td class="num reward">{x["reward"]:.2f}</td>'
        f'<td>{round_link(d["run_id"], x["first_round"])} &ndash; '
        f'{round_link(d["run_id"], x["last_round"])}</td></tr>' for x in d["exclusions"])
    return ('<section><h2>Excluded from the aggregate, not rejected</h2>'
            '<table class="data exclusions"><thead><tr><th>filter</th><th>submissions</th>'
            "<th>workers</th><th>rewards paid</th><th>rounds</th></tr></thead>"
            f'<tbody>{rows}</tbody></table><p class="note">A statistical filter is suspicion, '
            "not proof: these updates were left out of the aggregate and their workers paid "
            "by their clip quality, as if aggregated; only a failed check costs pay."
            "</p></section>")


def render_index(runs: list[dict[str, Any]]) -> str:
    items = "".join(f'<li><a class="run-link" href="/runs/{escape(r["run_id"])}">'
                    f'{escape(r["run_id"])}</a> <span class="tag">{escape(r["status"])}</span>'
                    f"</li>" for r in runs)
    body = ("<h1>Runs</h1>" + (f'<ul class="runs">{items}</ul>' if runs
                               else "<p>No run on this ledger yet.</p>"))
    return page("veritrain ledger", body)


@routes.get("/")
async def index(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return html_response(render_index(await ledger.read(queries.list_runs)))


@routes.get("/runs/{run_id}")
async def run_page(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return html_response(render_run(await ledger.read(page_data, request.match_info["run_id"])))


@routes.get("/runs/{run_id}/rounds/{round}")
async def round_page(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    r, offset = path_round(request), _offset(request)
    return html_response(render_round(await ledger.read(
        lambda s: queries.round_page(s, request.match_info["run_id"], r, offset=offset))))


@routes.get("/runs/{run_id}/workers/{worker}")
async def worker_page(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    worker, offset = request.match_info["worker"], _offset(request)
    if not re.fullmatch(r"[0-9a-f]{64}", worker):
        raise EncodingError("a worker is named by its whole key: 64 lowercase hex digits")
    return html_response(render_worker(await ledger.read(
        lambda s: queries.worker_page(s, request.match_info["run_id"], worker,
                                      offset=offset))))


def _offset(request: web.Request) -> int:
    offset = int_param(request, "offset", 0) or 0
    if offset < 0:
        raise EncodingError("offset must be >= 0")
    return offset


@routes.get("/static/{name}")
async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    path = STATIC / name
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{0,63}", name) or not path.is_file():
        raise RejectedInput(f"no static file {name!r}", "not_found")
    return web.FileResponse(path, headers={"Content-Type": STATIC_TYPES.get(
        path.suffix, "application/octet-stream"), "Cache-Control": "public, max-age=300"})
