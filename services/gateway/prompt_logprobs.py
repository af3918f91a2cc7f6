"""Prompt logprobs in responses: echo with logprobs and max_tokens 0 on completions (OpenAI's
legacy API, as lm-eval scores choices), and vLLM's prompt_logprobs field on both endpoints."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.gateway.detokenizer import TokenTexts
from services.gateway.openai_responses import completion_logprobs, logprob_value
from shared.errors import InvalidRequestError, PagedServeError
from shared.protocol import PromptLogprobs
from shared.sampling import SamplingParams

if TYPE_CHECKING:  # openai_api.py imports this module
    from services.gateway.openai_api import ParsedRequest


def completion_prompt_sampling(
    sampling: SamplingParams, echo: bool, logprobs: int | None
) -> SamplingParams:
    """Echo with logprobs reports every prompt token's logprob with the top `logprobs`."""
    if not echo or logprobs is None:
        return sampling
    return replace(sampling, prompt_logprobs=max(logprobs, sampling.prompt_logprobs or 0))


def check_executor_scores_prompts(sampling: SamplingParams, device_type: str) -> None:
    """The simulated executor (a modelled GPU, no weights) computes no logits, so a request for
    prompt logprobs (echo with logprobs, vLLM's prompt_logprobs) is refused up front rather than
    failing once the run ends without them."""
    if sampling.prompt_logprobs is not None and device_type == "sim":
        raise InvalidRequestError(
            "prompt logprobs need a model, and this server runs the simulated executor",
            param="prompt_logprobs",
        )


def check_streaming(stream: bool, body: dict[str, Any], prompt_only: bool) -> None:
    """vLLM's prompt_logprobs field and max_tokens 0 are answered in one JSON body only (echo
    with logprobs streams: the prompt's come in the first chunk)."""
    if stream and (body.get("prompt_logprobs") is not None or prompt_only):
        raise InvalidRequestError(
            "prompt_logprobs and max_tokens 0 cannot be streamed", param="stream"
        )


def add_prompt_logprobs(
    body: dict[str, Any], parsed: ParsedRequest, prompt: PromptLogprobs | None, texts: TokenTexts
) -> dict[str, Any]:
    """The response body with what the request asked of its prompt; raises when the scores
    did not all arrive (a partial answer would be silently wrong)."""
    if parsed.sampling.prompt_logprobs is None and not parsed.prompt_only:
        return body
    if parsed.sampling.prompt_logprobs is not None:
        check_arrived(parsed.prompt_token_ids, prompt)
    ids = parsed.prompt_token_ids
    if parsed.kind == "completion":
        for choice in body["choices"]:
            _completion_choice(choice, parsed, prompt, texts)
    elif parsed.show_prompt_logprobs:
        body["prompt_logprobs"] = vllm_prompt_logprobs(ids, prompt, texts)  # vLLM: top level
    if parsed.prompt_only:
        body["usage"]["completion_tokens"] = 0
        body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"]
    return body


def _completion_choice(
    choice: dict[str, Any], parsed: ParsedRequest, prompt: PromptLogprobs | None, texts: TokenTexts
) -> None:
    ids = parsed.prompt_token_ids
    if parsed.prompt_only:  # the one token drawn to run the prefill is not reported
        choice["text"] = parsed.echo_text
        choice["finish_reason"] = "length"
    if parsed.echo_text is not None and parsed.logprobs:
        generated = {} if parsed.prompt_only else choice["logprobs"]
        choice["logprobs"] = with_echo_logprobs(generated, ids, prompt, texts)
    if parsed.show_prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(ids, prompt, texts)


def check_arrived(prompt_ids: list[int], prompt: PromptLogprobs | None) -> None:
    if prompt is None or len(prompt.tokens) != len(prompt_ids) - 1:
        # Never a partial answer; an OpenAI error body like every other failure of ours.
        raise PagedServeError("the prompt's logprobs did not all arrive", code="prompt_logprobs")


def with_echo_logprobs(
    generated: dict[str, list[Any]],
    prompt_ids: list[int],
    prompt: PromptLogprobs | None,
    texts: TokenTexts,
) -> dict[str, list[Any]]:
    """A streamed sample's first logprobs, after the echoed prompt's."""
    check_arrived(prompt_ids, prompt)
    echoed = echo_logprobs(prompt_ids, prompt, texts)
    for key, values in generated.items():
        echoed[key].extend(values)
    return echoed


def echo_logprobs(
    prompt_ids: list[int], prompt: PromptLogprobs, texts: TokenTexts
) -> dict[str, list[Any]]:
    """The legacy shape for the prompt: the first token has no logprob (null) nor top ones."""
    scored = completion_logprobs(prompt.tokens, texts, len(texts.text(prompt_ids[0])))
    return {
        "tokens": [texts.text(prompt_ids[0]), *scored["tokens"]],
        "token_logprobs": [None, *scored["token_logprobs"]],
        "top_logprobs": [None, *scored["top_logprobs"]],
        "text_offset": [0, *scored["text_offset"]],
    }


def vllm_prompt_logprobs(
    prompt_ids: list[int], prompt: PromptLogprobs, texts: TokenTexts
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: per prompt token (the first null) {token_id: {logprob, rank,
    decoded_token}} for the token itself and the top ones."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, rank in zip(prompt.tokens, prompt.ranks):
        entry = {str(token.token_id): _vllm_item(token.logprob, rank, token.token_id, texts)}
        for top_rank, (top_id, top_logprob) in enumerate(token.top_logprobs, start=1):
            entry.setdefault(str(top_id), _vllm_item(top_logprob, top_rank, top_id, texts))
        out.append(entry)
    assert len(out) == len(prompt_ids)
    return out


def _vllm_item(value: float | None, rank: int, token_id: int, texts: TokenTexts) -> dict:
    return {"logprob": logprob_value(value), "rank": rank, "decoded_token": texts.text(token_id)}
