"""POST /v1/responses: OpenAI's Responses API, run as the chat completion its body translates to."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from services.gateway.openai_api import ParsedRequest, parse_chat_request
from services.gateway.request_run import GenerationFailed, RequestRun, SampleUpdate
from services.gateway.responses_reply import (
    EventLog,
    ResponseDraft,
    message_item,
    new_id,
    output_items,
    usage,
)
from services.gateway.responses_request import RESPONSES_PARAM, chat_body
from services.gateway.serving import (
    error_response,
    open_stream,
    read_json,
    relay,
    run_to_end,
    watch_disconnect,
)
from services.gateway.state import GatewayState
from services.gateway.tool_replies import tool_message
from shared.errors import InvalidRequestError
from shared.protocol import SchedulerReady


def parse_responses_request(
    body: Any,
    info: SchedulerReady,
    tokenizer: Any,
    max_messages: int,
    tool_parser: str | None = None,
) -> ParsedRequest:
    """Validate a /v1/responses body through the chat path (blocking: run off the loop); errors
    name the Responses field, not the chat one it became."""
    chat = chat_body(body)
    try:
        return parse_chat_request(chat, info, tokenizer, max_messages, tool_parser)
    except InvalidRequestError as exc:
        param = exc.param or ""
        if param.startswith("messages"):
            param = "input"
        message = exc.message
        for chat_name, name in RESPONSES_PARAM.items():
            message = message.replace(chat_name, name)
        raise InvalidRequestError(message, RESPONSES_PARAM.get(param, param), exc.code) from None


async def handle_responses(request: web.Request, state: GatewayState) -> web.StreamResponse:
    info = state.require_info()
    body = await read_json(request, state.inputs, state.max_chat_messages)
    parsed = await state.inputs.run(
        body.large,
        parse_responses_request,
        body.value,
        info,
        state.tokenizer,
        state.max_chat_messages,
        state.tool_call_parser,
    )
    state.check_queue()  # after the last await, so a burst cannot pass the limit together
    run = RequestRun(state, parsed)
    draft = ResponseDraft(body.value, parsed.model, run.created)
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(watch_disconnect(request, task))
    try:
        if parsed.stream:
            return await _stream(request, run, draft)
        return await _respond_json(run, draft)
    finally:
        watcher.cancel()


def _reply(run: RequestRun) -> tuple[dict[str, Any], str | None]:
    """The chat reply message of the one sample ({content, tool_calls}), and why it ended."""
    [sample] = run.samples
    text = "".join(sample.pieces)
    if run.parsed.tools is None:
        return {"content": text}, sample.finish_reason
    return tool_message(run.parsed.tools, text, sample.finish_reason)


def _usage(run: RequestRun) -> dict[str, Any]:
    return usage(run.num_prompt_tokens, run.completion_tokens)


async def _respond_json(run: RequestRun, draft: ResponseDraft) -> web.Response:
    if (failed := await run_to_end(run)) is not None:
        return failed
    message, finish_reason = _reply(run)
    return web.json_response(draft.finish(output_items(message), finish_reason, _usage(run)))


async def _stream(
    request: web.Request, run: RequestRun, draft: ResponseDraft
) -> web.StreamResponse:
    # As on the chat endpoint, headers go out with the first delta: a request the scheduler
    # rejects still gets its status code and JSON error body. With tools offered, whether the
    # text is a call is known only at its end: the items are sent whole then.
    streams_text = run.parsed.tools is None
    events = EventLog()
    item_id = new_id("msg")
    resp: web.StreamResponse | None = None

    async def opened() -> web.StreamResponse:
        stream = await open_stream(request)
        await stream.write(
            b"".join(
                [
                    events.event("response.created", response=draft.snapshot()),
                    events.event("response.in_progress", response=draft.snapshot()),
                    *(text_item_opened() if streams_text else []),
                ]
            )
        )
        return stream

    def text_item_opened() -> list[bytes]:
        item = message_item(item_id, None, "in_progress")
        return [
            events.event("response.output_item.added", output_index=0, item=item),
            *events.text_opened(item_id, 0),
        ]

    async def send(updates: list[SampleUpdate]) -> None:
        nonlocal resp
        resp = resp or await opened()
        texts = [u.text for u in updates if u.text and streams_text]
        data = b"".join(events.text_delta(item_id, 0, text) for text in texts)
        if data:
            await resp.write(data)

    try:
        try:
            failure = await relay(run, send, lambda: resp is not None, f"response {draft.id}")
        except GenerationFailed as exc:  # before anything was sent
            return error_response(exc.error, exc.status)
        resp = resp or await opened()
        if failure is not None:
            await resp.write(events.event("response.failed", response=draft.fail(failure)))
        else:
            message, finish_reason = _reply(run)
            if streams_text:
                items = [message_item(item_id, message["content"], "completed")]
                closing = events.text_closed(items[0], 0, message["content"])
            else:
                items = output_items(message)
                closing = [
                    data for i, item in enumerate(items) for data in events.whole_item(i, item)
                ]
            final = draft.finish(items, finish_reason, _usage(run))
            end = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            await resp.write(b"".join([*closing, events.event(end, response=final)]))
        await resp.write_eof()
    except ConnectionError:
        # The client went away while we wrote; RequestRun's exit has aborted the request.
        if resp is None:
            raise
    return resp
