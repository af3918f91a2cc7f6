"""Where a prefill chunk's time goes: GEMMs, attention, gathers, the rest, per quantization mode.

Each measured step is a pure prefill: --chunk / --prompt-len new prompts of random ids with
max_tokens=1, so each finishes in the step that computes it. The step time is a mean over
--steps steps, then one more set runs under torch.profiler and its self CPU time is grouped.

    .venv/bin/python benchmarks/profile_prefill_chunk.py --modes none,int8 --chunk 2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams

# Self-CPU time of these ops is grouped under one name each.
GROUPS = {
    "gemm": ("aten::mm", "aten::addmm", "aten::_int_mm", "aten::_weight_int4pack_mm_for_cpu"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm",
                  "aten::baddbmm"),
    "gathers": ("aten::index", "aten::index_select", "aten::embedding", "aten::gather",
                "aten::index_put_", "aten::_index_put_impl_"),
}  # fmt: skip


def group_of(op: str) -> str:
    return next((name for name, ops in GROUPS.items() if op in ops), "other")


def prefill_steps(engine: LLMEngine, args, count: int, rng: random.Random) -> None:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.scheduler.vocab_size  # ids 1000-40000 in SmolLM2's, the same share elsewhere
    low, high = min(1000, vocab // 2), min(40000, vocab)
    for _ in range(count):
        for _ in range(args.chunk // args.prompt_len):
            engine.add_request([rng.randrange(low, high) for _ in range(args.prompt_len)], sampling)
        engine.step()
        assert not engine.has_unfinished(), "a step did not finish its prompts: chunk too small"


def run_mode(mode: str, args) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=args.model, quantization=mode, device="cpu", num_threads=args.threads
            ),
            cache=CacheConfig(kv_cache_bytes=GiB // 2, swap_space_bytes=0),
            scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk),
        )
    )
    rng = random.Random(0)
    prefill_steps(engine, args, 1, rng)  # warm-up
    start = time.perf_counter()
    prefill_steps(engine, args, args.steps, rng)
    step_s = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prefill_steps(engine, args, args.steps, rng)
    groups: dict[str, float] = {}
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for event in top:
        name = group_of(event.key)
        groups[name] = groups.get(name, 0.0) + event.self_cpu_time_total / 1e3 / args.steps
    total = sum(groups.values())
    print(f"{mode}: {step_s * 1e3:.0f} ms per {args.chunk}-token prefill step")
    for name, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:10} {ms:8.1f} ms  {ms / total:5.1%}")
    return {
        "ms_per_step": step_s * 1e3,
        "profiled_ms_by_group": groups,
        "top_ops": [
            {"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps}
            for e in top[:12]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--modes", default="none,int8")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/profile_prefill_chunk.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {
        "command": "benchmarks/profile_prefill_chunk.py " + " ".join(sys.argv[1:]),
        "load_avg_1m": os.getloadavg()[0],
        "modes": {mode: run_mode(mode, args) for mode in args.modes.split(",")},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
