"""Speculative decoding through the in-process engine: greedy outputs token-identical to plain
decoding (K = 1, 3, 5, under preemption, n > 1, prefix caching), seeded samples identical, the
sampled distribution unchanged, and the block pool exact and empty after every run."""

from __future__ import annotations

import dataclasses

import pytest
from scipy.stats import chi2_contingency

from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig, SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.engine_runs import CONTENDED_GREEDY
from tests.support.reference_model import VOCAB
from tests.support.speculation import run_checked as _run

# Prompts that repeat themselves, and long enough runs that the random model's greedy output
# falls into loops: the lookup then proposes tokens that verification accepts.
REPETITIVE = [p * 3 for p in random_prompts([4, 9, 17, 30], VOCAB, seed=1)]
LONG_GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def _ngram(config: EngineConfig, k: int = 3) -> EngineConfig:
    # max_batch above every batch here: these tests are about correctness, not the rule.
    spec = SpeculativeConfig(
        method="ngram", ngram_min=1, num_tokens=k, max_batch=1000, adaptive=False
    )
    return dataclasses.replace(config, speculative=spec)


def _accepted(engine: LLMEngine) -> int:
    return engine.scheduler.speculation.num_accepted


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_are_those_of_plain_decoding(tiny_model_dir, k):
    config = engine_config(tiny_model_dir, block_size=8)
    plain, _ = _run(config, REPETITIVE, LONG_GREEDY)
    spec, engine = _run(_ngram(config, k), REPETITIVE, LONG_GREEDY)
    assert spec == plain
    assert _accepted(engine) > 0
    assert engine.scheduler.speculation.num_proposed > _accepted(engine)  # some were rejected


def test_greedy_outputs_equal_transformers(tiny_model_dir, prompts, hf_greedy):
    greedy = SamplingParams(max_tokens=len(hf_greedy[0]), temperature=0.0, ignore_eos=True)
    outputs, _ = _run(_ngram(engine_config(tiny_model_dir), 3), prompts, greedy)
    assert [o[0] for o in outputs] == hf_greedy


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_outputs_survive_preemption_mid_speculation(
    tiny_model_dir, contended_prompts, hf_greedy_contended, mode
):
    # As the plain preemption test: 12 blocks of 16 tokens for 14 growing requests.
    config = engine_config(
        tiny_model_dir,
        block_size=16,
        num_device_blocks=12,
        max_num_batched_tokens=128,
        preemption_mode=mode,
    )
    outputs, engine = _run(_ngram(config, 3), contended_prompts, CONTENDED_GREEDY)
    assert [o[0] for o in outputs] == hf_greedy_contended
    assert engine.scheduler.num_preemptions >= 5
    assert engine.scheduler.speculation.num_proposed > 0


def test_seeded_samples_are_those_of_plain_decoding_also_with_n_above_one(tiny_model_dir):
    # Each verified row draws with the key of that output position, as plain decoding does.
    config = engine_config(tiny_model_dir, block_size=8)
    sampling = SamplingParams(
        max_tokens=40, temperature=0.7, top_k=8, n=3, seed=11, ignore_eos=True, logprobs=1
    )
    plain, _ = _run(config, REPETITIVE, sampling)
    spec, engine = _run(_ngram(config, 3), REPETITIVE, sampling)
    again, _ = _run(_ngram(config, 3), REPETITIVE, sampling)
    assert spec == plain == again
    assert _accepted(engine) > 0


def test_sampled_token_distribution_matches_plain_decoding(tiny_model_dir):
    # Unseeded draws, different in each run: a chi-square test that the verified tokens (the
    # third and fourth of each continuation) follow the same distribution with and without
    # speculation.
    prompt = random_prompts([6], VOCAB, seed=4)[0] * 4
    sampling = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, n=1, ignore_eos=True)
    config = engine_config(tiny_model_dir, block_size=8, max_num_seqs=128)
    draws = 600

    def tokens(cfg: EngineConfig, seed: int) -> tuple[list[tuple[int, int]], LLMEngine]:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seed=seed))
        outputs, engine = _run(cfg, [prompt] * draws, sampling)
        return [tuple(o[0][-2:]) for o in outputs], engine

    plain, _ = tokens(config, seed=1)
    spec, engine = tokens(_ngram(config, 3), seed=2)
    assert _accepted(engine) > 0
    categories = sorted(set(plain) | set(spec))
    table = [[plain.count(c) for c in categories], [spec.count(c) for c in categories]]
    # Pool categories too rare for the test into one column.
    common = [i for i in range(len(categories)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(categories)) if i not in common]
    rows = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
    rows = [list(col) for col in zip(*[c for c in zip(*rows) if sum(c) > 0])]
    assert chi2_contingency(rows).pvalue > 1e-3


def test_prefix_cache_holds_only_accepted_tokens(tiny_model_dir):
    # A second request whose prompt is the first one's prompt and output reuses the blocks the
    # first one wrote while speculating; had a rejected token's K/V stayed in a cached block,
    # its output would differ from plain decoding.
    config = engine_config(tiny_model_dir, block_size=4)
    first_prompt = REPETITIVE[2]
    (first,), engine = _run(_ngram(config, 5), [first_prompt], LONG_GREEDY)
    second_prompt = first_prompt + first[0][:40]
    plain, _ = _run(config, [second_prompt], LONG_GREEDY)
    hits = engine.scheduler.prefix_cache_hit_tokens
    engine_outputs = engine.generate([second_prompt], LONG_GREEDY)
    assert [c.token_ids for c in engine_outputs[0].outputs] == plain[0]
    assert engine.scheduler.prefix_cache_hit_tokens - hits >= len(first_prompt) + 32
    assert engine.scheduler.block_manager.device.num_free == config.cache.num_device_blocks


def test_stop_tokens_and_max_tokens_cut_inside_an_accepted_run(tiny_model_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    (full,), _ = _run(config, [REPETITIVE[1]], LONG_GREEDY)
    output = full[0]
    stop = output[30]
    cut = output[: output.index(stop) + 1]
    sampling = dataclasses.replace(LONG_GREEDY, stop_token_ids=(stop,))
    (stopped,), _ = _run(_ngram(config, 5), [REPETITIVE[1]], sampling)
    assert stopped[0] == cut
    short = dataclasses.replace(LONG_GREEDY, max_tokens=37)
    (capped,), _ = _run(_ngram(config, 5), [REPETITIVE[1]], short)
    assert capped[0] == output[:37]


def test_penalised_requests_decode_without_speculation(tiny_model_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    sampling = dataclasses.replace(LONG_GREEDY, repetition_penalty=1.3, max_tokens=20)
    plain, _ = _run(config, REPETITIVE, sampling)
    spec, engine = _run(_ngram(config, 3), REPETITIVE, sampling)
    assert spec == plain
    assert engine.scheduler.speculation.num_proposed == 0


def test_no_speculation_above_the_batch_rule(tiny_model_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    spec = SpeculativeConfig(method="ngram", ngram_min=1, num_tokens=3, max_batch=2, adaptive=False)
    outputs, engine = _run(
        dataclasses.replace(config, speculative=spec),
        REPETITIVE,
        dataclasses.replace(LONG_GREEDY, max_tokens=8),
    )
    plain, _ = _run(config, REPETITIVE, dataclasses.replace(LONG_GREEDY, max_tokens=8))
    assert outputs == plain
    assert engine.scheduler.speculation.num_proposed == 0  # 4 sequences ran together


def test_orca_reservations_keep_their_blocks_through_rollback(tiny_model_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, kv_policy="orca-max")
    )
    plain, _ = _run(config, REPETITIVE, LONG_GREEDY)
    spec, engine = _run(_ngram(config, 3), REPETITIVE, LONG_GREEDY)
    assert spec == plain
    assert _accepted(engine) > 0


def test_accepted_tokens_carry_the_logprobs_of_plain_decoding(tiny_model_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)

    def logprobs(cfg: EngineConfig) -> tuple[list[list], LLMEngine]:
        engine = LLMEngine(cfg)
        outputs = engine.generate(REPETITIVE, sampling)
        rows = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs] for o in outputs]
        return rows, engine

    plain, _ = logprobs(config)
    spec, engine = logprobs(_ngram(config, 3))
    assert _accepted(engine) > 0
    assert [[t for t, _ in row] for row in spec] == [[t for t, _ in row] for row in plain]
    for spec_row, plain_row in zip(spec, plain):
        assert [lp for _, lp in spec_row] == pytest.approx([lp for _, lp in plain_row], abs=1e-4)


def test_beam_search_runs_beside_speculation_without_speculating(tiny_model_dir):
    config = engine_config(tiny_model_dir, block_size=8)
    beams = SamplingParams(
        max_tokens=12, n=2, use_beam_search=True, temperature=0.0, ignore_eos=True
    )
    plain, _ = _run(config, REPETITIVE[:2], beams)
    spec, engine = _run(_ngram(config, 3), REPETITIVE[:2], beams)
    assert spec == plain
    assert engine.scheduler.speculation.num_proposed == 0
