"""GPU: choose num_warps and num_stages for the attention kernels on this GPU, by timing.

For each kernel (decode, prefill) and each option pair of --warps x --stages (for decode also
each --decode-tiles, the context tokens it reads per loop iteration; for prefill each
--prefill-tile-rows and --prefill-block-n, its query tile and keys per step), times the kernel
on a few serving shapes (bf16, 32 query heads over 8 KV heads of 128: Llama-3-8B's layout)
with CUDA events (triton.testing.do_bench, medians), scores each by the geometric mean of its
times over the default's (4 warps, 3 stages; decode tiles of 64 tokens, prefill tiles of 64
rows and 32 keys), and writes the best per kernel
to kernels/configs/<device name>.json, which kernels/triton_configs.py reads at launch. A pair
that fails to compile (too many registers or too much shared memory) is recorded and skipped.
Needs CUDA; elsewhere it says so and exits 1.

    .venv/bin/python benchmarks/triton_config_sweep.py \\
        --json benchmarks/results/triton_config_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_SHAPES = [(1, 4096), (64, 2048), (256, 1024)]  # (sequences, context)
PREFILL_SHAPES = [(1, 2048), (8, 512)]  # (prompts, tokens each)


def _pool(num_seqs: int, length: int, device) -> tuple[torch.Tensor, ...]:
    """K and V caches under shuffled block ids, tables [num_seqs, blocks] int32, lengths."""
    per_seq = -(-length // BLOCK)
    k = torch.randn(num_seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM, device=device).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(num_seqs * per_seq, device=device).view(num_seqs, per_seq).int()
    lens = torch.full((num_seqs,), length, device=device, dtype=torch.int32)
    return k, v, table, lens


def decode_case(num_seqs: int, context: int, device):
    from kernels.triton_decode import paged_decode_attention

    k, v, table, lens = _pool(num_seqs, context, device)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, device=device).bfloat16()
    return lambda: paged_decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5)


def prefill_case(num_prompts: int, tokens: int, device):
    from kernels.triton_prefill import paged_prefill_attention

    k, v, table, lens = _pool(num_prompts, tokens, device)
    q = torch.randn(num_prompts * tokens, HEADS, HEAD_DIM, device=device).bfloat16()
    starts = torch.arange(0, num_prompts + 1, device=device, dtype=torch.int32) * tokens
    return lambda: paged_prefill_attention(q, k, v, table, starts, lens, HEAD_DIM**-0.5, tokens)


def sweep(kernel: str, cases: dict, grid: list[dict[str, int]], default: dict, do_bench) -> dict:
    """Times every option set of `grid` on every case; scores each by the geometric mean of its
    times over `default`'s."""
    from kernels import triton_configs

    rows = []
    for options in grid:
        triton_configs.trying[kernel] = dict(options)
        try:
            times = {name: do_bench(run) for name, run in cases.items()}
        except Exception as exc:  # noqa: BLE001 - an option set the compiler refuses
            rows.append({**options, "error": str(exc)[:200]})
            continue
        finally:
            triton_configs.trying.pop(kernel, None)
        rows.append({**options, "ms": times})
    reference = next(r for r in rows if all(r[k] == v for k, v in default.items()))
    if "ms" not in reference:
        raise RuntimeError(f"{kernel}: the default options failed: {reference['error']}")
    for r in rows:
        if "ms" in r:
            ratios = [r["ms"][n] / reference["ms"][n] for n in cases]
            r["over_default"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    timed = [r for r in rows if "over_default" in r]
    best = min(timed, key=lambda r: r["over_default"])
    return {"rows": rows, "default": default, "best": {k: best[k] for k in default},
            "best_over_default": best["over_default"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    parser.add_argument("--decode-tiles", default="16,32,64,128",
                        help="decode kernel: context tokens per loop iteration")  # fmt: skip
    parser.add_argument(
        "--prefill-tile-rows",
        default="64,128",
        help="prefill kernel: query rows (tokens x group heads) per program",
    )
    parser.add_argument("--prefill-block-n", default="32,64",
                        help="prefill kernel: keys per inner step")  # fmt: skip
    parser.add_argument("--json", default="benchmarks/results/triton_config_sweep.json")
    parser.add_argument("--no-write-config", action="store_true",
                        help="report only; leave kernels/configs alone")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: the options it chooses are a GPU's", file=sys.stderr)
        return 1
    import triton.testing

    from kernels.triton_configs import DEFAULT, config_path
    from kernels.triton_decode import TILE_TOKENS
    from kernels.triton_prefill import _BLOCK_N, _TILE_ROWS

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    pairs = list(itertools.product(map(int, args.warps.split(",")),
                                   map(int, args.stages.split(","))))  # fmt: skip
    if tuple(DEFAULT.values()) not in pairs:
        pairs.append(tuple(DEFAULT.values()))  # the reference every pair is scored against
    tiles = sorted({*map(int, args.decode_tiles.split(",")), TILE_TOKENS})
    prefill_rows = sorted({*map(int, args.prefill_tile_rows.split(",")), _TILE_ROWS})
    prefill_keys = sorted({*map(int, args.prefill_block_n.split(",")), _BLOCK_N})
    grids = {
        "decode": [
            {"num_warps": w, "num_stages": n, "tile_tokens": t}
            for (w, n), t in itertools.product(pairs, tiles)
        ],  # fmt: skip
        "prefill": [{"num_warps": w, "num_stages": n, "tile_rows": r, "block_n": b}
                    for (w, n), r, b in itertools.product(pairs, prefill_rows, prefill_keys)],
    }  # fmt: skip
    defaults = {
        "decode": {**DEFAULT, "tile_tokens": TILE_TOKENS},
        "prefill": {**DEFAULT, "tile_rows": _TILE_ROWS, "block_n": _BLOCK_N},
    }
    cases = {
        "decode": {f"{b}x{c}": decode_case(b, c, device) for b, c in DECODE_SHAPES},
        "prefill": {f"{p}x{t}": prefill_case(p, t, device) for p, t in PREFILL_SHAPES},
    }
    results = {
        k: sweep(k, c, grids[k], defaults[k], triton.testing.do_bench) for k, c in cases.items()
    }
    for kernel, r in results.items():
        print(f"{kernel}: best {r['best']} at {r['best_over_default']:.3f}x the default")
    if not args.no_write_config:
        path = config_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        kernels = {k: r["best"] for k, r in results.items()}
        path.write_text(json.dumps({"device": name, "kernels": kernels}, indent=2) + "\n")
        print("wrote", path)
    report = {"command": " ".join(sys.argv), "device": name, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
