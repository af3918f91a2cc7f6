"""What speculation costs a large batch, in the in-process engine (no HTTP, no client sharing
the CPU): the same prompts through engines configured off and with each speculation method, all
requests added at once with at most --max-num-seqs running. The engines run in lockstep: one
step of each in turn (the order rotating every step), each engine's time the sum of its own
steps, so that the machine's slow and fast spells (this one is shared) fall on every engine
alike instead of on whichever ran in that minute. Prints each engine's time and output
tokens/s per round and its throughput over the first engine's; writes JSON.

    .venv/bin/python benchmarks/speculation_batch_cost.py \\
        --engine off= --engine "ngram=--speculative-method ngram" \\
        --engine "draft=--speculative-method draft --draft-model DIR"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from services.bench.spec_prompts import workload_prompts
from services.config_args import add_engine_args, engine_config_from_args
from services.engine.llm_engine import LLMEngine
from shared.model_source import resolve_model
from shared.sampling import SamplingParams


def build_engine(extra: str, common: list[str]) -> LLMEngine:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return LLMEngine(engine_config_from_args(parser.parse_args(common + shlex.split(extra))))


def lockstep(
    engines: list[LLMEngine], prompts: list[list[int]], sampling: SamplingParams
) -> list[dict]:
    """Every engine runs the prompts, one step of each in turn; per engine its summed step
    time, output tokens and speculation counts."""
    counts = [_spec_counts(e) for e in engines]
    for engine in engines:
        for prompt in prompts:
            engine.add_request(prompt, sampling)
    seconds = [0.0] * len(engines)
    tokens = [0] * len(engines)
    step = 0
    while any(e.has_unfinished() for e in engines):
        n = len(engines)
        for i in [(step + j) % n for j in range(n)]:
            if not engines[i].has_unfinished():
                continue
            start = time.perf_counter()
            updates = engines[i].step()
            seconds[i] += time.perf_counter() - start
            tokens[i] += sum(len(u.new_tokens) for u in updates)
        step += 1
    runs = []
    for engine, before, took, made in zip(engines, counts, seconds, tokens):
        after = _spec_counts(engine)
        runs.append(
            {
                "engine_s": took,
                "output_tokens": made,
                "output_throughput": made / took,
                "spec_proposed": after[0] - before[0],
                "spec_accepted": after[1] - before[1],
                "load_avg_1m": os.getloadavg()[0],
            }
        )
    return runs


def _spec_counts(engine: LLMEngine) -> tuple[int, int]:
    spec = engine.scheduler.speculation
    return (spec.num_proposed, spec.num_accepted) if spec else (0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", metavar="LABEL=ARGS", required=True)
    parser.add_argument("--model", default=None, help="every engine's --model (default: embedded)")
    parser.add_argument("--workloads", default="random,repeat")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/speculation_batch_cost.json")
    args = parser.parse_args()

    common = ["--num-threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)]
    common += ["--model", args.model] if args.model else []
    labels, engines = [], []
    for spec in args.engine:
        label, extra = spec.split("=", 1)
        print(f"== {label}: {extra or '(defaults)'}", flush=True)
        labels.append(label)
        engines.append(build_engine(extra, common))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.model or resolve_model(None), local_files_only=True
    )
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warmup = workload_prompts("random", tokenizer, 2, args.seed + 99, random_len=16)
    for engine in engines:
        engine.generate(warmup, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    results: dict[str, dict[str, list[dict]]] = {label: {} for label in labels}
    for w, workload in enumerate(args.workloads.split(",")):
        for r in range(args.rounds):
            seed = args.seed * 1000 + w * 100 + r
            prompts = workload_prompts(workload, tokenizer, args.num_requests, seed)
            for label, run in zip(labels, lockstep(engines, prompts, sampling)):
                run["round"] = r
                results[label].setdefault(workload, []).append(run)
                print(
                    f"  {workload:7} round {r + 1}  {label:10} {run['engine_s']:7.2f} s  "
                    f"{run['output_throughput']:7.1f} out tok/s  "
                    f"proposed {run['spec_proposed']:5d}  (load {run['load_avg_1m']:.1f})",
                    flush=True,
                )
    summary: dict[str, dict[str, dict]] = {label: {} for label in labels}
    print(f"\n{'workload':8} {'engine':10} {'median tok/s':>12}  tok/s / {labels[0]}'s, per round")
    for workload in args.workloads.split(","):
        first = [run["output_throughput"] for run in results[labels[0]][workload]]
        for label in labels:
            mine = [run["output_throughput"] for run in results[label][workload]]
            ratios = [a / b for a, b in zip(mine, first)]
            summary[label][workload] = {
                "median_output_throughput": statistics.median(mine),
                "ratios_to_first": ratios,
                "median_ratio_to_first": statistics.median(ratios),
            }
            print(
                f"{workload:8} {label:10} {statistics.median(mine):12.1f}  "
                f"{' '.join(f'{x:.3f}' for x in ratios)}  (median {statistics.median(ratios):.3f})"
            )
    report = {
        "argv": sys.argv,
        "cpu": os.cpu_count(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "runs": results,
        "summary": summary,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
