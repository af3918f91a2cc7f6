"""GPU: our paged attention kernels against dense SDPA over contiguous K/V.

Decode: for batch 8/32/128 and context 64..4096 (every sequence at the same length), times
`kernels.triton_decode.paged_decode_attention` over a shuffled block pool and
`scaled_dot_product_attention` over contiguous K/V of the same lengths, prints a ratio table and
the bytes/s each achieves against this device's measured device-to-device copy bandwidth.
Prefill: for 1/8/32 prompts of 128..2048 tokens, `kernels.triton_prefill.paged_prefill_attention`
(causal, varlen, K/V read through the block table) against causal SDPA over the same prompts
padded to one length, with the TFLOP/s each achieves. Writes JSON. Needs CUDA; elsewhere it says
so and exits 1.

    .venv/bin/python benchmarks/attention_kernels.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def paged_pool(batch, length, hkv, d, bs, dtype, device) -> tuple[torch.Tensor, ...]:
    """K and V caches [blocks, bs, hkv, d] holding `batch` sequences of `length` tokens under
    shuffled block ids (the kernels' reads are scattered, as in a serving pool), their block
    tables [batch, blocks per sequence] int32 and lengths [batch] int32."""
    blocks_per_seq = -(-length // bs)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), length, device=device, dtype=torch.int32)
    return k_cache, v_cache, table, seq_lens


def contiguous(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The same K or V as SDPA reads it: [batch, hkv, length, d], contiguous."""
    batch, (_, _, hkv, d) = table.shape[0], cache.shape
    return cache[table].view(batch, -1, hkv, d)[:, :length].transpose(1, 2).contiguous()


def graphed(run):
    """run captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def measure(batch, context, h, hkv, d, bs, dtype, device, peak, splits=()) -> dict:
    """One (batch, context) cell: paged kernel vs dense SDPA, same lengths, same K/V values;
    and the paged kernel, graphed, at each split-K count of `splits` and at the automatic one
    (whether choose_num_splits picks well on this GPU)."""
    import triton.testing

    from kernels.triton_decode import choose_num_splits, paged_decode_attention

    k_cache, v_cache, table, seq_lens = paged_pool(batch, context, hkv, d, bs, dtype, device)
    q = torch.randn(batch, h, d, device=device, dtype=dtype)
    scale = d**-0.5

    def paged():
        return paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale)

    k, v = contiguous(k_cache, table, context), contiguous(v_cache, table, context)

    def sdpa():
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    paged_ms = triton.testing.do_bench(paged)
    sdpa_ms = triton.testing.do_bench(sdpa)
    # As a served decode step runs them: replayed from a CUDA graph, no launch overhead.
    paged_graph_ms = triton.testing.do_bench(graphed(paged))
    sdpa_graph_ms = triton.testing.do_bench(graphed(sdpa))
    # The two must compute the same attention (bf16 rounding apart).
    max_abs_diff = (paged().float() - sdpa().squeeze(2).float()).abs().max().item()
    moved = 2 * batch * context * hkv * d * k_cache.element_size()  # K and V, read once
    auto = choose_num_splits(batch, hkv, table.shape[1], bs)
    by_splits = {}
    for n in sorted({auto, *(n for n in splits if n <= table.shape[1])}):

        def split(n=n):
            return paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, num_splits=n)

        by_splits[str(n)] = triton.testing.do_bench(graphed(split)) * 1e3
    return {
        "auto_splits": auto,
        "graphed_us_by_splits": by_splits,
        "best_splits": int(min(by_splits, key=by_splits.get)),
        "max_abs_diff_vs_sdpa": max_abs_diff,
        "paged_graph_us": paged_graph_ms * 1e3,
        "sdpa_graph_us": sdpa_graph_ms * 1e3,
        "ratio_paged_over_sdpa_graphed": paged_graph_ms / sdpa_graph_ms,
        "graphed_fraction_of_copy_bandwidth": moved / (paged_graph_ms / 1e3) / peak,
        "batch": batch,
        "context": context,
        "paged_us": paged_ms * 1e3,
        "sdpa_us": sdpa_ms * 1e3,
        "ratio_paged_over_sdpa": paged_ms / sdpa_ms,
        "paged_bytes_per_s": moved / (paged_ms / 1e3),
        "fraction_of_copy_bandwidth": moved / (paged_ms / 1e3) / peak,
    }


def measure_prefill(batch, length, h, hkv, d, bs, dtype, device, bench) -> dict:
    """One (batch, prompt length) cell: the paged prefill kernel vs causal SDPA."""
    from kernels.triton_prefill import paged_prefill_attention

    k_cache, v_cache, table, seq_lens = paged_pool(batch, length, hkv, d, bs, dtype, device)
    qsl = torch.arange(0, (batch + 1) * length, length, device=device, dtype=torch.int32)
    q = torch.randn(batch * length, h, d, device=device, dtype=dtype)
    scale = d**-0.5
    paged_ms = bench(
        lambda: paged_prefill_attention(q, k_cache, v_cache, table, qsl, seq_lens, scale, length)
    )
    k, v = contiguous(k_cache, table, length), contiguous(v_cache, table, length)
    qd = q.view(batch, length, h, d).transpose(1, 2).contiguous()
    sdpa_ms = bench(
        lambda: F.scaled_dot_product_attention(
            qd, k, v, scale=scale, is_causal=True, enable_gqa=True
        )
    )
    # Causal: half of the L x L scores, two matrix products (QK^T and PV), 2 FLOP per MAC.
    flop = 2 * 2 * batch * h * d * length * (length + 1) / 2
    return {
        "batch": batch,
        "prompt_len": length,
        "paged_us": paged_ms * 1e3,
        "sdpa_us": sdpa_ms * 1e3,
        "ratio_paged_over_sdpa": paged_ms / sdpa_ms,
        "paged_tflop_per_s": flop / (paged_ms / 1e3) / 1e12,
        "sdpa_tflop_per_s": flop / (sdpa_ms / 1e3) / 1e12,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--contexts", default="64,256,1024,2048,4096")
    parser.add_argument(
        "--splits", default="1,2,4,8", help="split-K counts each decode cell is also timed at"
    )
    parser.add_argument("--prefill-batches", default="1,8,32")
    parser.add_argument("--prefill-lens", default="128,512,2048")
    parser.add_argument("--output", default="benchmarks/results/kernels.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"{Path(__file__).name} needs a CUDA device; GPU figures are not measured here.")
        return 1

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    h, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    peak = copy_bandwidth(device)
    rows = []
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {peak / 1e9:.0f} GB/s  {args.dtype}")
    splits = [int(n) for n in args.splits.split(",") if n]
    header = ("batch", "context", "paged us", "sdpa us", "ratio", "paged GB/s", "splits")
    print("{:>6} {:>8} {:>9} {:>9} {:>6} {:>11}  {}".format(*header))
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            row = measure(batch, context, h, hkv, d, bs, dtype, device, peak, splits)
            rows.append(row)
            by_splits = " ".join(f"{n}:{us:.1f}" for n, us in row["graphed_us_by_splits"].items())
            print(
                f"{batch:>6} {context:>8} {row['paged_us']:>9.1f} {row['sdpa_us']:>9.1f} "
                f"{row['ratio_paged_over_sdpa']:>6.2f} {row['paged_bytes_per_s'] / 1e9:>11.0f}  "
                f"auto {row['auto_splits']}, graphed us by splits {by_splits}"
            )
    import triton.testing

    prefill_rows = []
    print("prefill (causal)")
    header = ("batch", "prompt", "paged us", "sdpa us", "ratio", "paged TF/s", "sdpa TF/s")
    print("{:>6} {:>8} {:>9} {:>9} {:>6} {:>10} {:>10}".format(*header))
    for batch in map(int, args.prefill_batches.split(",")):
        for length in map(int, args.prefill_lens.split(",")):
            row = measure_prefill(
                batch, length, h, hkv, d, bs, dtype, device, triton.testing.do_bench
            )
            prefill_rows.append(row)
            print(
                f"{batch:>6} {length:>8} {row['paged_us']:>9.1f} {row['sdpa_us']:>9.1f} "
                f"{row['ratio_paged_over_sdpa']:>6.2f} {row['paged_tflop_per_s']:>10.1f} "
                f"{row['sdpa_tflop_per_s']:>10.1f}"
            )
    result = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_bytes_per_s": peak,
        "shape": {
            "num_heads": h,
            "num_kv_heads": hkv,
            "head_dim": d,
            "block_size": bs,
            "dtype": args.dtype,
        },
        "rows": rows,
        "prefill_rows": prefill_rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
