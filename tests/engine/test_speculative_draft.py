"""Speculative decoding with a draft model through the in-process engine: greedy outputs equal
transformers' (K = 1, 3, 5, under swap and recompute preemption, n > 1, prefix caching on), a
draft equal to the target accepts everything, seeded samples repeat, the sampled distribution
is unchanged, and the block pool is exact and empty after every run."""

from __future__ import annotations

import dataclasses

import pytest
from scipy.stats import chi2_contingency

from services.bench.layer_skip_draft import make_layer_skip_draft
from services.engine.llm_engine import LLMEngine
from shared.config import EngineConfig, SpeculativeConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, make_tiny_llama, random_prompts
from tests.support.engine_runs import CONTENDED_GREEDY, GREEDY
from tests.support.reference_model import VOCAB
from tests.support.speculation import run_checked as _run


@pytest.fixture(scope="module")
def layer_skip_dir(tiny_model_dir, tmp_path_factory):
    """The target's first layer with its head: proposals partly accepted."""
    return make_layer_skip_draft(tiny_model_dir, tmp_path_factory.mktemp("layer-skip"), [0])


def _draft(config: EngineConfig, draft_dir, k: int = 3) -> EngineConfig:
    # max_batch above every batch here and no gate: these tests are about correctness, not
    # the rules of when to speculate.
    spec = SpeculativeConfig(
        method="draft", num_tokens=k, max_batch=1000, draft_model=str(draft_dir), adaptive=False
    )
    return dataclasses.replace(config, speculative=spec)


def test_a_draft_equal_to_the_target_accepts_every_proposal(tiny_model_dir, prompts, hf_greedy):
    config = _draft(engine_config(tiny_model_dir), tiny_model_dir, k=3)
    outputs, engine = _run(config, prompts, GREEDY)
    assert [o[0] for o in outputs] == hf_greedy
    speculation = engine.scheduler.speculation
    assert speculation.num_proposed > 0
    assert speculation.num_accepted == speculation.num_proposed  # acceptance rate 1.0


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", ["small", "layer-skip"])
def test_greedy_outputs_equal_transformers(
    tiny_model_dir, small_draft_dir, layer_skip_dir, prompts, hf_greedy, k, draft
):
    draft_dir = small_draft_dir if draft == "small" else layer_skip_dir
    config = _draft(engine_config(tiny_model_dir, block_size=8), draft_dir, k)
    outputs, engine = _run(config, prompts, GREEDY)
    assert [o[0] for o in outputs] == hf_greedy
    speculation = engine.scheduler.speculation
    assert speculation.num_proposed > speculation.num_accepted  # rejections rolled back
    if draft == "layer-skip":
        assert speculation.num_accepted > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_outputs_survive_preemption_mid_speculation(
    tiny_model_dir, layer_skip_dir, contended_prompts, hf_greedy_contended, mode
):
    # As the plain preemption test: 12 blocks of 16 tokens for 14 growing requests.
    config = engine_config(
        tiny_model_dir,
        block_size=16,
        num_device_blocks=12,
        max_num_batched_tokens=128,
        preemption_mode=mode,
    )
    outputs, engine = _run(_draft(config, layer_skip_dir, 3), contended_prompts, CONTENDED_GREEDY)
    assert [o[0] for o in outputs] == hf_greedy_contended
    assert engine.scheduler.num_preemptions >= 5
    assert engine.scheduler.speculation.num_accepted > 0


def test_n_above_one_with_prefix_caching(tiny_model_dir, layer_skip_dir):
    # Greedy samples of one request are identical; a later request whose prompt extends the
    # first one's prompt and output reuses its cached blocks (draft KV recomputed there).
    config = engine_config(tiny_model_dir, block_size=8, enable_prefix_caching=True)
    first_prompt = random_prompts([20], VOCAB, seed=3)[0]
    sampling = dataclasses.replace(GREEDY, n=3)
    (first,), engine = _run(_draft(config, layer_skip_dir, 3), [first_prompt], sampling)
    (plain_first,), _ = _run(config, [first_prompt], sampling)
    assert first == plain_first
    second_prompt = first_prompt + first[0][:17]
    (plain_second,), _ = _run(config, [second_prompt], sampling)
    outputs = engine.generate([second_prompt], sampling)
    assert [c.token_ids for c in outputs[0].outputs] == plain_second
    assert engine.scheduler.prefix_cache_hit_tokens >= 32
    assert engine.scheduler.speculation.num_accepted > 0
    manager = engine.scheduler.block_manager
    manager.check()
    assert not manager.tables


def test_seeded_samples_repeat(tiny_model_dir, layer_skip_dir):
    config = _draft(engine_config(tiny_model_dir, block_size=8), layer_skip_dir, 3)
    prompts = random_prompts([5, 17, 40], VOCAB, seed=8)
    sampling = SamplingParams(
        max_tokens=30, temperature=0.8, top_p=0.9, n=2, seed=5, ignore_eos=True
    )
    first, engine = _run(config, prompts, sampling)
    again, _ = _run(config, prompts, sampling)
    assert first == again
    assert engine.scheduler.speculation.num_accepted > 0


def test_sampled_token_distribution_matches_plain_decoding(tiny_model_dir, layer_skip_dir):
    # Unseeded draws, different in each run: a chi-square test that the verified tokens (the
    # second and third of each continuation) follow the same distribution with and without
    # the draft's sampled proposals (Leviathan's rule with draft_probs).
    prompt = random_prompts([6], VOCAB, seed=4)[0]
    sampling = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    config = engine_config(tiny_model_dir, block_size=8, max_num_seqs=128)
    draws = 600

    def tokens(cfg: EngineConfig, seed: int) -> tuple[list[tuple[int, int]], LLMEngine]:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seed=seed))
        outputs, engine = _run(cfg, [prompt] * draws, sampling)
        return [tuple(o[0][-2:]) for o in outputs], engine

    plain, _ = tokens(config, seed=1)
    spec, engine = tokens(_draft(config, layer_skip_dir, 2), seed=2)
    speculation = engine.scheduler.speculation
    assert speculation.num_proposed > speculation.num_accepted > 0
    categories = sorted(set(plain) | set(spec))
    table = [[plain.count(c) for c in categories], [spec.count(c) for c in categories]]
    # Pool categories too rare for the test into one column.
    common = [i for i in range(len(categories)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(categories)) if i not in common]
    rows = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
    rows = [list(col) for col in zip(*[c for c in zip(*rows) if sum(c) > 0])]
    assert chi2_contingency(rows).pvalue > 1e-3


def test_a_draft_of_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other", seed=2, vocab_size=VOCAB + 16)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(_draft(engine_config(tiny_model_dir), other))
