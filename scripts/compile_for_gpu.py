"""Compile every Triton kernel variant the GPU path launches for a CUDA target, on a machine
without a GPU: nothing runs, each launch only compiles (Triton's front end, then ptxas).

Triton's interpreter, which the CPU tests use, accepts code its compiler rejects (a global read
inside a kernel, a loop variable that changes type), so a kernel can pass every CPU test and
fail on its first GPU launch. This drives the kernels' own Python wrappers (the attention
warm-up's variants, the KV store and block copy, the MoE GEMM, both sampler variants) with CPU
tensors while Triton believes the current device is a CUDA GPU of the given capability, and
turns every launch into a compile-only warm-up. Prints one line per compiled kernel variant,
with its registers and stack bytes per thread as the compiled binary records them (cuobjdump,
shipped with Triton): a stack frame in these kernels is registers spilled to local memory,
which a CPU test can catch before a GPU run measures it.

    .venv/bin/python -m scripts.compile_for_gpu --capability 90
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before triton is imported: the kernels must be compiled, not interpreted.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CompileOnlyDriver:
    """What a JITFunction asks of the active driver before compiling: a target, a device and a
    stream. Launching is never reached (every run is a warm-up)."""

    def __init__(self, capability: int, warp_size: int = 32) -> None:
        self.target = GPUTarget("cuda", capability, warp_size)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def compile_only(capability: int) -> list[dict]:
    """Make every later kernel launch in this process compile for `capability` and return
    without running; returns the list each compiled variant is appended to (its kernel,
    constexprs, compile seconds, registers and stack bytes per thread)."""
    compiled: list[dict] = []
    driver.set_active(CompileOnlyDriver(capability))
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        seconds = time.perf_counter() - start
        registers, stack = resource_usage(kernel.asm["cubin"])
        compiled.append(
            {
                "kernel": self.fn.__name__,
                "constexprs": {k: v for k, v in kwargs.items() if k.isupper()},
                "compile_s": round(seconds, 2),
                "registers": registers,
                "stack_bytes": stack,
            }
        )
        return kernel

    JITFunction.run = warm
    return compiled


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of the one kernel in a compiled binary."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        done = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", file.name],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"REG:(\d+) STACK:(\d+)", done.stdout)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {done.stdout[-500:]}")
    return int(found[1]), int(found[2])


def drive_kernels(dtype: torch.dtype) -> None:
    """Each wrapper once per variant the GPU path can launch, on small CPU tensors."""
    from kernels.triton_cache import copy_blocks, store_kv
    from kernels.triton_moe import fused_moe
    from kernels.triton_sampling import warm_up_sampling
    from kernels.triton_warmup import warm_up_attention

    # Head layouts of the benchmark shapes (1.1B: 32/4 heads of 64; 8B: 32/8 of 128), one
    # with a softcap and sliding windows (Gemma-2's kind) and one with odd group and head_dim.
    layouts = [
        dict(heads=32, kv_heads=4, head_dim=64, softcap=None, windows=(None,)),
        dict(heads=32, kv_heads=8, head_dim=128, softcap=None, windows=(None,)),
        dict(heads=8, kv_heads=4, head_dim=256, softcap=50.0, windows=(None, 64)),
        dict(heads=9, kv_heads=3, head_dim=80, softcap=None, windows=(None,)),
    ]
    for layout in layouts:
        cache = torch.zeros(4, 16, layout["kv_heads"], layout["head_dim"], dtype=dtype)
        warm_up_attention(
            cache,
            cache.clone(),
            layout["heads"],
            layout["head_dim"] ** -0.5,
            layout["softcap"],
            layout["windows"],
        )
        key = torch.zeros(3, layout["kv_heads"], layout["head_dim"], dtype=dtype)
        store_kv(key, key.clone(), cache, cache.clone(), torch.tensor([0, 17, -1]))
    pool = torch.zeros(2, 2, 4, 16, 8, 64, dtype=dtype)  # [layers, K/V, blocks, slots, heads, dim]
    copy_blocks(pool, [(0, 1), (2, 3)])
    hidden, width, experts = 64, 32, 4
    x = torch.zeros(5, hidden, dtype=dtype)
    gate_up = torch.zeros(experts, 2 * width, hidden, dtype=dtype)
    down = torch.zeros(experts, hidden, width, dtype=dtype)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]])
    fused_moe(x, gate_up, down, torch.ones(5, 2), ids, torch.nn.functional.silu)
    for vocab in (49152, 128256):
        warm_up_sampling(vocab, torch.device("cpu"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="e.g. 90 for an H100/H200")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", default=None, help="write every variant's resources here")
    args = parser.parse_args()
    compiled = compile_only(args.capability)
    drive_kernels(getattr(torch, args.dtype))
    for v in compiled:
        print(
            f"{v['kernel']} {v['constexprs']} {v['compile_s']:.1f}s "
            f"registers {v['registers']} stack {v['stack_bytes']}"
        )
    print(f"compiled {len(compiled)} kernel variants for sm_{args.capability}")
    if args.json:
        report = {
            "command": " ".join(["scripts/compile_for_gpu.py", *sys.argv[1:]]),
            "capability": args.capability,
            "dtype": args.dtype,
            "triton": triton.__version__,
            "variants": compiled,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
