"""What the batched sampler must draw, written out plainly one row and one token at a time."""

from __future__ import annotations

import math

import torch

from services.executor.counter_rng import uniform_reference
from shared.sampling import SamplingParams

VOCAB = 40
EOS = (2,)


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def reference_draw(
    logits: torch.Tensor,  # [vocab] one row
    p: SamplingParams,
    key: int,
    prompt: list[int],
    outputs: list[int],
) -> int:
    """The same draw, written out plainly one token at a time."""
    vocab = logits.shape[0]
    values = [float(v) for v in logits]
    for token, bias in p.logit_bias:
        values[token] += bias
    if len(outputs) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            values[token] = -math.inf
    for token in range(vocab):
        count = outputs.count(token)
        if token in prompt or count:
            r = p.repetition_penalty
            values[token] = values[token] / r if values[token] > 0 else values[token] * r
        values[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if p.greedy:
        return max(range(vocab), key=lambda t: values[t])
    values = [v / p.temperature for v in values]
    if p.min_p > 0:
        best = max(values)
        values = [v if v >= best + math.log(p.min_p) else -math.inf for v in values]
    order = sorted(range(vocab), key=lambda t: -values[t])
    if 0 < p.top_k < vocab:
        for t in order[p.top_k :]:
            values[t] = -math.inf
    if p.top_p < 1.0:
        finite = [values[t] for t in order if values[t] > -math.inf]
        top = max(finite)
        weights = [math.exp(v - top) for v in finite]
        total = sum(weights)
        mass = 0.0
        for rank, t in enumerate(order):
            if rank < len(weights):
                if mass > p.top_p:
                    values[t] = -math.inf
                mass += weights[rank] / total
    noise = [-math.log(-math.log(uniform_reference(key, t))) for t in range(vocab)]
    scores = [values[t] + noise[t] if values[t] > -math.inf else -1e30 for t in range(vocab)]
    return max(range(vocab), key=lambda t: scores[t])
