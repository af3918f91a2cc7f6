"""Parse and validate OpenAI completion and chat request bodies into prompts and SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from services.gateway.prompt_logprobs import (
    check_executor_scores_prompts,
    check_streaming,
    completion_prompt_sampling,
)
from services.gateway.prompts import (
    DEFAULT_MAX_CHAT_MESSAGES,
    chat_prompt_ids,
    max_seq_len,
    request_limits,
    text_prompt_ids,
)
from services.gateway.request_fields import reject_unsupported
from services.gateway.tool_request import ToolRequest, tool_request
from shared.errors import InvalidRequestError, ModelNotFoundError
from shared.protocol import SchedulerReady
from shared.sampling import BY_NAME_FIELDS, SamplingParams
from shared.structured import check_limits, check_spec, guided_from_body
from shared.text_codec import decode_ids

Kind = Literal["completion", "chat"]

MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows at most 5
MAX_CHAT_TOP_LOGPROBS = 20


@dataclass
class ParsedRequest:
    """Everything the gateway needs from a validated request body."""

    kind: Kind
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo_text: str | None = None  # completions with echo=true: the prompt as text
    logprobs: bool = False  # render logprobs in the response
    # Completions with echo and max_tokens 0: the prompt (and its logprobs) alone; one token is
    # still drawn, as the prefill's by-product, and not reported.
    prompt_only: bool = False
    show_prompt_logprobs: bool = False  # the body asked for vLLM's prompt_logprobs field
    tools: ToolRequest | None = None  # chat with tools offered: replies may carry tool calls


def parse_completion_request(body: Any, info: SchedulerReady, tokenizer: Any) -> ParsedRequest:
    """Validate a /v1/completions body and tokenize its prompt (blocking: run off the loop)."""
    body = _require_object(body)
    reject_unsupported(body, "completion")
    model = _check_model(body, info)
    prompt = _single_prompt(body.get("prompt"))
    if isinstance(prompt, str):
        prompt_ids = text_prompt_ids(prompt, info, tokenizer, "prompt")
    else:
        prompt_ids = list(prompt)
    request_limits(info).check_prompt(prompt_ids, "prompt")

    logprobs = _opt_int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}", param="logprobs"
        )
    echo = _opt_bool(body, "echo", False)
    echo_text = None
    if echo:
        echo_text = (
            prompt if isinstance(prompt, str) else decode_ids(tokenizer, prompt_ids, "prompt")
        )
    max_tokens = _opt_int(body, "max_tokens")
    prompt_only = echo and max_tokens == 0
    if prompt_only:
        max_tokens = 1
    stream, include_usage = _stream_flags(body)
    sampling = _sampling(body, info, max_tokens if max_tokens is not None else 16, logprobs, stream)
    sampling = completion_prompt_sampling(sampling, echo, logprobs)
    check_streaming(stream, body, prompt_only)
    check_executor_scores_prompts(sampling, info.executor.device_type)
    return ParsedRequest(
        kind="completion",
        model=model,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        stop=_stop_strings(body),
        stream=stream,
        include_usage=include_usage,
        echo_text=echo_text,
        logprobs=logprobs is not None,
        prompt_only=prompt_only,
        show_prompt_logprobs=body.get("prompt_logprobs") is not None,
    )


def parse_chat_request(
    body: Any,
    info: SchedulerReady,
    tokenizer: Any,
    max_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
    tool_parser: str | None = None,
) -> ParsedRequest:
    """Validate a /v1/chat/completions body and render its chat template (blocking)."""
    body = _require_object(body)
    reject_unsupported(body, "chat")
    model = _check_model(body, info)
    tools = tool_request(body, tool_parser, getattr(tokenizer, "chat_template", None))
    prompt_ids = chat_prompt_ids(
        body.get("messages"), info, tokenizer, max_messages, tools.tools if tools else None
    )
    request_limits(info).check_prompt(prompt_ids, "messages")

    want_logprobs = _opt_bool(body, "logprobs", False)
    top = _opt_int(body, "top_logprobs")
    if top is not None:
        if not want_logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}",
                param="top_logprobs",
            )
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    else:
        _opt_int(body, "max_tokens")  # still type-checked when both are given
    if max_tokens is None:
        # No limit given: generate until the context is full, as OpenAI does.
        max_tokens = max_seq_len(info) - len(prompt_ids)
    elif max_tokens < 1:
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise InvalidRequestError(f"{param} must be >= 1, got {max_tokens}", param=param)
    logprobs = (top or 0) if want_logprobs else None
    stream, include_usage = _stream_flags(body)
    sampling = _sampling(body, info, max_tokens, logprobs, stream)
    check_streaming(stream, body, prompt_only=False)
    check_executor_scores_prompts(sampling, info.executor.device_type)
    if tools is not None:
        sampling = _force_tool_call(sampling, tools, info)
    return ParsedRequest(
        kind="chat",
        model=model,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        stop=_stop_strings(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=want_logprobs,
        show_prompt_logprobs=body.get("prompt_logprobs") is not None,
        tools=tools,
    )


def _force_tool_call(
    sampling: SamplingParams, tools: ToolRequest, info: SchedulerReady
) -> SamplingParams:
    """A required or named tool_choice becomes a JSON-schema constraint over the call, so its
    arguments always parse and follow the function's parameters."""
    guided = tools.guided()
    if guided is None:
        return sampling
    if sampling.guided is not None:
        raise InvalidRequestError(
            "a required or named tool_choice cannot be combined with a structured-output field",
            param="tool_choice",
        )
    check_limits(*guided, info.grammar_limits, param="tools")
    try:
        check_spec(*guided)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param="tools") from None
    return replace(sampling, guided=guided)


# ---- pieces -----------------------------------------------------------------------------------


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def _check_model(body: dict[str, Any], info: SchedulerReady) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequestError("model is required", param="model")
    if not isinstance(model, str):
        raise InvalidRequestError(f"model must be a string, got {model!r}", param="model")
    if model != info.model_name and model not in info.model_aliases:
        raise ModelNotFoundError(
            f"the model `{model}` does not exist; this server serves `{info.model_name}`",
            param="model",
            code="model_not_found",
        )
    return model


def _single_prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise InvalidRequestError("prompt is required", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise InvalidRequestError("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str | list) and not prompt:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return prompt
    raise InvalidRequestError(
        "prompt must be a string or a list of token ids", param="prompt", code="invalid_type"
    )


def _sampling(
    body: dict[str, Any],
    info: SchedulerReady,
    max_tokens: int,
    logprobs: int | None,
    stream: bool,
) -> SamplingParams:
    n = _opt_int(body, "n")
    best_of = _opt_int(body, "best_of")
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None:
            request_limits(info).check_samples(name, value)
    if best_of is not None and stream and best_of > (n or 1):
        raise InvalidRequestError(
            "best_of > n cannot be streamed: the best candidates are known only at the end",
            param="best_of",
        )
    beam = _opt_bool(body, "use_beam_search", False)
    if beam and stream:
        raise InvalidRequestError(
            "beam search cannot be streamed: the best hypotheses are known only at the end",
            param="stream",
        )
    stop_ids = body.get("stop_token_ids")
    vocab = info.executor.vocab_size
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(_is_int(t) and 0 <= t < vocab for t in stop_ids)
    ):
        raise InvalidRequestError(
            f"stop_token_ids must be a list of token ids in [0, {vocab})", param="stop_token_ids"
        )
    bias = body.get("logit_bias")
    if bias is not None:
        _check_logit_bias(bias, info.executor.vocab_size)
    # Every sampling field the body gives by name (as shared/sampling.py declares them), then
    # those the gateway checked above or derives per endpoint.
    values: dict[str, Any] = {name: body.get(name) for name in BY_NAME_FIELDS}
    values.update(
        n=n,
        best_of=best_of,
        max_tokens=max_tokens,
        # Beam search is deterministic: an omitted temperature means 0 there, not 1.
        temperature=0.0 if beam and body.get("temperature") is None else body.get("temperature"),
        stop_token_ids=tuple(stop_ids) if stop_ids is not None else None,
        logprobs=logprobs,
        logit_bias=bias,
        guided=guided_from_body(body, info.grammar_limits),
        use_beam_search=beam,
    )
    # What the request leaves unset, the checkpoint's generation config may set (its values
    # are checked like a request's, by SamplingParams); beam search takes none of them.
    for name, default in ({} if beam else info.executor.default_sampling).items():
        if values.get(name) is None:
            values[name] = default
    # null means "the default", which SamplingParams supplies; it validates the rest itself.
    return SamplingParams(**{k: v for k, v in values.items() if v is not None})


def _check_logit_bias(bias: Any, vocab_size: int) -> None:
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    if len(bias) > vocab_size:
        raise InvalidRequestError(
            f"logit_bias has {len(bias)} entries, more than the {vocab_size} token ids",
            param="logit_bias",
        )
    # A key longer than the largest id is no id, and int() of a long one costs quadratic time
    # (Python refuses past 4,300 digits): measure before converting.
    max_digits = len(str(vocab_size))
    for key in bias:
        if not (
            isinstance(key, str)
            and 0 < len(key) <= max_digits
            and key.isascii()
            and key.isdigit()
            and int(key) < vocab_size
        ):
            shown = key if len(key) <= 20 else f"{key[:20]}... ({len(key)} characters)"
            raise InvalidRequestError(
                f"logit_bias key {shown!r} is not a token id in [0, {vocab_size})",
                param="logit_bias",
            )


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError(
            "stop must be a non-empty string or a list of non-empty strings", param="stop"
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop"
        )
    return list(stops)


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequestError(
            "stream_options.include_usage must be a boolean", param="stream_options"
        )
    return stream, stream and include


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=name)
    return value
