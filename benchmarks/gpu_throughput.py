"""Throughput on a GPU: ours in-process, ours through `pagedserve serve`, transformers `generate`.

Builds a random-weight Llama of a named shape on the device (nothing downloaded), saves it with
a tokenizer, and runs two workloads for all three in one run: fixed (256 requests, 256 prompt
tokens, 256 output tokens) and varied (prompt and output lengths uniform in 32-512, seeded).
Greedy, `ignore_eos`, bf16. In-process runs overlap steps (each launched behind the one in
flight, as the engine does on CUDA; --compare-sync adds one-after-another). Writes tok/s, ms per
step (CUDA-synchronised: the executor copies the sampled ids out once per step), the per-phase
split, TTFT/TPOT of the served run and the device name.

    python benchmarks/gpu_throughput.py --shape 1b --tokenizer DIR
    python benchmarks/gpu_throughput.py --shape 8b --tokenizer DIR --skip-hf
    python benchmarks/gpu_throughput.py --shape tiny --device cpu --num-requests 8 \\
        --input-len 16 --output-len 8 --json /tmp/smoke.json        # a CPU smoke run

--tokenizer names a Hugging Face tokenizer directory whose vocabulary covers the shape's (the
SmolLM2 tokenizer for 1b; any for tiny, whose vocabulary is the test tokenizer's); the served
run detokenizes with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.bench.random_models import SHAPES, add_random_run_args, build_model
from services.bench.server import ready_url
from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams


def workload(kind: str, args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    n = args.num_requests
    if kind == "fixed":
        in_lens, out_lens = [args.input_len] * n, [args.output_len] * n
    else:
        in_lens = [rng.randint(32, 512) for _ in range(n)]
        out_lens = [rng.randint(32, 512) for _ in range(n)]
    prompts = [[rng.randrange(3, vocab) for _ in range(k)] for k in in_lens]
    return prompts, out_lens


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_in_process(
    model_dir: Path, args, prompts, out_lens, enforce_eager: bool = False, overlap: bool = True
) -> dict:
    config = EngineConfig(
        model=ModelConfig(
            model=str(model_dir), dtype=args.dtype, device=args.device, enforce_eager=enforce_eager
        ),
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gb * GiB)),
        scheduler=SchedulerConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=8192),
    )
    # overlap: step N+1 is planned and launched behind N before N's samples are read.
    engine = LLMEngine(config, overlap_steps=overlap)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    engine.stats.seconds.clear()
    engine.stats.num_steps = 0
    host = _time_executor_calls(engine)
    step_times: list[float] = []
    decode_steps: list[float] = []
    last = [time.perf_counter(), 0]  # time and batched-token count after the previous step

    def on_step(e: LLMEngine) -> None:
        now = time.perf_counter()
        step_times.append(now - last[0])
        new_tokens = e.stats.num_batched_tokens - last[1]
        if new_tokens <= e.scheduler.num_running_seqs:  # one token per sequence: decode only
            decode_steps.append(now - last[0])
        last[0], last[1] = now, e.stats.num_batched_tokens

    sampling = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    _sync(args.device)
    start = time.perf_counter()
    last[0] = start
    outputs = engine.generate(prompts, sampling, on_step=on_step)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = engine.stats.num_steps
    decode_steps.sort()
    result = {
        "output_tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "steps": steps,
        "ms_per_step_mean": 1000 * elapsed / steps,
        "ms_per_decode_step_median": 1000 * decode_steps[len(decode_steps) // 2]
        if decode_steps
        else None,
        "phase_seconds": dict(engine.stats.seconds),
        # Host wall seconds in the executor's launch() and collect() and the rest of the loop
        # (scheduling, updates): collect() waits for the device, so a small one with the rest
        # large means the host, not the GPU, sets the pace.
        "host_seconds": {**host, "rest": elapsed - sum(host.values())},
    }
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _time_executor_calls(engine: LLMEngine) -> dict[str, float]:
    """Wraps the in-process executor's launch() and collect() to add up their wall seconds."""
    totals = {"launch": 0.0, "collect": 0.0}
    executor = engine.core.executor.executor

    def timed(name: str, call):
        def run(arg):
            start = time.perf_counter()
            try:
                return call(arg)
            finally:
                totals[name] += time.perf_counter() - start

        return run

    executor.launch = timed("launch", executor.launch)
    executor.collect = timed("collect", executor.collect)
    return totals


async def _stream_share(url: str, model: str, prompts, out_lens, start_at: float) -> dict:
    """One client process's share of the streams, all started at wall time start_at. Parses
    only the first event (TTFT) and the last (the usage chunk): a client that decoded every
    event's JSON would cost as much CPU per token as the gateway and limit the run itself."""
    import aiohttp

    ttft, tpot, tokens = [], [], 0

    async def one(session, prompt, n) -> None:
        nonlocal tokens
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = None
        last = b""
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                if first is None:
                    first = time.perf_counter()
                last = raw
        end = time.perf_counter()
        usage = json.loads(last[len(b"data: ") :])["usage"]
        tokens += usage["completion_tokens"]
        ttft.append(first - start)
        if n > 1:
            tpot.append((end - first) / (n - 1))

    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(one(session, p, n) for p, n in zip(prompts, out_lens)))
    return {"tokens": tokens, "ttft": ttft, "tpot": tpot, "end": time.time()}


def _client_process(url: str, model: str, prompts, out_lens, start_at: float) -> dict:
    import uvloop

    return uvloop.run(_stream_share(url, model, prompts, out_lens, start_at))


def _stream_all(url: str, model: str, prompts, out_lens, num_clients: int) -> dict:
    """Every request at once, spread over num_clients client processes (round robin)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    shares = [(prompts[i::num_clients], out_lens[i::num_clients]) for i in range(num_clients)]
    shares = [share for share in shares if share[0]]
    with ProcessPoolExecutor(len(shares), mp_context=get_context("spawn")) as pool:
        # Started a few seconds ahead, so that spawning the clients is not timed.
        start_at = time.time() + 5.0
        futures = [pool.submit(_client_process, url, model, p, n, start_at) for p, n in shares]
        parts = [f.result() for f in futures]
    elapsed = max(part["end"] for part in parts) - start_at
    tokens = sum(part["tokens"] for part in parts)
    ttft = sorted(t for part in parts for t in part["ttft"])
    tpot = sorted(t for part in parts for t in part["tpot"])
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
        "tpot_p50_s": tpot[len(tpot) // 2] if tpot else None,
        "client_processes": len(shares),
    }


def run_served(model_dir: Path, args, prompts, out_lens, overlap: bool = True) -> dict:
    # Port 0: the server binds one the kernel picks and names it in its ready line.
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", str(model_dir),
            "--port", "0", "--dtype", args.dtype, "--device", args.device,
            "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", str(args.num_requests),
            "--max-num-batched-tokens", "8192", "--gateways", str(args.gateways)]  # fmt: skip
    if not overlap:
        argv.append("--no-async-scheduling")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            url = ready_url(proc.stdout.readline())
        if url is None:
            raise RuntimeError(f"the server did not start (exit {proc.poll()})")
        warm = [p[:8] for p in prompts[: 2 * args.gateways]]
        _stream_all(url, model_dir.name, warm, [4] * len(warm), 1)
        result = _stream_all(url, model_dir.name, prompts, out_lens, args.client_processes)
        return result | {"gateways": args.gateways}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_transformers(model_dir: Path, args, prompts, out_lens) -> dict:
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, args.dtype)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    tokens = 0
    _sync(args.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[i : i + args.hf_batch_size]
        lens = out_lens[i : i + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=args.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device
        )
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens),
                min_new_tokens=max(lens), eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        tokens += sum(lens)  # only the tokens each request asked for count
    _sync(args.device)
    elapsed = time.perf_counter() - start
    del model
    return {"output_tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_run_args(parser, output_len=256, kv_cache_gb=40.0)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--workloads", nargs="+", default=["fixed", "varied"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument(
        "--compare-eager",
        action="store_true",
        help="also run in-process with --enforce-eager (no CUDA graphs)",
    )
    parser.add_argument(
        "--compare-sync",
        action="store_true",
        help="also run in-process without overlapped steps (each launched after the last ended)",
    )
    parser.add_argument(
        "--served-sync",
        action="store_true",
        help="also serve with --no-async-scheduling, to compare the two loops",
    )
    parser.add_argument(
        "--gateways", type=int, default=4, help="gateway processes of the served run"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="load-generator processes of the served run (one would limit it)",
    )
    parser.add_argument("--json", default="benchmarks/results/gpu_throughput.json")
    args = parser.parse_args()

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict = {}
    record = {
        "command": " ".join(["benchmarks/gpu_throughput.py", *sys.argv[1:]]),
        "device": device,
        "shape": {"name": args.shape, **SHAPES[args.shape]},
        "dtype": args.dtype,
        "torch": torch.__version__,
        "results": results,
    }

    def save() -> None:  # after every run: a stage cut off by its time limit keeps what it did
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")

    def attempt(entry: dict, key: str, run, *run_args, **run_kwargs) -> None:
        # One run's failure is recorded and the next runs go on: a GPU session is too short to
        # lose every figure to one broken mode.
        try:
            entry[key] = run(*run_args, **run_kwargs)
        except Exception as error:  # noqa: BLE001 - recorded in the JSON, then the next run
            entry[key] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{key} failed: {entry[key]['error']}", file=sys.stderr)
        save()

    def ratio(entry: dict, key: str, over: str, under: str) -> None:
        if "tok_per_s" in entry.get(over, {}) and "tok_per_s" in entry.get(under, {}):
            entry[key] = entry[over]["tok_per_s"] / entry[under]["tok_per_s"]

    work = Path(tempfile.mkdtemp(prefix="pagedserve-gpu-bench-"))
    try:
        start = time.perf_counter()
        model_dir = build_model(
            args.shape, args.device, getattr(torch, args.dtype), args.tokenizer, work / args.shape
        )
        record["model_build_seconds"] = time.perf_counter() - start
        vocab = SHAPES[args.shape]["vocab_size"]
        for kind in args.workloads:
            prompts, out_lens = workload(kind, args, vocab)
            work_args = (model_dir, args, prompts, out_lens)
            entry = results[kind] = {}
            attempt(entry, "in_process", run_in_process, *work_args)
            if args.compare_sync:  # launched behind the step in flight, or one after another
                attempt(entry, "in_process_sync", run_in_process, *work_args, overlap=False)
                ratio(entry, "overlap_over_sync", "in_process", "in_process_sync")
            if args.compare_eager:  # CUDA graphs (the default on CUDA) against eager steps
                attempt(entry, "in_process_eager", run_in_process, *work_args, enforce_eager=True)
                ratio(entry, "graphs_over_eager", "in_process", "in_process_eager")
            if not args.skip_served:
                # Async scheduling (the default) and the synchronous loop, side by side.
                for key, overlap in (("served", True), ("served_sync", False)):
                    if overlap or args.served_sync:
                        attempt(entry, key, run_served, *work_args, overlap)
                        ratio(entry, f"{key}_vs_in_process", key, "in_process")
            if not args.skip_hf:
                attempt(entry, "transformers", run_transformers, *work_args)
                ratio(entry, "in_process_vs_transformers", "in_process", "transformers")
            save()
            print(kind, json.dumps(entry, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
