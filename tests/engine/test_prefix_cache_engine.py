"""Prefix caching through the real engine: the same tokens with and without it, also when the
pool is so small that cached blocks are evicted and groups preempted."""

from __future__ import annotations

import pytest

from services.engine.llm_engine import LLMEngine, RequestOutput
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts

VOCAB = 384
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts() -> list[list[int]]:
    """Prompts over one 37-token prefix (some identical), and a few sharing only part of it."""
    prefix, *suffixes = random_prompts([37, 1, 5, 16, 30, 3, 12, 40, 9], VOCAB, seed=5)
    prompts = [prefix + s for s in suffixes]
    prompts.insert(3, list(prefix))
    prompts.insert(6, list(prefix))
    prompts += [prefix[:20] + s for s in random_prompts([7, 25], VOCAB, seed=6)]
    return prompts


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams, per_step: int = 2
) -> list[list[int]]:
    """Submit `per_step` prompts before each step (so later ones can find earlier ones' blocks),
    checking the pools after every step; the first sample's tokens, in prompt order."""
    pending = list(enumerate(prompts))
    index_of: dict[str, int] = {}
    done: dict[int, RequestOutput] = {}
    while pending or engine.has_unfinished():
        for i, prompt in pending[:per_step]:
            index_of[engine.add_request(prompt, sampling)] = i
        pending = pending[per_step:]
        for update in engine.step():
            if update.finished:
                done[index_of[update.group.request_id]] = RequestOutput.from_group(update.group)
        engine.scheduler.block_manager.check()
    manager = engine.scheduler.block_manager
    assert manager.device.num_free == manager.device.num_blocks
    assert not manager.tables and not manager.cpu_tables
    return [done[i].outputs[0].token_ids for i in range(len(prompts))]


def count_evictions(engine: LLMEngine) -> list[int]:
    cache = engine.scheduler.block_manager.prefix_cache
    evicted: list[int] = []
    remove = cache.remove

    def counting_remove(block_id: int) -> None:
        evicted.append(block_id)
        remove(block_id)

    cache.remove = counting_remove
    return evicted


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_outputs_are_identical_with_and_without_prefix_caching(tiny_model_dir, block_size):
    prompts = shared_prefix_prompts()
    outputs = {}
    for caching in (False, True):
        config = engine_config(
            tiny_model_dir,
            block_size=block_size,
            num_device_blocks=2048 // block_size,
            max_num_batched_tokens=64,
            enable_prefix_caching=caching,
        )
        engine = LLMEngine(config)
        outputs[caching] = run_staggered(engine, prompts, GREEDY)
        if caching:
            assert engine.scheduler.prefix_cache_hit_tokens >= 8 * 32  # most share 2+ blocks
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_are_identical_under_eviction_and_preemption(tiny_model_dir, mode):
    # 40 blocks of 4 for prompts of up to 77 tokens growing by 16: cached blocks are evicted,
    # groups preempted (by swap or recompute) and readmitted over cached prefixes.
    prompts = shared_prefix_prompts()
    outputs = {}
    for caching in (False, True):
        config = engine_config(
            tiny_model_dir,
            block_size=4,
            num_device_blocks=40,
            num_cpu_blocks=40,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            preemption_mode=mode,
            enable_prefix_caching=caching,
        )
        engine = LLMEngine(config)
        evicted = count_evictions(engine) if caching else []
        outputs[caching] = run_staggered(engine, prompts, GREEDY, per_step=3)
        if caching:
            assert engine.scheduler.num_preemptions > 0
            assert engine.scheduler.prefix_cache_hit_tokens > 0
            assert len(evicted) > 0
    assert outputs[True] == outputs[False]


def _prompt_positions(plans, seq_ids: set[int], end: int) -> int:
    return sum(
        max(0, min(s.start_pos + len(s.token_ids), end) - s.start_pos)
        for p in plans
        for s in p.seqs
        if s.seq_id in seq_ids
    )


def _run_parallel(tiny_model_dir, num_device_blocks: int, caching: bool, beams: bool = False):
    """A long greedy request beside an n=3 one (seeded samples, or beams) whose 18-token prompt
    fills 4 blocks of 4; its tokens, prompt positions < 16 computed, and the preemptions."""
    config = engine_config(
        tiny_model_dir,
        block_size=4,
        num_device_blocks=num_device_blocks,
        preemption_mode="recompute",
        enable_prefix_caching=caching,
    )
    engine = LLMEngine(config)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    long_prompt, prompt = random_prompts([40, 18], VOCAB, seed=9)
    if beams:
        shared = SamplingParams(
            n=3, max_tokens=20, temperature=0.0, use_beam_search=True, ignore_eos=True
        )
    else:
        shared = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    outputs = engine.generate(
        [long_prompt, prompt],
        [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), shared],
        on_step=lambda e: e.scheduler.block_manager.check(),
    )
    samples = [o.token_ids for o in outputs[1].outputs]
    # The long request is sequence 0; every other id belongs to the n=3 group.
    seq_ids = {s.seq_id for p in plans for s in p.seqs} - {0}
    return samples, _prompt_positions(plans, seq_ids, 16), engine.scheduler.num_preemptions


@pytest.mark.parametrize("beams", [False, True], ids=["samples", "beams"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_a_recomputed_parallel_group_prefills_its_prompt_once_with_the_same_outputs(
    tiny_model_dir, caching, beams
):
    alone, computed_alone, preemptions = _run_parallel(tiny_model_dir, 256, caching, beams)
    assert preemptions == 0 and computed_alone == 16
    # The long request needs 20 blocks, the samples 4 shared + 3 x 6 own (beams share more of
    # their outputs): in 30 blocks (24 for beams) the group is preempted once.
    pool = 24 if beams else 30
    crowded, computed, preemptions = _run_parallel(tiny_model_dir, pool, caching, beams)
    assert preemptions == 1
    assert crowded == alone
    if caching:
        assert computed <= 2 * 16
    else:
        assert computed == 2 * 16  # once at the start, once (not three times) after preemption


def _run_with_replacement(engine: LLMEngine, prompt, sampling, replace_at: int | None):
    from services.executor.executor import Executor

    engine.add_request(prompt, sampling)
    outputs = None
    for num_steps in range(200):
        if not engine.has_unfinished():
            break
        if num_steps == replace_at:
            engine.executor = Executor(engine.config, engine.model_dir)
            engine.scheduler.requeue_all(engine.executor.ready())
        for update in engine.step():
            if update.finished:
                outputs = [o.token_ids for o in RequestOutput.from_group(update.group).outputs]
        engine.scheduler.block_manager.check()
    return outputs


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_after_an_executor_restart_penalised_samples_are_fed_their_whole_prompt(
    tiny_model_dir, caching
):
    # The new executor learns the repetition penalty's prompt tokens only from fed tokens, so
    # these samples neither share the first one's prompt blocks nor reuse cached ones.
    config = engine_config(tiny_model_dir, block_size=4, enable_prefix_caching=caching)
    [prompt] = random_prompts([18], VOCAB, seed=4)
    sampling = SamplingParams(
        n=2, max_tokens=12, temperature=1.0, seed=3, repetition_penalty=1.5, ignore_eos=True
    )
    expected = _run_with_replacement(LLMEngine(config), prompt, sampling, None)
    assert _run_with_replacement(LLMEngine(config), prompt, sampling, 4) == expected
