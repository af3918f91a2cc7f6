"""The generation endpoints: validate, run the request, answer as one JSON body or SSE stream."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.gateway import openai_responses as fmt
from services.gateway.detokenizer import TokenTexts
from services.gateway.input_work import InputWork, JsonBody
from services.gateway.openai_api import Kind, parse_chat_request, parse_completion_request
from services.gateway.prompt_logprobs import add_prompt_logprobs, with_echo_logprobs
from services.gateway.request_body import read_body
from services.gateway.request_run import GenerationFailed, RequestRun, SampleUpdate
from services.gateway.state import GatewayState
from services.gateway.tool_replies import ToolCallStream, tool_message
from shared.errors import PagedServeError

log = logging.getLogger(__name__)

# How often a handler checks that its client is still connected (see watch_disconnect).
DISCONNECT_POLL_S = 1.0

INTERNAL_ERROR = PagedServeError("internal server error").to_dict()


async def handle_generate(
    request: web.Request, state: GatewayState, kind: Kind
) -> web.StreamResponse:
    info = state.require_info()
    body = await read_json(request, state.inputs, state.max_chat_messages)
    # Chat templates and tokenization cost a few milliseconds of CPU: keep them off the loop.
    if kind == "completion":
        work = functools.partial(parse_completion_request, body.value, info, state.tokenizer)
    else:
        work = functools.partial(
            parse_chat_request,
            body.value,
            info,
            state.tokenizer,
            state.max_chat_messages,
            state.tool_call_parser,
        )
    parsed = await state.inputs.run(body.large, work)
    state.check_queue()  # after the last await, so a burst cannot pass the limit together
    run = RequestRun(state, parsed)
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(watch_disconnect(request, task))
    try:
        if parsed.stream:
            return await _stream(request, run, state.texts)
        return await _respond_json(run, state.texts)
    finally:
        watcher.cancel()


async def read_json(
    request: web.Request, inputs: InputWork, max_messages: int | None = None
) -> JsonBody:
    raw = await read_body(request)  # bounded: a body that stops coming is a 408
    return await inputs.parse(raw, max_messages)


def error_response(error: dict[str, Any], status: int) -> web.Response:
    # Clients that back off (OpenAI's included) read Retry-After on 429 and 503.
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return web.json_response(fmt.error_event(error), status=status, headers=headers)


async def watch_disconnect(request: web.Request, handler: asyncio.Task[Any]) -> None:
    """Cancel the handler once its client is gone, as aiohttp's handler_cancellation would.

    Without that option nothing interrupts a handler that is awaiting the backend, so a request
    whose client left would run (and hold KV blocks) to its end. Cancelling makes RequestRun's
    exit abort it at the backend.
    """
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            handler.cancel()
            return


async def run_to_end(run: RequestRun) -> web.Response | None:
    """Run `run` to its end for a one-body answer: the error response when it failed."""
    async with run:
        try:
            while await run.next_updates() is not None:
                pass
        except GenerationFailed as exc:
            return error_response(exc.error, exc.status)
    return None


async def _respond_json(run: RequestRun, texts: TokenTexts) -> web.Response:
    if (failed := await run_to_end(run)) is not None:
        return failed
    return web.json_response(_final_body(run, texts))


async def _stream(request: web.Request, run: RequestRun, texts: TokenTexts) -> web.StreamResponse:
    # Headers go out with the first chunk, so a request the scheduler rejects still gets its
    # proper status code and JSON error body.
    chunker = _Chunker(run, texts)
    resp: web.StreamResponse | None = None

    async def send(updates: list[SampleUpdate]) -> None:
        nonlocal resp
        data = b"".join(fmt.sse(chunk) for chunk in chunker.chunks(updates))
        if data:
            resp = resp or await open_stream(request)
            await resp.write(data)

    try:
        try:
            failure = await relay(run, send, lambda: resp is not None, f"request {run.request_id}")
        except GenerationFailed as exc:  # before anything was sent
            return error_response(exc.error, exc.status)
        resp = resp or await open_stream(request)
        if failure is not None:
            await resp.write(fmt.sse(fmt.error_event(failure)))
        elif run.parsed.include_usage:
            await resp.write(fmt.sse(chunker.usage_chunk()))
        await resp.write(fmt.sse("[DONE]"))
        await resp.write_eof()
    except ConnectionError:
        # The client went away while we wrote; RequestRun's exit has aborted the request.
        if resp is None:
            raise
    return resp


async def relay(
    run: RequestRun,
    send: Callable[[list[SampleUpdate]], Awaitable[None]],
    sent: Callable[[], bool],
    what: str,
) -> dict[str, Any] | None:
    """Run `run`, handing each step's updates to send(); the failure a stream must end with
    (None: it ended well). Until sent() is true nothing went out, so a failure is raised as it
    came and the caller answers with a plain error response and status instead."""
    async with run:
        try:
            while (updates := await run.next_updates()) is not None:
                await send(updates)
        except GenerationFailed as exc:
            if not sent():
                raise
            return exc.error
        except ConnectionError:
            raise
        except Exception:
            if not sent():
                raise
            log.exception("%s failed mid-stream", what)
            return INTERNAL_ERROR["error"]
    return None


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer the stream
        }
    )
    await resp.prepare(request)
    return resp


def _object_name(run: RequestRun, chunk: bool) -> str:
    if run.parsed.kind == "completion":
        return fmt.OBJECT_COMPLETION
    return fmt.OBJECT_CHAT_CHUNK if chunk else fmt.OBJECT_CHAT


def _final_body(run: RequestRun, texts: TokenTexts) -> dict[str, Any]:
    parsed = run.parsed
    choices = []
    for s in run.samples:
        text = "".join(s.pieces)
        if parsed.kind == "completion":
            prefix = parsed.echo_text or ""
            lp = None
            if parsed.logprobs:
                lp = fmt.completion_logprobs(s.logprobs, texts, len(prefix))
            choices.append(fmt.completion_choice(s.index, prefix + text, lp, s.finish_reason))
        else:
            lp = fmt.chat_logprobs(s.logprobs, texts) if parsed.logprobs else None
            choices.append(fmt.chat_choice(s.index, text, lp, s.finish_reason))
            if parsed.tools is not None:
                message, reason = tool_message(parsed.tools, text, s.finish_reason)
                choices[-1].update(message=message, finish_reason=reason)
        if s.cumulative_logprob is not None:  # beam search: hypotheses come best first
            choices[-1]["cumulative_logprob"] = s.cumulative_logprob
    body = fmt.envelope(
        _object_name(run, chunk=False), run.request_id, run.created, parsed.model, choices
    )
    body["usage"] = fmt.usage(run.num_prompt_tokens, run.completion_tokens)
    return add_prompt_logprobs(body, parsed, run.prompt_logprobs, texts)


class _Chunker:
    """Turns per-sample updates into streaming chunks, one choice per chunk."""

    def __init__(self, run: RequestRun, texts: TokenTexts) -> None:
        self.run = run
        self.texts = texts
        tools = run.parsed.tools
        self.tool_streams = [ToolCallStream(tools) for _ in run.samples] if tools else None

    def chunks(self, updates: list[SampleUpdate]) -> list[dict[str, Any]]:
        parsed = self.run.parsed
        out = []
        for u in updates:
            s = u.sample
            first = not s.started
            has_logprobs = parsed.logprobs and bool(u.logprobs)
            if self.tool_streams is not None:
                out.extend(self._tool_chunks(u, first, has_logprobs))
                continue
            if not (first or u.text or has_logprobs or u.finish_reason):
                continue  # e.g. text held back for a possible stop string
            s.started = True
            if parsed.kind == "completion":
                prefix = (parsed.echo_text or "") if first else ""
                if first:
                    s.text_offset = len(prefix)
                lp = None
                if parsed.logprobs:
                    lp = fmt.completion_logprobs(u.logprobs, self.texts, s.text_offset)
                    s.text_offset += sum(len(t) for t in lp["tokens"])
                    if first and parsed.echo_text is not None:
                        ids, scored = parsed.prompt_token_ids, self.run.prompt_logprobs
                        lp = with_echo_logprobs(lp, ids, scored, self.texts)
                choice = fmt.completion_choice(s.index, prefix + u.text, lp, u.finish_reason)
            else:
                lp = fmt.chat_logprobs(u.logprobs, self.texts) if parsed.logprobs else None
                choice = fmt.chat_chunk_choice(s.index, u.text, first, lp, u.finish_reason)
            out.append(self._envelope([choice]))
        return out

    def _tool_chunks(
        self, u: SampleUpdate, first: bool, has_logprobs: bool
    ) -> list[dict[str, Any]]:
        """A chat sample with tools offered: text that may be a call is held until it ends."""
        assert self.tool_streams is not None
        s = u.sample
        stream = self.tool_streams[s.index]
        text, calls = stream.feed(u.text)
        finish = u.finish_reason
        if finish is not None:
            rest, more, called = stream.finish()
            text += rest
            calls += more
            if called and finish == "stop":
                finish = "tool_calls"
        if not (first or text or has_logprobs or finish or calls):
            return []
        s.started = True
        lp = fmt.chat_logprobs(u.logprobs, self.texts) if self.run.parsed.logprobs else None
        if not calls:
            return [self._envelope([fmt.chat_chunk_choice(s.index, text, first, lp, finish)])]
        out = []
        if first or text or lp is not None:
            out.append(self._envelope([fmt.chat_chunk_choice(s.index, text, first, lp, None)]))
        for delta in calls:
            choice = {"index": s.index, "delta": {"tool_calls": [delta]}, "logprobs": None}
            out.append(self._envelope([{**choice, "finish_reason": None}]))
        if finish is not None:
            end = {"index": s.index, "delta": {}, "logprobs": None, "finish_reason": finish}
            out.append(self._envelope([end]))
        return out

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope([])
        body["usage"] = fmt.usage(self.run.num_prompt_tokens, self.run.completion_tokens)
        return body

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        run = self.run
        body = fmt.envelope(
            _object_name(run, chunk=True), run.request_id, run.created, run.parsed.model, choices
        )
        if run.parsed.include_usage:
            body["usage"] = None  # OpenAI: every chunk but the last carries a null usage
        return body
