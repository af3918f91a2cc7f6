"""The gateway's CPU time per streamed token: how many tokens per second one gateway can serve.

Starts the real gateway process (`python -m services.gateway`) against a stand-in scheduler in
this process that acknowledges every request and then emits one token per request per step
(a fixed step interval, like a busy engine), and streams N concurrent SSE completions through
it with aiohttp. The gateway's own CPU time (user + system, from /proc) over the run divided by
the tokens it streamed is its cost per token, which contention on a small machine does not
inflate the way wall-clock rates are; its inverse is the most tokens per second one gateway
process can stream on this CPU.

With --gateways 1,2 it also runs two gateway processes sharing the port (SO_REUSEPORT, as
`pagedserve serve --gateways 2` does), summing their CPU: the same cost per token means the
work splits without being duplicated, so N processes on N free cores stream N times as much.

    .venv/bin/python benchmarks/gateway_cost.py --gateways 1,2 \\
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

from services.bench.ref_worktree import ref_worktree
from shared.ipc import Addresses, make_socket, recv_from, send_to
from shared.model_source import resolve_model
from shared.protocol import (
    ExecutorReady,
    GatewayHello,
    GenerateRequest,
    RequestDelta,
    SchedulerReady,
    SchedulerStats,
    SeqDelta,
    TokenDeltas,
)

ROOT = Path(__file__).resolve().parents[1]

MODEL_NAME = "stand-in"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class StandInScheduler:
    """Acknowledges requests, then one token per live request per step, each request's deltas
    to the gateway that sent it (as the real scheduler routes them)."""

    def __init__(self, addresses: Addresses, step_s: float, vocab: int) -> None:
        ctx = zmq.asyncio.Context()
        self.sock = make_socket(ctx, zmq.ROUTER, addresses.gateway, bind=True)
        self.step_s = step_s
        # request_id -> [tokens left, prompt length, its gateway]
        self.live: dict[str, list] = {}
        self.ready = SchedulerReady(ExecutorReady(4096, 0, 16, 4096, vocab, (2,)), 1024, MODEL_NAME)
        self.steps = 0
        self.tokens_by_gateway: dict[bytes, int] = {}

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.live), 0, 0, 0, 4096, 0, self.steps)

    async def run(self) -> None:
        await asyncio.gather(self._intake(), self._steps())

    async def _intake(self) -> None:
        while True:
            peer, message = await recv_from(self.sock)
            if isinstance(message, GatewayHello):
                await send_to(self.sock, peer, self.ready)
                await send_to(self.sock, peer, TokenDeltas([], self.stats()))
            elif isinstance(message, GenerateRequest):
                prompt_len = len(message.prompt_token_ids)
                self.live[message.request_id] = [message.sampling.max_tokens, prompt_len, peer]
                ack = RequestDelta(message.request_id, [], False, num_prompt_tokens=prompt_len)
                await send_to(self.sock, peer, TokenDeltas([ack], self.stats()))

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            by_gateway: dict[bytes, list[RequestDelta]] = {}
            for request_id, state in list(self.live.items()):
                state[0] -= 1
                token = 300 + (self.steps + len(request_id)) % 200  # ordinary vocabulary ids
                finished = state[0] == 0
                reason = "length" if finished else None
                by_gateway.setdefault(state[2], []).append(
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
            for peer, deltas in by_gateway.items():
                self.tokens_by_gateway[peer] = self.tokens_by_gateway.get(peer, 0) + len(deltas)
                await send_to(self.sock, peer, TokenDeltas(deltas, self.stats()))


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
    connector = aiohttp.TCPConnector(limit=0)  # every stream at once (the default caps at 100)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(num_streams)))
        seconds = time.perf_counter() - start
    tokens = sum(t for t, _ in counts)
    if tokens != num_streams * max_tokens:
        raise RuntimeError(f"{tokens} tokens streamed, {num_streams * max_tokens} expected")
    return tokens, sum(c for _, c in counts), seconds


async def wait_ready(url: str, ready_files: list[Path], deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200 and all(f.exists() for f in ready_files):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the gateways did not become ready")


async def measure(
    args, addresses: Addresses, url: str, pids: list[int], ready_files: list[Path]
) -> list[dict]:
    scheduler = StandInScheduler(addresses, args.step_ms / 1e3, vocab=49152)
    task = asyncio.create_task(scheduler.run())
    try:
        await wait_ready(url, ready_files)
        for _ in range(len(pids)):  # warm-up: first-request costs (tokenizer, imports)
            await stream_all(url, 8, 8)
        rounds = []
        for num_streams in (int(x) for x in args.streams.split(",")):
            cpu0 = sum(_cpu_seconds(pid) for pid in pids)
            scheduler.tokens_by_gateway.clear()
            tokens, chunks, seconds = await stream_all(url, num_streams, args.max_tokens)
            cpu = sum(_cpu_seconds(pid) for pid in pids) - cpu0
            split = sorted(scheduler.tokens_by_gateway.values(), reverse=True)
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
                    "tokens_per_gateway": split,
                }
            )
            r = rounds[-1]
            print(
                f"{num_streams:4d} streams: {tokens} tokens in {seconds:.2f} s "
                f"({r['tokens_per_s']:.0f} tok/s); gateways' CPU {cpu:.2f} s = "
                f"{r['gateway_cpu_us_per_token']:.0f} us/token ({100 * r['gateway_cpu_share']:.0f}%"
                f" of a core); tokens per gateway {split}",
                flush=True,
            )
        return rounds
    finally:
        task.cancel()


def run_gateways(args, num_gateways: int, root: Path = ROOT) -> list[dict]:
    """Start num_gateways gateway processes (of the checkout at root) on one port, measure every
    stream count, stop them."""
    directory = Path(tempfile.mkdtemp(prefix="pagedserve-gateway-bench-"))
    addresses = Addresses.ipc(str(directory))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        sys.executable, "-m", "services.gateway", "--model", str(resolve_model(None)),
        "--port", str(port), "--gateway-addr", addresses.gateway,
    ]  # fmt: skip
    env = None
    if num_gateways > 1:  # as `pagedserve serve --gateways N` runs them
        argv.append("--reuse-port")
        (directory / "metrics").mkdir()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory / "metrics")}
    ready_files = [directory / f"gateway-{i}.ready" for i in range(num_gateways)]
    gateways = [
        subprocess.Popen(
            [*argv, "--ready-file", str(ready)], cwd=root, env=env, stderr=subprocess.DEVNULL
        )
        for ready in ready_files
    ]
    try:
        url = f"http://127.0.0.1:{port}"
        pids = [g.pid for g in gateways]
        return asyncio.run(measure(args, addresses, url, pids, ready_files))
    finally:
        for gateway in gateways:
            gateway.terminate()
        for gateway in gateways:
            gateway.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="16,64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=10.0, help="the stand-in's step time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--gateways", default="1,2", help="gateway process counts to compare (one port each)"
    )
    parser.add_argument(
        "--compare-ref",
        default=None,
        help="also run the gateway as it was at this git revision (one that speaks the same "
        "protocol: the ROUTER pipe, from commit b80b667 on)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    counts = [int(x) for x in args.gateways.split(",")]
    roots = {"": ROOT}
    with ref_worktree(ROOT, args.compare_ref, "pagedserve-gateway-ref-") as tree:
        if tree is not None:
            roots[f" at {args.compare_ref}"] = tree
        runs: dict[str, list[list[dict]]] = {
            f"{n} gateways{suffix}": [] for n in counts for suffix in roots
        }
        for _ in range(args.rounds):  # alternated, so that drift in the machine's load hits all
            for n in counts:
                for suffix, root in roots.items():
                    print(f"{n} gateway process(es){suffix}", flush=True)
                    runs[f"{n} gateways{suffix}"].append(run_gateways(args, n, root))
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
        # None where a run took under one clock tick of CPU: too small to say.
        "max_tokens_per_s_per_gateway_core": {
            label: 1e6 / min(by_streams.values()) if min(by_streams.values()) > 0 else None
            for label, by_streams in best.items()
        },
    }
    for label, by_streams in best.items():
        cost = ", ".join(f"{n} streams {us:.0f} us" for n, us in by_streams.items())
        limit = report["max_tokens_per_s_per_gateway_core"][label]
        limit_text = f"~{limit:.0f}" if limit is not None else "(too short a run to say)"
        print(f"{label}: best CPU per token: {cost}; at most {limit_text} tok/s per gateway core")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
