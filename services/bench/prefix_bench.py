"""Prefix caching on shared-prefix workloads: throughput and hit rate with and without it."""

from __future__ import annotations

import argparse
import dataclasses
import time

from services.bench.traces import SHARED_PREFIX_LENS, TraceRequest, prefixed_trace, trace_stats
from services.config_args import engine_config_from_args
from shared.sampling import SamplingParams

# Every request starts with the same prefix: a long system prompt, or the paper's translation
# few-shot examples (1-shot ~80 tokens, 5-shot ~341), then its own ~30-token sentence.
SYSTEM_PROMPT_LEN = 800
WORKLOADS = {
    "system-prompt": SYSTEM_PROMPT_LEN,
    "translation-1shot": SHARED_PREFIX_LENS[1],
    "translation-5shot": SHARED_PREFIX_LENS[5],
}


def add_prefix_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix caching")
    group.add_argument(
        "--workload",
        dest="workloads",
        action="append",
        choices=list(WORKLOADS),
        help="shared-prefix workload to run (repeat it); default: all three",
    )
    group.add_argument(
        "--system-prompt-len",
        type=int,
        default=SYSTEM_PROMPT_LEN,
        help="prefix tokens of the system-prompt workload",
    )


def _engine(args: argparse.Namespace, caching: bool):
    from services.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    scheduler = dataclasses.replace(config.scheduler, enable_prefix_caching=caching)
    return LLMEngine(dataclasses.replace(config, scheduler=scheduler))


def run_once(args: argparse.Namespace, trace: list[TraceRequest], caching: bool) -> dict:
    """All requests at once through a fresh in-process engine (greedy, exact output lengths)."""
    engine = _engine(args, caching)
    # One short request first, so that neither run pays for torch's first calls.
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    scheduler = engine.scheduler
    queried0, hit0 = scheduler.prefix_cache_queried_tokens, scheduler.prefix_cache_hit_tokens
    steps0, preemptions0 = engine.stats.num_steps, scheduler.num_preemptions
    prompts = [list(r.prompt_token_ids) for r in trace]
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in trace
    ]
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params, progress=args.progress)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(map(len, prompts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    queried = scheduler.prefix_cache_queried_tokens - queried0
    hit = scheduler.prefix_cache_hit_tokens - hit0
    result = {
        "prefix_caching": caching,
        "elapsed_s": elapsed,
        "requests_per_s": len(trace) / elapsed,
        "tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_rate": hit / queried if queried else 0.0,
        "num_steps": engine.stats.num_steps - steps0,
        "num_preemptions": scheduler.num_preemptions - preemptions0,
        "setup": _setup(engine),
    }
    result["output_token_ids"] = [o.outputs[0].token_ids for o in outputs]
    engine.close()
    return result


def _setup(engine) -> dict:
    config = engine.config
    return {
        "model": str(engine.model_dir),
        "num_device_blocks": engine.scheduler.block_manager.device.num_blocks,
        "block_size": engine.scheduler.block_size,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "num_threads": config.model.num_threads,
        "device": config.model.device,
    }


def run_prefix_caching(args: argparse.Namespace, vocab_size: int) -> dict:
    """Each workload without, then with prefix caching; the section of `bench sharing`'s JSON."""
    workloads = {}
    for name in args.workloads or list(WORKLOADS):
        prefix_len = args.system_prompt_len if name == "system-prompt" else WORKLOADS[name]
        trace = prefixed_trace(prefix_len, args.num_requests, float("inf"), args.seed, vocab_size)
        off = run_once(args, trace, caching=False)
        on = run_once(args, trace, caching=True)
        identical = off.pop("output_token_ids") == on.pop("output_token_ids")
        workloads[name] = {
            "prefix_len": prefix_len,
            "trace": trace_stats(trace),
            "without": off,
            "with": on,
            "speedup": on["tokens_per_s"] / off["tokens_per_s"],
            "outputs_identical": identical,
        }
        print(_row(name, workloads[name]), flush=True)
    return {"workloads": workloads}


def header() -> str:
    return (
        f"{'workload':18s} {'prefix':>6s} {'req/s off':>10s} {'req/s on':>9s} {'tok/s off':>10s}"
        f" {'tok/s on':>9s} {'speedup':>8s} {'hit rate':>9s}  same outputs"
    )


def _row(name: str, w: dict) -> str:
    off, on = w["without"], w["with"]
    return (
        f"{name:18s} {w['prefix_len']:6d} {off['requests_per_s']:10.2f} {on['requests_per_s']:9.2f}"
        f" {off['tokens_per_s']:10.0f} {on['tokens_per_s']:9.0f} {w['speedup']:7.2f}x"
        f" {100 * on['hit_rate']:8.1f}%  {w['outputs_identical']}"
    )
