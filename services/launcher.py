"""`pagedserve serve`: start executor, scheduler and gateway processes, watch them, restart a
dead one within a budget, stop them in order."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace

from services.config_args import config_json_argv, engine_config_from_args
from services.gateway.service import add_gateway_args, check_exposure
from services.restart_budget import RestartBudget
from shared.config import EngineConfig
from shared.flags import parsed_argv
from shared.ipc import Addresses
from shared.model_source import model_name, resolve_model

START_TIMEOUT_S = 900.0  # the first start converts the embedded model (~45 s on 2 cores)
STOP_TIMEOUT_S = 10.0
GIVE_UP_GRACE_S = 1.5  # lets the scheduler's "giving up" error events reach open streams


class Stack:
    """The three service processes, started in dependency order."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.budgets: dict[str, RestartBudget] = {}  # one per process name, made at its spawn
        self.envs: dict[str, dict[str, str] | None] = {}  # per process; None: the launcher's
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")  # private pipes of this stack
        # With --port 0 the first gateway binds a port the kernel picks and writes it to a file;
        # the others (sharing it) start once it is known.
        self.port: int = args.port
        self._deferred: list[tuple[str, list[str], dict[str, str]]] = []

    def start(self) -> None:
        args = self.args
        # Converted or downloaded once, before the children race to it.
        model_dir = str(resolve_model(args.model, getattr(args, "download_dir", None)))
        config = engine_config_from_args(args)
        config = replace(config, model=replace(config.model, model=model_dir))
        name = [arg for served in served_model_names(args) for arg in ("--model-name", served)]
        name += ["--max-restarts", str(args.max_restarts)]
        name += ["--restart-window", str(args.restart_window)]
        if args.plan_log:
            name += ["--plan-log", args.plan_log]
        num_replicas = getattr(args, "replicas", 1)
        if num_replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {num_replicas}")
        num_gateways = getattr(args, "gateways", 1)
        if num_gateways < 1:
            raise ValueError(f"--gateways must be at least 1, got {num_gateways}")
        replicas = [self._replica_addresses(i) for i in range(num_replicas)]
        for i, addresses in enumerate(replicas):
            wires = _wires(addresses)
            suffix = f"-{i}" if i else ""
            own, env = _replica_engine(config, i, num_replicas)
            engine = config_json_argv(own)
            # The scheduler binds every pipe, so it goes first; the others connect to it.
            self._spawn(f"scheduler{suffix}", ["-m", "services.scheduler", *engine, *name, *wires])
            self._start_executor(i, f"executor{suffix}", own, wires, env)
        gateway = ["--model", model_dir, *gateway_argv(args), *self._gateway_extra_argv()]
        for addresses in replicas[1:]:
            gateway += ["--replica-addr", addresses.gateway]
        gateway_env = _gateway_env(args.api_key)
        if num_gateways > 1:
            # One port for all (the kernel spreads connections), one set of /metrics counters.
            gateway += ["--reuse-port"]
            metrics_dir = os.path.join(self.ipc_dir, "metrics")
            os.makedirs(metrics_dir)
            gateway_env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        for i in range(num_gateways):
            name = f"gateway-{i}" if i else "gateway"
            argv = ["-m", "services.gateway", *gateway, *_wires(replicas[0])]
            if num_gateways > 1:
                argv += ["--ready-file", self._ready_file(name)]
            if self.port == 0 and i == 0:
                argv += ["--port-file", self._port_file()]
            elif self.port == 0:
                self._deferred.append((name, argv, gateway_env))
                continue
            self._spawn(name, argv, gateway_env)

    def _replica_addresses(self, index: int) -> Addresses:
        """Where replica `index`'s scheduler listens: private ipc:// pipes on one machine."""
        return Addresses.ipc(os.path.join(self.ipc_dir, f"replica-{index}"))

    def _start_executor(
        self,
        index: int,
        name: str,
        engine: EngineConfig,
        wires: list[str],
        env: dict[str, str] | None,
    ) -> None:
        """Start replica `index`'s executor (it starts its own tensor-parallel ranks)."""
        self._spawn(name, ["-m", "services.executor", *config_json_argv(engine), *wires], env)

    def _gateway_extra_argv(self) -> list[str]:
        return []

    def ready_info(self) -> dict:
        """What the ready line reports beside the model, url and pids."""
        return {}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        # A process group of their own: Ctrl-C reaches only the launcher, which stops them in
        # order. Not a session of their own: with Linux's autogroups each session is a
        # scheduling group, and groups share the cores before priorities inside them count, so
        # the gateway's low-priority body parser took its group's half of the cores from the
        # executor's steps (docs/architecture.md, "background work and the cores").
        self.argv[name] = argv
        self.envs[name] = env if env is not None else self.envs.get(name)
        if name not in self.budgets:
            self.budgets[name] = RestartBudget(self.args.max_restarts, self.args.restart_window)
        self.procs[name] = subprocess.Popen(
            [sys.executable, *argv], process_group=0, env=self.envs[name]
        )

    def restart(self, name: str) -> bool:
        """Start a new `name` in place of the dead one; False when its budget is spent.

        The scheduler binds every pipe, so the others reconnect to a new one by themselves;
        but the executor holds the dead scheduler's sequences and blocks, so it is replaced too.
        A new executor announces itself and the scheduler requeues its requests there; a new
        gateway is announced the model when it connects.
        """
        if not self.budgets[name].allow():
            return False
        self._spawn(name, self.argv[name])
        if name.startswith("scheduler"):
            executor = name.replace("scheduler", "executor")  # the same replica's
            self._stop_one(executor)
            self._spawn(executor, self.argv[executor])
        return True

    def exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def _ready_file(self, gateway: str) -> str:
        return os.path.join(self.ipc_dir, f"{gateway}.ready")

    def _port_file(self) -> str:
        return os.path.join(self.ipc_dir, "gateway.port")

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.port}"

    def _learn_port(self) -> None:
        """--port 0: once the first gateway listens, its port is every gateway's, restarts too."""
        try:
            with open(self._port_file()) as f:
                self.port = int(f.read())
        except FileNotFoundError:
            return  # not listening yet
        for name in [n for n in self.argv if n.startswith("gateway")]:
            self.argv[name] = _with_port(self.argv[name], self.port)
        for name, argv, env in self._deferred:
            self._spawn(name, _with_port(argv, self.port), env)
        self._deferred.clear()

    def _gateways_listening(self) -> bool:
        """Behind a shared port /health reaches any one gateway: each says so in a file."""
        gateways = [n for n in self.procs if n.startswith("gateway")]
        return len(gateways) == 1 or all(os.path.exists(self._ready_file(n)) for n in gateways)

    def wait_ready(self, timeout: float, stopping: Callable[[], bool]) -> str | None:
        """None once /health answers 200 (and every gateway listens), else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if stopping():
                return "interrupted"
            gone = self.exited()
            if gone is not None:
                return f"the {gone[0]} process exited with code {gone[1]} during start-up"
            if self.port == 0:
                self._learn_port()
            if self.port != 0 and self._health_ok() and self._gateways_listening():
                return None
            time.sleep(0.5)
        return f"not ready after {timeout:.0f} s"

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                # "degraded": some replica is not up yet; start-up waits for all of them.
                return response.status == 200 and json.load(response).get("status") == "ok"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self) -> None:
        # Gateway first (it ends open streams), then the schedulers, then the executors.
        order = {"gateway": 0, "scheduler": 1, "executor": 2}
        for name in sorted(self.procs, key=lambda n: order[n.split("-")[0]]):
            self._stop_one(name)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _stop_one(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _replica_engine(
    config: EngineConfig, index: int, num_replicas: int
) -> tuple[EngineConfig, dict[str, str] | None]:
    """Replica `index`'s engine config and environment: its own rendezvous port and, on a
    machine with GPUs, its own devices (unless CUDA_VISIBLE_DEVICES already decides)."""
    if num_replicas == 1:
        return config, None
    parallel = config.parallel
    if parallel.master_port is not None:
        parallel = replace(parallel, master_port=parallel.master_port + index)
        config = replace(config, parallel=parallel)
    if config.model.device == "cpu" or "CUDA_VISIBLE_DEVICES" in os.environ:
        return config, None
    size = parallel.tensor_parallel_size
    devices = ",".join(str(d) for d in range(index * size, (index + 1) * size))
    return config, {**os.environ, "CUDA_VISIBLE_DEVICES": devices}


def served_model_names(args: argparse.Namespace) -> list[str]:
    """The names the API answers to, the first one reported (--served-model-name, else the
    model's own name)."""
    return getattr(args, "served_model_name", None) or [model_name(args.model)]


def gateway_argv(args: argparse.Namespace) -> list[str]:
    """The gateway's own flags of `serve`, as its process takes them; the API key goes by the
    environment instead (see _gateway_env)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_gateway_args(parser)
    return parsed_argv(parser, args, skip=frozenset({"api_key"}))


def _gateway_env(api_key: str | None) -> dict[str, str]:
    """The gateway's environment, which carries the API key (the gateway's --api-key defaults to
    $PAGEDSERVE_API_KEY): on argv any local user would read it in ps or /proc/PID/cmdline,
    while /proc/PID/environ is readable only by the process's owner."""
    env = dict(os.environ)
    if api_key:
        env["PAGEDSERVE_API_KEY"] = api_key
    else:  # no key (or --api-key ''): the gateway must not pick one up from the environment
        env.pop("PAGEDSERVE_API_KEY", None)
    return env


def _with_port(argv: list[str], port: int) -> list[str]:
    at = argv.index("--port") + 1
    return [*argv[:at], str(port), *argv[at + 1 :]]


def _wires(addresses: Addresses) -> list[str]:
    return [
        "--gateway-addr", addresses.gateway,
        "--plans-addr", addresses.plans,
        "--results-addr", addresses.results,
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    check_exposure(args)  # before any process starts
    if getattr(args, "ray_address", None):
        try:
            from services.ray.stack import RayStack  # Ray is imported on this path only
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise ValueError("--ray-address needs Ray: pip install 'pagedserve[ray]'") from exc
        stack = RayStack(args)
    else:
        stack = Stack(args)
    stopping = {"signal": None}

    def on_signal(signum, frame) -> None:
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # The services are background process groups of this session (Stack._spawn): on a terminal
    # set to `stty tostop` their first log line would stop them. Ignored (which exec keeps),
    # SIGTTOU lets their writes through.
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        stack.start()
        problem = stack.wait_ready(START_TIMEOUT_S, lambda: stopping["signal"] is not None)
        if problem is not None and stopping["signal"] is None:
            print(f"pagedserve: failed to start: {problem}", file=sys.stderr)
            return 1
        if stopping["signal"] is None:
            info = {
                "model": served_model_names(args)[0],
                "url": stack.url,  # with --port 0, the port the kernel picked
                "pids": {n: p.pid for n, p in stack.procs.items()},
                **stack.ready_info(),
            }
            print(f"pagedserve: ready {json.dumps(info)}", flush=True)
        while stopping["signal"] is None:
            gone = stack.exited()
            if gone is not None:
                name, code = gone
                if stack.restart(name):
                    pids = {n: p.pid for n, p in stack.procs.items()}
                    print(
                        f"pagedserve: the {name} process exited with code {code}; restarted "
                        f"{json.dumps({'pids': pids})}",
                        flush=True,
                    )
                    continue
                print(
                    f"pagedserve: the {name} process exited with code {code} "
                    f"with its restart budget ({stack.budgets[name].describe()}) spent; "
                    "stopping the others",
                    file=sys.stderr,
                )
                time.sleep(GIVE_UP_GRACE_S)
                return 1
            time.sleep(0.1)
        return 0
    finally:
        stack.stop()
