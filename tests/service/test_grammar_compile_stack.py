"""Through `pagedserve serve`: a grammar that takes long to compile stops no other stream, and
its request, aborted while compiling, stops its compile."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import psutil
import pytest

from tests.service.stack_process import HEADERS, ServeProcess, stream, wait_metric
from tests.support.polling import eventually

# Tens of seconds to compile even for the tiny model's vocabulary (one core); far past the
# default limits, which the stack raises so that it gets as far as the compile.
NUM_VALUES = 60000
LIMITS = [
    "--max-grammar-choices", str(NUM_VALUES),
    "--max-grammar-spec-bytes", str(4 << 20),
    "--grammar-compile-timeout", "600",
]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    serve = ServeProcess(tiny_model_dir, "--num-device-blocks", "128", *LIMITS)
    try:
        yield serve
    finally:
        assert serve.stop() == 0


async def test_a_slow_grammar_compile_stops_no_other_stream(stack) -> None:
    url = stack.url
    schema = {"enum": [f"city-{i:06d}" for i in range(NUM_VALUES)]}
    slow = {
        "model": stack.model,
        "prompt": "the capital of",
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    plain = {"model": stack.model, "prompt": "memory block", "max_tokens": 16, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        slow_task = asyncio.create_task(
            session.post(f"{url}/v1/completions", json=slow, headers=HEADERS)
        )
        # Accepted and waiting for its grammar (requests waiting for one count as waiting).
        await wait_metric(session, url, "pagedserve_num_requests_waiting", 1)
        for _ in range(3):
            out = await stream(session, f"{url}/v1/completions", plain)
            assert out["status"] == 200 and out["finish"] == {0: "length"}
            assert len(out["times"]) >= 1
        # Three streams have run to their end while the grammar still compiles.
        assert not slow_task.done()
        await wait_metric(session, url, "pagedserve_num_requests_waiting", 1, timeout=1.0)

        # The compile runs on a worker process beside the executor (tens of seconds for this
        # grammar, and the worker outlives a compile it finishes).
        worker = _compile_worker(stack.pids["executor"])
        assert worker is not None
        slow_task.cancel()  # the client leaves: its request is aborted while compiling
        with pytest.raises(asyncio.CancelledError):
            await slow_task
        await wait_metric(session, url, "pagedserve_num_requests_waiting", 0)
        # Nothing else runs, so no plan carries the abort: the scheduler tells the executor at
        # once, which kills the compile nobody waits for any more.
        # Within a heartbeat or two (1 s each); the compile itself would run on for tens of
        # seconds (then the worker, grown past its memory cap, is recycled).
        await eventually(lambda: not worker.is_running(), timeout=10.0)
        small = plain | {"max_tokens": 20, "guided_choice": ["paris", "london"]}
        small.pop("ignore_eos")
        async with session.post(f"{url}/v1/completions", json=small, headers=HEADERS) as reply:
            assert reply.status == 200, await reply.text()
            text = (await reply.json())["choices"][0]["text"]
        assert text in ("paris", "london"), json.dumps(text)


def _compile_worker(executor_pid: int) -> psutil.Process | None:
    children = psutil.Process(executor_pid).children()
    return children[0] if children else None
