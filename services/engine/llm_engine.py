"""The in-process engine: the scheduler and the executor in one process, one step at a time.

Tests, benchmarks and `pagedserve generate` use it; the service runs the same two classes in
separate processes and passes the same plan and result records between them.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.executor.executor import Executor
from services.scheduler.scheduler import GroupUpdate, Scheduler
from services.scheduler.sequence import SequenceGroup
from services.scheduler.step_loop import StepLoop
from shared.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.model_source import resolve_model
from shared.protocol import CompileGrammar, GrammarCompiled, SampledToken, StepPlan
from shared.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampledToken] | None = None
    cumulative_logprob: float | None = None  # set when the tokens' logprobs were drawn


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    @classmethod
    def from_group(cls, group: SequenceGroup) -> RequestOutput:
        want_logprobs = group.sampling.logprobs is not None
        outputs = [
            CompletionOutput(
                index,
                seq.output_token_ids,
                seq.finish_reason,
                list(seq.logprobs) if want_logprobs else None,
                seq.cumulative_logprob if group.sampling.wants_logprob else None,
            )
            for index, seq in sorted(group.reported_seqs(), key=lambda pair: pair[0])
        ]
        return cls(group.request_id, group.prompt_token_ids, outputs, group.is_finished)


@dataclass
class StepStats:
    """Seconds spent per phase, summed over steps, plus counters."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    num_steps: int = 0
    num_batched_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, overlap_steps: bool | None = None) -> None:
        """overlap_steps: async scheduling in one process: plan step N+1 and launch it behind
        step N before N's samples reach the host, then apply N's result. On a GPU the device
        then runs N+1 while the host turns N's samples into tokens and plans N+2; on a CPU,
        where a launch computes the whole step, it gains nothing (and reports each step's
        tokens one step late on a replay's clock), but tests cover that ordering with it.
        None (the default): on where it pays, a CUDA executor, unless the config turns async
        scheduling off."""
        self.config = config
        self._ahead: tuple[StepPlan, Any] | None = None  # planned and launched, not applied
        if config.executor == "sim":
            from services.executor.sim import SimExecutor

            self.model_dir = None  # no model: no weights, no tokenizer
            self.executor = SimExecutor(config)
        else:
            self.model_dir = resolve_model(config.model.model)
            self.executor = Executor(config, self.model_dir)
        if overlap_steps is None:
            device = getattr(self.executor, "device", None)  # the simulator has none
            overlap_steps = device is not None and device.type == "cuda"
        self.overlap_steps = overlap_steps and config.scheduler.async_scheduling
        self.scheduler = Scheduler(config.scheduler, self.executor.ready(), config.grammar)
        self.loop = StepLoop(self.scheduler)
        self.stats = StepStats()
        self.last_step_num_seqs = 0
        self._ids = itertools.count()
        self._tokenizer = None

    def close(self) -> None:
        """Stop the executor's other tensor-parallel ranks, if any (idempotent)."""
        self.executor.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        """Loaded on first use: token-id-only callers (tests, benchmarks) never pay for it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        return self._tokenizer

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; raises InvalidRequestError (and changes nothing) when it is bad."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add_request(request_id, prompt_token_ids, sampling)
        # In one process nobody else waits: compile now, before the request can be scheduled,
        # through the executor's grammar store (the served stack compiles off its step loop).
        for request in self.scheduler.take_compile_requests():
            answer = self._compile_grammar(request)
            update = self.scheduler.grammar_compiled(answer.key, answer.error)
            if update is not None:
                raise InvalidRequestError(update.error["message"], param="guided")
        return request_id

    def _compile_grammar(self, request: CompileGrammar) -> GrammarCompiled:
        compile_now = getattr(self.executor, "compile_grammar_now", None)
        if compile_now is None:  # the simulator samples no grammar
            return GrammarCompiled(request.key)
        return compile_now(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        update = self.scheduler.abort(request_id)
        return RequestOutput.from_group(update.group) if update else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._ahead is not None

    def step(self) -> list[GroupUpdate]:
        t1 = time.perf_counter()
        if self._ahead is not None:
            (plan, flight), self._ahead = self._ahead, None
        else:
            plan = self.loop.plan()
            flight = self.executor.launch(plan)
        if self.overlap_steps:
            ahead = self.loop.plan_ahead()
            if ahead is not None:  # queued behind `plan` before its samples are read
                self._ahead = (ahead, self.executor.launch(ahead))
        result = self.executor.collect(flight)
        t2 = time.perf_counter()
        self.last_step_num_seqs = len(plan.seqs)  # the batch the step ran (for benchmarks)
        updates = self.loop.finish(plan, result)
        seconds = self.stats.seconds
        seconds["schedule"] += self.loop.schedule_s
        seconds["execute"] += t2 - t1
        for phase, value in result.timings.items():
            seconds[phase] += value
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += plan.num_tokens
        return updates

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        on_step: Callable[[LLMEngine], None] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        while self.has_unfinished():
            for update in self.step():
                if update.finished:
                    results[update.group.request_id] = RequestOutput.from_group(update.group)
                    if bar is not None:
                        bar.update(1)
            if on_step is not None:
                on_step(self)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]
