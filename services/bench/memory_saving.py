"""KV memory saved by sharing blocks within a request (the paper's section 6.3, Figure 15).

Saving = 1 - (distinct device blocks in use) / (blocks the same sequences would hold unshared),
each side summed over steps weighted by the step's duration (a time average). The unshared count
is the sum of every live sequence's block-table length: a block referenced by k tables counts k
times, as it would if each sequence had its own copy. Prefix caching is switched off for this
measure, so only sharing inside a request (parallel samples, beams) is counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from services.bench.text_prompts import text_prompt
from services.bench.traces import synthetic_trace, trace_stats
from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams

# The paper's section 6.3 (OPT-13B on Alpaca and ShareGPT), as ranges over its widths 2-6.
PAPER_SAVING = {
    ("alpaca", "parallel"): (0.061, 0.098),
    ("alpaca", "beam"): (0.376, 0.552),
    ("sharegpt", "beam"): (0.443, 0.663),
}


def add_memory_saving_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory saving (parallel sampling and beam search)")
    group.add_argument("--widths", default="2,4,6", help="n for parallel sampling, beam widths")
    group.add_argument(
        "--saving-traces", default="alpaca,sharegpt", help="synthetic traces to run (comma list)"
    )
    group.add_argument(
        "--saving-prompts",
        choices=["text", "random"],
        default="text",
        help="prompt contents at the trace's lengths: windows of English text, or random ids",
    )
    group.add_argument(
        "--saving-requests",
        default="alpaca=12,sharegpt=4",
        help="requests per trace, as name=count pairs",
    )


def measure(
    engine: LLMEngine,
    requests: list[tuple[list[int], SamplingParams]],
    progress: str | None = None,
) -> dict:
    """Serve every request at once; the time-averaged saving and the run's counters.
    `progress`: a label for a progress bar over the run's generated tokens, None for none."""
    preemptions_before = engine.scheduler.num_preemptions
    for prompt, sampling in requests:
        engine.add_request(prompt, sampling)
    bar = None
    if progress is not None:
        from tqdm import tqdm

        total = max((s.max_tokens for _, s in requests), default=0)
        bar = tqdm(total=total, desc=progress, unit="step", leave=False)
    manager = engine.scheduler.block_manager
    used_s = listed_s = duration = 0.0
    per_step: list[float] = []
    num_steps = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        # Blocks after the step are what the next step holds: weight them by this step's length
        # (steps are alike in length when the batch is, which is what the average needs).
        used = manager.device.num_used
        listed = sum(len(table) for table in manager.tables.values())
        if listed:
            used_s += used * dt
            listed_s += listed * dt
            duration += dt
            per_step.append(1 - used / listed)
        num_steps += 1
        if bar is not None:
            bar.n = min(bar.total, num_steps)
            bar.refresh()
    if bar is not None:
        bar.close()
    return {
        "saving": 1 - used_s / listed_s if listed_s else 0.0,
        "saving_step_mean": sum(per_step) / len(per_step) if per_step else 0.0,
        "num_steps": num_steps,
        "duration_s": duration,
        "num_preemptions": engine.scheduler.num_preemptions - preemptions_before,
    }


def _sampling(mode: str, width: int, output_len: int, seed: int) -> SamplingParams:
    # ignore_eos: every sequence runs to the trace's output length, as in the paper's traces.
    if mode == "beam":
        return SamplingParams(
            n=width, max_tokens=output_len, temperature=0.0, use_beam_search=True, ignore_eos=True
        )
    return SamplingParams(
        n=width, max_tokens=output_len, temperature=1.0, seed=seed, ignore_eos=True
    )


def run_memory_saving(args: argparse.Namespace, make_engine) -> dict:
    """make_engine(): an in-process engine (prefix caching off), made once and reused by every
    run (each run ends with the pool empty; one engine keeps one KV pool in memory)."""
    widths = [int(w) for w in args.widths.split(",")]
    counts = dict(pair.split("=") for pair in args.saving_requests.split(","))
    results: dict = {
        "definition": __doc__.strip().splitlines()[2],
        "prompts": args.saving_prompts,
        "runs": [],
    }
    traces = args.saving_traces.split(",")
    total = len(traces) * 2 * len(widths)
    engine = make_engine()
    done = 0
    for trace_name in traces:
        trace = synthetic_trace(
            trace_name,
            int(counts[trace_name]),
            float("inf"),
            args.seed,
            engine.scheduler.vocab_size,
        )
        prompts = [list(r.prompt_token_ids) for r in trace]
        if args.saving_prompts == "text":
            rng = random.Random(args.seed)
            prompts = [text_prompt(engine.tokenizer, len(p), rng) for p in prompts]
        for mode in ("parallel", "beam"):
            for width in widths:
                requests = [
                    (prompt, _sampling(mode, width, r.output_len, args.seed + i))
                    for i, (prompt, r) in enumerate(zip(prompts, trace))
                ]
                label = f"{trace_name} {mode} {width}"
                run = measure(engine, requests, label if args.progress else None)
                paper = PAPER_SAVING.get((trace_name, mode))
                run.update(
                    trace=trace_name,
                    mode=mode,
                    width=width,
                    trace_stats=trace_stats(trace),
                    paper_range=list(paper) if paper else None,
                )
                results["runs"].append(run)
                done += 1
                print(
                    f"[{done}/{total}] {trace_name:8s} {mode:8s} width {width}: saving "
                    f"{100 * run['saving']:5.1f}%  ({run['num_steps']} steps, "
                    f"{run['duration_s']:.0f} s)",
                    flush=True,
                )
    return results


def without_prefix_caching(config):
    """The engine config with prefix caching off: only sharing inside a request counts."""
    scheduler = dataclasses.replace(config.scheduler, enable_prefix_caching=False)
    return dataclasses.replace(config, scheduler=scheduler)
