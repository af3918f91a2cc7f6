"""Offline throughput: our engine against transformers `generate` in static batches, one run.

The same prompts (random token ids, fixed length), greedy, `ignore_eos`, fp32, the same torch
thread count. Prints a table and writes JSON. Also measures this CPU's fp32 matmul rate to give
ceilings for output tokens/s, and splits our per-step time into phases.

With --varied-output each request asks for its own number of tokens (uniform around
--output-len, as real traffic does); a static batch then runs until its longest request is done,
and only the tokens each request asked for count.

    .venv/bin/python benchmarks/offline_throughput.py                  # the fixed workload
    .venv/bin/python benchmarks/offline_throughput.py --varied-output  # per-request lengths
    .venv/bin/python benchmarks/offline_throughput.py --skip-hf        # ours only, quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from services.bench.cpu_rates import matmul_gflops
from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.model_source import resolve_model
from shared.sampling import SamplingParams


def matmul_params_per_token(model_dir: Path) -> int:
    """Weights each generated token multiplies through: every linear layer plus the LM head."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = c.num_key_value_heads * head_dim
    per_layer = (
        c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    return c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size


def run_ours(args, model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", quantization=args.quantization),
        cache=CacheConfig(block_size=args.block_size, kv_cache_bytes=int(args.kv_cache_gb * GiB)),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )
    engine = LLMEngine(config)
    sampling = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    engine.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    engine.stats.seconds.clear()
    engine.stats.num_steps = 0
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    engine.scheduler.block_manager.check()
    assert (
        engine.scheduler.block_manager.device.num_free
        == engine.scheduler.block_manager.device.num_blocks
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    phases = {k: round(v, 3) for k, v in sorted(engine.stats.seconds.items())}
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "steps": engine.stats.num_steps,
        "phase_seconds": phases,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def run_transformers(args, model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    token_ids = []
    with torch.inference_mode():
        warm = torch.tensor([prompts[0]])
        model.generate(
            warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False
        )
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[i : i + args.hf_batch_size]
            batch_lengths = lengths[i : i + args.hf_batch_size]
            width = max(len(p) for p in batch)
            # Left padding, so every row's last prompt token sits at the right edge.
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(batch_lengths),
                min_new_tokens=max(batch_lengths),
                pad_token_id=pad,
            )
            # A static batch runs to its longest request; each keeps what it asked for.
            token_ids.extend(row[:n] for row, n in zip(out[:, width:].tolist(), batch_lengths))
        elapsed = time.perf_counter() - start
    tokens = sum(len(t) for t in token_ids)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "token_ids": token_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--varied-output", action="store_true", help="per-request output lengths")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4", "auto"],
        help="our weights (default none: fp32, like transformers')",
    )
    parser.add_argument("--output", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    rng = random.Random(0)
    # Token ids from the ordinary vocabulary (SmolLM2 keeps its special tokens below 17).
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]

    if args.varied_output:
        spread = args.output_len - 16
        lengths = [rng.randint(args.output_len - spread, args.output_len + spread) for _ in prompts]
    else:
        lengths = [args.output_len] * len(prompts)

    params = matmul_params_per_token(model_dir)
    head = AutoConfig.from_pretrained(model_dir).hidden_size * vocab
    gflops = matmul_gflops(args.num_prompts, 576, 1536)
    # Decode ceiling: every output token multiplies through all weights once.
    ceiling = gflops * 1e9 / (2 * params)
    # Workload ceiling: the matmul FLOPs of the whole run (prompts without the LM head except
    # their last token, then one full pass per further output token) at the measured rate.
    workload_flops = 2 * sum(
        len(p) * (params - head) + head + (n - 1) * params for p, n in zip(prompts, lengths)
    )
    workload_ceiling = sum(lengths) / (workload_flops / (gflops * 1e9))

    ours = run_ours(args, model_dir, prompts, lengths)
    theirs = None if args.skip_hf else run_transformers(args, model_dir, prompts, lengths)

    rows = [("pagedserve", ours)] + ([("transformers generate", theirs)] if theirs else [])
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"greedy, fp32, {args.threads} threads"
    )
    print(f"{'system':<24}{'seconds':>10}{'out tok/s':>12}")
    for name, r in rows:
        print(f"{name:<24}{r['seconds']:>10.1f}{r['tokens_per_s']:>12.1f}")
    result = {
        "command": " ".join(sys.argv),
        "machine": {
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "workload": {
            **{
                k: getattr(args, k)
                for k in ("num_prompts", "input_len", "output_len", "hf_batch_size")
            },
            "varied_output": args.varied_output,
            "quantization": args.quantization,
            "output_tokens_requested": sum(lengths),
        },
        "matmul_gflops": gflops,
        "matmul_params_per_token": params,
        "decode_ceiling_tokens_per_s": ceiling,
        "workload_ceiling_tokens_per_s": workload_ceiling,
        "ours": {k: v for k, v in ours.items() if k != "token_ids"},
        "ours_fraction_of_workload_ceiling": ours["tokens_per_s"] / workload_ceiling,
    }
    print(
        f"fp32 matmul {gflops:.0f} GFLOP/s -> decode-only ceiling {ceiling:.0f} out tok/s; "
        f"whole-workload ceiling {workload_ceiling:.0f} out tok/s, "
        f"ours at {ours['tokens_per_s'] / workload_ceiling:.0%} of it"
    )
    if theirs:
        result["transformers"] = {k: v for k, v in theirs.items() if k != "token_ids"}
        result["ratio_ours_vs_transformers"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        same = sum(a == b for a, b in zip(ours["token_ids"], theirs["token_ids"]))
        result["identical_greedy_sequences"] = f"{same}/{len(prompts)}"
        print(
            f"ratio ours / transformers: {result['ratio_ours_vs_transformers']:.2f}x; "
            f"identical greedy outputs: {same}/{len(prompts)}"
        )
    steps = ours["steps"]
    print("our time per phase (s, summed over", steps, "steps):", ours["phase_seconds"])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.output)


if __name__ == "__main__":
    main()
