"""Compile every Triton kernel variant the GPU path launches for a CUDA target, on a machine
without a GPU: nothing runs, each launch only compiles (Triton's front end, then ptxas).

Triton's interpreter, which the CPU tests use, accepts code its compiler rejects (a global read
inside a kernel, a loop variable that changes type), so a kernel can pass every CPU test and
fail on its first GPU launch. This drives the kernels' own Python wrappers (the attention
warm-up's variants, the KV store and block copy, the MoE GEMM, both sampler variants) with CPU
tensors while Triton believes the current device is a CUDA GPU of the given capability, and
turns every launch into a compile-only warm-up. Prints one line per compiled kernel variant.

    .venv/bin/python -m scripts.compile_for_gpu --capability 90
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Before triton is imported: the kernels must be compiled, not interpreted.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
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


def compile_only(capability: int) -> list[str]:
    """Make every later kernel launch in this process compile for `capability` and return
    without running; returns the list each compiled variant's name is appended to."""
    compiled: list[str] = []
    driver.set_active(CompileOnlyDriver(capability))
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {k: v for k, v in kwargs.items() if k.isupper()}
        compiled.append(f"{self.fn.__name__} {constexprs} {time.perf_counter() - start:.1f}s")
        return kernel

    JITFunction.run = warm
    return compiled


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
    args = parser.parse_args()
    compiled = compile_only(args.capability)
    drive_kernels(getattr(torch, args.dtype))
    print("\n".join(compiled))
    print(f"compiled {len(compiled)} kernel variants for sm_{args.capability}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
