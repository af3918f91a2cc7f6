"""One engine per allocation policy, its trace and its JSON: what the bench subcommands share."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from services.bench.traces import (
    load_sharegpt,
    scale_trace,
    shared_prefix_trace,
    synthetic_trace,
)
from services.config_args import engine_config_from_args

# The paper's Figure 2 (OPT-13B, A100-40GB, ShareGPT): share of KV memory holding token states.
PAPER_TOKEN_STATES = {"paged": 0.963, "orca-max": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382}
# Section 6.2: vLLM sustains 1.7-2.7x the rate of Orca (Oracle) and 2.7-8x that of Orca (Max).
PAPER_RATE_RATIOS = {"orca-oracle": [1.7, 2.7], "orca-max": [2.7, 8.0]}


def engine_for(args: argparse.Namespace, policy: str):
    from services.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, kv_policy=policy)
    )
    return LLMEngine(config)


def make_trace(args: argparse.Namespace, rate: float, vocab_size: int, tokenizer=None):
    if args.sharegpt_json:
        trace = load_sharegpt(args.sharegpt_json, tokenizer, args.num_requests, rate, args.seed)
    elif args.trace.startswith("shared-prefix"):
        shots = int(args.trace.rsplit("-", 1)[1])
        trace = shared_prefix_trace(shots, args.num_requests, rate, args.seed, vocab_size)
    else:
        trace = synthetic_trace(args.trace, args.num_requests, rate, args.seed, vocab_size)
    return scale_trace(trace, args.length_scale)


def run_setup(args: argparse.Namespace, engine) -> dict:
    scheduler = engine.scheduler
    return {
        "argv": sys.argv[1:],
        "executor": engine.config.executor,
        "sim": dataclasses.asdict(engine.config.sim) if engine.config.executor == "sim" else None,
        "num_device_blocks": scheduler.block_manager.device.num_blocks,
        "block_size": scheduler.block_size,
        "max_seq_len": scheduler.max_seq_len,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_prefill_tokens_per_request": scheduler.prefill_cap,
        "preemption_mode": engine.config.scheduler.preemption_mode,
    }


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")
