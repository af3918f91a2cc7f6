"""Speculative decoding on a CPU: TPOT and throughput at several concurrencies, off vs on, with
llama.cpp's llama-server (plain and with its own n-gram speculation) in the same run.

Workloads, streamed /v1/completions of prompt token ids, greedy, max_tokens with ignore_eos:
  repeat  the chat model is asked to repeat a given passage word for word (summarising or
          quoting a given text: the output reuses the prompt's n-grams);
  code    the chat model is asked to rename an identifier in a given function and return it
          whole (code editing);
  random  random prompt token ids (nothing to look up: speculation's worst case).
Every server is started first and waits idle; then for each workload and concurrency every
server gets the same prompts in turn (one server under load at a time), with at most
`concurrency` requests in flight. With --repeats N that is done N times, each round starting
from the next server, so that drift in the machine's load falls on every server alike; a
server's figures are then its median round's (by throughput), every round kept beside them,
and the table adds each server's throughput against the first one's, round by round.
Acceptance is read from pagedserve's /metrics around each run.
Prints a table and writes JSON.

    .venv/bin/python benchmarks/speculative.py --llama-server /path/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from services.bench.http_load import run_load
from services.bench.latency import summarize
from services.bench.server import free_port, stop_process_group, wait_healthy, wait_ready_url
from services.bench.spec_prompts import random_prompts, workload_prompts
from services.bench.traces import TraceRequest
from shared.model_source import embedded_gguf_path, resolve_model


class Server:
    """One server process, started idle; measured in turns with the others."""

    def __init__(self, label: str, argv: list[str], url: str | None, log_path: Path) -> None:
        print(f"== {label}: {shlex.join(argv)}", flush=True)
        self.label, self.argv, self.url = label, argv, url
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, start_new_session=True, stdout=self.log, stderr=self.log)
        self.results: dict[str, dict[str, dict]] = {}  # workload -> concurrency -> summary

    def wait_ready(self, timeout_s: float) -> None:
        if self.url is None:
            self.url = wait_ready_url(self.proc, self.log_path, timeout_s)
        else:
            wait_healthy(self.proc, self.url, timeout_s)

    def spec_counters(self) -> tuple[float, float] | None:
        """pagedserve's (proposed, accepted) since start; None for a server without them."""
        if not self.label.startswith("pagedserve"):
            return None
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        found = []
        for name in ("proposed", "accepted"):
            match = re.search(
                rf"^pagedserve_spec_decode_{name}_tokens_total\{{[^}}]*\}} ([0-9.e+-]+)$",
                text,
                re.MULTILINE,
            )
            found.append(float(match.group(1)) if match else 0.0)
        return found[0], found[1]

    def llama_acceptance(self, start: int) -> tuple[int, int]:
        """llama-server's (accepted, generated) draft tokens in its log from byte `start` on
        (its slots print them per request)."""
        self.log.flush()
        with open(self.log_path, errors="replace") as log:
            log.seek(start)
            found = re.findall(
                r"draft acceptance = [0-9.]+ \( *(\d+) accepted / *(\d+)", log.read()
            )
        return sum(int(a) for a, _ in found), sum(int(g) for _, g in found)

    def measure(self, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
        if self.proc.poll() is not None:
            print(f"  {self.label:24} exited ({self.proc.returncode}): not measured", flush=True)
            return {"error": f"server exited with {self.proc.returncode}"}
        trace = [TraceRequest(0.0, tuple(p), output_len) for p in prompts]
        before = self.spec_counters()
        log_start = self.log_path.stat().st_size
        try:
            records, duration = asyncio.run(
                run_load(self.url, trace, max_concurrency=concurrency, fresh_connections=True)
            )
        except Exception as exc:  # noqa: BLE001 - a server that died mid-run: recorded, go on
            print(f"  {self.label:24} failed: {exc!r}", flush=True)
            return {"error": repr(exc)}
        after = self.spec_counters()
        summary = summarize(records, duration)
        summary["output_tokens"] = sum(r.output_len for r in records)
        summary["load_avg_1m"] = os.getloadavg()[0]
        if before is not None:
            proposed, accepted = after[0] - before[0], after[1] - before[1]
            summary["spec_proposed"] = proposed
            summary["spec_accepted"] = accepted
            summary["acceptance_rate"] = accepted / proposed if proposed else None
        elif self.label.startswith("llama.cpp"):
            accepted, proposed = self.llama_acceptance(log_start)
            if proposed:
                summary["spec_proposed"] = proposed
                summary["spec_accepted"] = accepted
                summary["acceptance_rate"] = accepted / proposed
        rate = summary.get("acceptance_rate")
        print(
            f"  {self.label:24} c={concurrency:<3} {summary.get('output_throughput', 0):7.1f} "
            f"out tok/s  TPOT {summary.get('mean_tpot_s', 0) * 1e3:6.1f} ms  "
            f"TTFT {summary.get('mean_ttft_s', 0):6.2f} s"
            + (f"  accepted {rate:.2f}" if rate is not None else "")
            + f"  (load {summary['load_avg_1m']:.1f})",
            flush=True,
        )
        return summary

    def stop(self) -> None:
        stop_process_group(self.proc)
        self.log.close()


ROUND_KEYS = ("output_throughput", "mean_tpot_s", "mean_ttft_s", "load_avg_1m")


def median_round(rounds: list[dict]) -> dict:
    """The round of median throughput (the lower middle one of an even count), with every
    round's main figures under "rounds" when there was more than one."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    ranked = sorted(ok, key=lambda r: r.get("output_throughput", 0.0))
    summary = dict(ranked[(len(ranked) - 1) // 2])
    if len(rounds) > 1:
        summary["rounds"] = [{k: r.get(k) for k in ROUND_KEYS} for r in rounds]
    return summary


def round_ratios(summary: dict, first: dict) -> list[float]:
    """A server's throughput over the first server's in each round (rounds ran side by side)."""
    mine = summary.get("rounds") or [summary]
    theirs = first.get("rounds") or [first]
    return [
        a["output_throughput"] / b["output_throughput"]
        for a, b in zip(mine, theirs)
        if a.get("output_throughput") and b.get("output_throughput")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pagedserve",
        action="append",
        default=None,
        metavar="LABEL=ARGS",
        help="a pagedserve configuration (repeatable); default: off='' and "
        "ngram='--speculative-method ngram --num-speculative-tokens K'",
    )
    parser.add_argument("--model", default=None, help="pagedserve --model (default: embedded)")
    parser.add_argument("--draft-model", default=None, help="adds a draft='...' configuration")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    parser.add_argument("--gguf", default=None, help="GGUF for llama-server (default: embedded)")
    parser.add_argument(
        "--llama-spec-args",
        default="--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
        "--spec-ngram-simple-size-m {k} --spec-draft-n-max {k}",
        help="llama-server's own speculation flags for its second configuration",
    )
    parser.add_argument(
        "--llama-draft-gguf",
        default=None,
        help="adds llama-server with this draft model (-md, --spec-type draft-simple)",
    )
    parser.add_argument("--tokenizer", default=None, help="default: the embedded model's")
    parser.add_argument("--workloads", default="repeat,code,random")
    parser.add_argument(
        "--concurrency",
        default="1:4,4:8,64:64",
        help="concurrency:requests pairs, comma-separated",
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--passage-words", type=int, default=90)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every measurement")
    parser.add_argument("--output", default="benchmarks/results/speculative.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer_dir = args.tokenizer or args.model or resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    k = args.num_speculative_tokens
    spec = f"--speculative-method ngram --num-speculative-tokens {k}"
    configs = [c.split("=", 1) for c in (args.pagedserve or ["off=", f"ngram={spec}"])]
    if args.draft_model:
        configs.append(
            (
                "draft",
                f"--speculative-method draft --num-speculative-tokens {k} "
                f"--draft-model {shlex.quote(args.draft_model)}",
            )
        )
    levels = [tuple(int(x) for x in pair.split(":")) for pair in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    log_prefix = Path(tempfile.gettempdir()) / Path(args.output).stem
    servers: list[Server] = []
    try:
        for label, extra in configs:
            model = ["--model", args.model] if args.model else []
            argv = [
                sys.executable, "-m", "services.cli", "serve", "--port", "0",
                "--num-threads", str(args.threads), *model, *shlex.split(extra),
            ]  # fmt: skip
            log = Path(f"{log_prefix}.{label}.log")
            servers.append(Server(f"pagedserve {label}", argv, None, log))
        if args.llama_server:
            gguf = args.gguf or str(embedded_gguf_path())
            slots = max(c for c, _ in levels)
            ctx = slots * 1024
            llama_configs = [("", ""), (" ngram", args.llama_spec_args.format(k=k))]
            if args.llama_draft_gguf:
                draft = shlex.quote(args.llama_draft_gguf)
                llama_configs.append(
                    (" draft", f"-md {draft} --spec-type draft-simple --spec-draft-n-max {k}")
                )
            for label, extra in llama_configs:
                port = free_port()
                argv = [
                    args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                    "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
                    "-c", str(ctx), "-fa", "on", "--no-webui", *shlex.split(extra),
                ]  # fmt: skip
                log = Path(f"{log_prefix}.llama.cpp{label.strip()}.log")
                servers.append(Server(f"llama.cpp{label}", argv, f"http://127.0.0.1:{port}", log))
        for server in servers:
            server.wait_ready(timeout_s=600.0)
        warmup = random_prompts(len(tokenizer), 2, 16, args.seed + 99)
        for server in servers:
            server.measure(warmup, 8, 2)
        for w, workload in enumerate(workloads):
            for c, (concurrency, num_requests) in enumerate(levels):
                rounds: dict[str, list[dict]] = {s.label: [] for s in servers}
                for r in range(args.repeats):
                    # New prompts each round: a repeated prompt would hit the prefix cache.
                    seed = args.seed * 1000 + w * 100 + c + r * 100_000
                    prompts = workload_prompts(
                        workload, tokenizer, num_requests, seed, args.passage_words,
                        args.random_input_len,
                    )  # fmt: skip
                    print(f"-- {workload}, concurrency {concurrency}, round {r + 1}", flush=True)
                    for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
                        summary = server.measure(prompts, args.output_len, concurrency)
                        rounds[server.label].append(summary)
                for server in servers:
                    server.results.setdefault(workload, {})[str(concurrency)] = median_round(
                        rounds[server.label]
                    )
    finally:
        for server in servers:
            server.stop()

    print(
        f"\n{'workload':8} {'c':>3} {'server':24} {'out tok/s':>10} {'TPOT ms':>8} {'acc':>5}"
        f"  throughput / {servers[0].label}, per round"
    )
    for workload in workloads:
        for concurrency, _ in levels:
            first = servers[0].results.get(workload, {}).get(str(concurrency), {})
            for server in servers:
                r = server.results.get(workload, {}).get(str(concurrency), {})
                rate = r.get("acceptance_rate")
                ratios = round_ratios(r, first)
                print(
                    f"{workload:8} {concurrency:>3} {server.label:24} "
                    f"{r.get('output_throughput', 0):>10.1f} "
                    f"{r.get('mean_tpot_s', 0) * 1e3:>8.1f} "
                    f"{'' if rate is None else f'{rate:.2f}':>5}"
                    f"  {' '.join(f'{x:.2f}' for x in ratios)}"
                )
    report = {
        "workload": {
            "workloads": workloads,
            "concurrency_requests": levels,
            "output_len": args.output_len,
            "passage_words": args.passage_words,
            "random_input_len": args.random_input_len,
            "num_speculative_tokens": k,
            "threads": args.threads,
            "repeats": args.repeats,
        },
        "argv": sys.argv,
        "cpu": os.cpu_count(),
        "servers": {
            s.label: {"command": shlex.join(s.argv), "results": s.results} for s in servers
        },
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
