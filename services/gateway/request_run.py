"""One accepted request's life at the backend: deltas in, per-sample text out, abort on any exit."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.backend import BackendGone
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.http_errors import (
    RateLimitError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from services.gateway.openai_api import ParsedRequest
from services.gateway.state import GatewayState
from shared.errors import InvalidRequestError, ModelNotFoundError, PagedServeError
from shared.protocol import GenerateRequest, PromptLogprobs, RequestDelta, SampledToken

log = logging.getLogger(__name__)

_STATUS_BY_TYPE = {
    cls.error_type: cls.http_status
    for cls in (
        InvalidRequestError,
        ModelNotFoundError,
        ServiceUnavailableError,
        RequestTimeoutError,
        RateLimitError,
    )
}


class GenerationFailed(Exception):
    """The backend rejected or failed the request; `error` is the OpenAI error object."""

    def __init__(self, error: dict[str, Any], status: int | None = None) -> None:
        super().__init__(error.get("message"))
        self.error = error
        self.status = status or _STATUS_BY_TYPE.get(error.get("type", ""), 500)


def _unavailable(message: str) -> dict[str, Any]:
    return ServiceUnavailableError(message).to_dict()["error"]


@dataclass
class Sample:
    """The gateway's view of one of the request's n samples."""

    index: int
    detok: IncrementalDetokenizer
    pieces: list[str] = field(default_factory=list)  # text released so far
    logprobs: list[SampledToken] = field(default_factory=list)
    num_tokens: int = 0  # tokens that count as output (none after a stop string)
    finish_reason: str | None = None
    started: bool = False  # a streaming chunk was sent for it (echo / chat role go first)
    text_offset: int = 0  # completions logprobs: characters sent before the next token
    cumulative_logprob: float | None = None  # beam search: reported beside each hypothesis


@dataclass
class SampleUpdate:
    sample: Sample
    text: str
    logprobs: list[SampledToken]
    finish_reason: str | None  # set on the update that ends the sample


class RequestRun:
    """Iterates the backend's deltas for one request; use as `async with` so that leaving early
    in any way (client gone, stop string, error, cancellation) aborts it at the backend."""

    def __init__(self, state: GatewayState, parsed: ParsedRequest) -> None:
        self.state = state
        self.parsed = parsed
        prefix = "cmpl" if parsed.kind == "completion" else "chatcmpl"
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.arrival = time.time()
        self.created = int(self.arrival)
        self.num_prompt_tokens = len(parsed.prompt_token_ids)
        self.samples = [
            Sample(
                i,
                IncrementalDetokenizer(state.tokenizer, parsed.stop, parsed.sampling.min_tokens),
            )
            for i in range(parsed.sampling.n)
        ]
        self.finished = False  # the backend sent the last delta: nothing to abort
        self.prompt_logprobs: PromptLogprobs | None = None  # asked-for, once they arrive
        self._done = False  # nothing more to read: finished, or every sample has ended here
        self._iter: Any = None
        self._started = False  # a first delta arrived
        self._accepted = False  # ... and it was not a rejection
        self._failed = False
        self._gone = False  # the backend died: there is nobody to abort at
        self._first_token_t: float | None = None
        self._last_token_t: float | None = None
        self._steps = [0] * parsed.sampling.n  # tokens received per sample (for TPOT)

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    async def __aenter__(self) -> RequestRun:
        self.state.num_unstarted += 1
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._started:
            self.state.num_unstarted -= 1
        if not self.finished:
            # Also after BackendGone: the scheduler may be alive while its executor was not, and
            # an abort of an unknown request is a no-op. Spawned, not awaited: the handler may
            # be under cancellation already.
            self.state.spawn(self.state.backend.abort(self.request_id), "abort")
        aclose = getattr(self._iter, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:
                log.exception("closing the delta stream of %s", self.request_id)
        self._record_metrics()

    async def next_updates(self) -> list[SampleUpdate] | None:
        """Updates from the next delta; None once the request is over. Raises GenerationFailed."""
        if self._done:
            return None
        try:
            if self._iter is None:
                request = GenerateRequest(
                    request_id=self.request_id,
                    prompt_token_ids=self.parsed.prompt_token_ids,
                    sampling=self.parsed.sampling,
                    arrival_time=self.arrival,
                )
                self._iter = aiter(self.state.backend.generate(request))
            left = self._time_left()
            if left is None:  # no request timeout: no timer per delta either
                delta = await anext(self._iter)
            else:
                async with asyncio.timeout(left):  # not wait_for: no task per delta
                    delta = await anext(self._iter)
        except TimeoutError:
            # Leaving unfinished makes __aexit__ abort it, which frees its blocks.
            self._done = self._failed = True
            limit = self.state.request_timeout_s
            error = RequestTimeoutError(
                f"the request did not finish within the server's {limit:g} s request timeout",
                code="request_timeout",
            )
            raise GenerationFailed(error.to_dict()["error"]) from None
        except StopAsyncIteration:
            self._done = True
            if self.finished:
                return None
            self._failed = True
            raise GenerationFailed(_unavailable("the backend ended the request early")) from None
        except BackendGone as exc:
            self._done = self._failed = self._gone = True
            raise GenerationFailed(_unavailable(f"the model backend is gone: {exc}")) from exc
        return self._apply(delta)

    def _time_left(self) -> float | None:
        limit = self.state.request_timeout_s
        return None if limit is None else max(0.0, self.arrival + limit - time.time())

    def _apply(self, delta: RequestDelta) -> list[SampleUpdate]:
        self._on_delta(delta)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = self.finished or delta.finished
        if delta.error is not None:
            self._done = self._failed = True
            raise GenerationFailed(delta.error)
        updates = []
        for seq in delta.seqs:
            if not 0 <= seq.index < len(self.samples):
                continue
            sample = self.samples[seq.index]
            if sample.finish_reason is not None:
                continue  # stopped by a stop string here; the backend runs the group on
            if seq.finish_reason in ("abort", "error"):
                self._done = self._failed = True
                raise GenerationFailed(self._backend_end_error(seq.finish_reason))
            sample.cumulative_logprob = seq.cumulative_logprob
            parts, used = [], []
            for i, token_id in enumerate(seq.token_ids):
                parts.append(sample.detok.step(token_id))
                sample.num_tokens += 1
                if i < len(seq.logprobs):
                    used.append(seq.logprobs[i])
                if sample.detok.stopped:
                    sample.finish_reason = "stop"
                    break
            if sample.finish_reason is None and seq.finish_reason is not None:
                parts.append(sample.detok.flush())
                sample.finish_reason = seq.finish_reason
            updates.append(self._update(sample, "".join(parts), used))
        if delta.finished:
            for sample in self.samples:
                if sample.finish_reason is None:  # not expected: the scheduler names a reason
                    sample.finish_reason = "stop"
                    updates.append(self._update(sample, sample.detok.flush(), []))
        if self.finished or all(s.finish_reason is not None for s in self.samples):
            self._done = True
        return updates

    def _update(self, sample: Sample, text: str, used: list[SampledToken]) -> SampleUpdate:
        sample.pieces.append(text)
        if self.parsed.logprobs:
            sample.logprobs.extend(used)
        return SampleUpdate(sample, text, used, sample.finish_reason)

    @staticmethod
    def _backend_end_error(reason: str) -> dict[str, Any]:
        if reason == "abort":
            return _unavailable("the request was aborted by the server")
        return PagedServeError("generation failed in the model backend").to_dict()["error"]

    # ---- metrics ------------------------------------------------------------------------------
    def _on_delta(self, delta: RequestDelta) -> None:
        metrics = self.state.metrics
        if not self._started:
            self._started = True
            self.state.num_unstarted -= 1
            if delta.error is None:
                self._accepted = True
                if delta.num_prompt_tokens:
                    self.num_prompt_tokens = delta.num_prompt_tokens
                metrics.prompt_tokens.inc(self.num_prompt_tokens)
        now = time.time()
        for seq in delta.seqs:
            if not seq.token_ids or not 0 <= seq.index < len(self._steps):
                continue
            metrics.generation_tokens.inc(len(seq.token_ids))
            self._steps[seq.index] += len(seq.token_ids)
            if self._first_token_t is None:
                self._first_token_t = now
                metrics.time_to_first_token.observe(now - self.arrival)
            self._last_token_t = now

    def _record_metrics(self) -> None:
        metrics = self.state.metrics
        if self._started and not self._accepted:
            metrics.requests_finished.labels("rejected").inc()
            return
        if self._failed:
            reason = "error"
        elif not self._done:
            reason = "abort"  # the client went away (or the handler failed) mid-request
        else:
            reason = self.samples[0].finish_reason or "stop"
        metrics.requests_finished.labels(reason).inc()
        if not self._accepted:
            return
        metrics.e2e_latency.observe(time.time() - self.arrival)
        steps = max(self._steps)
        if steps > 1 and self._first_token_t is not None and self._last_token_t is not None:
            metrics.time_per_output_token.observe(
                (self._last_token_t - self._first_token_t) / (steps - 1)
            )
