"""The fused Gumbel-max kernel draws the torch sampler's tokens, token for token: plain draws
and draws under min-p, top-k and top-p (which the kernel filters by searching each row's
thresholds instead of sorting)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import triton_sampling  # noqa: E402
from kernels.triton_sampling import gumbel_argmax, warm_up_sampling  # noqa: E402
from services.executor.counter_rng import gumbel, position_key, sample_key  # noqa: E402
from services.executor.sampler import SamplingBatch, _draw, _top_k_top_p  # noqa: E402
from tests.support.triton_launches import record_launches  # noqa: E402

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


def _filtered_batch(rows: int, vocab: int, options: str, seed: int) -> SamplingBatch:
    """A batch whose rows mix the named filters (each on for some rows, off for others) with
    greedy rows and rows without any filter, as a served step's rows do."""
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    temperature[::6] = 0.0  # greedy rows in the same batch
    top_k = torch.full((rows,), vocab, dtype=torch.int64)
    top_p = torch.full((rows,), float("inf"))
    min_p = torch.zeros(rows)
    if "top_k" in options:
        top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
        top_k[::4] = vocab  # off
        top_k[1::5] = 1
    if "top_p" in options:
        top_p = torch.rand(rows, generator=gen) * 0.97 + 0.02
        top_p[2::4] = float("inf")  # off
    if "min_p" in options:
        min_p = torch.rand(rows, generator=gen) * 0.3
        min_p[3::4] = 0.0  # off
    return SamplingBatch(
        logits_rows=torch.arange(rows),
        rows_identity=True,
        temperature=temperature,
        top_k=top_k,
        max_top_k=int(top_k[top_k < vocab].max()) if (top_k < vocab).any() else 1,
        top_p=top_p,
        min_p=min_p,
        rng_keys=torch.tensor([position_key(sample_key(s, 0), 7) for s in range(rows)]),
        all_greedy=False,
        use_top_k="top_k" in options,
        use_top_p="top_p" in options,
        use_min_p="min_p" in options,
        num_logprobs=-1,
    )


@pytest.mark.parametrize(
    "vocab, scale, options",
    [
        (384, 3.0, "top_k"),  # the torch path's k-th value threshold, not its sort
        (384, 0.3, "top_p"),  # flat rows: nuclei of many tokens
        (384, 3.0, "min_p"),
        (1000, 2.0, "top_k+top_p+min_p"),  # several tiles per row
        (7, 3.0, "top_k+top_p"),
    ],
)
def test_filtered_draws_equal_the_torch_path(vocab, scale, options):
    rows = 24
    gen = torch.Generator().manual_seed(vocab + len(options))
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[::5, : vocab // 3] = float("-inf")  # masked tokens (grammar, min_tokens) never win
    batch = _filtered_batch(rows, vocab, options, seed=vocab)
    # The sort (top-p) or k-th value (top-k alone) path the GPU took before the kernel.
    expected, _ = _draw(logits.clone().to(DEVICE), batch_on(batch, DEVICE), vocab, fused=False)
    drawn, _ = _draw(logits.clone().to(DEVICE), batch_on(batch, DEVICE), vocab, fused=True)
    assert torch.equal(drawn.cpu(), expected.cpu())
    # The filters did their work: every draw is a token the sort path keeps, and some rows
    # drew otherwise than the unfiltered race would.
    scaled = logits / torch.where(batch.temperature == 0, 1.0, batch.temperature)[:, None]
    if batch.use_min_p:
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    kept = _top_k_top_p(scaled, batch.top_k, batch.top_p).isfinite()
    assert kept.gather(1, drawn.cpu()[:, None]).all()
    unfiltered = gumbel_argmax(
        logits.to(DEVICE), torch.where(batch.temperature == 0, 1.0, batch.temperature).to(DEVICE),
        batch.rng_keys.to(DEVICE),
    ).cpu()  # fmt: skip
    sampled = batch.temperature > 0
    assert (drawn.cpu()[sampled] != unfiltered[sampled]).any()


def batch_on(batch: SamplingBatch, device: str) -> SamplingBatch:
    from dataclasses import fields, replace

    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, **moved)


def test_top_k_of_one_and_a_tiny_top_p_draw_the_argmax():
    # Both keep only each row's largest logit: the draw is the argmax whatever the noise.
    rows, vocab = 16, 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE)
    ones = torch.ones(rows, device=DEVICE)
    keys = torch.tensor([position_key(sample_key(s, 0), 1) for s in range(rows)]).to(DEVICE)
    argmax = logits.argmax(dim=-1)
    k1 = torch.ones(rows, dtype=torch.int64, device=DEVICE)
    assert torch.equal(gumbel_argmax(logits, ones * 2, keys, top_k=k1), argmax)
    assert torch.equal(gumbel_argmax(logits, ones * 2, keys, top_p=ones * 1e-6), argmax)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN arithmetic, on purpose
def test_rows_that_are_not_numbers_end_their_searches():
    # A broken model's NaN row or a row every mask removed: the searches stop within their
    # pass cap and every row gets an id in the vocabulary (on a GPU a stuck program would
    # hang the executor).
    rows, vocab = 4, 100
    logits = torch.randn(rows, vocab)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, 5] = float("nan")
    ones = torch.ones(rows)
    top_k = torch.full((rows,), 10, dtype=torch.int64)
    keys = torch.arange(rows, dtype=torch.int64)
    on = {k: v.to(DEVICE) for k, v in dict(top_k=top_k, top_p=ones * 0.5, min_p=ones * 0.1).items()}
    drawn = gumbel_argmax(logits.to(DEVICE), ones.to(DEVICE), keys.to(DEVICE), **on).cpu()
    assert ((drawn >= 0) & (drawn < vocab)).all()


def test_an_engine_with_the_fused_sampler_draws_the_torch_samplers_tokens(
    tiny_model_dir, monkeypatch
):
    # The whole path a GPU step takes to the kernel (the sampling layout's aligned per-row
    # tensors, the batch's filter flags, greedy rows among drawing ones), on the CPU: the same
    # requests with the sampler's torch path and with every draw through the kernel.
    from services.engine.llm_engine import LLMEngine
    from services.executor import sampler
    from shared.sampling import SamplingParams
    from tests.factories import engine_config, random_prompts

    prompts = random_prompts([5, 9, 3, 7, 4, 6], 384, seed=2)
    common = dict(max_tokens=5, ignore_eos=True)
    # Narrow filters: the tiny random model's logits are nearly flat, so wide ones would
    # rarely change a draw.
    params = [
        SamplingParams(temperature=0.8, top_p=0.2, seed=1, **common),
        SamplingParams(temperature=1.0, top_k=3, seed=2, **common),
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.3, min_p=0.9, seed=3, **common),
        SamplingParams(temperature=1.0, seed=4, **common),  # unfiltered beside filtered rows
        SamplingParams(temperature=0.5, min_p=0.5, top_k=5, top_p=0.6, seed=5, **common),
    ]

    def run(params) -> list[list[int]]:
        engine = LLMEngine(engine_config(tiny_model_dir))
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]

    through_torch = run(params)
    unfiltered = [SamplingParams(temperature=p.temperature, seed=p.seed, **common) for p in params]
    # The filters decide draws here: each filtered request draws otherwise without them.
    without = run(unfiltered)
    assert [without[i] != through_torch[i] for i in (0, 1, 3, 5)] == [True] * 4
    draws = []
    draw = sampler._draw

    def fused(logits, batch, vocab, fused=None):
        draws.append(logits.shape[0])
        return draw(logits, batch, vocab, fused=True)

    monkeypatch.setattr(sampler, "_draw", fused)
    assert run(params) == through_torch
    assert draws and max(draws) == len(prompts)  # the kernel drew for the whole batch


def test_warm_up_compiles_both_variants(monkeypatch):
    chosen = record_launches(
        monkeypatch, triton_sampling, "_gumbel_argmax_kernel", "FILTERS", "BLOCK"
    )
    assert warm_up_sampling(500, torch.device(DEVICE)) == [False, True]
    # The served draws of that vocabulary then use the variants compiled here.
    logits = torch.zeros(3, 500, device=DEVICE)
    ones = torch.ones(3, device=DEVICE)
    keys = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    gumbel_argmax(logits, ones, keys)
    gumbel_argmax(logits, ones, keys, top_p=ones * 0.9)
    assert chosen[2:] == chosen[:2] and {f for f, _ in chosen} == {False, True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", ["", "top_k", "top_p", "top_k+top_p+min_p"])
def test_the_sampler_on_a_gpu_draws_the_cpu_sampler_tokens(options):
    from services.executor.sampler import sample

    rows, vocab = 32, 5000
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    batch = _filtered_batch(rows, vocab, options, seed=5)
    # The CPU sampler: the sort, the k-th value or (every drawing row filtered) candidates.
    on_cpu = sample(logits.clone(), batch).token_ids
    on_gpu = sample(logits.cuda(), batch_on(batch, "cuda")).token_ids.cpu()
    assert torch.equal(on_gpu, on_cpu)
