"""How long a streaming request waits between tokens while a long prompt is admitted beside it.

For each server setting a `pagedserve serve` stack (the embedded model unless --model) starts,
then one short streamed completion runs alone (idle), then another runs while a prompt of
--long-len random token ids (max_tokens 1) is sent beside it once the stream has its first
tokens. Reported per setting: the stream's longest and median gap between tokens, idle and
while the long prompt is computed, and the long prompt's latency. Settings run one after the
other on fresh stacks (no prefix cache shared between them).

    .venv/bin/python benchmarks/long_prompt_fairness.py \\
        --json benchmarks/results/long_prompt_fairness.json

Default settings: "old" (--max-num-batched-tokens 2048, no per-request cap: the defaults
before), "cap256" and "cap32" (the per-request cap at 256 and 32 context-free tokens) and "new"
(the defaults now: 512 on a CPU, 32 context-free prompt tokens per request while others decode).
`--checkout label=path` serves one setting from another checkout (a git worktree of an earlier
revision), so that two revisions compare in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from services.bench.http_load import model_name
from services.bench.server import wait_ready_url

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = [
    "old=--max-num-batched-tokens 2048 --max-prefill-tokens-per-request 2048",
    "cap256=--max-prefill-tokens-per-request 256",
    "cap32=--max-prefill-tokens-per-request 32",
    "new=",
]


async def stream_gaps(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, times: list
) -> None:
    """Stream a completion, appending each token chunk's arrival time to `times`."""
    body = {"model": await model_name(session, url), "prompt": prompt, "stream": True}
    body.update(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    times.append(time.perf_counter())


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def p99(values: list[float]) -> float:
    if len(values) < 2:  # one gap (a tiny smoke run): it is its own percentile
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def measure(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    short = [rng.randrange(100, args.vocab_size) for _ in range(args.short_len)]
    other = [rng.randrange(100, args.vocab_size) for _ in range(args.short_len)]
    long = [rng.randrange(100, args.vocab_size) for _ in range(args.long_len)]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Warm-up: a fresh server's first few dozen decode steps run slower (its memory is
        # first touched then), which would make the idle reference look slow.
        await stream_gaps(session, url, [5, 6, 7], 2 * args.idle_tokens, [])
        idle: list[float] = []
        await stream_gaps(session, url, short, args.idle_tokens, idle)
        times: list[float] = []
        stream = asyncio.create_task(stream_gaps(session, url, other, args.stream_tokens, times))
        while len(times) < 3:
            await asyncio.sleep(0.01)
        sent = time.perf_counter()
        body = {"model": await model_name(session, url), "prompt": long, "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            await resp.json()
        done = time.perf_counter()
        stream.cancel()  # the client goes away: the server aborts the stream
        # Gaps that end while the long prompt is in (from its sending to its answer).
        index = [i for i in range(1, len(times)) if sent < times[i] <= done + 1e-3]
        if not index:  # a prompt answered within one gap (tiny runs): the gap it fell in
            index = [next(i for i in range(1, len(times)) if times[i] > sent)]
        during = [times[i] - times[i - 1] for i in index]
        # The same stream alone, as far: its gaps at the same token positions (so at the same
        # context of its own, which grows by hundreds of tokens while the long prompt runs).
        # Cut by chunks, not max_tokens: a chunk may carry several tokens (text held back
        # until it decodes), chunked alike in both runs since the tokens are the same.
        alone: list[float] = []
        rerun = asyncio.create_task(stream_gaps(session, url, other, args.stream_tokens, alone))
        while len(alone) <= index[-1] and not rerun.done():
            await asyncio.sleep(0.01)
        rerun.cancel()
        matched = [alone[i] - alone[i - 1] for i in index if i < len(alone)]
    if len(idle) < 2 or not matched:
        # A gateway that falls behind sends what queued as one chunk: on a loaded machine a
        # short stream may arrive whole, and there is no gap to measure.
        raise SystemExit(
            f"too few chunks to measure gaps (idle stream {len(idle)}, matched {len(matched)}): "
            "the machine is too loaded, or --idle-tokens is too small"
        )
    return {
        "idle_matched_max_gap_s": max(matched),
        "idle_matched_median_gap_s": statistics.median(matched),
        "idle_matched_p99_gap_s": p99(matched),
        "idle_max_gap_s": max(gaps(idle)),
        "idle_median_gap_s": statistics.median(gaps(idle)),
        "long_max_gap_s": max(during),
        "long_median_gap_s": statistics.median(during),
        # The longest of thousands of gaps holds the machine's own rare stalls too: the 99th
        # percentile says what most steps beside the prompt cost.
        "long_p99_gap_s": p99(during),
        "stream_tokens_during_long": len(during),
        "long_prompt_latency_s": done - sent,
    }


def run_setting(label: str, flags: str, args: argparse.Namespace) -> dict:
    # Port 0: the server binds one the kernel picks and names it in its ready line.
    argv = [sys.executable, "-m", "services.cli", "serve", "--port", "0"]
    argv += shlex.split(args.common) + shlex.split(flags)
    log_path = Path(tempfile.gettempdir()) / f"long_prompt_fairness.{label}.log"
    # `python -m` imports the checkout it runs in: another revision's worktree serves its code.
    root = Path(dict(r.split("=", 1) for r in args.checkout or []).get(label, ROOT))
    commit = subprocess.run(  # the code served (read before, not after, the run)
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, cwd=root, start_new_session=True, env=os.environ.copy(), stdout=log
        )
    try:
        url = wait_ready_url(proc, log_path, 600)
        result = asyncio.run(measure(url, args))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"setting": label, "flags": flags, "commit": commit, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", action="append", help="label=flags (repeatable)")
    parser.add_argument("--common", default="", help="flags for every setting (e.g. --model)")
    parser.add_argument(
        "--checkout",
        action="append",
        help="label=path: serve that setting from another checkout (e.g. a git worktree of an "
        "earlier revision), so that two revisions compare in one run (repeatable)",
    )
    parser.add_argument("--long-len", type=int, default=7800)
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--idle-tokens", type=int, default=32)
    parser.add_argument(
        "--vocab-size", type=int, default=40000, help="prompt token ids are drawn below this"
    )
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=4000,
        help="max_tokens of the stream beside the long prompt (it is cut once that is answered)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for setting in args.setting or SETTINGS:
        label, _, flags = setting.partition("=")
        rows.append(run_setting(label, flags, args))
        r = rows[-1]
        print(
            f"{label}: idle max {r['idle_max_gap_s']:.2f} s (median "
            f"{r['idle_median_gap_s']:.3f}); the same stream alone at the same tokens max "
            f"{r['idle_matched_max_gap_s']:.2f} s (p99 {r['idle_matched_p99_gap_s']:.3f}, "
            f"median {r['idle_matched_median_gap_s']:.3f}); beside the long prompt max "
            f"{r['long_max_gap_s']:.2f} s (p99 {r['long_p99_gap_s']:.3f}, "
            f"median {r['long_median_gap_s']:.3f}, "
            f"{r['stream_tokens_during_long']} tokens); long prompt "
            f"{r['long_prompt_latency_s']:.1f} s",
            flush=True,
        )
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k not in ("json", "setting", "checkout")}
        setup["cpus"] = os.cpu_count()
        setup["load_avg_1m_at_end"] = os.getloadavg()[0]
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
