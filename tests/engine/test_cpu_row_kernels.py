"""The CPU row kernels in the engine: the steps they serve give transformers' greedy tokens and
plain decoding's, with speculation, preemption and parallel samples; families they do not
implement keep the reference layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu_rows
from services.engine.llm_engine import LLMEngine
from services.executor.models.decoder import ROW_QUERY_LIMIT, DecoderForCausalLM
from services.executor.quantized import Int4Linear, Int8Linear
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.reference_model import VOCAB
from tests.support.speculation import oracle_proposals, run_checked

pytestmark = pytest.mark.skipif(
    cpu_rows.load_row_ops() is None, reason=f"not built: {cpu_rows.build_error()}"
)

REPETITIVE = [p * 3 for p in random_prompts([5, 11, 23], VOCAB, seed=4)]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _kernels(config, setting: str):
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, cpu_row_kernels=setting)
    )


def _count_row_steps(monkeypatch) -> list[int]:
    """How many forwards went through the row kernels (and with how many tokens)."""
    calls: list[int] = []
    original = DecoderForCausalLM._forward_rows

    def counted(self, h, *args):
        calls.append(h.shape[0])
        return original(self, h, *args)

    monkeypatch.setattr(DecoderForCausalLM, "_forward_rows", counted)
    return calls


def test_greedy_tokens_equal_transformers_through_the_row_kernels(
    tiny_model_dir, prompts, hf_greedy, monkeypatch
):
    calls = _count_row_steps(monkeypatch)
    engine = LLMEngine(engine_config(tiny_model_dir))
    assert engine.executor.model.row_ops is not None
    greedy = SamplingParams(max_tokens=len(hf_greedy[0]), temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    # Every decode step went through them; prompts longer than the limit did not.
    assert len(calls) >= len(hf_greedy[0]) - 1
    assert max(calls) <= len(prompts) * ROW_QUERY_LIMIT


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_speculation_and_preemption_give_the_reference_layers_tokens(
    tiny_model_dir, preemption, monkeypatch
):
    """ngram verify steps (K + 1 rows per sequence) and n > 1 through the row kernels, in a
    pool small enough to preempt, against the same engine on the reference layers."""
    config = engine_config(
        tiny_model_dir, block_size=4, num_device_blocks=40, preemption_mode=preemption
    )
    spec = SpeculativeConfig(
        method="ngram", ngram_min=1, num_tokens=3, max_batch=1000, adaptive=False
    )
    sampling = dataclasses.replace(GREEDY, n=2, temperature=0.0)
    plain, _ = run_checked(config, REPETITIVE, GREEDY)
    oracle_proposals(monkeypatch, REPETITIVE, [p[0] for p in plain], VOCAB)
    config = dataclasses.replace(config, speculative=spec)
    reference, _ = run_checked(_kernels(config, "off"), REPETITIVE, sampling)
    calls = _count_row_steps(monkeypatch)
    rows, engine = run_checked(config, REPETITIVE, sampling)
    assert rows == reference
    speculation = engine.scheduler.speculation
    assert speculation.num_proposed > speculation.num_accepted > 0  # both outcomes verified
    assert any(n > len(REPETITIVE) * 2 for n in calls)  # verify steps took the row kernels
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("quantization", "num_tokens"), [("int8", 1), ("int8", 3), ("int8", 5), ("int4", 3)]
)
def test_quantized_speculation_keeps_plain_decodings_tokens(
    tiny_model_dir, quantization, num_tokens, monkeypatch
):
    """With int8 or 4-bit weights too: each row of a verify step is quantized on its own levels
    by the row kernels' linears, so a verified token's logits are the bits its plain decode
    step gives, and greedy speculation changes no token."""
    config = engine_config(tiny_model_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, quantization=quantization)
    )
    spec = SpeculativeConfig(
        method="ngram", ngram_min=1, num_tokens=num_tokens, max_batch=1000, adaptive=False
    )
    plain, engine = run_checked(config, REPETITIVE, GREEDY)
    kind = Int8Linear if quantization == "int8" else Int4Linear
    layers = [m for m in engine.executor.model.modules() if isinstance(m, kind)]
    assert layers and all(m.rows_packed is not None for m in layers)
    oracle_proposals(monkeypatch, REPETITIVE, [p[0] for p in plain], VOCAB)
    speculating, engine = run_checked(
        dataclasses.replace(config, speculative=spec), REPETITIVE, GREEDY
    )
    assert speculating == plain
    speculation = engine.scheduler.speculation
    assert speculation.num_proposed > speculation.num_accepted > 0  # both outcomes verified


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_quantized_stack_in_one_call_gives_the_layer_loops_bits(
    tiny_model_dir, quantization, monkeypatch
):
    """With every linear the row kernels' int8 (or 4-bit), a step's layers run in one C++ call
    (rows_forward); its logits are the Python loop's over the same kernels, bit for bit."""
    config = engine_config(tiny_model_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, quantization=quantization)
    )
    spec = SpeculativeConfig(
        method="ngram", ngram_min=1, num_tokens=3, max_batch=1000, adaptive=False
    )
    config = dataclasses.replace(config, speculative=spec)
    logits: dict[str, list] = {"one call": [], "loop": []}
    stacks: list[bool] = []
    original_logits = DecoderForCausalLM.compute_logits
    original_stack = DecoderForCausalLM._row_stack
    for name in logits:

        def recorded(self, hidden, name=name):
            out = original_logits(self, hidden)
            logits[name].append(out.clone())
            return out

        def stack(self, name=name):
            found = original_stack(self)
            stacks.append(found is not None)
            return found if name == "one call" else None

        monkeypatch.setattr(DecoderForCausalLM, "compute_logits", recorded)
        monkeypatch.setattr(DecoderForCausalLM, "_row_stack", stack)
        run_checked(config, REPETITIVE, GREEDY)
    assert all(stacks) and len(stacks) > 20
    assert len(logits["one call"]) == len(logits["loop"])
    assert all(torch.equal(a, b) for a, b in zip(logits["one call"], logits["loop"]))


def test_off_keeps_the_reference_layers(tiny_model_dir):
    engine = LLMEngine(_kernels(engine_config(tiny_model_dir), "off"))
    assert engine.executor.model.row_ops is None


def test_layers_the_kernels_do_not_implement_keep_the_reference(tiny_model_dir):
    engine = LLMEngine(engine_config(tiny_model_dir))
    model = engine.executor.model
    ops = cpu_rows.load_row_ops()
    assert model.use_row_kernels(ops)
    model.layers[-1].self_attn.use_window(8)  # a sliding window: not in the row kernels
    assert not model.use_row_kernels(ops) and model.row_ops is None
    model.layers[-1].self_attn.use_window(None)
    assert not model.use_row_kernels(None)  # a failed build
