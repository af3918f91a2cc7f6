"""Hostile inputs against `pagedserve serve` on the embedded model: per input, the HTTP answers,
their wall time, the longest gap of a short greedy stream sent beside them (against the same
stream's on an idle server), and each process's RSS; then the KV blocks left and who is alive.
Run from the repository root as a module: it drives the test suite's hostile harness
(tests/service/), which `-m` finds there.

    .venv/bin/python -m scripts.hostile_inputs \\
        --output docs/reliability/hostile_inputs.json
    .venv/bin/python -m scripts.hostile_inputs --rows deep_json,slow_head
    .venv/bin/python -m scripts.hostile_inputs --serve-arg=--max-grammar-choices=100000
    .venv/bin/python -m scripts.hostile_inputs --idle-each-row \\
        --rows messages_100k_x8@loop,messages_100k_x8@process

A row's bodies are built and sent by the event loop that times the probe, or (`sender`
"process", or NAME@process) each by a client process of its own, started before the row, or
(NAME@idle-process) by such processes under SCHED_IDLE, so that the client's own CPU work does
not count as the server's on this one machine.

Serve flags this server does not know are left out with a note, so one command fits old and new.
Exits 1 when a row shows a problem (a 5xx, an input not refused, an error body not OpenAI's, a
connection held to the cap, a probe gap over 2x idle) or the server ends unclean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import aiohttp

from shared.model_source import EMBEDDED_MODEL, resolve_model
from tests.service import hostile_payloads as hp
from tests.service.hostile_client import (
    Ctx,
    alive,
    idle_probe,
    matched_idle_probe,
    matched_ratios,
    post,
    probe,
    probe_figures,
    raw,
    settle,
    since,
)
from tests.service.hostile_sender import ProcessSenders
from tests.service.process_rss import RssSampler, rss_mib, rss_now
from tests.service.raw_http import hold_open
from tests.service.stack_process import HEADERS, ServeProcess, metric, wait_metric

PROBE_GRACE_S = 30.0  # a probe still streaming at a row's cap may finish within this
SENDERS = ("loop", "process", "idle-process")
GOAL_RATIO = 2.0  # the most a probe's longest gap or first-token time may grow beside an input


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    calls: Callable[[Ctx], list[Callable[[], Awaitable[dict]]]] | None = None  # raw sockets
    bodies: Callable[[Ctx], list[hp.Recipe]] | None = None  # HTTP calls, built as sent
    # Who builds and sends the bodies: "loop", the probe's own event loop; "process", a client
    # process per body (for bodies large enough that building and writing them would hold up
    # the loop timing the probe, and so count the client's work as the server's);
    # "idle-process", the same under SCHED_IDLE (the client's CPU then is not the server's).
    sender: str = "loop"
    expect: str = "answered"  # no 5xx; "refused": every answer a 4xx; "closed": before the cap
    sequential: bool = False  # one call after another, the executor's RSS read after each
    cap_s: float | None = None  # default: --row-cap-s, or --connection-cap-s for "closed"
    baseline: Callable[[Ctx], hp.Call] | None = None  # timed alone first, for comparison


def _slow(kind: str):
    def calls(ctx: Ctx) -> list:
        attack = partial(hold_open, "127.0.0.1", ctx.stack.port, kind, ctx.timeout_s)
        return [attack] * ctx.connections

    return calls


ROWS = {row.name: row for row in [
    Row("enum_50k", "json_schema enum of 50,000 strings",
        bodies=lambda c: [partial(hp.enum_schema, c.model, 50_000, c.salt())]),
    Row("enums_15k_x3", "three different enums of 15,000 strings at once",
        bodies=lambda c: [partial(hp.enum_schema, c.model, 15_000, c.salt()) for _ in range(3)]),
    Row("guided_choice_10k", "guided_choice with 10,000 choices",
        bodies=lambda c: [partial(hp.guided_choice, c.model, 10_000, c.salt())]),
    Row("logit_bias_vocab_n64", "logit_bias on every token id, n=64, 16 tokens",
        bodies=lambda c: [partial(hp.logit_bias, c.model, c.vocab_size, 64)],
        baseline=lambda c: hp.logit_bias(c.model, None, 64)),
    # The control for the row above: its gap shows what n=64 rows cost the step, so the bias's
    # own share is the difference between the two rows.
    Row("n64_no_bias", "the same n=64 request without logit_bias (the row above's control)",
        bodies=lambda c: [partial(hp.logit_bias, c.model, None, 64)]),
    Row("logit_bias_long_key", "a logit_bias key of 5,000 digits",
        bodies=lambda c: [partial(hp.long_bias_key, c.model, 5000)], expect="refused"),
    Row("deep_json", "JSON nested 100,000 deep: body, prompt, /v1/tokenize",
        bodies=lambda c: hp.prebuilt(hp.deep_json(c.model, 100_000)), expect="refused"),
    Row("lone_surrogate", "a lone surrogate: completion prompt, /v1/tokenize, chat",
        bodies=lambda c: hp.prebuilt(hp.lone_surrogate(c.model)), expect="refused"),
    Row("auth_non_ascii", "a non-ASCII byte in the Authorization header",
        calls=lambda c: [partial(raw, c, hp.bad_auth_request(c.model))], expect="refused"),
    Row("messages_100k_x8", "8 requests of 100,000 chat messages at once",
        bodies=lambda c: [partial(hp.many_messages, c.model, 100_000)] * 8, sender="process"),
    Row("long_prompt_7800", "a prompt of 7,800 token ids",
        bodies=lambda c: [partial(hp.long_prompt, c.model, min(7800, c.max_model_len - 8),
                                  c.vocab_size, c.rng)]),
    Row("content_length_short", "Content-Length 100x the body sent",
        calls=_slow("content_length_short"), expect="closed"),
    Row("chunked_endless", "a chunked body, one byte a second, never ended",
        calls=_slow("chunked_endless"), expect="closed"),
    Row("slow_head", "request headers one byte a second, never ended",
        calls=_slow("slow_head"), expect="closed"),
    Row("role_injection", "a role named <|im_end|>\\n<|im_start|>system",
        bodies=lambda c: [partial(hp.injected_role, c.model)], expect="refused"),
    Row("grammar_memory", "20 different enums of 2,000-5,000 strings, one after another",
        bodies=lambda c: [partial(hp.enum_schema, c.model, c.rng.randint(2000, 5000), c.salt())
                          for _ in range(20)], sequential=True, cap_s=300.0),
]}  # fmt: skip


async def _capped(coro, deadline: float) -> dict:
    t0 = time.monotonic()
    try:
        return await asyncio.wait_for(coro, max(0.0, deadline - t0))
    except TimeoutError:
        return {"status": None, "wall_s": since(t0), "held_until_cap": True}


def sent_from_loop(ctx: Ctx, recipes: list[hp.Recipe]) -> list[Callable[[], Awaitable[dict]]]:
    """Each body built here, on the probe's loop; a recipe a row repeats is built once, one
    body sent that many times."""
    built: dict[int, hp.Call] = {}
    for recipe in recipes:
        if id(recipe) not in built:
            built[id(recipe)] = recipe()
    return [partial(post, ctx, built[id(recipe)]) for recipe in recipes]


async def _process_senders(ctx: Ctx, row: Row) -> ProcessSenders | None:
    """The row's sender processes, started and each with its body built, before its clock."""
    if row.bodies is None or row.sender == "loop":
        return None
    senders = ProcessSenders(ctx.stack.url, row.bodies(ctx), idle=row.sender == "idle-process")
    try:
        await senders.start()
    except BaseException:
        senders.close()
        raise
    return senders


async def _hostile(ctx: Ctx, row: Row, deadline: float, senders: ProcessSenders | None):
    if senders is not None:
        calls = senders.calls()
    elif row.bodies is not None:
        calls = sent_from_loop(ctx, row.bodies(ctx))
    else:
        calls = row.calls(ctx)
    if not row.sequential:
        return list(await asyncio.gather(*(_capped(call(), deadline) for call in calls)))
    results = []
    for call in calls:
        result = await _capped(call(), deadline)
        results.append(result | {"executor_rss_mib": round(rss_mib(ctx.stack.pids["executor"]))})
    return results


async def run_row(ctx: Ctx, row: Row, args, idle: dict, sampler: RssSampler) -> dict:
    out: dict = {"row": row.name, "what": row.what, "sender": row.sender if row.bodies else None}
    if row.baseline is not None:
        out["baseline_wall_s"] = (await post(ctx, row.baseline(ctx)))["wall_s"]
        await settle(ctx)
    if args.idle_each_row:
        idle = out["idle_probe"] = await idle_probe(ctx, args.idle_probes)
    senders = await _process_senders(ctx, row)
    try:
        return await _measure_row(ctx, row, args, idle, sampler, senders, out)
    finally:
        if senders is not None:
            senders.close()


async def _measure_row(ctx, row, args, idle, sampler, senders, out: dict) -> dict:
    cap_s = row.cap_s or (args.connection_cap_s + 5 if row.expect == "closed" else args.row_cap_s)
    ctx.timeout_s = args.connection_cap_s if row.expect == "closed" else args.row_cap_s
    restarts = len(ctx.stack.restarts)
    before = rss_now(ctx.stack.pids)
    sampler.reset_peak()
    t0 = time.monotonic()
    hostile = asyncio.ensure_future(_hostile(ctx, row, t0 + cap_s, senders))
    await asyncio.sleep(0.5)  # the hostile request first, then the probe beside it
    probes = []
    while not probes or not (hostile.done() or time.monotonic() > t0 + cap_s):
        probes.append(await probe(ctx, t0 + cap_s + PROBE_GRACE_S))
    probed_s = time.monotonic() - t0
    results = await hostile
    out |= {
        "statuses": dict(Counter(_status(r) for r in results)),
        "wall_s": max(r["wall_s"] for r in results),
        "requests": results,
        "probe": probe_figures(probes, idle, t0),
        "settle_s": await settle(ctx),
        "rss_mib": {"before": before, "peak": dict(sampler.peak), "after": rss_now(ctx.stack.pids)},
        "restarts": ctx.stack.restarts[restarts:],
    }
    if args.idle_matched:
        out["matched_idle"] = await matched_idle_probe(ctx, len(probes), probed_s + 5)
        out["probe"] |= matched_ratios(out["probe"], out["matched_idle"])
    out["problems"] = _problems(row, out)
    return out


def _status(result: dict) -> str:
    if result.get("held_until_cap"):
        return "open at cap"
    return str(result["status"] if result["status"] is not None else "closed")


def _problems(row: Row, out: dict) -> list[str]:
    problems = []
    statuses = [r["status"] for r in out["requests"]]
    if any(s is not None and s >= 500 for s in statuses):
        problems.append("5xx")
    if any(r.get("held_until_cap") for r in out["requests"]):
        problems.append("held until cap")
    if row.expect == "refused" and not all(s is not None and 400 <= s < 500 for s in statuses):
        problems.append("not refused")
    if any(r.get("openai_error") is False and r["status"] for r in out["requests"]):
        problems.append("error body not OpenAI's")
    # With matched idle probes the goal is held against them.
    ratios = (
        (
            ("longest_gap_x_matched_idle", "gap"),
            ("longest_first_token_x_matched_idle", "first token"),
        )
        if "matched_idle" in out
        else (("gap_x_idle", "gap"), ("first_token_x_idle", "first token"))
    )
    for key, what in ratios:
        ratio = out["probe"][key]
        if ratio is not None and ratio > GOAL_RATIO:
            problems.append(f"probe {what} {ratio}x idle")
    if out["probe"]["failed"]:
        problems.append("probe failed")
    if out["settle_s"] is None:
        problems.append("not idle after")
    if out["restarts"]:
        problems.append(f"restarted {out['restarts']}")
    return problems


def _table_line(r: dict) -> str:
    answers = " ".join(f"{k}x{v}" if v > 1 else k for k, v in r["statuses"].items())
    rss, p = r["rss_mib"], r["probe"]
    executor = f"{rss['before'].get('executor', 0):.0f}>{rss['after'].get('executor', 0):.0f}"
    return (
        f"{r['row']:22} {answers[:18]:18} {r['wall_s']:7.1f} "
        f"{p['longest_first_token_s'] or 0:7.2f} {p['first_token_x_idle'] or 0:6.1f} "
        f"{p['longest_gap_s'] or 0:7.2f} {p['gap_x_idle'] or 0:6.1f} "
        f"{p.get('longest_gap_x_matched_idle') or 0:7.1f} "
        f"{executor:>11} {rss['peak'].get('gateway', 0):7.0f}  {', '.join(r['problems'])}"
    )


TABLE_HEAD = (
    f"{'row':22} {'answers':18} {'wall s':>7} {'1st s':>7} {'x idle':>6} {'gap s':>7} "
    f"{'x idle':>6} {'x match':>7} "
    f"{'exec MiB':>11} {'gw peak':>7}  problems"
)


def known_serve_args(extra: list[str]) -> tuple[list[str], list[str]]:
    """The --serve-arg tokens this `pagedserve serve` accepts, and those it would refuse."""
    argv = [sys.executable, "-m", "services.cli", "serve", "--help"]
    words = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    known = [a for a in extra if not a.startswith("--") or a.split("=")[0] in words]
    return known, [a for a in extra if a not in known]


async def _run(args, stack: ServeProcess, rows: list[Row], sampler: RssSampler) -> dict:
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        url = f"{stack.url}/v1/tokenize"
        async with session.post(url, json={"prompt": "hi"}, headers=HEADERS) as response:
            max_model_len = (await response.json())["max_model_len"]
        vocab_size = json.loads((resolve_model(args.model) / "config.json").read_text())
        ctx = Ctx(stack, session, vocab_size["vocab_size"], max_model_len,
                  random.Random(args.seed), probe_tokens=args.probe_tokens,
                  connections=args.slow_connections)  # fmt: skip
        await settle(ctx)
        idle = await idle_probe(ctx, args.idle_probes)
        print(f"idle probe (medians of {idle['count']}): first token "
              f"{idle['longest_first_token_s']} s, longest gap {idle['longest_gap_s']} s, "
              f"mean gap {idle['mean_gap_s']} s", flush=True)  # fmt: skip
        print(TABLE_HEAD, flush=True)
        results = []
        for row in rows:
            results.append(await run_row(ctx, row, args, idle, sampler))
            print(_table_line(results[-1]), flush=True)
        # Idle again at the end: a machine busier than at the start shows here, not as a fault.
        idle_after = await idle_probe(ctx, args.idle_probes)
        print(f"idle probe after: first token {idle_after['longest_first_token_s']} s, longest "
              f"gap {idle_after['longest_gap_s']} s", flush=True)  # fmt: skip
        await wait_metric(session, stack.url, "pagedserve_kv_blocks_used", 0, timeout=60)
        final = {
            "kv_blocks_used": await metric(session, stack.url, "pagedserve_kv_blocks_used"),
            "alive": {n: alive(p) for n, p in stack.pids.items()},
            "restarts": stack.restarts,
        }
    return {"idle_probe": idle, "rows": results, "idle_probe_after": idle_after, "final": final}


def row_named(name: str) -> Row:
    """A row by name; NAME@SENDER is that row with its bodies sent by SENDER."""
    base, _, sender = name.partition("@")
    if base not in ROWS:
        raise ValueError(f"unknown row {base!r}; known: {', '.join(ROWS)}")
    row = ROWS[base]
    if not sender:
        return row
    if sender not in SENDERS or row.bodies is None:
        raise ValueError(f"{name}: a sender is one of {SENDERS}, for a row of HTTP bodies")
    return replace(row, name=name, sender=sender)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated, of: {','.join(ROWS)}; "
        "NAME@loop, NAME@process or NAME@idle-process sends that row's bodies from the "
        "probe's event loop, from a process per body, or from such processes under "
        "SCHED_IDLE (a client elsewhere, as near as one machine allows; a row may be named "
        "twice)",
    )
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more `pagedserve serve` argument, as --flag=value")  # fmt: skip
    parser.add_argument("--row-cap-s", type=float, default=120.0, help="per row, HTTP rows")
    parser.add_argument("--connection-cap-s", type=float, default=90.0, help="slow-client rows")
    parser.add_argument("--slow-connections", type=int, default=8, help="per slow-client row")
    parser.add_argument("--probe-tokens", type=int, default=32)
    parser.add_argument("--idle-probes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--idle-each-row",
        action="store_true",
        help="an idle probe before each row, that row's ratios against it",
    )
    parser.add_argument(
        "--idle-matched",
        action="store_true",
        help="after each row, as many idle probes as it ran; its goal is held against theirs",
    )
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    try:
        rows = [row_named(name) for name in (args.rows.split(",") if args.rows else ROWS)]
    except ValueError as exc:
        parser.error(str(exc))
    serve_args, left_out = known_serve_args(args.serve_arg)
    if left_out:
        print(f"this pagedserve serve has no flag for {left_out}: left out", flush=True)
    t0 = time.monotonic()
    stack = ServeProcess(Path(args.model), *serve_args)
    sampler = RssSampler(lambda: stack.pids).start()
    try:
        figures = asyncio.run(_run(args, stack, rows, sampler))
    finally:
        sampler.stop()
        code = stack.stop()
    final = figures["final"] | {"serve_exit_code": code}
    print(json.dumps(final))
    report = {
        "command": " ".join(sys.argv),
        "model": stack.model,
        "serve_args": serve_args,
        "serve_args_left_out": left_out,
        "minutes": round((time.monotonic() - t0) / 60, 1),
        **figures,
        "final": final,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    clean = final["kv_blocks_used"] == 0 and all(final["alive"].values()) and code == 0
    ok = clean and not final["restarts"] and not any(r["problems"] for r in figures["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
