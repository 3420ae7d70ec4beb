"""The ledger's round and worker pages: why each submission was accepted or rejected.

``/runs/{run}/rounds/{r}`` shows one round: what it certified, every verdict with
its reason, the segments the beacon challenged and the evidence of each check
(the content hashes of the revealed states), the penalties and validator faults
it recorded and the writes refused at the door. ``/runs/{run}/workers/{key}``
shows one worker round by round, with its penalties. Pure functions of the views
in queries.py (:func:`round_page`, :func:`worker_page`); one page of rows each.
"""

from __future__ import annotations

from html import escape
from typing import Any

from .html_layout import (
    cards,
    hash_cell,
    page,
    pager,
    round_link,
    short_key,
    status_tag,
    when,
    worker_link,
)

__all__ = ["render_round", "render_worker"]


def _num(value: float | None, fmt: str) -> str:
    return "&ndash;" if value is None else format(value, fmt)


def _checks(v: dict[str, Any]) -> str:
    """The segments challenged and each recorded check with its evidence hashes."""
    checks = v.get("checks") or []
    challenged = v.get("challenged") or []
    if not checks:
        if challenged:
            return (f'<span class="challenged">challenged {", ".join(map(str, challenged))}'
                    "</span>")
        return '<span class="none">not spot-checked</span>' if not v["spot_checked"] else "yes"
    items = []
    for c in checks:
        ok = bool(c.get("ok"))
        ef = f", residual {hash_cell(c['ef'])}" if c.get("ef") else ""
        note = f' <span class="note">{escape(c["note"])}</span>' if c.get("note") else ""
        items.append(
            f'<li class="check {"ok" if ok else "bad"}" data-segment="{int(c["segment"])}" '
            f'data-ok="{str(ok).lower()}">segment {int(c["segment"])}: '
            f'<b>{"ok" if ok else "failed"}</b>, distance '
            f'{_num(c.get("distance"), ".2e")}, states {hash_cell(c.get("start"))} &rarr; '
            f"{hash_cell(c.get('end'))}{ef}{note}</li>")
    return f'<ul class="checks">{"".join(items)}</ul>'


def _why(v: dict[str, Any]) -> str:
    if v["status"] == "excluded":  # a statistical filter's suspicion: left out, still paid
        return (f'<span class="reason excluded">{escape(v.get("reason") or "")}</span>'
                '<div class="detail">excluded from the aggregate, not rejected: paid by its '
                f'clip quality. {escape(v.get("detail") or "")}</div>')
    if v["status"] != "rejected":
        return ""
    return (f'<span class="reason">{escape(v.get("reason") or "")}</span>'
            f'<div class="detail">{escape(v.get("detail") or "")}</div>')


def _penalties(run_id: str, rows: list[dict[str, Any]], *, by_worker: bool) -> str:
    if not rows:
        return '<p class="note">None.</p>'
    head = "<th>worker</th>" if by_worker else "<th>round</th>"

    def who(p: dict[str, Any]) -> str:
        return worker_link(run_id, p["worker"]) if by_worker else round_link(run_id, p["round"])

    body = "".join(
        f'<tr class="penalty"><td>{who(p)}</td><td>{escape(p["kind"])}</td>'
        f'<td class="num">{p["amount"]:.2f}</td>'
        f'<td>{round_link(run_id, p["source_round"])}</td><td>{escape(p["reason"])}</td>'
        f'<td class="detail">{escape(p["detail"])}</td></tr>' for p in rows)
    return (f'<table class="data penalties"><thead><tr>{head}<th>kind</th><th>amount</th>'
            "<th>earned in round</th><th>reason</th><th>detail</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _certificate(cert: dict[str, Any] | None) -> str:
    """The quorum certificate of the round's new model: who signed which hashes."""
    if cert is None:
        return '<section><h2>New model</h2><p class="note">Not certified yet.</p></section>'
    c = cert["certified"]
    rows = "".join(f"<tr><th>{escape(k.replace('_', ' '))}</th><td>{hash_cell(c.get(k))}</td>"
                   "</tr>" for k in ("model_hash", "outer_state_hash", "update_hash",
                                     "verdicts_hash", "scores_hash"))
    signers = ", ".join(str(i) for i in cert["signers"])
    return ('<section><h2>New model, certified by validators <span class="signers">'
            f'{escape(signers)}</span></h2><table class="data certificate">'
            f"<tbody>{rows}</tbody></table></section>")


def render_round(d: dict[str, Any]) -> str:
    run_id, r = d["run_id"], d["round"]
    run = escape(run_id)
    nav = [f'<a href="/runs/{run}">&larr; run {run}</a>']
    if r > 0:
        nav.append(round_link(run_id, r - 1, f"round {r - 1}"))
    if d.get("last_round") is not None and r < d["last_round"]:
        nav.append(round_link(run_id, r + 1, f"round {r + 1}"))
    figures = cards([
        ("status", escape(d["status"])),
        ("eval loss", _num(d.get("eval_loss"), ".4f")),
        ("submissions", str(d["submissions"])),
        ("accepted", str(d["accepted"])), ("rejected", str(d["rejected"])),
        ("excluded (paid)", str(d.get("excluded", 0))),
        ("rewards paid", f"{d['rewards_paid']:.2f}"),
        ("refused at the door", str(d["door_rejections"])),
    ])
    extended = f" (extended {d['extensions']}x)" if d.get("extensions") else ""
    times = (f'<p class="times">Opened {when(d.get("opened_at"))}, deadline '
             f'{when(d.get("deadline"))}{extended}, closed {when(d.get("closed_at"))}, '
             f'finalized {when(d.get("finalized_at"))}.</p>')
    source = ("the genesis model of the signed run spec" if r == 0 else
              f"certified at the end of {round_link(run_id, r - 1, f'round {r - 1}')}")
    base = f'<p>Base model {hash_cell(d.get("base_model_hash"))}: {source}.</p>'
    rows = []
    for v in d["verdicts"]:
        rows.append(
            f'<tr class="verdict {escape(v["status"])}" data-worker="{escape(v["worker"])}" '
            f'data-status="{escape(v["status"])}" data-reason="{escape(v["reason"] or "")}">'
            f'<td>{worker_link(run_id, v["worker"])}</td><td>{status_tag(v["status"])}</td>'
            f'<td class="why">{_why(v)}</td><td class="spot">{_checks(v)}</td>'
            f'<td class="num">{v["samples"]}</td><td class="num">{v["score"]:.1f}</td>'
            f'<td class="num reward">{v["reward"]:.2f}</td></tr>')
    verdicts = (
        '<table class="data verdicts"><thead><tr><th>worker</th><th>verdict</th>'
        "<th>why rejected or excluded</th><th>spot checks (evidence)</th>"
        "<th>verified samples</th>"
        f'<th>score</th><th>reward</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
        if rows else '<p class="note">No verdicts yet.</p>')
    paging = pager(f"/runs/{run_id}/rounds/{r}", d["offset"], d["limit"], d["next_offset"],
                   "verdicts")
    faults = "".join(f'<li class="fault">validator {short_key(f["validator"])} signed '
                     f'{hash_cell(f["result_digest"])}, certified '
                     f'{hash_cell(f["certified_digest"])}</li>' for f in d["validator_faults"])
    door = "".join(
        f'<tr class="refusal"><td class="key" title="{escape(x["signer"] or "")}">'
        f'{short_key(x["signer"]) if x["signer"] else "&ndash;"}</td>'
        f'<td>{escape(x["endpoint"])}</td><td>{escape(x["reason"])}</td>'
        f'<td class="detail">{escape(x["detail"])}</td><td>{when(x["at"])}</td></tr>'
        for x in d["rejections"])
    more_door = (f'<p class="note">Showing {len(d["rejections"])} of {d["door_rejections"]}: '
                 f'all of them at <a href="/v1/runs/{run}/rejections?round={r}">'
                 "rejections</a> (JSON, paged).</p>"
                 if d["door_rejections"] > len(d["rejections"]) else "")
    body = (
        f'<nav class="crumbs">{" &middot; ".join(nav)}</nav>'
        f'<h1>Run <span class="run-id">{run}</span>, round <span class="round-no">{r}</span> '
        f"{status_tag(d['status'])}</h1>{figures}{times}{base}"
        f"{_certificate(d.get('certificate'))}"
        f"<section><h2>Verdicts</h2>{verdicts}{paging}</section>"
        f"<section><h2>Penalties taken in this round</h2>"
        f"{_penalties(run_id, d['penalties'], by_worker=True)}</section>"
        + (f'<section><h2>Validators whose result differs from the certificate</h2>'
           f'<ul class="faults">{faults}</ul></section>' if faults else "")
        + "<section><h2>Refused at the ledger's door</h2>"
        + (f'<table class="data refusals"><thead><tr><th>signer</th><th>endpoint</th>'
           f"<th>reason</th><th>detail</th><th>at</th></tr></thead><tbody>{door}</tbody>"
           f"</table>{more_door}" if door else '<p class="note">Nothing.</p>')
        + f'</section><section class="downloads"><h2>Audit it yourself</h2><ul>'
        f'<li><a href="/v1/runs/{run}/rounds/{r}">this round (JSON)</a>, '
        f'<a href="/v1/runs/{run}/verdicts.csv?round={r}">its verdicts (CSV)</a>, '
        f'<a href="/v1/runs/{run}/rounds/{r}/challenges">its challenges</a></li>'
        f"<li><code>veritrain audit round {r}</code>; re-run a spot check: "
        f"<code>veritrain audit recheck {r} --worker KEY</code></li></ul></section>")
    return page(f"veritrain run {run_id}, round {r}", body)


def render_worker(d: dict[str, Any]) -> str:
    run_id, key = d["run_id"], d["worker"]
    run = escape(run_id)
    totals, summary = d["totals"], d.get("summary") or {}
    banned = d["banned_until_round"] >= 0
    net = totals["reward"] - totals.get("forfeited", 0.0)
    figures = cards([
        ("status", (f'<span class="tag banned">banned to r{d["banned_until_round"]}</span>'
                    if banned else "in good standing")),
        ("registered in round", str(d["registered_round"])),
        ("accepted", str(summary.get("accepted", totals["verdicts"] - totals["rejected"]
                                     - totals.get("excluded", 0)))),
        ("rejected", str(totals["rejected"])),
        ("excluded (paid)", str(totals.get("excluded", 0))),
        ("spot-checked", str(summary.get("spot_checked", 0))),
        ("verified samples", str(summary.get("samples", 0))),
        ("score", f"{totals['score']:.1f}"), ("reward", f"{totals['reward']:.2f}"),
        ("forfeited", f"{totals.get('forfeited', 0.0):.2f}"), ("net reward", f"{net:.2f}"),
    ])
    subs = {x["round"]: x for x in d["submissions"]}
    verdicts = {v["round"]: v for v in d["verdicts"]}
    rows = []
    for r in sorted(set(subs) | set(verdicts)):
        sub, v = subs.get(r), verdicts.get(r)
        status = v["status"] if v else "pending"
        cells = (f'<td class="why">{_why(v)}</td><td class="spot">{_checks(v)}</td>'
                 f'<td class="num">{v["samples"]}</td><td class="num">{v["score"]:.1f}</td>'
                 f'<td class="num reward">{v["reward"]:.2f}</td>' if v else
                 '<td></td><td></td><td></td><td></td><td></td>')
        rows.append(
            f'<tr class="worker-round {escape(status)}" data-round="{r}" '
            f'data-status="{escape(status)}" data-reason="{escape((v or {}).get("reason") or "")}">'
            f"<td>{round_link(run_id, r)}</td>"
            f'<td>{hash_cell(sub["digest"]) if sub else "&ndash;"}</td>'
            f'<td class="num">{sub["payload_bytes"] if sub else "&ndash;"}</td>'
            f"<td>{status_tag(status)}</td>{cells}</tr>")
    paging = pager(f"/runs/{run_id}/workers/{key}", d["offset"], d["limit"], d["next_offset"],
                   "rounds")
    table = ('<table class="data rounds"><thead><tr><th>round</th><th>submission</th>'
             "<th>bytes</th><th>verdict</th><th>why rejected or excluded</th>"
             "<th>spot checks (evidence)</th><th>verified samples</th><th>score</th>"
             f'<th>reward</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
             if rows else '<p class="note">No submissions yet.</p>')
    body = (
        f'<nav class="crumbs"><a href="/runs/{run}">&larr; run {run}</a></nav>'
        f'<h1>Worker <span class="run-id" title="{escape(key)}">{short_key(key)}</span></h1>'
        f'<p>Key <code class="key full-key">{escape(key)}</code> in run {run}.</p>{figures}'
        f"{bond_section(d)}"
        f"<section><h2>Round by round</h2>{table}{paging}</section>"
        "<section><h2>Penalties</h2>"
        f"{_penalties(run_id, d['penalties'], by_worker=False)}</section>"
        f'<section class="downloads"><h2>Audit it yourself</h2><ul>'
        f'<li><a href="/v1/runs/{run}/workers/{escape(key)}">this worker (JSON)</a>, '
        f'<a href="/v1/runs/{run}/verdicts.csv?worker={escape(key)}">its verdicts (CSV)</a></li>'
        f"<li><code>veritrain audit worker {escape(key[:12])}</code></li></ul></section>")
    return page(f"veritrain run {run_id}, worker {key[:12]}", body,
                refresh=d.get("run_status") == "active")


def bond_section(d: dict[str, Any]) -> str:
    """One worker's bond, slashes and admission (runs with an admission policy only;
    folded from the chain's membership rows, ledger/membership.py)."""
    b, admission = d.get("bond"), d.get("admission")
    if not b or not admission:
        return ""
    slashes = "".join(f'<li class="slash" data-round="{x["round"]}">round '
                      f'{round_link(d["run_id"], x["round"])}: slashed {x["amount"]} units</li>'
                      for x in b["slashes"])
    admitted = ("admitted" if b["admitted"] else
                f'<span class="tag banned">not admitted</span> {escape(b.get("why_not") or "")}')
    figures = [("bond", str(b["bond"])), ("deposited", str(b["deposited"])),
               ("slashed", str(b["slashed"])), ("withdrawn", str(b["withdrawn"])),
               ("pending withdrawal", str(b.get("withdrawal_pending", 0))), ("now", admitted)]
    return (f'<section class="bond"><h2>Admission ({escape(str(admission.get("policy")))})'
            f"</h2>{cards(figures)}"
            f'{"<ul class=slashes>" + slashes + "</ul>" if slashes else ""}</section>')
