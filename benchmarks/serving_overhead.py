"""Scheduler and IPC time per step against executor time, with real processes over ZeroMQ.

Starts the scheduler and executor processes, streams N concurrent greedy requests through the
gateway's ZeroMQ backend (no HTTP), and reads the per-step timings the scheduler reports:
schedule()+update() time, the executor's own time, and the plan->result round trip (whose
excess over the executor's time is serialization plus transport).

    .venv/bin/python benchmarks/serving_overhead.py --num-requests 32 --output-len 64

Runs the scheduler with async scheduling (the default) and without, alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from services.gateway.zmq_backend import ZmqBackend
from shared.ipc import Addresses
from shared.model_source import resolve_model
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams


async def drive(args, addresses: Addresses, vocab: int) -> dict:
    stats = []
    backend = ZmqBackend(addresses, stats_log=stats)
    await backend.start()
    while not backend.ready:
        await asyncio.sleep(0.2)
    # A short request first, as run_in_process warms its engine up: the first step of a fresh
    # executor pays one-time costs (allocations, first kernel calls) that are not serving.
    warm = GenerateRequest(
        uuid.uuid4().hex, [100] * 8, SamplingParams(max_tokens=2, temperature=0.0), time.time()
    )
    async for _ in backend.generate(warm):
        pass
    # Later acknowledgements repeat the last step's stats: steps up to here are the warm-up's.
    warm_steps = max((s.num_steps for s in stats), default=0)
    stats.clear()
    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    async def one() -> int:
        prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        request = GenerateRequest(uuid.uuid4().hex, prompt, sampling, time.time())
        count = 0
        async for delta in backend.generate(request):
            count += sum(len(s.token_ids) for s in delta.seqs)
        return count

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(args.num_requests))))
    elapsed = time.perf_counter() - start
    await backend.close()
    # Request acknowledgements and heartbeats carry the last step's stats again: one per step.
    by_step = {}
    for s in stats:
        if s.step_executor_s > 0 and s.num_steps > warm_steps:
            by_step.setdefault(s.num_steps, s)
    steps = list(by_step.values())
    sched = [s.step_scheduler_s for s in steps]
    execu = [s.step_executor_s for s in steps]
    ipc = [max(0.0, s.step_roundtrip_s - s.step_executor_s) for s in steps]
    return {
        "requests": args.num_requests,
        "output_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "steps_observed": len(steps),
        "mean_ms": {
            "scheduler": 1000 * statistics.mean(sched),
            # Plan sent -> result received, less the executor's own time: IPC and serialization
            # in the synchronous loop; under async scheduling also the wait behind the step
            # ahead of it (the plan leaves while the previous step still runs).
            "roundtrip_beyond_executor": 1000 * statistics.mean(ipc),
            "executor": 1000 * statistics.mean(execu),
        },
        "wall_ms_per_step": 1000 * elapsed / max(1, len(steps)),
    }


def run_in_process(args, model_dir: Path, vocab: int) -> dict:
    """The same requests through the in-process engine with the same engine settings."""
    from services.config_args import add_engine_args, engine_config_from_args
    from services.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--model", str(model_dir), "--num-threads", str(args.num_threads)]
    engine = LLMEngine(engine_config_from_args(parser.parse_args(argv)))
    rng = random.Random(0)  # the prompts drive() sends, in the same order
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def run_stack(args, model_dir: Path, vocab: int, overlap: bool) -> dict:
    """Start a scheduler and an executor process, drive them, stop them."""
    addresses = Addresses.ipc(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    wires = [
        "--gateway-addr", addresses.gateway,
        "--plans-addr", addresses.plans, "--results-addr", addresses.results,
    ]  # fmt: skip
    common = ["--model", str(model_dir), "--num-threads", str(args.num_threads), *wires]
    if not overlap:
        common.append("--no-async-scheduling")
    procs = [
        subprocess.Popen([sys.executable, "-m", "services.scheduler", *common]),
        subprocess.Popen([sys.executable, "-m", "services.executor", *common]),
    ]
    try:
        return asyncio.run(drive(args, addresses, vocab))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--random-shape", default=None, help="e.g. tiny: a random model instead")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="async and sync alternately, N each")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="the executor's torch threads (on two cores, one leaves the other core to the "
        "scheduler and this client; the in-process run uses as many)",
    )
    parser.add_argument("--output", default="benchmarks/results/serving_overhead.json")
    args = parser.parse_args()

    if args.random_shape:
        # A random-weight Llama of a named shape (services/bench/random_models.py), with the
        # embedded model's tokenizer: "tiny" makes the executor's step cheap, so the host's
        # work between steps shows.
        import torch

        from services.bench.random_models import build_model

        work = Path(tempfile.mkdtemp(prefix="pagedserve-random-model-"))
        model_dir = build_model(
            args.random_shape, "cpu", torch.float32, resolve_model(None), work / "model"
        )
    else:
        model_dir = resolve_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    runs: dict[str, list[dict]] = {"in_process": [], "async": [], "sync": []}
    for _ in range(args.rounds):  # alternated, so that drift in the machine's load hits all
        for mode in runs:
            if mode == "in_process":
                result = run_in_process(args, model_dir, vocab)
                runs[mode].append(result)
                print(
                    f"in-process: {result['output_tokens']} tokens in {result['seconds']:.2f} s "
                    f"({result['tokens_per_s']:.1f} tok/s)",
                    flush=True,
                )
                continue
            result = run_stack(args, model_dir, vocab, overlap=mode == "async")
            runs[mode].append(result)
            m = result["mean_ms"]
            print(
                f"{mode:5s}: {result['requests']} streams, {result['output_tokens']} tokens in "
                f"{result['seconds']:.2f} s ({result['tokens_per_s']:.1f} tok/s), "
                f"{result['steps_observed']} steps; per step: scheduler {m['scheduler']:.2f} ms,"
                f" round trip beyond the executor {m['roundtrip_beyond_executor']:.2f} ms,"
                f" executor {m['executor']:.2f} ms, wall {result['wall_ms_per_step']:.2f} ms",
                flush=True,
            )
    best = {mode: max(r["tokens_per_s"] for r in rs) for mode, rs in runs.items()}
    record = {
        "command": " ".join(["benchmarks/serving_overhead.py", *sys.argv[1:]]),
        "model": args.random_shape or str(args.model or "embedded"),
        "runs": runs,
        "best_tokens_per_s": best,
        "async_over_sync": best["async"] / best["sync"],
        "async_over_in_process": best["async"] / best["in_process"],
        "sync_over_in_process": best["sync"] / best["in_process"],
    }
    print(
        f"best of {args.rounds}: in-process {best['in_process']:.1f} tok/s, served async "
        f"{best['async']:.1f} ({100 * record['async_over_in_process']:.0f}%), served sync "
        f"{best['sync']:.1f} ({100 * record['sync_over_in_process']:.0f}%)"
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print("wrote", args.output)


if __name__ == "__main__":
    main()
