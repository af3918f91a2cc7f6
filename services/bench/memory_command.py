"""`pagedserve bench memory`: the KV pool by kind per allocation policy (the paper's Figure 2)."""

from __future__ import annotations

import argparse
import math

from services.bench.latency import summarize
from services.bench.policy_runs import (
    PAPER_TOKEN_STATES,
    engine_for,
    make_trace,
    run_setup,
    write_json,
)
from services.bench.traces import trace_stats
from services.scheduler.kv_accounting import KINDS


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def run_memory(args: argparse.Namespace) -> int:
    from services.bench.replay import replay

    policies, whole, runs = {}, {}, {}
    setup = trace_info = None
    for policy in args.kv_policies:
        engine = engine_for(args, policy)
        tokenizer = engine.tokenizer if args.sharegpt_json else None
        trace = make_trace(args, args.rate, engine.scheduler.vocab_size, tokenizer)
        trace_info = trace_info or trace_stats(trace)
        setup = setup or run_setup(args, engine)
        result = replay(engine, trace, progress=args.progress)
        # The breakdown while memory binds (some request waits for admission); a run that never
        # waited falls back to its whole-run average.
        saturated = result.saturated_s > 0
        policies[policy] = result.memory_saturated if saturated else result.memory
        whole[policy] = result.memory
        runs[policy] = {
            "saturated_s": result.saturated_s,
            "duration_s": result.duration_s,
            "num_steps": result.num_steps,
            "num_preemptions": result.num_preemptions,
            "max_running_seqs": result.max_running,
            "latency": summarize(result.records, result.duration_s),
        }
        del engine
    print(f"{'policy':12s} " + " ".join(f"{k[:12]:>12s}" for k in KINDS) + "  paper tokens")
    for policy, fractions in policies.items():
        cells = " ".join(f"{_pct(fractions[k]):>12s}" for k in KINDS)
        print(f"{policy:12s} {cells}  {_pct(PAPER_TOKEN_STATES[policy]):>12s}")
    write_json(
        args.json,
        {
            "setup": setup,
            "trace": trace_info,
            "rate": None if math.isinf(args.rate) else args.rate,
            "window": "steps after which a request waited for admission (memory binds)",
            "policies": policies,
            "whole_run": whole,
            "runs": runs,
            "paper_token_states": PAPER_TOKEN_STATES,
        },
    )
    if args.plot:
        from services.bench.plots import plot_memory

        plot_memory(policies, args.plot, f"KV cache usage ({args.trace}, {setup['executor']})")
        print(f"wrote {args.plot}")
    return 0
