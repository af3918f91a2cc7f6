"""Seeded synthetic request traces (ShareGPT-like, Alpaca-like, shared-prefix), Poisson arrivals,
and a loader for a ShareGPT JSON file the user has."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# vLLM's benchmark sampler drops (it does not truncate) pairs outside these bounds.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
FIRST_TOKEN_ID = 3  # ids below are special in the models we serve (pad, bos, eos)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace starts
    prompt_token_ids: tuple[int, ...]
    output_len: int  # served with max_tokens = output_len and ignore_eos: the true length

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthModel:
    """Lognormal prompt and output lengths whose means, after vLLM's filter, hit the targets."""

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float  # of log length; heavy tails come from here
    output_sigma: float


# Target means are the paper's (Fig. 11: ShareGPT 161.3 in / 338.0 out, Alpaca 19.3 / 58.5);
# the sigmas are our choice of tail, not fitted to the datasets.
SHAREGPT = LengthModel("sharegpt", 161.0, 338.0, 1.0, 1.0)
ALPACA = LengthModel("alpaca", 19.0, 58.0, 0.6, 0.8)
LENGTH_MODELS = {m.name: m for m in (SHAREGPT, ALPACA)}


def keep(prompt_len: int, output_len: int) -> bool:
    return (
        prompt_len >= MIN_LEN
        and output_len >= MIN_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


def _draw(mu: tuple[float, float], model: LengthModel, z: np.ndarray) -> tuple[np.ndarray, ...]:
    """Lengths from standard normals z [n, 2], filtered as vLLM does: (prompt_lens, output_lens)."""
    p = np.rint(np.exp(mu[0] + model.prompt_sigma * z[:, 0])).astype(np.int64)
    o = np.rint(np.exp(mu[1] + model.output_sigma * z[:, 1])).astype(np.int64)
    ok = (p >= MIN_LEN) & (o >= MIN_LEN) & (p <= MAX_PROMPT_LEN) & (p + o <= MAX_TOTAL_LEN)
    return p[ok], o[ok]


@functools.cache
def calibrated_mu(model: LengthModel) -> tuple[float, float]:
    """Log-scale locations whose filtered sample means equal the targets (fixed-point, fixed seed).

    The filter cuts the upper tail, so the raw lognormal means must sit above the targets.
    """
    z = np.random.default_rng(12345).standard_normal((200_000, 2))
    mu = (math.log(model.prompt_mean), math.log(model.output_mean))
    for _ in range(40):
        p, o = _draw(mu, model, z)
        mu = (
            mu[0] + math.log(model.prompt_mean / p.mean()),
            mu[1] + math.log(model.output_mean / o.mean()),
        )
    return mu


def poisson_arrivals(num_requests: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` requests/s; rate inf: all at time 0."""
    if math.isinf(rate):
        return np.zeros(num_requests)
    return np.cumsum(rng.exponential(1.0 / rate, num_requests))


def synthetic_trace(
    model: LengthModel | str, num_requests: int, rate: float, seed: int, vocab_size: int
) -> list[TraceRequest]:
    """num_requests requests with lognormal lengths and Poisson arrivals, all from `seed`."""
    model = LENGTH_MODELS[model] if isinstance(model, str) else model
    rng = np.random.default_rng(seed)
    mu = calibrated_mu(model)
    prompt_lens: list[int] = []
    output_lens: list[int] = []
    while len(prompt_lens) < num_requests:
        p, o = _draw(mu, model, rng.standard_normal((2 * num_requests + 16, 2)))
        prompt_lens += p.tolist()
        output_lens += o.tolist()
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return [
        TraceRequest(
            float(arrivals[i]),
            tuple(rng.integers(FIRST_TOKEN_ID, vocab_size, prompt_lens[i]).tolist()),
            output_lens[i],
        )
        for i in range(num_requests)
    ]


# The paper's shared-prefix workload (WMT16 En->De with few-shot examples): a 1-shot prefix of
# ~80 tokens or a 5-shot prefix of ~341 shared by every request, then the sentence to translate.
SHARED_PREFIX_LENS = {1: 80, 5: 341}
SENTENCE_MEAN = 30.0  # tokens of sentence and of translation: our assumption, not the dataset's


def shared_prefix_trace(
    num_shots: int, num_requests: int, rate: float, seed: int, vocab_size: int
) -> list[TraceRequest]:
    return prefixed_trace(SHARED_PREFIX_LENS[num_shots], num_requests, rate, seed, vocab_size)


def prefixed_trace(
    prefix_len: int, num_requests: int, rate: float, seed: int, vocab_size: int
) -> list[TraceRequest]:
    """Requests that all start with one seeded prefix of prefix_len tokens (few-shot examples,
    a system prompt), then a sentence and a translation of lognormal lengths."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(FIRST_TOKEN_ID, vocab_size, prefix_len).tolist()
    sigma = 0.5
    mu = math.log(SENTENCE_MEAN) - sigma**2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    lens = np.maximum(MIN_LEN, np.rint(np.exp(mu + sigma * rng.standard_normal((num_requests, 2)))))
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return [
        TraceRequest(
            float(arrivals[i]),
            tuple(prefix + rng.integers(FIRST_TOKEN_ID, vocab_size, int(lens[i, 0])).tolist()),
            int(lens[i, 1]),
        )
        for i in range(num_requests)
    ]


def load_sharegpt(
    path: str | Path, tokenizer, num_requests: int, rate: float, seed: int
) -> list[TraceRequest]:
    """Sample conversations from a ShareGPT JSON file as vLLM's benchmark does: the first turn is
    the prompt, the second's token count the output length, pairs outside the bounds dropped."""
    with open(path) as f:
        data = json.load(f)
    pairs = [
        (d["conversations"][0]["value"], d["conversations"][1]["value"])
        for d in data
        if len(d.get("conversations", [])) >= 2
    ]
    rng = np.random.default_rng(seed)
    kept: list[tuple[list[int], int]] = []
    for index in rng.permutation(len(pairs)):
        prompt, completion = pairs[index]
        prompt_ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(completion))
        if keep(len(prompt_ids), output_len):
            kept.append((prompt_ids, output_len))
            if len(kept) == num_requests:
                break
    arrivals = poisson_arrivals(len(kept), rate, rng)
    return [TraceRequest(float(t), tuple(p), o) for t, (p, o) in zip(arrivals, kept)]


def scale_trace(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same trace with every length times `factor` (at least MIN_LEN): paper-shaped
    workloads small enough for a CPU. Bounds scale with it."""
    if factor == 1.0:
        return trace
    out = []
    for r in trace:
        prompt_len = max(MIN_LEN, round(r.prompt_len * factor))
        out.append(
            TraceRequest(
                r.arrival_s,
                r.prompt_token_ids[:prompt_len],
                max(MIN_LEN, round(r.output_len * factor)),
            )
        )
    return out


def trace_stats(trace: list[TraceRequest]) -> dict[str, float]:
    prompt = np.array([r.prompt_len for r in trace])
    output = np.array([r.output_len for r in trace])
    return {
        "num_requests": len(trace),
        "mean_prompt_len": float(prompt.mean()),
        "mean_output_len": float(output.mean()),
        "max_prompt_len": int(prompt.max()),
        "max_total_len": int((prompt + output).max()),
        "duration_s": trace[-1].arrival_s if trace else 0.0,
    }
