"""A `pagedserve serve` process for fault tests: start it, follow its pids, read its metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp

from tests.support.polling import eventually, eventually_blocking

API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


class ServeProcess:
    """The launcher and its current children's pids (updated from its `restarted` lines)."""

    def __init__(self, model_dir: Path, *extra: str, start_timeout: float = 240.0) -> None:
        self.model = Path(model_dir).name
        # Port 0: the gateway binds one the kernel picks, and the ready line's url names it.
        argv = [
            sys.executable, "-m", "services.cli", "serve", "--model", str(model_dir),
            "--port", "0", "--api-key", API_KEY, *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.pids: dict[str, int] = {}
        self.restarts: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._follow, daemon=True).start()
        if not self._ready.wait(start_timeout):
            self.proc.kill()
            raise AssertionError(f"the stack did not start (exit {self.proc.poll()})")

    def _follow(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("pagedserve: ready"):
                info = json.loads(line.split(" ", 2)[2])
                self.info = info  # the whole ready line (serve --ray-address: its placement)
                self.port = int(info["url"].rsplit(":", 1)[1])
                self.url = f"http://127.0.0.1:{self.port}"  # whatever --host it listens on
                self.pids = info["pids"]
                self._ready.set()
            elif "restarted" in line:
                self.restarts.append(line.split()[2])
                self.pids = json.loads(line[line.index("{") :])["pids"]

    def kill(self, name: str) -> int:
        pid = self.pids[name]
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, count: int, timeout: float = 120.0) -> None:
        eventually_blocking(
            lambda: len(self.restarts) >= count,
            timeout,
            message=lambda: f"{count} restarts, seen: {self.restarts}",
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics", headers=HEADERS) as response:
        text = await response.text()
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def wait_metric(session, url: str, name: str, value: float, timeout: float = 60.0) -> None:
    async def reached() -> bool:
        return await metric(session, url, name) == value

    # ClientError: the gateway is restarting; AssertionError: no stats from the scheduler yet.
    await eventually(
        reached, timeout, 0.1, f"{name} never became {value}",
        ignore=(aiohttp.ClientError, AssertionError),
    )  # fmt: skip


async def wait_health(session, url: str, timeout: float = 120.0) -> None:
    """Until /health says "ok" (not "degraded", not 503)."""

    async def ok() -> bool:
        async with session.get(f"{url}/health") as response:
            return response.status == 200 and (await response.json())["status"] == "ok"

    await eventually(ok, timeout, 0.1, "/health never said ok", ignore=(aiohttp.ClientError,))


async def stream(session, url: str, body: dict, on_event=None) -> dict:
    """POST a streaming request; the texts per choice, finish reasons, error event, token times."""
    out = {"status": None, "texts": {}, "finish": {}, "error": None, "times": [], "done": False}
    async with session.post(url, json=body | {"stream": True}, headers=HEADERS) as response:
        out["status"] = response.status
        if response.status != 200:
            out["error"] = (await response.json())["error"]
            return out
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["times"].append(time.monotonic())
            for choice in event["choices"]:
                i = choice["index"]
                out["texts"][i] = out["texts"].get(i, "") + choice["text"]
                if choice["finish_reason"]:
                    out["finish"][i] = choice["finish_reason"]
            if on_event is not None:
                on_event()
    return out


async def stream_completion(session, url, model, prompt_ids, max_tokens) -> tuple[str, str]:
    """A greedy streamed completion of token ids: its text and the last finish reason."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, finish = "", None
    async with session.post(f"{url}/v1/completions", json=body, headers=HEADERS) as response:
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish
