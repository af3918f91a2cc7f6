"""Bodies past PARSE_IN_PROCESS_BYTES are parsed in a process of the gateway's own, which refuses
a `messages` list past the limit there; a parser that dies costs one 503, not the gateway."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
import pytest

from services.gateway import input_work
from services.gateway.input_work import PARSE_IN_PROCESS_BYTES, InputWork
from shared.errors import InvalidRequestError, ServiceUnavailableError
from tests.support.polling import eventually


def _chat_body(num_messages: int) -> bytes:
    filler = "x" * (PARSE_IN_PROCESS_BYTES // num_messages + 1)  # past the mark in all
    messages = [{"role": "user", "content": filler}] * num_messages
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    assert len(raw) >= PARSE_IN_PROCESS_BYTES
    return raw


def _parser_pids() -> list[int]:
    return [child.pid for child in psutil.Process().children(recursive=True)]


@pytest.fixture
async def inputs():
    work = InputWork()
    yield work
    work.close()


async def test_a_huge_body_is_parsed_in_a_process_that_refuses_too_many_messages(inputs):
    before = set(_parser_pids())
    with pytest.raises(InvalidRequestError) as refused:
        await inputs.parse(_chat_body(3000), max_messages=2048)
    assert refused.value.param == "messages"
    assert refused.value.message == "at most 2048 messages are allowed, got 3000"
    assert set(_parser_pids()) - before  # the parse ran in a new child of this process

    body = await inputs.parse(_chat_body(100), max_messages=2048)
    assert len(body.value["messages"]) == 100 and body.large


async def test_a_body_under_the_mark_is_parsed_here_whatever_its_messages(inputs):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 3000}).encode()
    assert len(raw) < PARSE_IN_PROCESS_BYTES
    before = set(_parser_pids())  # a forkserver an earlier test started stays
    body = await inputs.parse(raw, max_messages=2048)  # the chat parser refuses it later
    assert len(body.value["messages"]) == 3000
    assert set(_parser_pids()) <= before  # nothing new (an old parser may be exiting)


async def test_a_parser_killed_costs_one_503_and_the_next_body_gets_a_new_one(inputs):
    await inputs.parse(_chat_body(10))
    # The forkserver and the parser it forked are both children; the parser is the youngest.
    parser = max(psutil.Process().children(recursive=True), key=lambda p: p.create_time())
    os.kill(parser.pid, signal.SIGKILL)
    parser.wait(10)
    with pytest.raises(ServiceUnavailableError):
        await inputs.parse(_chat_body(10))
    body = await inputs.parse(_chat_body(10))
    assert len(body.value["messages"]) == 10


async def test_bodies_queued_as_the_parser_is_replaced_are_all_parsed(inputs, monkeypatch):
    # Python 3.11's own recycling (max_tasks_per_child) left the parses queued behind the
    # process that exited waiting for a later submit, which may never come.
    monkeypatch.setattr(input_work, "PARSES_PER_PROCESS", 2)
    parses = asyncio.gather(*(inputs.parse(_chat_body(10)) for _ in range(5)))
    bodies = await asyncio.wait_for(parses, timeout=60)  # a guard against a hang, not a figure
    assert [len(body.value["messages"]) for body in bodies] == [10] * 5
    # Three parsers took 2 + 2 + 1: the two retired ones exit, the last stays.
    await eventually(lambda: len(_forked_parsers()) == 1, timeout=30, message=_forked_parsers)


def _forked_parsers() -> list[int]:
    """The parser processes: what the forkserver (a child of this process) forked."""
    return [
        grandchild.pid
        for child in psutil.Process().children()
        if "forkserver" in " ".join(child.cmdline())
        for grandchild in child.children()
        if grandchild.status() != psutil.STATUS_ZOMBIE
    ]


@pytest.mark.skipif(not hasattr(os, "SCHED_OTHER"), reason="scheduling policies are Linux's")
async def test_the_parser_and_its_forkserver_run_at_the_parsers_nice_and_the_gateway_does_not(
    inputs,
):
    await inputs.parse(_chat_body(10))
    (parser,) = _forked_parsers()
    forkserver = psutil.Process(parser).parent().pid
    for pid in (parser, forkserver):
        # A share of a core while the steps keep every core busy (SCHED_IDLE would give none).
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, pid) == input_work.PARSER_NICE
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # only the thread that started it was lowered


async def test_a_parse_past_its_deadline_is_a_503_and_the_next_body_is_parsed(inputs, monkeypatch):
    await inputs.parse(_chat_body(10))  # the parser is up: only the parse itself is timed
    monkeypatch.setattr(input_work, "PARSE_DEADLINE_S", 0.0)
    with pytest.raises(ServiceUnavailableError) as busy:
        await inputs.parse(_chat_body(3000))
    assert busy.value.code == "parser_busy"
    monkeypatch.setattr(input_work, "PARSE_DEADLINE_S", 60.0)
    body = await inputs.parse(_chat_body(100))
    assert len(body.value["messages"]) == 100
