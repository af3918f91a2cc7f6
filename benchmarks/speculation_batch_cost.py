"""What speculation costs a large batch, in the in-process engine (no HTTP, no client sharing
the CPU): the same prompts through engines configured off and with each speculation method, all
requests added at once with at most --max-num-seqs running, in rounds that rotate the order of
the engines. Prints wall time and output tokens/s per run and each engine's throughput over
the first one's round by round (the rounds' ratios are paired: same prompts, same minute);
writes JSON.

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
            order = list(range(len(engines)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                engine, label = engines[i], labels[i]
                spec = engine.scheduler.speculation
                before = (spec.num_proposed, spec.num_accepted) if spec else (0, 0)
                start = time.perf_counter()
                outputs = engine.generate(prompts, sampling)
                wall = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                after = (spec.num_proposed, spec.num_accepted) if spec else (0, 0)
                run = {
                    "round": r,
                    "wall_s": wall,
                    "output_tokens": tokens,
                    "output_throughput": tokens / wall,
                    "spec_proposed": after[0] - before[0],
                    "spec_accepted": after[1] - before[1],
                    "load_avg_1m": os.getloadavg()[0],
                }
                results[label].setdefault(workload, []).append(run)
                print(
                    f"  {workload:7} round {r + 1}  {label:10} {wall:7.2f} s  "
                    f"{tokens / wall:7.1f} out tok/s  proposed {run['spec_proposed']:5d}  "
                    f"(load {run['load_avg_1m']:.1f})",
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
