"""Small seeded objects for tests: tiny random Llama checkpoints, engines, prompts."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def make_tiny_llama(
    path: Path,
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 512,
    tie_word_embeddings: bool = False,
) -> Path:
    """A seeded random Llama with GQA saved as a local HF checkpoint; returns its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        # A wide init spreads the logits, so greedy choices are not decided by rounding noise.
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    make_tiny_tokenizer(vocab_size).save_pretrained(path)
    return path


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE trained on a fixed corpus: ids 0-2 are pad, <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = "the capital of france is paris memory block page token cache model serve batch"
    words = words.split()
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)]
    corpus += [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(80)) for _ in range(200)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


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
    head_dim = hf.hidden_size // hf.num_attention_heads
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
