"""Where a decode step's time goes: mean step time and the top torch ops, for N sequences.

.venv/bin/python benchmarks/profile_decode_step.py --num-seqs 64 --prompt-len 100
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.llm_engine import LLMEngine  # noqa: E402
from shared.config import EngineConfig, ModelConfig  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model)))
    rng = random.Random(0)
    vocab = engine.executor.model.spec.vocab_size
    sampling = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for _ in range(args.num_seqs):
        engine.add_request([rng.randrange(100, vocab) for _ in range(args.prompt_len)], sampling)
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for g in engine.scheduler.running for s in g.seqs
    ):
        engine.step()  # prefill everything first
    engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(
        f"{args.num_seqs} sequences, context ~{args.prompt_len + args.steps}: "
        f"{step_s * 1000:.0f} ms per decode step"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
