"""Quantized CPU layers against fp32, GGUF block repacking, and the quantized engine end to end.

Tolerances: int8 (per-channel weights, per-row activations) stays within 2% relative Frobenius
error of the fp32 linear on random data; int4 from fp32 within 8% (16 levels per group of 32);
int4 repacked from Q4_1 blocks reproduces the blocks' own weights to fp32 rounding (1e-6).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.executor.gguf_blocks import read_q4_1, read_q8_0
from services.executor.quantized import (
    FBGEMM_MAX_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    exact_decode_kernel,
)
from tests.factories import engine_config
from tests.support.reference_model import MAX_NEW_TOKENS


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def random_layer(out_features: int = 96, in_features: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen)
    return weight, bias


@pytest.mark.parametrize("rows", [1, 16, 17, 300])
def test_int8_linear_is_within_two_percent_of_fp32(rows):
    weight, bias = random_layer()
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    assert relative_error(Int8Linear(weight, bias)(x), F.linear(x, weight, bias)) < 0.02


@pytest.mark.parametrize("decode_kernel", [False, True])
def test_int8_linear_gives_a_row_the_same_result_whatever_the_other_rows(decode_kernel):
    # Activation scales are per row: another request in the batch cannot change a token's result.
    weight, bias = random_layer()
    layer = Int8Linear(weight, bias, decode_kernel)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    other = x.clone()
    other[7] *= 100  # an outlier row
    assert torch.equal(layer(x)[3], layer(other)[3])
    assert torch.equal(layer(x[:2])[1], layer(other[[7, 1]])[1])
    # Every row count up to the fbgemm limit (its guard row keeps one range per call), and
    # beyond it, where _int_mm takes over.
    many = torch.randn(FBGEMM_MAX_ROWS + 8, 128, generator=torch.Generator().manual_seed(2))
    assert all(
        torch.equal(layer(many[:rows])[0], layer(many[:2])[0])
        for rows in range(2, FBGEMM_MAX_ROWS + 1)
    )
    if not (decode_kernel and exact_decode_kernel()):
        assert torch.equal(layer(x[3:4]), layer(x)[3:4])  # one kernel for every call
        assert torch.equal(layer(many)[0], layer(many[:2])[0])


@pytest.mark.skipif(not exact_decode_kernel(), reason="fbgemm does not sum exactly here (no VNNI)")
def test_a_one_row_int8_call_takes_fbgemm_within_two_percent_of_fp32():
    weight, bias = random_layer()
    layer = Int8Linear(weight, bias)
    assert layer.few_rows is not None and layer.packed_bytes == 96 * 128
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    assert relative_error(out, F.linear(x, weight, bias)) < 0.02
    # Not _int_mm's result: the one-row kernel quantizes the activations its own way.
    plain = Int8Linear(weight, bias, decode_kernel=False)
    assert not torch.equal(out, plain(x))


@pytest.mark.skipif(not exact_decode_kernel(), reason="fbgemm does not sum exactly here (no VNNI)")
def test_several_rows_through_fbgemm_take_the_int8_paths_levels():
    # The guard row sets scale 1/127 and zero point 128: each row's levels are _int_mm's, so the
    # sums are the same and only the dequantization's float rounding may differ.
    weight, bias = random_layer()
    layer, plain = Int8Linear(weight, bias), Int8Linear(weight, bias, decode_kernel=False)
    x = torch.randn(FBGEMM_MAX_ROWS, 128, generator=torch.Generator().manual_seed(4))
    x[5] *= 1000  # rows of very different scales
    x[6] = 0.0  # and a row of zeros
    out, ref = layer(x), plain(x)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(out[6], plain.bias)  # zeros times the weights: the bias alone
    beyond = torch.cat([x, x[:1]])  # one row over the limit: _int_mm itself
    assert torch.equal(layer(beyond), plain(beyond))


def test_several_rows_in_and_out_of_inference_mode():
    # The guard buffer made inside inference mode (as the executor calls) must stay writable
    # outside it, and the other way round.
    layer = Int8Linear(*random_layer())
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        inside = layer(x)
    outside = layer(x)
    with torch.inference_mode():
        again = layer(x)
    assert torch.equal(inside, outside) and torch.equal(outside, again)


def test_the_decode_kernel_is_used_only_where_it_sums_exactly(monkeypatch):
    import services.executor.quantized as quantized

    weight, bias = random_layer()
    monkeypatch.setattr(quantized, "exact_decode_kernel", lambda: False)
    assert Int8Linear(weight, bias).few_rows is None
    monkeypatch.setattr(quantized, "exact_decode_kernel", lambda: True)
    assert Int8Linear(weight, bias).few_rows is not None
    assert Int8Linear(weight, bias, decode_kernel=False).few_rows is None


@pytest.mark.parametrize("rows", [1, 33])
def test_int4_linear_from_fp32_is_within_eight_percent(rows):
    weight, bias = random_layer()
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    assert relative_error(Int4Linear.from_float(weight, bias)(x), F.linear(x, weight, bias)) < 0.08


def q4_1_bytes(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """GGUF Q4_1 rows from d, m [rows, blocks] and q [rows, blocks * 32] (ggml's layout)."""
    rows, blocks = d.shape
    q = q.reshape(rows, blocks, 32).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    head = np.concatenate(
        [
            d.astype(np.float16)[..., None].view(np.uint8),
            m.astype(np.float16)[..., None].view(np.uint8),
        ],
        axis=-1,
    ).reshape(rows, blocks, 4)
    return np.concatenate([head, nibbles], axis=-1).reshape(rows, blocks * 20)


def test_q4_1_blocks_repack_into_the_int4_kernel_exactly():
    rng = np.random.default_rng(0)
    rows, blocks = 64, 4
    d = rng.uniform(0.001, 0.02, (rows, blocks)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.2, 0.0, (rows, blocks)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (rows, blocks * 32))
    parsed = read_q4_1(q4_1_bytes(d, m, q))
    expected = (q.reshape(rows, blocks, 32) * d[..., None] + m[..., None]).reshape(rows, -1)
    assert torch.equal(parsed.dequantized(), torch.from_numpy(expected.astype(np.float32)))
    layer = Int4Linear(parsed.q, parsed.d, parsed.m, None)
    # Multiplying the identity reads the kernel's weight back: w = (q - 8) * d + (m + 8d).
    weight_back = layer(torch.eye(blocks * 32)).t()
    assert (weight_back - parsed.dequantized()).abs().max().item() < 1e-6


def test_q8_0_rows_become_an_int8_embedding_and_from_float_recovers_them():
    rng = np.random.default_rng(1)
    rows, blocks = 10, 2
    d = rng.uniform(0.001, 0.01, (rows, blocks)).astype(np.float16)
    q = rng.integers(-127, 128, (rows, blocks * 32)).astype(np.int8)
    q[:, 0], q[:, 32] = 127, -127  # ggml scales each block so that its largest value is +-127
    raw = np.concatenate(
        [d[..., None].view(np.uint8), q.reshape(rows, blocks, 32).view(np.uint8)], axis=-1
    ).reshape(rows, blocks * 34)
    blocks_read = read_q8_0(raw)
    embedding = Int8Embedding(blocks_read.q, blocks_read.d)
    dense = embedding.dequantized()
    ids = torch.tensor([3, 0, 3])
    assert torch.equal(embedding(ids), dense[ids])
    # Quantizing the dequantized rows again lands on the same int8 values and scales.
    again = Int8Embedding.from_float(dense)
    assert torch.equal(again.qweight, embedding.qweight)
    assert torch.allclose(again.scales, embedding.scales, rtol=1e-6)


# How many of the 12 first greedy tokens must agree with fp32's. The tiny model's random
# weights (init 0.3) lose more to 16 levels per group than a trained model's do: 6 of 12 with
# torch's int4 kernel (fp32 activations), 5 with the row kernels' 4-bit linear, whose
# activations take 8-bit levels per 32 inputs as well (the embedded model's perplexity says
# what that costs a trained model: docs/benchmarks.md, "4-bit weights on the CPU").
@pytest.mark.parametrize(("mode", "min_agree"), [("int8", 10), ("int4", 5)])
def test_quantized_engine_keeps_greedy_first_tokens_of_fp32(
    tiny_model_dir, prompts, hf_greedy, mode, min_agree
):
    from dataclasses import replace

    from services.engine.llm_engine import LLMEngine
    from services.executor.quantized import QUANTIZED_LINEARS
    from shared.sampling import SamplingParams

    config = engine_config(tiny_model_dir)
    config = replace(config, model=replace(config.model, quantization=mode))
    with LLMEngine(config) as engine:
        assert isinstance(engine.executor.model.layers[0].mlp.down_proj, QUANTIZED_LINEARS)
        sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = engine.generate(prompts, sampling)
    first_same = sum(o.outputs[0].token_ids[0] == ref[0] for o, ref in zip(outputs, hf_greedy))
    assert all(len(o.outputs[0].token_ids) == MAX_NEW_TOKENS for o in outputs)
    assert first_same >= min_agree, f"{first_same}/{len(prompts)} first tokens agree"


def test_auto_keeps_fp32_for_models_other_than_the_embedded_one(tiny_model_dir):
    from services.executor.quantize_model import resolve_quantization

    assert resolve_quantization("auto", tiny_model_dir, torch.device("cpu")) == "none"
    assert resolve_quantization("int4", tiny_model_dir, torch.device("cpu")) == "int4"


@pytest.mark.parametrize(
    "vnni, row_kernels_built, setting, expected",
    [
        (True, False, "off", "int8"),  # torch._int_mm has its fast GEMM
        (False, True, "auto", "int8"),  # the row kernels take every int8 call
        (False, True, "off", "none"),  # turned off: prompt chunks would run _int_mm's loop
        (False, False, "auto", "none"),  # not built (no compiler): the same
    ],
)
def test_auto_int8_only_with_a_fast_int8_gemm(
    monkeypatch, tiny_model_dir, vnni, row_kernels_built, setting, expected
):
    from services.executor import quantize_model

    monkeypatch.setattr(quantize_model, "is_embedded", lambda path: True)
    monkeypatch.setattr(quantize_model, "int_mm_has_fast_path", lambda: vnni)
    monkeypatch.setattr(
        quantize_model, "load_row_ops", lambda: object() if row_kernels_built else None
    )
    cpu = torch.device("cpu")
    assert quantize_model.resolve_quantization("auto", tiny_model_dir, cpu, setting) == expected
    assert quantize_model.resolve_quantization("int8", tiny_model_dir, cpu, setting) == "int8"


@pytest.mark.slow
def test_embedded_gguf_blocks_equal_the_converted_fp32_weights():
    from safetensors import safe_open

    from services.executor.gguf_blocks import read_blocks
    from services.executor.models.llama import LlamaForCausalLM
    from shared.model_source import embedded_gguf_path, resolve_model

    packed = LlamaForCausalLM.packed_modules_mapping
    blocks = read_blocks(
        embedded_gguf_path(), num_heads=9, num_kv_heads=3, packed_modules_mapping=packed
    )
    with safe_open(str(resolve_model(None) / "model.safetensors"), "pt") as f:
        names = ["q_proj", "k_proj", "v_proj"]
        for part, name in zip(blocks["layers.5.self_attn.qkv_proj"], names):
            assert torch.equal(
                part.dequantized(), f.get_tensor(f"model.layers.5.self_attn.{name}.weight")
            )
        embed = blocks["embed_tokens"][0]
        dense = Int8Embedding(embed.q, embed.d).dequantized()
        assert torch.equal(dense, f.get_tensor("model.embed_tokens.weight"))


def test_smoothing_folds_into_the_model_without_changing_its_logits(tiny_model_dir):
    # The factors divide the norms' weights and v/up rows and multiply the next weights: the
    # fp32 model must compute the same logits, so that int8 alone changes anything.
    from torch import nn

    from kernels.ops import select_ops
    from services.executor.quantize_model import calibration_token_ids
    from services.executor.smoothing import (
        HEAD,
        input_maxima,
        prefill_hidden,
        smooth_layers,
        smoothed_head,
    )
    from services.executor.weights import load_model

    model = load_model(tiny_model_dir, torch.float32, 512, select_ops("torch", "cpu"), "cpu")
    ids = calibration_token_ids(tiny_model_dir, 512)[:96]
    before = model.compute_logits(prefill_hidden(model, ids))
    maxima = input_maxima(model, ids, type(model).quantizable_modules)
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear)  # observers removed again
    smooth_layers(model, maxima, alpha=0.5)
    weight = smoothed_head(model, maxima[HEAD], alpha=0.5)
    model.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    model.lm_head.weight.data = weight
    after = model.compute_logits(prefill_hidden(model, ids))
    assert not torch.equal(model.layers[0].input_layernorm.weight, torch.ones(64))
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4 * before.abs().max().item())


# The CPU default's quality cost, held to a margin: per-token mean NLL over the first 512 tokens
# of the perplexity benchmark's text (benchmarks/perplexity.py; docs/benchmarks.md), at most
# 0.01 nats above fp32's (a perplexity ratio of exp(0.01) = 1.01). Deterministic on a CPU; when
# written, int8 with SmoothQuant scored 0.012 nats below fp32 here, int8 before it 0.041 above.
DEFAULT_NLL_MARGIN = 0.01


@pytest.mark.slow
def test_cpu_default_stays_within_its_nll_margin_of_fp32():
    from pathlib import Path

    from services.engine.llm_engine import LLMEngine
    from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
    from shared.sampling import SamplingParams

    text = Path(__file__).parents[2] / "benchmarks" / "data" / "pride_and_prejudice_ch1-6.txt"
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    nll = {}
    for mode in ("none", "auto"):
        config = EngineConfig(
            model=ModelConfig(quantization=mode, device="cpu"),
            cache=CacheConfig(kv_cache_bytes=GiB // 16, swap_space_bytes=0),
            scheduler=SchedulerConfig(enable_prefix_caching=False),
        )
        with LLMEngine(config) as engine:
            if mode == "auto":
                assert isinstance(engine.executor.model.lm_head, Int8Linear)
            ids = engine.tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
            (output,) = engine.generate([ids[:512]], sampling)
        nll[mode] = -torch.tensor([t.logprob for t in output.prompt_logprobs.tokens]).mean()
    assert nll["auto"] - nll["none"] <= DEFAULT_NLL_MARGIN, nll


@pytest.mark.parametrize("isa", ["AVX2", "AVX512"])
def test_the_exactness_check_fails_where_fbgemm_adds_products_in_int16(isa):
    # fbgemm limited to AVX2 or AVX-512 without VNNI adds pairs of u8 x s8 products in int16
    # (vpmaddubsw), which saturate on the worst case: the check must see it and keep _int_mm.
    # fbgemm reads the limit when it starts: a fresh interpreter.
    code = (
        "from services.executor.quantized import Int8Linear, exact_decode_kernel\n"
        "import torch\n"
        "assert not exact_decode_kernel()\n"
        "assert Int8Linear(torch.randn(8, 64), None).few_rows is None\n"
    )
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": isa}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
