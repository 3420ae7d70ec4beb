"""The ledger's web page, rendered by headless Chromium: screenshot and what it shows."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from ledger_harness import run_api
from ledger_scenarios import COPIER, FREE_RIDER, HONEST, SPOT_FAIL, make_store, play_run, quick_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed "
                                "(./dev test installs it with apt where it can)")
KINDS = [HONEST, HONEST, HONEST, FREE_RIDER, COPIER, SPOT_FAIL]
ROUNDS = 3


async def chromium(*args: str, timeout: float = 90.0) -> bytes:
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        proc = await asyncio.create_subprocess_exec(
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        return out
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def colour_share(png: Path, rgb: tuple[int, int, int], tol: int = 12) -> float:
    from PIL import Image

    img = Image.open(png).convert("RGB")
    raw = img.tobytes()
    n = len(raw) // 3
    near = sum(1 for k in range(0, len(raw), 3)
               if all(abs(raw[k + c] - rgb[c]) <= tol for c in range(3)))
    return near / n


def test_run_page_in_headless_chromium(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    store = make_store(url)
    played = play_run(store, quick_run("page-run"), KINDS, ROUNDS)
    store.engine.dispose()
    shot = tmp_path / "run-page.png"

    async def scenario(api):
        page = f"{api.url}/runs/page-run"
        dom = (await chromium("--dump-dom", page)).decode()
        await chromium(f"--screenshot={shot}", "--window-size=1280,1000", page)
        index = (await chromium("--dump-dom", f"{api.url}/")).decode()
        return dom, index

    dom, index = run_api(tmp_path, scenario, db_url=url, identity=store.identity)
    assert 'href="/runs/page-run"' in index
    # The charts: one loss point per finalized round, a green and a red bar per round.
    points = re.findall(r'class="loss-point" data-round="(\d+)" data-loss="([\d.]+)"', dom)
    assert [int(r) for r, _ in points] == list(range(ROUNDS))
    assert [float(v) for _, v in points] == [3.0 - 0.25 * r for r in range(ROUNDS)]
    accepted = re.findall(r'class="bar-accepted" data-round="\d+" data-count="(\d+)"', dom)
    rejected = re.findall(r'class="bar-rejected" data-round="\d+" data-count="(\d+)"', dom)
    assert accepted == ["3"] * ROUNDS
    assert rejected == ["3", "2", "2"]  # the spot-check cheat is banned after round 0
    # Each worker's row: scores, penalties, rewards; honest ones share the rewards.
    rows = re.findall(r'<tr class="worker" data-worker="([0-9a-f]{64})">(.*?)</tr>', dom)
    assert len(rows) == len(KINDS)
    for key, cells in rows:
        reward = float(re.search(r'class="num reward">([\d.]+)<', cells).group(1))
        if played.workers[key] == HONEST:
            assert reward == pytest.approx(ROUNDS * 100 / 3, rel=1e-3)
        else:
            assert reward == 0.0
        if played.workers[key] == SPOT_FAIL:
            assert "banned to r" in cells
    assert f'data-card="rounds finalized">{ROUNDS}<' in dom
    links = re.findall(r'(?:src|href)="([^"]*)"', dom)
    assert links and all(link.startswith("/") for link in links)  # nothing from elsewhere
    # The screenshot shows the page: mostly background, green and red bars, blue line.
    assert shot.stat().st_size > 20_000
    assert colour_share(shot, (0x2E, 0x9D, 0x5B)) > 0.002  # accepted bars and reward bars
    assert colour_share(shot, (0xD2, 0x45, 0x3B)) > 0.001  # rejected bars
    assert colour_share(shot, (0xF6, 0xF7, 0xF9)) > 0.3  # the page background
