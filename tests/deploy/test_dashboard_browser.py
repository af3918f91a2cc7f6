"""/dashboard in a real headless Chromium: it loads, its grid follows the pool while requests
run, and a screenshot is saved as a test artifact (tmp/artifacts/dashboard.png)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.deploy.cdp import Browser, find_browser
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "tmp" / "artifacts" / "dashboard.png"
API_KEY = "dash-key"
NUM_BLOCKS = 128
BROWSER = find_browser()

pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine")


@pytest.fixture(scope="module")
def small_pool_stack(tiny_model_dir):
    """A stack whose pool is small enough that 10 long requests fill it and swap each other."""
    argv = [
        sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_model_dir),
        "--port", "0", "--api-key", API_KEY, "--block-size", "4",
        "--num-device-blocks", str(NUM_BLOCKS), "--max-num-seqs", "16",
        "--preemption-mode", "swap",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("pagedserve: ready"):
            break
    assert line.startswith("pagedserve: ready"), f"stack did not start (exit {proc.poll()})"
    port = json.loads(line.split(" ", 2)[2])["url"].rsplit(":", 1)[1]  # the one it bound
    try:
        yield f"http://127.0.0.1:{port}", Path(tiny_model_dir).name
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


async def _stream(session: aiohttp.ClientSession, url: str, model: str, i: int) -> None:
    body = {
        "model": model,
        "prompt": [3 + (i * 7 + j) % 300 for j in range(24)],
        "max_tokens": 240,  # long enough that a 0.2 s poll sees swapped blocks, also on a fast host
        "n": 2 if i % 3 == 0 else 1,  # parallel samples share their prompt blocks
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200
        async for _ in response.content:
            pass


# Before the page has loaded (navigation in flight) the elements are missing: updates 0.
GRID = """(() => { try { return {
  updates: Number(document.body.dataset.updates || 0),
  cells: document.querySelectorAll('#device .blk').length,
  used: Number(document.getElementById('device').dataset.used || 0),
  swapped: Number(document.getElementById('cpu').dataset.used || 0),
  rows: document.querySelectorAll('#requests tr td:nth-child(2)').length,
  preemptions: document.getElementById('c-pre').textContent,
}; } catch (e) { return {updates: 0, cells: 0, used: 0, swapped: 0, rows: 0}; } })()"""


async def test_the_dashboard_follows_the_pool_live(small_pool_stack):
    url, model = small_pool_stack
    async with Browser(BROWSER) as page:
        # The page and its fetches carry the key, as a browser does after the Basic prompt.
        await page.send("Network.enable")
        await page.send(
            "Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        await page.send("Page.navigate", url=f"{url}/dashboard")
        idle = await _wait_for(page, lambda g: g["updates"] >= 1)
        assert idle["cells"] == NUM_BLOCKS and idle["used"] == 0

        seen: list[dict] = []
        shot = False
        async with aiohttp.ClientSession() as session:
            run = asyncio.gather(*(_stream(session, url, model, i) for i in range(10)))
            task = asyncio.ensure_future(run)
            while not task.done():
                grid = await page.evaluate(GRID)
                seen.append(grid)
                # One picture of a busy pool: blocks in use and some swapped out to the CPU.
                if not shot and grid["used"] > NUM_BLOCKS // 2 and grid["swapped"] > 0:
                    await page.screenshot(ARTIFACT)
                    shot = True
                await asyncio.sleep(0.2)
            await task
        if not shot:
            await page.screenshot(ARTIFACT)
        done = await _wait_for(
            page, lambda g: g["used"] == 0 and g["updates"] > seen[-1]["updates"]
        )

    busy = [g["used"] for g in seen if g["used"] > 0]
    assert len(set(busy)) >= 2, f"the grid did not change while requests ran: {busy}"
    assert max(g["rows"] for g in seen) > 0
    assert max(g["swapped"] for g in seen) > 0, "no swapped blocks were shown"
    assert int(done["preemptions"]) > 0
    assert ARTIFACT.read_bytes().startswith(b"\x89PNG")


async def test_a_browser_with_basic_credentials_gets_the_page_and_its_data(small_pool_stack):
    url, _ = small_pool_stack
    async with Browser(BROWSER) as page:
        # What a person does at the Basic prompt: the key as password, any user name.
        await page.send(
            "Page.navigate", url=url.replace("http://", f"http://me:{API_KEY}@") + "/dashboard"
        )
        grid = await _wait_for(page, lambda g: g["updates"] >= 2)  # fetches with the same key
        assert grid["cells"] == NUM_BLOCKS


async def _wait_for(page, condition, timeout: float = 30.0) -> dict:
    last: dict = {}

    async def reached() -> dict | None:
        last.update(await page.evaluate(GRID))
        return dict(last) if condition(last) else None

    return await eventually(
        reached, timeout, 0.2, lambda: f"the page never reached the state: {last}"
    )
