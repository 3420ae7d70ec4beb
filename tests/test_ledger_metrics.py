"""Prometheus /metrics: request counts by route and status, latency histogram,
submissions, refusals by reason, rounds and chain rows."""

from __future__ import annotations

import re

from fakes import make_fake_run, make_submission
from ledger_harness import run_api
from veritrain.protocol.identity import Identity

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not exposition format: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_metrics_count_requests_submissions_and_refusals(tmp_path):
    run = make_fake_run("metric-run")
    w1, w2, outsider = (Identity.generate("worker") for _ in range(3))

    async def scenario(api):
        await api.create_run(run)
        await api.register(run, w1)
        await api.register(run, w2)
        assert (await api.submit(make_submission(run, w1, b"a" * 8), b"a" * 8))[0] == 201
        assert (await api.submit(make_submission(run, outsider, b"b" * 8), b"b" * 8))[0] == 403
        await api.get("/v1/runs/metric-run/rounds/0")
        await api.get("/v1/runs/metric-run/rounds/zero")
        async with api.session.get(f"{api.url}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return parse(await resp.text())

    m = run_api(tmp_path, scenario)
    route = "/v1/runs/{run_id}/rounds/{round}"
    assert m[f'veritrain_http_requests_total{{route="{route}",method="GET",status="200"}}'] == 1
    assert m[f'veritrain_http_requests_total{{route="{route}",method="GET",status="400"}}'] == 1
    assert m["veritrain_submissions_total"] == 1
    assert m['veritrain_rejections_total{reason="unknown_worker"}'] == 1
    assert m['veritrain_rejections_total{reason="malformed"}'] == 1
    assert m['veritrain_rounds{status="open"}'] == 1
    assert m["veritrain_chain_rows"] >= 5
    # The histogram's buckets are cumulative and end with the count.
    sub = route + "/submissions"
    buckets = [v for k, v in m.items() if k.startswith(
        f'veritrain_http_request_duration_seconds_bucket{{route="{sub}"')]
    assert buckets == sorted(buckets) and buckets[-1] == 2
    assert m[f'veritrain_http_request_duration_seconds_count{{route="{sub}"}}'] == 2
