"""The executor: owns the model, the KV pools and per-sequence sampling state; runs one plan a step.

It decides nothing about blocks: every block id, copy and swap comes from the plan.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.ops import select_ops
from services.executor.input_batch import build_inputs
from services.executor.kv_cache import KVCache
from services.executor.sampler import SampleRow, sample, sequence_generator
from services.executor.weights import load_hf_config, load_model
from shared.config import EngineConfig
from shared.protocol import ExecutorReady, StepPlan, StepResult
from shared.sampling import SamplingParams

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass
class _SeqState:
    params: SamplingParams
    generator: torch.Generator | None
    block_table: list[int]


class Executor:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        self.device = _device(config.model.device)
        self.ops = select_ops(config.model.attention_backend, self.device)
        block_size = config.cache.block_size
        if self.ops.name == "triton" and block_size & (block_size - 1):
            raise ValueError(f"the triton kernels need a power-of-two block size, got {block_size}")
        hf_config = load_hf_config(model_dir)
        self.max_model_len = _max_model_len(hf_config, config.model.max_model_len)
        dtype = DTYPES[config.model.dtype]
        self.model = load_model(model_dir, dtype, self.max_model_len, self.ops, self.device)
        self.cache = KVCache(self.model.spec, config.cache, dtype, self.device, self.ops)
        self.eos_token_ids = _eos_token_ids(model_dir, hf_config)
        self.shared_generator = torch.Generator().manual_seed(config.model.seed)
        self.seqs: dict[int, _SeqState] = {}

    def ready(self) -> ExecutorReady:
        return ExecutorReady(
            num_device_blocks=self.cache.num_device_blocks,
            num_cpu_blocks=self.cache.num_cpu_blocks,
            block_size=self.cache.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model.spec.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan; a failure becomes StepResult.error so its requests end, not hang."""
        try:
            return self._execute(plan)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which ends requests
            traceback.print_exc()
            return StepResult(plan.step_id, [], error=f"{type(exc).__name__}: {exc}")

    def _execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for seq_id in plan.freed_seq_ids:
            self.seqs.pop(seq_id, None)
        self.cache.apply(plan.swap_out, plan.swap_in, plan.copies)
        for seq in plan.seqs:
            state = self.seqs.get(seq.seq_id)
            if state is None:
                if seq.sampling is None:
                    raise ValueError(
                        f"plan schedules unknown sequence {seq.seq_id} without sampling"
                    )
                state = _SeqState(seq.sampling, sequence_generator(seq.sampling, 0), [])
                self.seqs[seq.seq_id] = state
            if seq.replace_table:
                state.block_table = list(seq.block_ids)
            else:
                state.block_table.extend(seq.block_ids)
        if not plan.seqs:
            return StepResult(plan.step_id, [], {"cache_ops": time.perf_counter() - t0})

        t1 = time.perf_counter()
        inputs = build_inputs(
            plan.seqs,
            [self.seqs[s.seq_id].block_table for s in plan.seqs],
            self.cache.block_size,
            self.device,
            reference_views=self.ops.name == "torch",
        )
        t2 = time.perf_counter()
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.cache.device, inputs.attention
            )
            # Sampling runs on the CPU with per-request CPU generators (seed reproducibility).
            logits = self.model.compute_logits(hidden[inputs.logits_rows]).cpu()
        t3 = time.perf_counter()
        rows = []
        sampling_seqs = [seq for seq in plan.seqs if seq.sample]
        for row, seq in enumerate(sampling_seqs):
            state = self.seqs[seq.seq_id]
            rows.append(SampleRow(row, seq.seq_id, state.params, state.generator))
            for index, child_id in enumerate(seq.fork_seq_ids, start=1):
                child = _SeqState(state.params, sequence_generator(state.params, index), [])
                self.seqs[child_id] = child
                rows.append(SampleRow(row, child_id, child.params, child.generator))
        tokens = sample(logits, rows, self.shared_generator) if rows else []
        t4 = time.perf_counter()
        timings = {"cache_ops": t1 - t0, "prepare": t2 - t1, "forward": t3 - t2, "sample": t4 - t3}
        return StepResult(plan.step_id, tokens, timings)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def _max_model_len(hf_config, requested: int | None) -> int:
    limit = hf_config.max_position_embeddings
    # Mistral-style sliding windows are not implemented: stay within the window, where full
    # attention and windowed attention agree.
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit}")
    return requested or limit


def _eos_token_ids(model_dir: Path, hf_config) -> tuple[int, ...]:
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))
