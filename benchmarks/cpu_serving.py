"""CPU serving: pagedserve, and llama.cpp's llama-server when given, under one client and workload.

The workload of issue #13: N requests of random prompt token ids, all sent at once, streamed
/v1/completions with max_tokens and ignore_eos (services/bench/http_load.py, one aiohttp
client for every server). Output tokens come from the usage each server reports, or, when it
reports none, from tokenizing the streamed text. All servers start first and wait idle; then
each gets its warm-up runs and its measured runs in turns (one server under load at a time).
Prints a table and writes JSON.

    .venv/bin/python benchmarks/cpu_serving.py                       # pagedserve defaults
    .venv/bin/python benchmarks/cpu_serving.py --pagedserve fp32="--quantization none" \\
        --pagedserve default="" --llama-server /path/llama-server --gguf /path/model.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from services.bench.http_load import run_load
from services.bench.latency import summarize
from services.bench.server import free_port, stop_process_group, wait_healthy, wait_ready_url
from services.bench.traces import TraceRequest
from shared.model_source import embedded_gguf_path, resolve_model


def pagedserve_argv(port: int, threads: int, extra: str) -> list[str]:
    return [
        sys.executable, "-m", "services.cli", "serve", "--port", str(port),
        "--num-threads", str(threads), *shlex.split(extra),
    ]  # fmt: skip


def llama_server_argv(binary: str, gguf: str, port: int, threads: int, args) -> list[str]:
    slots = args.num_requests
    # Each slot holds one request's prompt and output, with room to spare.
    ctx = slots * (args.input_len + args.output_len + 64)
    return [
        binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
        "-tb", str(threads), "-np", str(slots), "-c", str(ctx), "-fa", "on", "--no-webui",
        *shlex.split(args.llama_server_args),
    ]  # fmt: skip


def _source_commit(directory: str) -> dict:
    """A source tree and the commit it holds, for the record."""
    found = subprocess.run(
        ["git", "-C", directory, "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return {"dir": directory, "commit": found.stdout.strip() or None}


def make_trace(args, run: int, vocab_size: int) -> list[TraceRequest]:
    # New prompts every run: a server that caches prompts (llama-server keeps each slot's last
    # prompt) must not answer a repeated run from its cache.
    rng = random.Random(args.seed * 1000 + run)
    # Ids from the ordinary part of the vocabulary (1000-40000 of SmolLM2's 49,152, the same
    # share of a smaller one): no special tokens in a random prompt.
    low, high = min(1000, vocab_size // 2), min(40000, vocab_size)
    return [
        TraceRequest(0.0, tuple(rng.randrange(low, high) for _ in range(args.input_len)), n)
        for n in [args.output_len] * args.num_requests
    ]


class Server:
    """One server process, started idle; measured in turns with the others."""

    def __init__(
        self, label: str, argv: list[str], url: str | None, log_path: Path, cwd: str | None = None
    ) -> None:
        """url None: a `pagedserve serve --port 0`, whose ready line names the port it bound.
        cwd: a source tree to run it from (`python -m` imports the tree in its working
        directory before the installed one, and the processes it starts inherit it)."""
        where = f" (from {cwd})" if cwd else ""
        print(f"== {label}: {shlex.join(argv)}{where}", flush=True)
        self.label, self.argv, self.url, self.runs = label, argv, url, []
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, start_new_session=True, stdout=self.log, stderr=self.log, cwd=cwd
        )

    def wait_ready(self, timeout_s: float) -> None:
        if self.url is None:
            self.url = wait_ready_url(self.proc, self.log_path, timeout_s)
        else:
            wait_healthy(self.proc, self.url, timeout_s)

    def measure(self, trace, tokenizer, kind: str) -> dict:
        records, duration = asyncio.run(run_load(self.url, trace))
        counted_by = "usage"
        for record in records:
            if record.output_len == 0 and record.text:
                record.output_len = len(tokenizer.encode(record.text, add_special_tokens=False))
                counted_by = "tokenized text"
        summary = summarize(records, duration)
        summary["output_tokens"] = sum(r.output_len for r in records)
        summary["counted_by"] = counted_by
        summary["load_avg_1m"] = os.getloadavg()[0]
        print(
            f"  {self.label:22} {kind:7} {summary['output_throughput']:7.1f} out tok/s  "
            f"TTFT {summary['mean_ttft_s']:6.2f} s  TPOT {summary['mean_tpot_s'] * 1e3:6.1f} ms"
            f"  ({summary['num_finished']}/{len(trace)} done, {counted_by}, "
            f"load {summary['load_avg_1m']:.1f})",
            flush=True,
        )
        return summary

    def stop(self) -> None:
        stop_process_group(self.proc)
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pagedserve",
        action="append",
        default=None,
        metavar="LABEL=ARGS",
        help="a pagedserve configuration to run (repeatable); default: defaults=''",
    )
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="run the pagedserve configuration LABEL from the source tree DIR (e.g. a git "
        "worktree of an earlier commit), to compare code versions in one run",
    )
    parser.add_argument("--no-pagedserve", action="store_true", help="run llama-server only")
    parser.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    parser.add_argument("--gguf", default=None, help="GGUF for llama-server (default: embedded)")
    parser.add_argument("--llama-server-args", default="", help="extra llama-server flags")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the served model's tokenizer directory (default: the embedded model's); it "
        "bounds the prompt ids and counts streamed text a server reports no usage for",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/cpu_serving.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer or resolve_model(None), local_files_only=True
    )
    configs = [c.split("=", 1) for c in (args.pagedserve or ["defaults="])]
    sources = dict(s.split("=", 1) for s in args.source)
    if args.no_pagedserve:
        configs = []
    servers: list[Server] = []
    # Server logs go to the temporary directory, not beside the committed JSON.
    log_prefix = Path(tempfile.gettempdir()) / Path(args.output).stem
    try:
        for label, extra in configs:
            argv = pagedserve_argv(0, args.threads, extra)  # port 0: the server picks one
            log = Path(f"{log_prefix}.{label}.log")
            cwd = sources.get(label)
            servers.append(Server(f"pagedserve {label}", argv, None, log, cwd=cwd))
        if args.llama_server:
            port = free_port()
            gguf = args.gguf or str(embedded_gguf_path())
            argv = llama_server_argv(args.llama_server, gguf, port, args.threads, args)
            log = Path(f"{log_prefix}.llama.cpp.log")
            servers.append(Server("llama.cpp", argv, f"http://127.0.0.1:{port}", log))
        for server in servers:
            server.wait_ready(timeout_s=600.0)
        # Idle servers take no CPU: each is measured in turn, run by run, so that a change in
        # the machine's load falls on every server alike rather than on one.
        for i in range(args.warmup + args.runs):
            # The same prompts for every server in this round.
            trace = make_trace(args, i, len(tokenizer))
            for server in servers:
                kind = "warm-up" if i < args.warmup else "run"
                summary = server.measure(trace, tokenizer, kind)
                if i >= args.warmup:
                    server.runs.append(summary)
    finally:
        for server in servers:
            server.stop()

    print(f"\n{'server':28} {'out tok/s (runs)':>24} {'mean TTFT s':>12} {'mean TPOT ms':>13}")
    for server in servers:
        name, runs = server.label, server.runs
        tput = ", ".join(f"{r['output_throughput']:.0f}" for r in runs)
        ttft = sum(r["mean_ttft_s"] for r in runs) / len(runs)
        tpot = sum(r["mean_tpot_s"] for r in runs) / len(runs) * 1e3
        print(f"{name:28} {tput:>24} {ttft:>12.2f} {tpot:>13.1f}")
    report = {
        "workload": {
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "threads": args.threads,
            "warmup": args.warmup,
            "runs": args.runs,
            "sources": {label: _source_commit(d) for label, d in sources.items()},
        },
        "argv": sys.argv,
        "cpu": os.cpu_count(),
        "servers": {s.label: {"command": shlex.join(s.argv), "runs": s.runs} for s in servers},
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
