"""Soak: minutes of mixed load on `pagedserve serve` with random client aborts and one executor
kill; reports requests served, errors, leaked blocks and each process's peak RSS. With --hostile,
hostile inputs (tests/service/hostile_traffic.py) join the traffic, their answers are counted
apart (a 5xx is never expected), and every process's RSS is sampled over the run.
Run from the repository root as a module: it drives the test suite's harness (tests/service/),
which `-m` finds there.

    python -m scripts.soak --minutes 10 --clients 16 --output soak.json
    python -m scripts.soak --minutes 3 --gateways 2    # two gateway processes
    python -m scripts.soak --minutes 10 --hostile --output soak_hostile.json \\
        --plot soak_hostile_rss.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from shared.model_source import resolve_model
from tests.service.hostile_client import Ctx
from tests.service.hostile_traffic import HostileTally, hostile_traffic
from tests.service.process_rss import RssSampler, plot_rss
from tests.service.stack_process import HEADERS, ServeProcess, metric, wait_metric


class Tally:
    def __init__(self) -> None:
        self.served = 0  # ended normally (finish reason stop/length), streamed or not
        self.cut = 0  # the client left mid-stream on purpose
        self.errors: list[str] = []  # anything else: non-200, error event, missing [DONE]
        self.hostile = HostileTally()


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


async def _hostile(stack: ServeProcess, vocab_size: int, stop_at: float, args, tally) -> None:
    timeout = aiohttp.ClientTimeout(total=120)  # a hostile request may be slow, never endless
    async with aiohttp.ClientSession(timeout=timeout) as session:
        url = f"{stack.url}/v1/tokenize"
        async with session.post(url, json={"prompt": "hi"}, headers=HEADERS) as response:
            max_model_len = (await response.json())["max_model_len"]
        ctx = Ctx(stack, session, vocab_size, max_model_len, random.Random(args.seed + 1))
        await hostile_traffic(ctx, stop_at, args.hostile_rate, tally.hostile)


async def _soak(stack: ServeProcess, args, vocab_size: int, tally) -> dict:
    seconds, clients, seed = args.minutes * 60, args.clients, args.seed
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

    hostile = [_hostile(stack, vocab_size, stop_at, args, tally)] if args.hostile else []
    await asyncio.gather(killer(), *hostile, *(client(i) for i in range(clients)))
    async with aiohttp.ClientSession() as session:
        await wait_metric(session, stack.url, "pagedserve_kv_blocks_used", 0, timeout=60)
        leaked = await metric(session, stack.url, "pagedserve_kv_blocks_used")
        restarts = await metric(session, stack.url, "pagedserve_executor_restarts_total")
    return {"leaked_blocks": leaked, "executor_restarts": restarts}


def _vocab_size(model: str | Path) -> int:
    return json.loads((resolve_model(str(model)) / "config.json").read_text())["vocab_size"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny one)")
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes (serve)")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    parser.add_argument("--hostile", action="store_true", help="mix hostile inputs in")
    parser.add_argument("--hostile-rate", type=float, default=0.5, help="hostile requests/s")
    parser.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sample interval")
    parser.add_argument("--plot", default=None, help="PNG: each process's RSS over the run")
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
    tally = Tally()
    sampler = RssSampler(lambda: stack.pids, keep_every_s=args.rss_every_s).start()
    t0 = time.monotonic()
    try:
        end = asyncio.run(_soak(stack, args, _vocab_size(model), tally))
    finally:
        sampler.stop()
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
        "peak_rss_mib": {n: round(v) for n, v in sorted(sampler.peak.items())},
        "serve_exit_code": code,
    }
    if args.hostile:
        figures["hostile"] = tally.hostile.figures()
        figures["rss_samples_mib"] = sampler.samples
    if args.plot:
        title = f"soak{' with hostile inputs' if args.hostile else ''}: RSS per process"
        plot_rss(sampler.samples, args.plot, title)
    samples = figures.pop("rss_samples_mib", None)  # too long to print
    print(json.dumps(figures, indent=2))
    if samples is not None:
        figures["rss_samples_mib"] = samples
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=2) + "\n")
    ok = not tally.errors and end["leaked_blocks"] == 0 and code == 0
    ok = ok and not tally.hostile.unexpected
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
