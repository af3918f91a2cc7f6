"""Prompt logprobs through the paged engine equal transformers' log-softmax of the same prompt,
also over chunked prefills, prompts whose blocks sit in the prefix cache, and recomputed ones."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from services.engine.llm_engine import LLMEngine, RequestOutput
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.reference_model import CONTENDED_NEW_TOKENS, hf_model

TOP_K = 3
ASKING = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP_K)


@functools.cache
def hf_prompt_logprobs(model_dir, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] fp32: row i is the log-softmax predicting prompt[i + 1]."""
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_transformers(model_dir, prompt: list[int], output: RequestOutput) -> None:
    scored = output.prompt_logprobs
    assert scored is not None and scored.start_pos == 1
    assert [t.token_id for t in scored.tokens] == prompt[1:]
    if len(prompt) == 1:
        return
    reference = hf_prompt_logprobs(model_dir, tuple(prompt))
    expected = reference.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    got = torch.tensor([t.logprob for t in scored.tokens])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    ranks = (reference > expected[:, None]).sum(dim=-1) + 1
    # A rank may differ only where two logprobs tie within the tolerance.
    assert sum(a != b for a, b in zip(scored.ranks, ranks.tolist())) <= len(prompt) // 50
    top_values, top_ids = reference.topk(TOP_K, dim=-1)
    for row, token in enumerate(scored.tokens):
        assert len(token.top_logprobs) == TOP_K
        values = torch.tensor([lp for _, lp in token.top_logprobs])
        torch.testing.assert_close(values, top_values[row], atol=1e-4, rtol=0)


def run(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams):
    outputs = engine.generate(prompts, sampling)
    manager = engine.scheduler.block_manager
    manager.check()
    assert manager.device.num_free == manager.device.num_blocks
    return outputs


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
def test_prompt_logprobs_match_transformers(tiny_model_dir, prompts, hf_greedy, chunked):
    # A budget below the longest prompt splits it across steps when chunking is on.
    config = engine_config(
        tiny_model_dir, max_num_batched_tokens=96 if chunked else 512,
        enable_chunked_prefill=chunked,
    )  # fmt: skip
    outputs = run(LLMEngine(config), prompts, ASKING)
    for prompt, output, greedy in zip(prompts, outputs, hf_greedy):
        assert_matches_transformers(tiny_model_dir, prompt, output)
        assert output.outputs[0].token_ids == greedy[:4]  # generation itself is unchanged


def test_requests_without_prompt_logprobs_get_none(tiny_model_dir, prompts):
    outputs = run(LLMEngine(engine_config(tiny_model_dir)), prompts[:3], ASKING.__class__())
    assert all(o.prompt_logprobs is None for o in outputs)


def test_prompt_in_prefix_cache_still_gets_every_logprob(tiny_model_dir, prompts):
    engine = LLMEngine(engine_config(tiny_model_dir, enable_prefix_caching=True))
    prompt = prompts[-1]  # 200 tokens: 12 full blocks
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run(engine, [prompt], plain)  # its blocks are now cached
    hits = engine.scheduler.prefix_cache_hit_tokens
    run(engine, [prompt], plain)
    assert engine.scheduler.prefix_cache_hit_tokens > hits  # the cache would serve it
    hits = engine.scheduler.prefix_cache_hit_tokens
    (output,) = run(engine, [prompt], ASKING)
    assert engine.scheduler.prefix_cache_hit_tokens == hits  # ... but this request computes all
    assert_matches_transformers(tiny_model_dir, prompt, output)


def test_prompt_logprobs_survive_recompute_preemption(tiny_model_dir, contended_prompts):
    # As in the greedy preemption test: the pool is far too small, groups are recomputed.
    config = engine_config(
        tiny_model_dir, block_size=16, num_device_blocks=12, max_num_batched_tokens=128,
        preemption_mode="recompute",
    )  # fmt: skip
    engine = LLMEngine(config)
    sampling = SamplingParams(
        max_tokens=CONTENDED_NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP_K
    )
    outputs = run(engine, contended_prompts, sampling)
    assert engine.scheduler.num_preemptions >= 5
    for prompt, output in zip(contended_prompts, outputs):
        assert_matches_transformers(tiny_model_dir, prompt, output)


def test_parallel_samples_get_one_set(tiny_model_dir, prompts):
    sampling = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, prompt_logprobs=0)
    (output,) = run(LLMEngine(engine_config(tiny_model_dir)), [prompts[8]], sampling)
    assert len(output.outputs) == 3
    assert [t.top_logprobs for t in output.prompt_logprobs.tokens] == [[]] * 63
    prompt = prompts[8]
    reference = hf_prompt_logprobs(tiny_model_dir, tuple(prompt))
    expected = reference.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    got = torch.tensor([t.logprob for t in output.prompt_logprobs.tokens])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_offline_generate_writes_prompt_logprobs(tiny_model_dir, prompts, tmp_path):
    from services.cli import main as cli_main

    prompt = prompts[6]  # 31 tokens
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": prompt, "prompt_logprobs": 1}) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(dst)]
    assert cli_main(argv + ["--num-device-blocks", "32", "--max-tokens", "2"]) == 0
    [row] = [json.loads(line) for line in dst.read_text().splitlines()]
    scored = row["prompt_logprobs"]
    assert scored[0] is None and [e["token_id"] for e in scored[1:]] == prompt[1:]
    reference = hf_prompt_logprobs(tiny_model_dir, tuple(prompt))
    expected = reference.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
    assert [e["logprob"] for e in scored[1:]] == pytest.approx(expected, abs=1e-4)
    assert all(len(e["top_logprobs"]) == 1 and e["rank"] >= 1 for e in scored[1:])
