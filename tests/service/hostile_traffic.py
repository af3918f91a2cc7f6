"""Hostile requests mixed into a soak's traffic at a modest rate and at sizes that do not dominate
it; each answer is sorted into expected refusals, answers, and what a server must never do."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tests.service import hostile_payloads as hp
from tests.service.hostile_client import Ctx, post, raw
from tests.service.raw_http import ATTACKS, hold_open


def _one(build: Callable[[Ctx], hp.Call]) -> Callable[[Ctx], Awaitable[dict]]:
    return lambda ctx: post(ctx, build(ctx))


def _any(build: Callable[[Ctx], list[hp.Call]]) -> Callable[[Ctx], Awaitable[dict]]:
    return lambda ctx: post(ctx, ctx.rng.choice(build(ctx)))


async def _slow_socket(ctx: Ctx) -> dict:
    # Short-lived: the client leaves after a few seconds whether or not the server has closed.
    kind, cap_s = ctx.rng.choice(ATTACKS), ctx.rng.uniform(1.0, 5.0)
    return await hold_open("127.0.0.1", ctx.stack.port, kind, cap_s)


def _long_prompt(ctx: Ctx) -> hp.Call:
    # Long enough to take many prefill chunks, short enough not to crowd out the soak itself.
    num_tokens = min(2000, ctx.max_model_len - 16)
    return hp.long_prompt(ctx.model, num_tokens, ctx.vocab_size, ctx.rng)


# kind -> (what the server must do: "refused" = a 4xx, "answered" = anything but a 5xx; sender)
KINDS: dict[str, tuple[str, Callable[[Ctx], Awaitable[dict]]]] = {
    "deep_json": ("refused", _any(lambda c: hp.deep_json(c.model, 100_000))),
    "lone_surrogate": ("refused", _any(lambda c: hp.lone_surrogate(c.model))),
    "bad_auth_byte": ("refused", lambda c: raw(c, hp.bad_auth_request(c.model))),
    "injected_role": ("refused", _one(lambda c: hp.injected_role(c.model))),
    "long_bias_key": ("refused", _one(lambda c: hp.long_bias_key(c.model, 5000))),
    "vocab_logit_bias": (
        "answered",
        _one(lambda c: hp.logit_bias(c.model, c.vocab_size, c.rng.randint(1, 8), max_tokens=8)),
    ),
    "long_prompt": ("answered", _one(_long_prompt)),
    "medium_enum": (
        "answered",
        _one(lambda c: hp.enum_schema(c.model, c.rng.randint(500, 2000), c.salt())),
    ),
    "medium_choice": (
        "answered",
        _one(lambda c: hp.guided_choice(c.model, c.rng.randint(200, 1000), c.salt())),
    ),
    "many_messages": ("answered", _one(lambda c: hp.many_messages(c.model, 10_000))),
    "slow_socket": ("answered", _slow_socket),
}


@dataclass
class HostileTally:
    by_kind: dict[str, Counter] = field(default_factory=dict)  # kind -> answers by class
    expected_4xx: int = 0  # refusals of inputs that must be refused
    other_4xx: int = 0  # refusals of inputs a server may also serve (limits, full queues)
    served: int = 0
    server_errors: int = 0  # 5xx
    unexpected: list[str] = field(default_factory=list)  # 5xx, accepted, non-OpenAI errors
    sockets: Counter = field(default_factory=Counter)  # closed by the server / left by us
    skipped: int = 0  # arrivals while too many were still out

    def add(self, kind: str, expect: str, result: dict) -> None:
        status = result.get("status")
        if "attack" in result:
            self.sockets["left_by_client" if result["held_until_cap"] else "closed_by_server"] += 1
            label = "open" if result["held_until_cap"] else str(status or "closed")
        else:
            label = "none" if status is None else f"{status // 100}xx"
        self.by_kind.setdefault(kind, Counter())[label] += 1
        problem = None
        if status is not None and status >= 500:
            self.server_errors += 1
            problem = "5xx"
        elif "attack" in result:
            return
        elif status is None:
            problem = "no answer"
        elif status >= 400 and not result.get("openai_error"):
            problem = "error body not OpenAI's"
        elif status >= 400:
            self.expected_4xx += expect == "refused"
            self.other_4xx += expect != "refused"
        elif expect == "refused":
            problem = "accepted"
        else:
            self.served += 1
        if problem is not None:
            self.unexpected.append(f"{kind}: {problem}: {status} {result.get('detail', '')}"[:200])

    def figures(self) -> dict:
        return {
            "sent": sum(sum(c.values()) for c in self.by_kind.values()),
            "skipped_while_busy": self.skipped,
            "served": self.served,
            "expected_4xx": self.expected_4xx,
            "other_4xx": self.other_4xx,
            "server_errors_5xx": self.server_errors,
            "unexpected": len(self.unexpected),
            "first_unexpected": self.unexpected[:5],
            "slow_sockets": dict(self.sockets),
            "by_kind": {k: dict(c) for k, c in sorted(self.by_kind.items())},
        }


async def hostile_traffic(
    ctx: Ctx, stop_at: float, rate_per_s: float, tally: HostileTally, max_in_flight: int = 8
) -> None:
    """Hostile requests arriving as a Poisson stream of `rate_per_s` until `stop_at`; an arrival
    while `max_in_flight` are still out is skipped, so slow answers cannot pile up."""
    in_flight: set[asyncio.Task] = set()

    async def one(kind: str) -> None:
        expect, send = KINDS[kind]
        tally.add(kind, expect, await send(ctx))

    while True:
        await asyncio.sleep(ctx.rng.expovariate(rate_per_s))
        if time.monotonic() >= stop_at:
            break
        if len(in_flight) >= max_in_flight:
            tally.skipped += 1
            continue
        task = asyncio.ensure_future(one(ctx.rng.choice(list(KINDS))))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
