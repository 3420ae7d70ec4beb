"""The OpenAPI document covers exactly the served routes, matches specs/openapi.json, and
the server's answers conform to it (schemathesis, bounded)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from veritrain.ledger.openapi import build_document, documented_operations
from veritrain.ledger.server import LedgerConfig, make_app
from veritrain.protocol.identity import Identity

SPEC_FILE = Path(__file__).resolve().parents[1] / "specs" / "openapi.json"


def served_operations(tmp_path: Path) -> set[tuple[str, str]]:
    app = make_app(LedgerConfig(data_dir=tmp_path, db_url=f"sqlite:///{tmp_path / 'l.sqlite'}"),
                   Identity.generate("ledger"))
    return {(route.method, resource.canonical) for resource in app.router.resources()
            for route in resource if route.method not in ("HEAD", "*")}


def test_document_covers_every_served_route_and_nothing_else(tmp_path):
    served = served_operations(tmp_path)
    documented = documented_operations()
    assert served - documented == set(), "served but not documented"
    assert documented - served == set(), "documented but not served"


def test_checked_in_document_is_the_served_one():
    assert json.loads(SPEC_FILE.read_text()) == build_document(), (
        "regenerate: python -m veritrain.ledger.openapi > specs/openapi.json")


def test_document_is_valid_openapi():
    from openapi_spec_validator import validate

    validate(build_document())


@pytest.fixture(scope="module")
def live_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ledger on a loopback port, in a thread, with one played run to read."""
    from aiohttp import web
    from ledger_scenarios import COPIER, HONEST, make_store, play_run, quick_run

    tmp = tmp_path_factory.mktemp("openapi")
    url = f"sqlite:///{tmp / 'ledger.sqlite'}"
    store = make_store(url)
    play_run(store, quick_run("live-run"), [HONEST, COPIER], 1)
    store.engine.dispose()
    started = threading.Event()
    state: dict[str, object] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        config = LedgerConfig(data_dir=tmp / "data", db_url=url, ip_rate=0, key_rate=0)
        runner = web.AppRunner(make_app(config, store.identity))
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        state["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        state["loop"], state["runner"] = loop, runner
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    yield str(state["url"])
    loop = state["loop"]
    loop.call_soon_threadsafe(loop.stop)  # type: ignore[attr-defined]
    thread.join(30)


def test_answers_conform_to_the_document(live_ledger):
    """Every operation, with generated parameters and bodies: no 500, answers as documented."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_dict(build_document())
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=10, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:  # noqa: ANN001
            nonlocal calls
            calls += 1
            case.call_and_validate(base_url=live_ledger, checks=checks)

        try:
            check()
        except Exception as exc:  # collect, to report every failing operation at once
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}"[:1500])
    assert calls >= 100
    assert not failures, "\n\n".join(failures[:4])
