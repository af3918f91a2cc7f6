"""The in-process engine: the scheduler and the executor in one process, one step at a time.

Tests, benchmarks and `pagedserve generate` use it. It is a thin driver of the engine core
(`services/scheduler/engine_core.py`) over the executor object itself; the scheduler service
drives the same core over the executor process, so both run the same step loop.
"""

from __future__ import annotations

import gc
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.executor.factory import make_executor
from services.scheduler.engine_core import EngineCore, run_now
from services.scheduler.local_executor import LocalExecutor
from services.scheduler.outputs import RequestOutput
from services.scheduler.scheduler import GroupUpdate, Scheduler
from shared.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.heap import freeze_startup_heap
from shared.protocol import CompileGrammar, GrammarCompiled
from shared.sampling import SamplingParams


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
        executor = make_executor(config)
        self.model_dir = getattr(executor, "model_dir", None)  # the simulator has no model
        if overlap_steps is None:
            device = getattr(executor, "device", None)  # the simulator has none
            overlap_steps = device is not None and device.type == "cuda"
        self.overlap_steps = overlap_steps and config.scheduler.async_scheduling
        self.scheduler = Scheduler(
            config.scheduler, executor.ready(), config.grammar, config.speculative
        )
        self._local = LocalExecutor(executor)
        self.core = EngineCore(self.scheduler, self._local, self.overlap_steps)
        self.stats = StepStats()
        self.last_step_num_seqs = 0
        self._ids = itertools.count()
        self._tokenizer = None
        # As the services do once started: the collector's full passes otherwise walk every
        # import, module and tensor wrapper at each pass (pauses of 0.1 s and more at 256
        # running sequences on the simulated executor; docs/benchmarks.md).
        freeze_startup_heap()

    @property
    def executor(self) -> Any:
        """The executor object the core drives (Executor, or SimExecutor)."""
        return self._local.executor

    @executor.setter
    def executor(self, executor: Any) -> None:
        # A replacement for a dead executor (as the service's restart does): steps in flight
        # died with the old one; the caller requeues the scheduler onto the new one.
        self.core.forget()
        self._local.executor = executor

    def close(self) -> None:
        """Stop the executor's other tensor-parallel ranks, if any (idempotent), and hand the
        frozen heap back to the collector: what this engine leaves in reference cycles would
        otherwise outlive it (a process that builds engine after engine, as tests do)."""
        self.executor.close()
        gc.unfreeze()

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
        return self.core.has_unfinished()

    def step(self) -> list[GroupUpdate]:
        outcome = run_now(self.core.step())
        plan, result = outcome.plan, outcome.result
        self.last_step_num_seqs = len(plan.seqs)  # the batch the step ran (for benchmarks)
        seconds = self.stats.seconds
        seconds["schedule"] += self.core.schedule_s
        seconds["execute"] += outcome.collected_at - outcome.started_at
        for phase, value in result.timings.items():
            seconds[phase] += value
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += plan.num_tokens
        return outcome.updates

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
