"""The gateway's CPU time per streamed token: how many tokens per second one gateway can serve.

Starts the real gateway process (`python -m services.gateway`) against a stand-in scheduler in
this process that acknowledges every request and then emits one token per request per step
(a fixed step interval, like a busy engine), and streams N concurrent SSE completions through
it with aiohttp. The gateway's own CPU time (user + system, from /proc) over the run divided by
the tokens it streamed is its cost per token, which contention on a small machine does not
inflate the way wall-clock rates are; its inverse is the most tokens per second one gateway
process can stream on this CPU.

    .venv/bin/python benchmarks/gateway_cost.py --compare-ref 3c8ae27 \\
        --json benchmarks/results/gateway_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.ipc import Addresses, make_socket, recv, send  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402
from shared.protocol import (  # noqa: E402
    ExecutorReady,
    GenerateRequest,
    RequestDelta,
    SchedulerReady,
    SchedulerStats,
    SeqDelta,
    TokenDeltas,
)

MODEL_NAME = "stand-in"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class StandInScheduler:
    """Acknowledges requests, then one token per live request per step."""

    def __init__(self, addresses: Addresses, step_s: float, vocab: int) -> None:
        ctx = zmq.asyncio.Context()
        self.requests = make_socket(ctx, zmq.PULL, addresses.requests, bind=True)
        self.deltas = make_socket(ctx, zmq.PUSH, addresses.deltas, bind=True)
        self.step_s = step_s
        self.live: dict[str, list[int]] = {}  # request_id -> [tokens left, prompt length]
        self.ready = SchedulerReady(ExecutorReady(4096, 0, 16, 4096, vocab, (2,)), 1024, MODEL_NAME)
        self.steps = 0

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.live), 0, 0, 0, 4096, 0, self.steps)

    async def run(self) -> None:
        await send(self.deltas, self.ready)
        await asyncio.gather(self._intake(), self._steps())

    async def _intake(self) -> None:
        while True:
            message = await recv(self.requests)
            if isinstance(message, GenerateRequest):
                prompt_len = len(message.prompt_token_ids)
                self.live[message.request_id] = [message.sampling.max_tokens, prompt_len]
                ack = RequestDelta(message.request_id, [], False, num_prompt_tokens=prompt_len)
                await send(self.deltas, TokenDeltas([ack], self.stats()))

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            deltas = []
            for request_id, state in list(self.live.items()):
                state[0] -= 1
                token = 300 + (self.steps + len(request_id)) % 200  # ordinary vocabulary ids
                finished = state[0] == 0
                reason = "length" if finished else None
                deltas.append(
                    RequestDelta(
                        request_id,
                        [SeqDelta(0, [token], [], reason)],
                        finished,
                        num_prompt_tokens=state[1],
                    )  # fmt: skip
                )
                if finished:
                    del self.live[request_id]
            self.steps += 1
            await send(self.deltas, TokenDeltas(deltas, self.stats()))


async def stream_all(url: str, num_streams: int, max_tokens: int) -> tuple[int, int, float]:
    """(tokens streamed, SSE chunks received, seconds) for num_streams concurrent completions.
    Tokens come from each stream's final usage chunk: a chunk carries the text of one token or,
    when the detokenizer holds a partial character back, of two."""

    async def one(session: aiohttp.ClientSession, index: int) -> tuple[int, int]:
        body = {
            "model": MODEL_NAME,
            "prompt": [300 + index % 100] * 16,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = tokens = 0
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[len(b"data: ") :])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                else:
                    chunks += 1
        return tokens, chunks

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(num_streams)))
        seconds = time.perf_counter() - start
    tokens = sum(t for t, _ in counts)
    if tokens != num_streams * max_tokens:
        raise RuntimeError(f"{tokens} tokens streamed, {num_streams * max_tokens} expected")
    return tokens, sum(c for _, c in counts), seconds


async def wait_ready(url: str, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the gateway did not become ready")


async def measure(args, addresses: Addresses, url: str, pid: int) -> list[dict]:
    scheduler = StandInScheduler(addresses, args.step_ms / 1e3, vocab=49152)
    task = asyncio.create_task(scheduler.run())
    try:
        await wait_ready(url)
        await stream_all(url, 4, 8)  # warm-up: first-request costs (tokenizer, imports)
        rounds = []
        for num_streams in (int(x) for x in args.streams.split(",")):
            cpu0 = _cpu_seconds(pid)
            tokens, chunks, seconds = await stream_all(url, num_streams, args.max_tokens)
            cpu = _cpu_seconds(pid) - cpu0
            rounds.append(
                {
                    "streams": num_streams,
                    "tokens": tokens,
                    "sse_chunks": chunks,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "gateway_cpu_s": cpu,
                    "gateway_cpu_us_per_token": 1e6 * cpu / tokens,
                    "gateway_cpu_share": cpu / seconds,
                }
            )
            r = rounds[-1]
            print(
                f"{num_streams:4d} streams: {tokens} tokens in {seconds:.2f} s "
                f"({r['tokens_per_s']:.0f} tok/s); gateway CPU {cpu:.2f} s = "
                f"{r['gateway_cpu_us_per_token']:.0f} us/token ({100 * r['gateway_cpu_share']:.0f}%"
                " of a core)",
                flush=True,
            )
        return rounds
    finally:
        task.cancel()


def run_gateway(args, root: Path) -> list[dict]:
    """Start the gateway from the checkout at `root`, measure every stream count, stop it."""
    addresses = Addresses.ipc(tempfile.mkdtemp(prefix="pagedserve-gateway-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        sys.executable, "-m", "services.gateway", "--model", str(resolve_model(None)),
        "--port", str(port), "--requests-addr", addresses.requests,
        "--deltas-addr", addresses.deltas, "--plans-addr", addresses.plans,
        "--results-addr", addresses.results,
    ]  # fmt: skip
    gateway = subprocess.Popen(argv, cwd=root, stderr=subprocess.DEVNULL)
    try:
        return asyncio.run(measure(args, addresses, f"http://127.0.0.1:{port}", gateway.pid))
    finally:
        gateway.terminate()
        gateway.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="16,64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=10.0, help="the stand-in's step time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--compare-ref", default=None, help="also run the gateway as it was at this git revision"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    roots = {"current": ROOT}
    worktree = None
    if args.compare_ref:
        worktree = Path(tempfile.mkdtemp(prefix="pagedserve-gateway-ref-")) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), args.compare_ref],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        roots[args.compare_ref] = worktree
    runs: dict[str, list[list[dict]]] = {label: [] for label in roots}
    try:
        for _ in range(args.rounds):  # alternated, so that drift in the machine's load hits all
            for label, root in roots.items():
                print(f"gateway: {label}", flush=True)
                runs[label].append(run_gateway(args, root))
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT)
    best = {
        label: {
            str(r["streams"]): min(
                rr["gateway_cpu_us_per_token"]
                for rounds in label_runs
                for rr in rounds
                if rr["streams"] == r["streams"]
            )
            for r in label_runs[0]
        }
        for label, label_runs in runs.items()
    }
    report = {
        "command": " ".join(["benchmarks/gateway_cost.py", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "best_cpu_us_per_token": best,
        "max_tokens_per_s_per_gateway_core": {
            label: 1e6 / min(by_streams.values()) for label, by_streams in best.items()
        },
    }
    for label, by_streams in best.items():
        cost = ", ".join(f"{n} streams {us:.0f} us" for n, us in by_streams.items())
        limit = report["max_tokens_per_s_per_gateway_core"][label]
        print(f"{label}: best gateway CPU per token: {cost}; at most ~{limit:.0f} tok/s per core")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
