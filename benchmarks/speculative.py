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
`concurrency` requests in flight. Acceptance is read from pagedserve's /metrics around each run.
Prints a table and writes JSON.

    .venv/bin/python benchmarks/speculative.py --llama-server /path/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from services.bench.traces import TraceRequest
from shared.model_source import embedded_gguf_path, resolve_model

CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "services/executor/calibration_text.txt"
NAMES = ("total", "count", "price", "items", "result", "value", "index", "scale", "offset")
CODE = '''def {fn}({a}, {b}):
    """Return the weighted {a} of every entry in {b}."""
    {c} = 0
    for entry in {b}:
        if entry is None:
            continue
        {c} += entry * {a}
    if {c} < 0:
        raise ValueError("negative {c}")
    return {c}


def {fn}_all(groups, {a}):
    return [{fn}({a}, group) for group in groups]
'''


def repeat_prompts(tokenizer, n: int, words: int, seed: int) -> list[list[int]]:
    text = CALIBRATION_TEXT.read_text().split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        start = rng.randrange(0, len(text) - words)
        passage = " ".join(text[start : start + words])
        message = f"Repeat the following text exactly, word for word.\n\n{passage}"
        prompts.append(_chat(tokenizer, message))
    return prompts


def code_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        a, b, c, new = rng.sample(NAMES, 4)
        fn = rng.choice(("weigh", "accumulate", "combine", "tally"))
        code = CODE.format(fn=fn, a=a, b=b, c=c)
        message = (
            f"Rename the variable `{c}` to `{new}` in this Python code and return the "
            f"complete code.\n\n```python\n{code}```"
        )
        prompts.append(_chat(tokenizer, message))
    return prompts


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    # Ids from the ordinary part of the vocabulary, as benchmarks/cpu_serving.py.
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 2), min(40000, vocab_size)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def _chat(tokenizer, message: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


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
                seed = args.seed * 1000 + w * 100 + c
                if workload == "repeat":
                    prompts = repeat_prompts(tokenizer, num_requests, args.passage_words, seed)
                elif workload == "code":
                    prompts = code_prompts(tokenizer, num_requests, seed)
                else:
                    prompts = random_prompts(
                        len(tokenizer), num_requests, args.random_input_len, seed
                    )
                print(f"-- {workload}, concurrency {concurrency}", flush=True)
                for server in servers:
                    summary = server.measure(prompts, args.output_len, concurrency)
                    server.results.setdefault(workload, {})[str(concurrency)] = summary
    finally:
        for server in servers:
            server.stop()

    print(f"\n{'workload':8} {'c':>3} {'server':24} {'out tok/s':>10} {'TPOT ms':>8} {'acc':>5}")
    for workload in workloads:
        for concurrency, _ in levels:
            for server in servers:
                r = server.results.get(workload, {}).get(str(concurrency), {})
                rate = r.get("acceptance_rate")
                print(
                    f"{workload:8} {concurrency:>3} {server.label:24} "
                    f"{r.get('output_throughput', 0):>10.1f} "
                    f"{r.get('mean_tpot_s', 0) * 1e3:>8.1f} "
                    f"{'' if rate is None else f'{rate:.2f}':>5}"
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
