"""A Ray actor that runs one executor rank's process (`services.executor` or its tp_worker) on
the node Ray placed it on, and lives exactly as long as it.

The rank runs as a subprocess the actor owns, not inside the actor: the executor's main installs
signal handlers and torch.distributed state that are process-wide, and a rank that is blocked in
a collective or exits with os._exit must not take Ray's worker with it before Ray can report it.
The subprocess dies with the actor (PR_SET_PDEATHSIG), so a lost node or a killed actor leaves no
rank behind that could still answer the scheduler.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


class RankProcess:
    """Wrapped by ray.remote in services/ray/replica.py; methods run on the actor's node."""

    def node(self) -> dict[str, str]:
        """Where Ray placed this rank: its node's id and the address other nodes reach it at."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def free_port(self) -> int:
        """A port free on this node now, for rank 0's rendezvous (torch's TCPStore binds it)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """Run `python argv...` to its end and return its exit code; the caller's ObjectRef of
        this call is the rank's liveness (it resolves when the rank exits or the actor dies)."""
        parent = os.getpid()
        # Ray's worker environment (devices it reserved, thread counts) plus the launcher's.
        child_env = {**os.environ, **env}
        proc = subprocess.Popen(
            [sys.executable, *argv, "--parent-pid", str(parent)],
            env=child_env,
            preexec_fn=lambda: _die_with(parent),
        )
        return proc.wait()


def _die_with(parent: int) -> None:
    """In the child before exec: SIGKILL when the actor's thread that started it ends."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the actor died between fork and prctl
        os._exit(1)
