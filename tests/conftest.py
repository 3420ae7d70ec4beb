"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import FakeRun, make_fake_run


@pytest.fixture
def fake_run() -> FakeRun:
    return make_fake_run()


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.sqlite'}"
