"""N-gram proposals replayed offline: acceptance, tokens per verify step and a projected TPOT
ratio for a grid of proposer settings, over the embedded model's recorded greedy outputs.

The streams are the greedy outputs (int8 as served on a CPU by default) of
benchmarks/speculative.py's `repeat` and `code` prompts, with its seeds and sizes: the prompts of
its default run (concurrency 1:4, 4:8, 64:64) and so those of its concurrency-1 runs. They are
generated once with the in-process engine, as many requests at a time as the run's concurrency,
and cached (--streams); the replay itself (services/bench/ngram_replay.py) runs no model. Its
TPOT figure is a projection from counts, not a timing: a verify step of k proposals is assumed
to cost (1 + --verify-row-cost * k) plain decode steps.

    .venv/bin/python benchmarks/ngram_replay.py
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

from services.bench.ngram_replay import ReplayCounts, lookup_bound_stream, replay_stream
from services.bench.spec_prompts import workload_prompts
from shared.config import SpeculativeConfig

BENCHMARKS = Path(__file__).resolve().parent
# benchmarks/speculative.py's default --concurrency pairs, and its seed rule for them.
LEVELS = ((1, 4), (4, 8), (64, 64))
WORKLOADS = ("repeat", "code")
SETTINGS = ("num_tokens", "ngram_min", "ngram_max", "ngram_proposals_per_match")


def generate_streams(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from services.engine.llm_engine import LLMEngine
    from shared.config import EngineConfig, ModelConfig
    from shared.model_source import resolve_model
    from shared.sampling import SamplingParams

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir, local_files_only=True)
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), num_threads=args.threads),
    )
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    streams = []
    with LLMEngine(config) as engine:
        for w, workload in enumerate(WORKLOADS):
            for c, (concurrency, num_requests) in enumerate(args.levels):
                seed = w * 100 + c  # benchmarks/speculative.py with --seed 0
                prompts = workload_prompts(
                    workload, tokenizer, num_requests, seed, args.passage_words
                )
                # `concurrency` requests at a time, as served (a batch may round differently).
                outputs = []
                for at in range(0, len(prompts), concurrency):
                    outputs += engine.generate(prompts[at : at + concurrency], greedy)
                for i, (prompt, out) in enumerate(zip(prompts, outputs)):
                    streams.append(
                        {
                            "workload": workload,
                            "concurrency": concurrency,
                            "index": i,
                            "prompt": prompt,
                            "output": list(out.outputs[0].token_ids),
                        }
                    )
                print(f"generated {workload} concurrency {concurrency}: {len(prompts)}", flush=True)
    return {
        "model": str(args.model or "embedded"),
        "quantization": "int8 (auto, on a CPU)" if args.model is None else "auto",
        "output_len": args.output_len,
        "passage_words": args.passage_words,
        "levels": args.levels,
        "streams": streams,
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where a and b differ; None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def engine_check(
    args: argparse.Namespace, streams: list[dict], config: SpeculativeConfig | None
) -> list:
    """Per workload, the in-process engine's own proposed/accepted counters with `config` (None:
    speculation off, the control), the concurrency-1 prompts run one at a time, beside the
    replay's counts on the recorded streams and on the outputs this run produced, and where
    those outputs first differ from the recorded ones."""
    import dataclasses

    from services.engine.llm_engine import LLMEngine
    from shared.config import EngineConfig, ModelConfig
    from shared.model_source import resolve_model
    from shared.sampling import SamplingParams

    engine_config = EngineConfig(
        model=ModelConfig(model=str(resolve_model(args.model)), num_threads=args.threads),
    )
    if config is not None:
        engine_config = dataclasses.replace(
            engine_config, speculative=dataclasses.replace(config, max_batch=1)
        )
    checks = []
    with LLMEngine(engine_config) as engine:
        speculation = engine.scheduler.speculation
        for workload in WORKLOADS:
            chosen = [s for s in streams if s["concurrency"] == 1 and s["workload"] == workload]
            before = (speculation.num_proposed, speculation.num_accepted) if speculation else None
            on_recorded, on_own = ReplayCounts(), ReplayCounts()
            differences = []
            for s in chosen:
                greedy = SamplingParams(
                    max_tokens=len(s["output"]), temperature=0.0, ignore_eos=True
                )
                (out,) = engine.generate([s["prompt"]], greedy)
                own = list(out.outputs[0].token_ids)
                differences.append(_first_difference(own, s["output"]))
                if config is not None:
                    on_recorded.add(replay_stream(config, s["prompt"], s["output"]))
                    on_own.add(replay_stream(config, s["prompt"], own))
            check = {"workload": workload, "num_streams": len(chosen)}
            if config is None:
                check["speculation"] = "off"
            else:
                check.update({name: getattr(config, name) for name in SETTINGS})
                check.update(
                    {
                        "engine_proposed": speculation.num_proposed - before[0],
                        "engine_accepted": speculation.num_accepted - before[1],
                        "replay_proposed": on_recorded.num_proposed,
                        "replay_accepted": on_recorded.num_accepted,
                        "replay_of_own_outputs_proposed": on_own.num_proposed,
                        "replay_of_own_outputs_accepted": on_own.num_accepted,
                    }
                )
            check["first_difference_from_recorded"] = differences
            checks.append(check)
            print(f"engine check: {check}", flush=True)
    return checks


def write_streams(data: dict, path: Path) -> None:
    # One stream a line: small to diff, still plain JSON.
    header = {k: v for k, v in data.items() if k != "streams"}
    lines = [json.dumps(s, separators=(",", ":")) for s in data["streams"]]
    text = json.dumps(header, indent=1)[:-2] + ',\n "streams": [\n' + ",\n".join(lines) + "\n]}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def replay(streams: list[dict], count, costs: list[float]) -> dict:
    """Summaries per workload, over all streams and over the concurrency-1 ones (the prompts
    benchmarks/speculative.py's concurrency-1 runs measured), keyed "code", "code@c1", ...;
    count(prompt, output) -> ReplayCounts of one stream."""
    groups: dict[str, ReplayCounts] = {}
    for s in streams:
        counts = count(s["prompt"], s["output"])
        keys = [s["workload"], "all"]
        if s["concurrency"] == 1:
            keys.append(f"{s['workload']}@c1")
        for key in keys:
            groups.setdefault(key, ReplayCounts()).add(counts)
    return {
        key: _rounded(
            {
                **counts.summary(costs[0]),
                "projected_tpot_ratio_by_cost": {
                    str(c): counts.projected_tpot_ratio(c) for c in costs
                },
            }
        )
        for key, counts in sorted(groups.items())
    }


# What a grid row keeps per group: hundreds of rows stay a small file (the rest follows).
KEPT = (
    "num_steps", "num_proposed", "num_accepted", "num_tokens", "acceptance_rate",
    "tokens_per_step", "speculating_step_fraction", "projected_tpot_ratio_by_cost",
)  # fmt: skip


def _rounded(value):
    """Ratios to 4 digits, only the KEPT fields."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items() if k in KEPT or k[0].isdigit()}
    return round(value, 4) if isinstance(value, float) else value


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def grid(args: argparse.Namespace) -> list[SpeculativeConfig]:
    configs = []
    product = itertools.product(args.k, args.ngram_min, args.ngram_max, args.per_match)
    for k, n_min, n_max, per_match in product:
        if n_min <= n_max:
            configs.append(
                SpeculativeConfig(
                    method="ngram",
                    num_tokens=k,
                    ngram_min=n_min,
                    ngram_max=n_max,
                    ngram_proposals_per_match=per_match,
                )
            )
    return configs


# The settings served before and after this benchmark: always printed.
NAMED = {(3, 1, 4, 0): "old default", (8, 1, 4, 2): "default"}


def _named(row: dict) -> str | None:
    return NAMED.get(tuple(row[name] for name in SETTINGS))


def _bound(prompt: list[int], output: list[int], k: int) -> ReplayCounts:
    return lookup_bound_stream(prompt, output, k)


def _line(row: dict) -> str:
    label = row.get("label") or (
        f"K={row['num_tokens']:<2} n={row['ngram_min']}-{row['ngram_max']} "
        f"per_match={row['ngram_proposals_per_match']}"
    )
    parts = [label]
    for key in ("all", "repeat@c1", "code@c1"):
        r = row["results"][key]
        ratios = "/".join(f"{v:.3f}" for v in r["projected_tpot_ratio_by_cost"].values())
        parts.append(
            f"{key}: acc {r['acceptance_rate'] or 0:.2f} tok/step {r['tokens_per_step']:.2f} "
            f"TPOT x {ratios}"
        )
    name = _named(row) if "label" not in row else None
    return " | ".join(parts) + (f"  ({name})" if name else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default=str(BENCHMARKS / "data/ngram_streams.json"))
    parser.add_argument(
        "--generate", action="store_true", help="(re)generate --streams even if it exists"
    )
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--passage-words", type=int, default=90)
    parser.add_argument(
        "--levels",
        type=lambda t: [tuple(_ints(p.replace(":", ","))) for p in t.split(",")],
        default=list(LEVELS),
        help="benchmarks/speculative.py's concurrency:requests pairs, whose prompts to use",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=_ints, default=[2, 3, 4, 5, 6, 8, 12])
    parser.add_argument("--ngram-min", type=_ints, default=[1, 2, 3])
    parser.add_argument("--ngram-max", type=_ints, default=[3, 4, 8])
    parser.add_argument(
        "--per-match",
        type=_ints,
        default=[0, 1, 2, 3],
        help="--ngram-proposals-per-match values (0: always K)",
    )
    parser.add_argument(
        "--verify-row-cost",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[0.03, 0.08],
        help="assumed costs of one verified proposal, in plain decode steps (comma-separated; "
        "the table and the ranking use the first)",
    )
    parser.add_argument("--concurrency", type=int, default=None, help="replay only these")
    parser.add_argument(
        "--engine-check",
        action="append",
        default=[],
        metavar="K:MIN:MAX:PER_MATCH",
        help="also run the in-process engine with these settings (and once with speculation "
        "off) over the concurrency-1 prompts and compare its proposed/accepted counters and "
        "outputs with the replay's and the recorded ones (repeatable)",
    )
    parser.add_argument("--output", default="benchmarks/results/ngram_replay.json")
    args = parser.parse_args()

    path = Path(args.streams)
    if args.generate or not path.exists():
        write_streams(generate_streams(args), path)
        print(f"wrote {path}")
    data = json.loads(path.read_text())
    streams = [s for s in data["streams"] if args.concurrency in (None, s["concurrency"])]
    rows = []
    for config in grid(args):
        settings = {name: getattr(config, name) for name in SETTINGS}
        count = functools.partial(replay_stream, config)
        rows.append({**settings, "results": replay(streams, count, args.verify_row_cost)})
    first_cost = str(args.verify_row_cost[0])
    rows.sort(key=lambda r: r["results"]["all"]["projected_tpot_ratio_by_cost"][first_cost])
    bounds = {
        str(k): replay(streams, functools.partial(_bound, k=k), args.verify_row_cost)
        for k in sorted({3, max(args.k)})
    }
    print(f"{len(streams)} streams; verify row costs {args.verify_row_cost} (assumed)")
    for row in rows[:15] + [r for r in rows if _named(r)]:
        print(_line(row))
    for k, results in bounds.items():
        print(_line({"label": f"lookup bound (hindsight), K={k}", "results": results}))

    checks = engine_check(args, streams, None) if args.engine_check else []
    for setting in args.engine_check:
        k, n_min, n_max, per_match = _ints(setting.replace(":", ","))
        config = SpeculativeConfig(
            method="ngram",
            num_tokens=k,
            ngram_min=n_min,
            ngram_max=n_max,
            ngram_proposals_per_match=per_match,
        )
        checks += engine_check(args, streams, config)

    report = {
        "argv": sys.argv,
        "streams": {
            "path": os.path.relpath(path, BENCHMARKS.parent),
            "num_streams": len(streams),
            **{k: v for k, v in data.items() if k != "streams"},
        },
        "verify_row_cost_assumed": args.verify_row_cost,
        "engine_checks": checks,
        "lookup_bound_by_k": bounds,
        "rows": rows,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    # One grid row a line: hundreds of rows stay readable in a diff.
    head = json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1)[:-2]
    lines = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
    out.write_text(head + ',\n "rows": [\n' + lines + "\n]}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
