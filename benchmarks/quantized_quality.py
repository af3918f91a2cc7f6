"""Greedy outputs of the quantized embedded model beside fp32's on a fixed 20-prompt chat set.

Each mode runs the same chat prompts (greedy, up to --max-tokens, stopping at EOS) in-process;
a prompt counts as identical when its whole token sequence equals fp32's. Also reports the
weight bytes each mode's model holds and the offline wall time of the batch. Writes JSON.

    .venv/bin/python benchmarks/quantized_quality.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from services.engine.llm_engine import LLMEngine
from services.executor.quantize_model import weight_bytes
from shared.chat import chat_prompt_ids
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig
from shared.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "What is 17 times 23?",
    "Give me three tips for learning a new language.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Fahrenheit?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery.",
    "How many days are there in a leap year?",
    "What does a CPU do?",
    "Summarize the story of Cinderella in one paragraph.",
    "What are the primary colors?",
    "Give an example of a renewable energy source.",
    "How do I make a cup of tea?",
]


def run_mode(mode: str, max_tokens: int, threads: int | None, model: str | None = None) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=model, quantization=mode, device="cpu", num_threads=threads),
        cache=CacheConfig(kv_cache_bytes=GiB // 4, swap_space_bytes=0),
    )
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, [sampling] * len(prompts))
    seconds = time.perf_counter() - start
    token_ids = [o.outputs[0].token_ids for o in outputs]
    result = {
        "weight_bytes": weight_bytes(engine.executor.model),
        "seconds": seconds,
        "token_ids": token_ids,
        "texts": [tokenizer.decode(t, skip_special_tokens=True) for t in token_ids],
    }
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/quantized_quality.json")
    args = parser.parse_args()

    modes = args.modes.split(",")
    runs = {mode: run_mode(mode, args.max_tokens, args.num_threads, args.model) for mode in modes}
    reference = runs[modes[0]]
    report = {"load": os.getloadavg(), "max_tokens": args.max_tokens, "modes": {}}
    print(f"{'mode':6} {'identical':>9} {'weight MB':>9} {'seconds':>8}")
    for mode, run in runs.items():
        same = [a == b for a, b in zip(run["token_ids"], reference["token_ids"])]
        # Where each differing output first leaves the reference (tokens that agree before it).
        diverge = [
            next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
            for a, b in zip(run["token_ids"], reference["token_ids"])
            if a != b
        ]
        report["modes"][mode] = {
            "identical": sum(same),
            "of": len(same),
            "first_divergence": diverge,
            "weight_bytes": run["weight_bytes"],
            "seconds": round(run["seconds"], 2),
            "texts": run["texts"],
        }
        print(
            f"{mode:6} {sum(same):>6}/{len(same)} {run['weight_bytes'] / 1e6:>9.1f}"
            f" {run['seconds']:>8.1f}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
