"""The fused Gumbel-max kernel draws the torch sampler's tokens, token for token."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.triton_sampling import gumbel_argmax  # noqa: E402
from services.executor.counter_rng import gumbel, position_key, sample_key  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_draw(logits, temperature, keys):
    """sampler._draw's plain path: divide, add the counter-based noise, argmax."""
    return (logits / temperature[:, None] + gumbel(keys, logits.shape[-1])).argmax(dim=-1)


@pytest.mark.parametrize("vocab", [7, 1024, 3001])
def test_draws_equal_the_torch_path(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::5, : vocab // 2] = float("-inf")  # masked tokens (grammar, min_tokens) never win
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    keys = torch.tensor([position_key(sample_key(seed, 0), 3) for seed in range(rows)])
    expected = _torch_draw(logits, temperature, keys)
    drawn = gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), keys.to(DEVICE)).cpu()
    assert torch.equal(drawn, expected)
    if vocab > 1:
        assert len(set(drawn.tolist())) > 1  # the noise does its work: rows differ


def test_a_flat_row_samples_every_token_by_its_key():
    # Equal logits: the draw is the noise's argmax alone, so different keys spread over the
    # vocabulary and equal keys agree.
    vocab, rows = 16, 256
    logits = torch.zeros(rows, vocab)
    temperature = torch.ones(rows)
    keys = torch.tensor([position_key(sample_key(7, 0), p) for p in range(rows)])
    drawn = gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), keys.to(DEVICE)).cpu()
    assert torch.equal(drawn, _torch_draw(logits, temperature, keys))
    assert set(drawn.tolist()) == set(range(vocab))
    again = gumbel_argmax(logits.to(DEVICE), temperature.to(DEVICE), keys.to(DEVICE)).cpu()
    assert torch.equal(drawn, again)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_on_a_gpu_draws_the_cpu_sampler_tokens():
    from services.executor.sampler import SamplingBatch, sample

    gen = torch.Generator().manual_seed(11)
    rows, vocab = 32, 5000
    logits = torch.randn(rows, vocab, generator=gen) * 2
    keys = torch.tensor([position_key(sample_key(s, 1), 9) for s in range(rows)])
    temperature = torch.rand(rows, generator=gen) + 0.2
    temperature[::4] = 0.0  # greedy rows in the same batch

    def batch(device):
        to = dict(device=device)
        return SamplingBatch(
            logits_rows=torch.arange(rows, **to),
            rows_identity=True,
            temperature=temperature.to(**to),
            top_k=torch.full((rows,), vocab, **to),
            max_top_k=1,
            top_p=torch.full((rows,), float("inf"), **to),
            min_p=torch.zeros(rows, **to),
            rng_keys=keys.to(**to),
            all_greedy=False,
            use_top_k=False,
            use_top_p=False,
            use_min_p=False,
            num_logprobs=-1,
        )

    on_cpu = sample(logits.clone(), batch("cpu")).token_ids
    on_gpu = sample(logits.cuda(), batch("cuda")).token_ids.cpu()
    assert torch.equal(on_gpu, on_cpu)
