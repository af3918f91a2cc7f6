"""What prefix caching costs the scheduler: schedule() + update() per step, with it and without.

The scheduler alone against a stand-in executor (every sequence samples token 7), so only the
bookkeeping is timed: digests, lookups at admission, offering full blocks after each step. Two
workloads of 256 requests served at once: ShareGPT-like unique prompts (nothing to find: pure
overhead) and the same with an 800-token system prompt in front (most of every prompt found).
Writes benchmarks/results/prefix_cache_overhead.json.

    .venv/bin/python benchmarks/prefix_cache_overhead.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from services.bench.traces import synthetic_trace
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams

NUM_REQUESTS = 256
VOCAB = 32000
SYSTEM_PROMPT = list(range(1000, 1800))  # 800 tokens


def run(prompts: list[list[int]], output_lens: list[int], caching: bool) -> dict:
    ready = ExecutorReady(16384, 0, 16, 4096, VOCAB, (2,))
    config = SchedulerConfig(max_num_seqs=256, enable_prefix_caching=caching)
    scheduler = Scheduler(config, ready)
    for i, (prompt, output_len) in enumerate(zip(prompts, output_lens)):
        sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(f"r{i}", prompt, sampling)
    seconds = 0.0
    steps = 0
    while scheduler.has_unfinished():
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        tokens = [SampledToken(s.seq_id, 7) for s in plan.seqs if s.sample]
        scheduler.update(StepResult(plan.step_id, tokens))
        seconds += time.perf_counter() - t0
        steps += 1
    return {
        "prefix_caching": caching,
        "num_steps": steps,
        "ms_per_step": 1e3 * seconds / steps,
        "total_s": seconds,
        "hit_rate": scheduler.prefix_cache_hit_tokens
        / max(1, scheduler.prefix_cache_queried_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--json", default="benchmarks/results/prefix_cache_overhead.json")
    args = parser.parse_args()
    trace = synthetic_trace("sharegpt", args.num_requests, float("inf"), 0, VOCAB)
    unique = [list(r.prompt_token_ids) for r in trace]
    output_lens = [r.output_len for r in trace]
    results = {}
    for name, prompts in (
        ("unique", unique),
        ("system-prompt", [SYSTEM_PROMPT + p for p in unique]),
    ):
        results[name] = [
            run(prompts, output_lens, caching) for caching in (False, True, False, True)
        ]
        for r in results[name]:
            print(
                f"{name:14s} caching {str(r['prefix_caching']):5s} {r['num_steps']:5d} steps "
                f"{r['ms_per_step']:7.3f} ms/step  hit rate {100 * r['hit_rate']:5.1f}%",
                flush=True,
            )
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
