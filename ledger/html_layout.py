"""What every page of the ledger's web site shares: the frame, keys, hashes, tags, times.

Every value that came from a row is escaped here or by the caller; the frame loads
only ``/static/style.css`` and ``/static/page.js`` (nothing from elsewhere).
"""

from __future__ import annotations

import time
from html import escape

from aiohttp import web


def page(title: str, body: str, refresh: bool = False) -> str:
    """A whole HTML page; ``refresh`` reloads it every 15 s (an active run)."""
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


def html_response(text: str) -> web.Response:
    return web.Response(text=text, content_type="text/html", charset="utf-8")


def short_key(key: str) -> str:
    """The first 12 hex digits of a key, escaped, with an ellipsis."""
    return escape(key[:12]) + "&hellip;"


def hash_cell(digest: str | None) -> str:
    """A content hash cut to 12 digits, the whole of it in the tooltip and for copying."""
    if not digest:
        return '<span class="none">&ndash;</span>'
    return (f'<code class="hash" title="{escape(digest)}" data-hash="{escape(digest)}">'
            f"{escape(digest[:12])}</code>")


def worker_link(run_id: str, key: str) -> str:
    return (f'<a class="worker-link key" href="/runs/{escape(run_id)}/workers/{escape(key)}" '
            f'title="{escape(key)}">{short_key(key)}</a>')


def round_link(run_id: str, r: int, text: str | None = None) -> str:
    return (f'<a class="round-link" href="/runs/{escape(run_id)}/rounds/{r}">'
            f"{escape(text if text is not None else str(r))}</a>")


def status_tag(status: str) -> str:
    kind = {"accepted": "ok", "finalized": "ok", "rejected": "bad",
            "excluded": "warn"}.get(status, "")
    return f'<span class="tag {kind}">{escape(status)}</span>'


def when(ts: float | None) -> str:
    return "&ndash;" if ts is None else escape(
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)))


def cards(items: list[tuple[str, str]]) -> str:
    """A row of labelled figures; the values are markup the caller escaped."""
    return '<section class="cards">' + "".join(
        f'<div class="card"><div class="label">{escape(k)}</div>'
        f'<div class="value" data-card="{escape(k)}">{v}</div></div>' for k, v in items
    ) + "</section>"


def pager(base: str, offset: int, limit: int, next_offset: int | None, what: str) -> str:
    """Links to the previous and next page of a list shown ``limit`` rows at a time."""
    links = []
    if offset > 0:
        links.append(f'<a class="prev-page" href="{escape(base)}?offset={max(0, offset - limit)}">'
                     f"&larr; previous {limit} {escape(what)}</a>")
    if next_offset is not None:
        links.append(f'<a class="next-page" href="{escape(base)}?offset={next_offset}">'
                     f"next {limit} {escape(what)} &rarr;</a>")
    return f'<p class="pager">{" ".join(links)}</p>' if links else ""
