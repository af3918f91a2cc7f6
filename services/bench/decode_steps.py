"""Shared by the benchmarks that time decode steps of one in-process engine per batch size,
alternating two variants step by step (benchmarks/cpu_row_kernels.py, int8_rows_linear.py)."""

from __future__ import annotations

import json
import platform
import random
import sys
from pathlib import Path

import torch

from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig, ModelConfig
from shared.sampling import SamplingParams


def prefilled_engine(model: str | None, quantization: str, batch: int, prompt_len: int):
    """An engine with `batch` random prompts of `prompt_len` tokens, all prefilled: every
    later step decodes each sequence by one token (greedy, no end)."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model, quantization=quantization)))
    rng = random.Random(0)
    vocab = engine.executor.model.spec.vocab_size
    sampling = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, vocab) for _ in range(prompt_len)], sampling)
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for g in engine.scheduler.running for s in g.seqs
    ):
        engine.step()  # prefill everything first
    return engine


def write_report(script: str, args, rows: list[dict]) -> None:
    """The rows as JSON at args.json, with the command and the machine."""
    result = {
        "command": f"benchmarks/{script} " + " ".join(sys.argv[1:]),
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.json)


def parse_args(doc: str, batch_sizes: str, steps: int, json_path: str):
    """The options both benchmarks take, with their own defaults."""
    import argparse

    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch-sizes", default=batch_sizes)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps of each variant")
    parser.add_argument("--json", default=json_path)
    return parser.parse_args()
