"""Prometheus metrics of a ledger server, in the text exposition format (version 0.0.4).

Counted by a middleware (outermost, so it sees every answer, refusals
included): requests by route, method and status; request latency as a
histogram by route; accepted submissions; refusals by reason. Read from the
database at scrape time: rounds and runs by status, chain rows. Route labels
are the route templates (``/v1/runs/{run_id}/...``), never raw paths, so the
number of series stays bounded.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from . import schema as t

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SUBMIT_ROUTE = "/v1/runs/{run_id}/rounds/{round}/submissions"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class Metrics:
    requests: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    latency: dict[str, Histogram] = field(default_factory=dict)
    submissions: int = 0
    rejections: Counter[str] = field(default_factory=Counter)

    def observe(self, route: str, method: str, status: int, seconds: float,
                reason: str | None) -> None:
        self.requests[(route, method, status)] += 1
        self.latency.setdefault(route, Histogram()).observe(seconds)
        if route == SUBMIT_ROUTE and method == "POST" and status == 201:
            self.submissions += 1
        if reason is not None:
            self.rejections[reason] += 1


METRICS = web.AppKey("metrics", Metrics)


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _reason(resp: web.StreamResponse) -> str | None:
    if resp.status < 400 or not isinstance(resp, web.Response) or not isinstance(
            resp.body, bytes):
        return None
    if resp.content_type != "application/problem+json":
        return "http_" + str(resp.status)
    try:
        return str(json.loads(resp.body)["reason"])[:64]
    except (ValueError, KeyError, TypeError):
        return "http_" + str(resp.status)


@web.middleware
async def metrics_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    start = time.perf_counter()
    metrics = request.app[METRICS]
    try:
        resp = await handler(request)
    except web.HTTPException as exc:  # only raised past the problem middleware by aiohttp itself
        metrics.observe(route_label(request), request.method, exc.status,
                        time.perf_counter() - start, None)
        raise
    metrics.observe(route_label(request), request.method, resp.status,
                    time.perf_counter() - start, _reason(resp))
    return resp


def _esc(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}"


def db_gauges(s: Session) -> dict[str, list[tuple[dict[str, Any], float]]]:
    rounds = s.execute(select(t.Round.status, func.count()).group_by(t.Round.status)).all()
    runs = s.execute(select(t.Run.status, func.count()).group_by(t.Run.status)).all()
    events = s.execute(select(func.count()).select_from(t.Event)).scalar_one()
    checkpoints = s.execute(select(func.count()).select_from(t.Checkpoint)).scalar_one()
    return {
        "veritrain_rounds": [({"status": st}, float(n)) for st, n in rounds],
        "veritrain_runs": [({"status": st}, float(n)) for st, n in runs],
        "veritrain_chain_rows": [({}, float(events))],
        "veritrain_chain_checkpoints": [({}, float(checkpoints))],
    }


HELP = {
    "veritrain_http_requests_total": ("counter", "HTTP requests by route template, method and status"),
    "veritrain_http_request_duration_seconds": ("histogram", "time to answer a request"),
    "veritrain_submissions_total": ("counter", "submissions accepted (receipt issued)"),
    "veritrain_rejections_total": ("counter", "refused requests by problem reason"),
    "veritrain_rate_limited_total": ("counter", "requests refused by a rate limit, by scope"),
    "veritrain_rounds": ("gauge", "rounds by status"),
    "veritrain_runs": ("gauge", "runs by status"),
    "veritrain_chain_rows": ("gauge", "hash-chain rows stored"),
    "veritrain_chain_checkpoints": ("gauge", "ledger checkpoint signatures stored"),
}


def render(metrics: Metrics, gauges: dict[str, list[tuple[dict[str, Any], float]]],
           rate_limited: dict[str, int]) -> str:
    out: list[str] = []

    def head(name: str) -> None:
        kind, text = HELP[name]
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} {kind}")

    head("veritrain_http_requests_total")
    for (route, method, status), n in sorted(metrics.requests.items()):
        out.append(f"veritrain_http_requests_total"
                   f"{_labels(route=route, method=method, status=status)} {n}")
    head("veritrain_http_request_duration_seconds")
    for route, h in sorted(metrics.latency.items()):
        for bound, n in zip(BUCKETS, h.counts, strict=True):
            out.append(f"veritrain_http_request_duration_seconds_bucket"
                       f"{_labels(route=route, le=bound)} {n}")
        out.append(f"veritrain_http_request_duration_seconds_bucket"
                   f"{_labels(route=route, le='+Inf')} {h.n}")
        out.append(f"veritrain_http_request_duration_seconds_sum{_labels(route=route)} {h.total}")
        out.append(f"veritrain_http_request_duration_seconds_count{_labels(route=route)} {h.n}")
    head("veritrain_submissions_total")
    out.append(f"veritrain_submissions_total {metrics.submissions}")
    head("veritrain_rejections_total")
    for reason, n in sorted(metrics.rejections.items()):
        out.append(f"veritrain_rejections_total{_labels(reason=reason)} {n}")
    head("veritrain_rate_limited_total")
    for scope, n in sorted(rate_limited.items()):
        out.append(f"veritrain_rate_limited_total{_labels(scope=scope)} {n}")
    for name, samples in gauges.items():
        head(name)
        for labels, value in samples:
            out.append(f"{name}{_labels(**labels) if labels else ''} {value}")
    return "\n".join(out) + "\n"
