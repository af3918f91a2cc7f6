"""Start and stop a `pagedserve serve` child for one allocation policy (bench serve --launch)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.config_args import engine_argv


class Server:
    def __init__(self, args: argparse.Namespace, policy: str, port: int) -> None:
        child = copy.copy(args)
        child.kv_policy = policy
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(port)]
        self.proc = subprocess.Popen(
            argv + engine_argv(child, args.model), start_new_session=True, env=os.environ.copy()
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_healthy(self.proc, self.url, timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop a server started with start_new_session=True and everything it started: SIGINT to
    its group (it stops its children in order), SIGKILL after a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


READY_LINE = "pagedserve: ready "


def ready_url(line: str) -> str | None:
    """The url in `pagedserve serve`'s ready line (with --port 0, the port the kernel picked),
    or None for any other line."""
    if not line.startswith(READY_LINE):
        return None
    port = json.loads(line[len(READY_LINE) :])["url"].rsplit(":", 1)[1]
    return f"http://127.0.0.1:{port}"  # whatever --host it listens on


def wait_ready_url(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    """The url of a `pagedserve serve` child whose stdout goes to log_path, once its ready line
    is there (it prints it when /health answers); raise if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = Path(log_path).read_text(errors="replace")
        url = next(filter(None, map(ready_url, text.splitlines())), None)
        if url is not None:
            return url
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; its log: {log_path}")
        time.sleep(0.2)
    raise TimeoutError(f"no ready line after {timeout_s} s; the server's log: {log_path}")


def free_port() -> int:
    """A port free now, for a server that cannot bind port 0 and report it (llama-server); it
    binds the port a moment later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Poll `url`/health until it answers 200; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")
