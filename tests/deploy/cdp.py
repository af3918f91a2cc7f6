"""A headless Chromium driven over the DevTools protocol (a websocket), just enough for tests."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.polling import eventually

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root, where the sandbox cannot start
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--remote-debugging-port=0",  # Chromium picks a port and writes it to DevToolsActivePort
]


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


class Browser:
    """`async with Browser(path) as page:` gives a Page on a fresh profile; closed afterwards."""

    def __init__(self, executable: str, width: int = 1280, height: int = 960) -> None:
        self.executable = executable
        self.size = (width, height)

    async def __aenter__(self) -> Page:
        self._profile = tempfile.mkdtemp(prefix="pagedserve-chromium-")
        self._proc = subprocess.Popen(
            [self.executable, *FLAGS, f"--user-data-dir={self._profile}",
             f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port = await self._devtools_port()
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        target = next(t for t in targets if t["type"] == "page")
        socket = await self._http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        self.page = Page(socket)
        await self.page.send(
            "Emulation.setDeviceMetricsOverride",
            width=self.size[0], height=self.size[1], deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        return self.page

    async def _devtools_port(self) -> int:
        active = Path(self._profile) / "DevToolsActivePort"

        def port() -> int | None:
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self._proc.returncode}")
            text = active.read_text().strip() if active.is_file() else ""
            return int(text.split()[0]) if text else None

        return await eventually(port, 60.0, 0.1, "chromium did not open its DevTools port")

    async def __aexit__(self, *exc: Any) -> None:
        await self.page.socket.close()
        await self._http.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)


class Page:
    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self._ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a DevTools method and return its result; events in between are skipped."""
        call_id = next(self._ids)
        await self.socket.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads((await self.socket.receive(timeout=60)).data)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))
