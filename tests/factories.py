"""Small seeded objects for tests: tiny random Llama checkpoints, engines, prompts."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from services.bench.random_models import CHATML_TEMPLATE, make_tiny_llama, make_tiny_tokenizer
from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

# The checkpoint builders live in the package, where the benchmark scripts find them too.
__all__ = [
    "CHATML_TEMPLATE",
    "engine_config",
    "make_tiny_llama",
    "make_tiny_tokenizer",
    "random_prompts",
]


def engine_config(
    model_dir: Path,
    block_size: int = 16,
    num_device_blocks: int | None = 256,
    num_cpu_blocks: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 256,
    enable_chunked_prefill: bool = True,
    preemption_mode: str = "recompute",
    dtype: str = "float32",
    attention_backend: str = "torch",
    enable_prefix_caching: bool = True,
) -> EngineConfig:
    from services.executor.weights import load_hf_config

    hf = load_hf_config(model_dir)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    bytes_per_block = (
        hf.num_hidden_layers * 2 * block_size * hf.num_key_value_heads * head_dim * element
    )
    swap_blocks = num_cpu_blocks if num_cpu_blocks is not None else num_device_blocks or 0
    return EngineConfig(
        # Tests run on the CPU even where a GPU exists: transformers, the reference, runs there.
        model=ModelConfig(
            model=str(model_dir), dtype=dtype, device="cpu", attention_backend=attention_backend
        ),
        cache=CacheConfig(
            block_size=block_size,
            num_device_blocks=num_device_blocks,
            swap_space_bytes=swap_blocks * bytes_per_block,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode,
            enable_prefix_caching=enable_prefix_caching,
        ),
    )


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths over token ids 3.. (0-2 are pad, bos and eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]
