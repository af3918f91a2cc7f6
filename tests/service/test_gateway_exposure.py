"""Without an API key the gateway serves only loopback: on an address other machines can reach it
refuses to start, unless a key or --allow-unauthenticated is given; its connection flags apply."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from services.gateway.service import check_exposure
from tests.service.stack_process import API_KEY, HEADERS, ServeProcess
from tests.support.polling import eventually


def _args(host: str, api_key: str | None = None, allow: bool = False) -> argparse.Namespace:
    return argparse.Namespace(host=host, api_key=api_key, allow_unauthenticated=allow)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host):
    check_exposure(_args(host))


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3", "gateway.example"])
def test_a_reachable_address_needs_a_key_or_consent(host):
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        check_exposure(_args(host))
    check_exposure(_args(host, api_key="k"))
    check_exposure(_args(host, allow=True))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_API_KEY"}
    return env | extra


@pytest.mark.parametrize("command", ["services.gateway", "services.cli serve"])
def test_refuses_to_start_unauthenticated_on_all_addresses(command, tiny_model_dir):
    argv = [sys.executable, "-m", *command.split(), "--model", str(tiny_model_dir)]
    argv += ["--host", "0.0.0.0", "--port", "0"]
    result = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "no API key is set" in result.stderr
    assert "--allow-unauthenticated" in result.stderr


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize("consent", ["--allow-unauthenticated", "PAGEDSERVE_API_KEY"])
async def test_starts_on_all_addresses_with_a_key_or_consent(consent, tiny_model_dir, tmp_path):
    port_file = tmp_path / "port"
    argv = [sys.executable, "-m", "services.gateway", "--model", str(tiny_model_dir)]
    argv += ["--host", "0.0.0.0", "--port", "0", "--port-file", str(port_file)]
    argv += ["--header-read-timeout", "1"]
    argv += ["--gateway-addr", f"ipc://{tmp_path}/gateway"]  # no scheduler there: not ready
    env = _env()
    if consent == "PAGEDSERVE_API_KEY":
        env["PAGEDSERVE_API_KEY"] = "k"  # the default of --api-key
    else:
        argv.append(consent)
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        # The gateway binds a port the kernel picks and says which once it listens.
        await eventually(lambda: proc.poll() is not None or port_file.exists(), timeout=120)
        assert proc.poll() is None
        port = int(port_file.read_text())
        assert _listening(port)
        # Listening, not ready (no scheduler), and asking for the key only when it has one.
        assert _status(port, "/health") == 503
        assert _status(port, "/v1/models") == (401 if consent == "PAGEDSERVE_API_KEY" else 503)
        # --header-read-timeout reaches the listener: a connection that sends nothing is closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 1.0 + 5.0) == b""
        writer.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _descendants(pid: int) -> set[int]:
    """The pids under `pid` now, from each process's parent in /proc/PID/stat."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The name, in parentheses, may hold spaces: the parent's pid follows its end.
                parents[int(entry)] = int(stat.read().rpartition(")")[2].split()[1])
        except (ValueError, OSError):  # not a process, or one gone since listdir
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def test_the_api_key_is_on_no_command_line_the_launcher_starts(tiny_model_dir):
    # Any user of the machine reads every process's argv (ps, /proc/PID/cmdline); the key reaches
    # the gateway in its environment, which only its owner reads.
    stack = ServeProcess(tiny_model_dir, "--num-device-blocks", "64")
    try:
        children = _descendants(stack.proc.pid)
        assert set(stack.pids.values()) <= children
        for pid in children:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                assert API_KEY.encode() not in cmdline.read(), pid
        assert _status(stack.port, "/v1/models") == 401  # the key reached the gateway
        request = urllib.request.Request(f"{stack.url}/v1/models", headers=HEADERS)
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    finally:
        assert stack.stop() == 0
