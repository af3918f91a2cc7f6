"""What every request handler of one gateway app shares: backend, tokenizer, limits, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from services.gateway.backend import Backend
from services.gateway.detokenizer import TokenTexts
from services.gateway.http_errors import RateLimitError, ServiceUnavailableError
from services.gateway.input_work import InputWork
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompts import DEFAULT_MAX_CHAT_MESSAGES
from shared.protocol import SchedulerReady

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    backend: Backend
    tokenizer: Any
    metrics: GatewayMetrics
    texts: TokenTexts
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES  # more in one request is a 400
    tool_call_parser: str | None = None  # None: the chat template's format, else Hermes
    request_timeout_s: float | None = None  # a request running longer ends with a timeout error
    # Submitted by this gateway but without any delta yet: the scheduler's num_waiting may not
    # count them yet, and a burst must not slip past the queue limit in between.
    num_unstarted: int = 0
    started: int = field(default_factory=lambda: int(time.time()))  # /v1/models "created"
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    inputs: InputWork = field(default_factory=InputWork)  # where bodies are parsed and tokenized

    def require_info(self) -> SchedulerReady:
        info = self.backend.info
        # While a dead executor is replaced, new requests queue like the ones in flight.
        usable = self.backend.ready or getattr(self.backend, "degraded", False)
        if not usable or info is None:
            raise ServiceUnavailableError("the model server is not ready", code="not_ready")
        return info

    def check_queue(self) -> None:
        if self.max_queued_requests is None:
            return
        stats = self.backend.stats
        # A backend that tracks acknowledgements knows exactly what is in transit; otherwise
        # count the requests without a first delta (may overlap num_waiting briefly).
        in_transit = getattr(self.backend, "num_in_transit", None)
        if in_transit is None:
            in_transit = self.num_unstarted
        queued = (stats.num_waiting if stats is not None else 0) + in_transit
        if queued >= self.max_queued_requests:
            raise RateLimitError(
                f"too many queued requests ({queued}); retry later", code="queue_full"
            )

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run coro to completion even if the handler that started it is being cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("%s failed: %r", what, t.exception())

        task.add_done_callback(done)

    async def drain(self) -> None:
        """Let pending background work (aborts) finish; used on app cleanup."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        self.inputs.close()
