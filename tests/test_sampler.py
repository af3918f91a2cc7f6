"""The sampler: greedy, temperature, top-k, top-p, seeded generators, logprobs."""

from __future__ import annotations

import torch

from services.executor.sampler import SampleRow, sample, sequence_generator
from shared.sampling import SamplingParams


def _rows(params: SamplingParams, num_rows: int, index: int = 0) -> list[SampleRow]:
    return [
        SampleRow(i, 100 + i, params, sequence_generator(params, index)) for i in range(num_rows)
    ]


def _logits(num_rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_takes_the_argmax():
    logits = _logits()
    tokens = sample(logits, _rows(SamplingParams(temperature=0.0), 4), torch.Generator())
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    assert [t.seq_id for t in tokens] == [100, 101, 102, 103]


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    logits = _logits()
    for params in (SamplingParams(top_k=1, seed=3), SamplingParams(top_p=1e-6, seed=3)):
        tokens = sample(logits, _rows(params, 4), torch.Generator())
        assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = _logits(num_rows=1, vocab=20)
    order = logits[0].argsort(descending=True).tolist()
    shared = torch.Generator().manual_seed(0)
    rows = [SampleRow(0, i, SamplingParams(top_k=3), None) for i in range(400)]
    drawn = {t.token_id for t in sample(logits, rows, shared)}
    assert drawn == set(order[:3])
    probs = logits[0].softmax(-1)[order]
    keep = int((probs.cumsum(0) - probs < 0.5).sum())  # the nucleus holding half the mass
    rows = [SampleRow(0, i, SamplingParams(top_p=0.5), None) for i in range(400)]
    drawn = {t.token_id for t in sample(logits, rows, shared)}
    assert drawn == set(order[:keep])


def test_sampling_follows_the_temperature_scaled_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    params = SamplingParams(temperature=2.0)
    rows = [SampleRow(0, i, params, None) for i in range(20000)]
    tokens = torch.tensor(
        [t.token_id for t in sample(logits, rows, torch.Generator().manual_seed(1))]
    )
    freq = torch.bincount(tokens, minlength=4).double() / len(rows)
    expected = (logits[0] / 2.0).softmax(-1).double()
    assert torch.allclose(freq, expected, atol=0.015)


def test_same_seed_same_tokens_and_samples_differ_by_index():
    logits = _logits(num_rows=1, vocab=1000)
    params = SamplingParams(seed=1234)

    def draw(index: int) -> list[int]:
        gen = sequence_generator(params, index)
        rows = [SampleRow(0, 0, params, gen)]
        return [sample(logits, rows, torch.Generator())[0].token_id for _ in range(20)]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)  # the n parallel samples of one seeded request are distinct streams
    assert sequence_generator(SamplingParams(), 0) is None


def test_logprobs_are_the_models_log_softmax():
    logits = _logits(num_rows=2, vocab=30)
    params = SamplingParams(temperature=0.7, seed=5, logprobs=3)
    tokens = sample(logits, _rows(params, 2), torch.Generator())
    reference = torch.log_softmax(logits, dim=-1)
    for row, token in enumerate(tokens):
        assert abs(token.logprob - reference[row, token.token_id].item()) < 1e-5
        top_ids = [i for i, _ in token.top_logprobs]
        assert top_ids == reference[row].topk(3).indices.tolist()
        values = [v for _, v in token.top_logprobs]
        assert values == sorted(values, reverse=True)
    without = sample(logits, _rows(SamplingParams(temperature=0.0), 2), torch.Generator())
    assert without[0].logprob is None and without[0].top_logprobs == []


def test_tiny_temperature_is_greedy_and_huge_top_k_keeps_everything():
    logits = _logits()
    rows = _rows(SamplingParams(temperature=1e-40, seed=1), 4)
    assert [t.token_id for t in sample(logits, rows, torch.Generator())] == logits.argmax(
        -1
    ).tolist()
    mixed = [SampleRow(0, 0, SamplingParams(top_k=2**31 - 1, seed=2), None)]
    mixed.append(SampleRow(1, 1, SamplingParams(top_k=1, seed=2), None))
    tokens = sample(logits[:2], mixed, torch.Generator().manual_seed(0))
    assert tokens[1].token_id == logits[1].argmax().item()
