"""The client side of a hostile-input run: send one hostile call, stream a probe beside it and
measure its gaps, and wait for the server to go idle again."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

from tests.service import hostile_payloads as hp
from tests.service.raw_http import exchange
from tests.service.stack_process import HEADERS, ServeProcess, stream, wait_health, wait_metric

PROBE = {"prompt": "The capital of France is", "temperature": 0, "ignore_eos": True}


@dataclass
class Ctx:
    stack: ServeProcess
    session: aiohttp.ClientSession
    vocab_size: int
    max_model_len: int
    rng: random.Random
    timeout_s: float = 120.0  # for a raw exchange
    probe_tokens: int = 32
    connections: int = 8  # per slow-client attack
    salts: int = 0

    @property
    def model(self) -> str:
        return self.stack.model

    def salt(self) -> str:
        self.salts += 1
        return f"r{self.rng.randrange(10**6)}n{self.salts}"


def since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)


def _answer(path: str, status: int | None, text: str, t0: float) -> dict:
    out = {"path": path, "status": status, "wall_s": since(t0)}
    if status != 200:
        out |= {"openai_error": hp.openai_error(text), "detail": text[:160]}
    return out


async def post(ctx: Ctx, call: hp.Call) -> dict:
    return await post_to(ctx.session, ctx.stack.url, call)


async def post_to(session: aiohttp.ClientSession, url: str, call: hp.Call) -> dict:
    """One hostile call to the server at `url`: its status, wall time and error shape."""
    path, body = call
    t0 = time.monotonic()
    headers = HEADERS | {"Content-Type": "application/json"}
    try:
        async with session.post(url + path, data=body, headers=headers) as response:
            return _answer(path, response.status, await response.text(), t0)
    except aiohttp.ClientError as exc:
        return {"path": path, "status": None, "wall_s": since(t0), "detail": repr(exc)[:160]}


async def raw(ctx: Ctx, data: bytes) -> dict:
    t0 = time.monotonic()
    try:
        status, text = await exchange("127.0.0.1", ctx.stack.port, data, ctx.timeout_s)
    except OSError as exc:
        return {"path": "raw", "status": None, "wall_s": since(t0), "detail": repr(exc)[:160]}
    return _answer("raw", status, text, t0)


async def probe(ctx: Ctx, hard_deadline: float) -> dict:
    """One short greedy stream; its gaps: send to first token, then token to token."""
    times: list[float] = []
    body = PROBE | {"model": ctx.model, "max_tokens": ctx.probe_tokens}
    url = f"{ctx.stack.url}/v1/completions"
    t0 = time.monotonic()
    task = stream(ctx.session, url, body, on_event=lambda: times.append(time.monotonic()))
    out = {"status": None, "unfinished": False, "started": t0}
    try:
        result = await asyncio.wait_for(task, max(1.0, hard_deadline - t0))
        out["status"] = result["status"] if result["error"] is None else "error event"
    except TimeoutError:
        out["unfinished"] = True
        times.append(time.monotonic())  # the gap still open when we gave up counts too
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        out["status"] = repr(exc)[:80]
    marks = [t0, *times]
    out["gaps"] = [b - a for a, b in zip(marks, marks[1:])]
    return out


def probe_figures(probes: list[dict], idle: dict | None = None, t0: float | None = None) -> dict:
    """Over probes: the longest time to a first token and the longest gap between tokens, and
    each against the idle server's (`idle`: what `idle_probe` returned); with `t0` (monotonic),
    also when each began, in seconds after t0."""
    first = [p["gaps"][0] for p in probes if p["gaps"]]
    between = [g for p in probes for g in p["gaps"][1:]]
    out = {
        "count": len(probes),
        # A probe cut off at a row's end is not a failure; its open gap is counted as a gap.
        "failed": sum(p["status"] != 200 and not p["unfinished"] for p in probes),
        "unfinished": sum(p["unfinished"] for p in probes),
        "longest_first_token_s": round(max(first), 3) if first else None,
        "longest_gap_s": round(max(between), 3) if between else None,
        "mean_gap_s": round(statistics.fmean(between), 4) if between else None,
        "p99_gap_s": round(statistics.quantiles(between, n=100, method="inclusive")[98], 3)
        if len(between) > 1
        else None,
    }
    if idle is not None:
        for key, ratio in (("longest_first_token_s", "first_token_x_idle"),
                           ("longest_gap_s", "gap_x_idle")):  # fmt: skip
            out[ratio] = round(out[key] / idle[key], 2) if out[key] and idle[key] else None
    if t0 is not None:
        out |= _when_longest(probes, t0)
    return out


def _when_longest(probes: list[dict], t0: float) -> dict:
    """When the longest first-token wait and the longest gap began, in seconds after t0: where
    in a row to look for their cause (the requests arriving, a worker starting, the cap)."""
    longest = {"longest_first_token_at_s": (0.0, None), "longest_gap_at_s": (0.0, None)}
    for p in probes:
        at = p["started"] - t0
        for i, gap in enumerate(p["gaps"]):
            key = "longest_gap_at_s" if i else "longest_first_token_at_s"
            if gap > longest[key][0]:
                longest[key] = (gap, round(at, 2))
            at += gap
    return {key: at for key, (_, at) in longest.items()}


async def idle_probe(ctx: Ctx, count: int) -> dict:
    """Probes on the idle server, after one to warm it: the medians of their figures."""
    await probe(ctx, time.monotonic() + 120)
    probes = [await probe(ctx, time.monotonic() + 120) for _ in range(count)]
    each = [probe_figures([p]) for p in probes]
    out: dict = {"count": count}
    for key in ("longest_first_token_s", "longest_gap_s", "mean_gap_s"):
        values = [f[key] for f in each if f[key] is not None]
        out[key] = statistics.median(values) if values else None
        out[f"each_{key}"] = values
    return out


async def matched_idle_probe(ctx: Ctx, count: int, max_s: float) -> dict:
    """As many probes on the idle server as a row ran (or as many as fit in max_s): the
    figures a row's are fairly held against. The longest of a few thousand gaps is longer than
    the longest of a hundred on an idle machine too (an idle 32-token probe here has had one
    gap of 0.12 s among its neighbours' 0.04 s), so a row of 100 probes set against the median
    of 5 idle ones counts the machine's own noise as the row's."""
    deadline = time.monotonic() + max_s
    probes = []
    while len(probes) < count and time.monotonic() < deadline:
        probes.append(await probe(ctx, deadline + 30))
    return probe_figures(probes)


def matched_ratios(row: dict, idle: dict) -> dict:
    """The row's longest waits and 99th-percentile gap over the matched idle probes'."""
    out = {}
    for key in ("longest_first_token_s", "longest_gap_s", "p99_gap_s"):
        ratio = f"{key.removesuffix('_s')}_x_matched_idle"
        out[ratio] = round(row[key] / idle[key], 2) if row.get(key) and idle.get(key) else None
    return out


async def settle(ctx: Ctx, timeout_s: float = 120.0) -> float | None:
    """Seconds until /health says ok and nothing runs, waits or holds KV blocks; None if that
    never came. Health first: while the scheduler has no stats, the gauges read 0."""
    t0 = time.monotonic()
    try:
        await wait_health(ctx.session, ctx.stack.url, timeout=timeout_s)
        for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used"):
            left = max(1.0, timeout_s - (time.monotonic() - t0))
            await wait_metric(ctx.session, ctx.stack.url, f"pagedserve_{name}", 0, timeout=left)
    except AssertionError:
        return None
    return since(t0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
