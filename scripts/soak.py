"""Soak: minutes of mixed load on `pagedserve serve` with random client aborts and one executor
kill; reports requests served, errors, leaked blocks and each process's peak RSS.

    PYTHONPATH=. python scripts/soak.py --minutes 10 --clients 16 --output soak.json
    PYTHONPATH=. python scripts/soak.py --minutes 3 --gateways 2    # two gateway processes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

from tests.service.stack_process import HEADERS, ServeProcess, metric, wait_metric


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass  # the process is gone (killed, or being replaced)
    return 0.0


class Tally:
    def __init__(self) -> None:
        self.served = 0  # ended normally (finish reason stop/length), streamed or not
        self.cut = 0  # the client left mid-stream on purpose
        self.errors: list[str] = []  # anything else: non-200, error event, missing [DONE]
        self.peak_rss: dict[str, float] = {}


async def _one(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random, tally):
    kind = rng.choice(["completions", "chat/completions"])
    body: dict = {"model": model, "max_tokens": rng.randint(1, 64)}
    if kind == "completions":
        body["prompt"] = [rng.randrange(3, 384) for _ in range(rng.randint(1, 60))]
    else:
        body["messages"] = [
            {"role": "user", "content": "the capital of france " * rng.randint(1, 8)}
        ]
    if rng.random() < 0.5:
        body |= {"temperature": 1.0, "seed": rng.randint(0, 99), "n": rng.randint(1, 3)}
    else:
        body["temperature"] = 0
    stream = rng.random() < 0.7
    cut_after = rng.randint(0, 10) if stream and rng.random() < 0.25 else None
    async with session.post(
        f"{url}/v1/{kind}", json=body | {"stream": stream}, headers=HEADERS
    ) as response:
        if response.status != 200:
            tally.errors.append(f"{response.status}: {(await response.text())[:200]}")
            return
        if not stream:
            await response.json()
            tally.served += 1
            return
        events, done = 0, False
        async for raw in response.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: ") and '"error"' in line:
                tally.errors.append(line[:200])
            events += 1
            if cut_after is not None and events >= cut_after:
                tally.cut += 1
                return  # leaving closes the connection mid-stream
        if done:
            tally.served += 1
        else:
            tally.errors.append("stream ended without [DONE]")


async def _soak(stack: ServeProcess, seconds: float, clients: int, seed: int, tally) -> dict:
    stop_at = time.monotonic() + seconds
    kill_at = time.monotonic() + seconds / 2
    rng = random.Random(seed)
    killed = {}

    async def client(i: int) -> None:
        crng = random.Random(rng.random())
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < stop_at:
                await _one(session, stack.url, stack.model, crng, tally)

    async def killer() -> None:
        await asyncio.sleep(max(0.0, kill_at - time.monotonic()))
        killed["pid"] = stack.kill("executor")

    await asyncio.gather(killer(), *(client(i) for i in range(clients)))
    async with aiohttp.ClientSession() as session:
        await wait_metric(session, stack.url, "pagedserve_kv_blocks_used", 0, timeout=60)
        leaked = await metric(session, stack.url, "pagedserve_kv_blocks_used")
        restarts = await metric(session, stack.url, "pagedserve_executor_restarts_total")
    return {"leaked_blocks": leaked, "executor_restarts": restarts}


def _watch_rss(stack: ServeProcess, tally: Tally, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        for name, pid in dict(stack.pids).items():
            tally.peak_rss[name] = max(tally.peak_rss.get(name, 0.0), _rss_mib(pid))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny one)")
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes (serve)")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tests.factories import make_tiny_llama

        model = make_tiny_llama(
            Path(tempfile.mkdtemp(prefix="soak-")) / "tiny-llama", vocab_size=384
        )
    stack = ServeProcess(
        model, "--num-device-blocks", "256", "--max-num-seqs", "32",
        "--gateways", str(args.gateways),
    )  # fmt: skip
    tally, stop = Tally(), threading.Event()
    watcher = threading.Thread(target=_watch_rss, args=(stack, tally, stop), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        end = asyncio.run(_soak(stack, args.minutes * 60, args.clients, args.seed, tally))
    finally:
        stop.set()
        code = stack.stop()
    figures = {
        "minutes": round((time.monotonic() - t0) / 60, 1),
        "clients": args.clients,
        "gateways": args.gateways,
        "requests_served": tally.served,
        "streams_cut_by_client": tally.cut,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "executor_kills": 1,
        **end,
        "restarts_seen_by_launcher": stack.restarts,
        "peak_rss_mib": {n: round(v) for n, v in sorted(tally.peak_rss.items())},
        "serve_exit_code": code,
    }
    print(json.dumps(figures, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=2) + "\n")
    ok = not tally.errors and end["leaked_blocks"] == 0 and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
