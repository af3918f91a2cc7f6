"""Seeded random-weight Llama checkpoints built on this machine (nothing downloaded): named shapes
for benchmarks, tiny ones with their own small tokenizer for tests and smoke runs."""

from __future__ import annotations

import random
from pathlib import Path

import torch

SHAPES = {
    # TinyLlama-1.1B's shape with SmolLM2's vocabulary.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, vocab_size=49152,
               max_position_embeddings=2048, rope_theta=10000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                 max_position_embeddings=2048, rope_theta=10000.0),
}  # fmt: skip


def add_random_run_args(parser, output_len: int, kv_cache_gb: float) -> None:
    """The flags of a run of `num_requests` random prompts on a random model of a SHAPES entry
    (the GPU benchmarks share them)."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--kv-cache-gb", type=float, default=kv_cache_gb)


def build_model(shape: str, device: str, dtype: torch.dtype, tokenizer: Path, out: Path) -> Path:
    """A random Llama of a SHAPES entry, made on `device`, saved to `out` with the tokenizer
    found at `tokenizer`; returns `out`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


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
