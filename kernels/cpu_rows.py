"""The CPU's row kernels (kernels/csrc/cpu_rows.cpp): built on first use, or never.

At decode and verify sizes a CPU step spends more time dispatching each layer's small ops than
running them, and attention's gather of whole blocks and its SDPA call are the largest share
(`benchmarks/cpu_row_kernels.py`). The C++ ops do a layer's norms, rotary, KV write, attention
and gate in four calls, each query row on its own. They are compiled with the machine's compiler
for its own instruction set the first time a process asks (seconds; torch keeps the
build under TORCH_EXTENSIONS_DIR, so later processes load it at once); where that fails the
reference ops stay in use: the kernels are a speed-up, never a requirement.

    python -m kernels.cpu_rows   # builds them now (`make setup` does) and says so
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_rows.cpp", "int8_rows.cpp", "int4_rows.cpp")]
HEADERS = [CSRC / name for name in ("int8_rows.h", "int4_rows.h")]
# -march=native: built for the CPU it runs on, so the name carries that CPU's flags (a build
# cache shared by different CPUs never hands one the other's instructions; _build_tag).
# -ffp-contract=off: products round before they are added, as torch's elementwise ops round them.
# -fopenmp: at::parallel_for spreads work over torch's threads only in a translation unit built
# with OpenMP (ATen/ParallelOpenMP.h); without it every call ran on one thread. The library links
# libgomp.so.1 by name, and the process has torch's own loaded already, so both share one pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
OPS = (
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "rows_attention",
    "int8_rows_linear",
    "int4_rows_linear",
    "rows_forward",
)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded ops or None once tried; "error": why not


def _build_tag() -> str:
    """The CPU's flags, the build's and the sources, hashed: a changed source builds into a new
    directory instead of rewriting a library that running processes have loaded."""
    text = (
        _cpu_flags()
        + " ".join(CFLAGS + LDFLAGS)
        + "".join(s.read_text() for s in SOURCES + HEADERS)
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _cpu_flags() -> str:
    flags = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return flags


def load_row_ops() -> SimpleNamespace | None:
    """The ops (torch.ops.pagedserve_cpu.*), built and loaded on the first call; None where
    they cannot be (no compiler, a failed build): the caller keeps the reference ops."""
    with _lock:
        if "ops" not in _state:
            _state["ops"] = None
            try:
                from torch.utils.cpp_extension import load

                load(
                    name=f"pagedserve_cpu_{_build_tag()}",
                    sources=[str(source) for source in SOURCES],
                    extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS,
                    is_python_module=False,
                    verbose=False,
                )
                namespace = torch.ops.pagedserve_cpu
                _state["ops"] = SimpleNamespace(**{name: getattr(namespace, name) for name in OPS})
            except Exception as exc:  # no compiler, no headers, a failed build: the reference
                _state["error"] = f"{type(exc).__name__}: {exc}"
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("CPU row kernels not built (%s); the reference ops run", first_line)
        return _state["ops"]  # type: ignore[return-value]


def build_error() -> str | None:
    """Why the kernels are not available, once load_row_ops() has been asked."""
    return _state.get("error")  # type: ignore[return-value]


if __name__ == "__main__":
    if load_row_ops() is None:
        raise SystemExit(f"CPU row kernels not built: {build_error()}")
    print("CPU row kernels ready")
