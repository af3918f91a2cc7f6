"""A sliding-window model through the engine: when every layer is windowed (Mistral) the KV
blocks a sequence holds stay bounded by its window however long it runs, with transformers'
greedy tokens; a model with full-context layers (Gemma 2) keeps every block."""

from __future__ import annotations

import pytest

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.support.tiny_families import FAMILIES, VOCAB, hf_greedy, make_tiny_family

BLOCK_SIZE = 4
CHUNK = 16  # max_num_batched_tokens: the prompt is prefilled in two chunks
NEW_TOKENS = 60


def _held_blocks_per_step(engine: LLMEngine):
    """Runs `engine` on one 30-token prompt: after every step, (tokens computed, blocks held)
    of its sequence and the device blocks in use, read from the block manager as it runs; the
    tokens it generated and the prompt."""
    held, in_use = [], []

    def on_step(e: LLMEngine) -> None:
        manager = e.scheduler.block_manager
        manager.check()
        seqs = [s for g in e.scheduler.running for s in g.live_seqs()]
        held.extend((s.num_computed_tokens, len(manager.held_blocks(s.seq_id))) for s in seqs)
        in_use.append(manager.device.num_used)

    prompt = random_prompts([30], VOCAB, seed=21)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompt, greedy, on_step=on_step)
    tokens = outputs[0].outputs[0].token_ids
    return held, in_use, tokens, prompt[0]


# overlap_steps: each decode is planned while the previous one runs (async scheduling), so
# blocks are freed while a step that may read them is still in flight.
@pytest.mark.parametrize("overlap_steps", [False, True])
def test_a_windowed_sequence_holds_at_most_its_window_of_blocks(tmp_path, overlap_steps):
    model_dir = make_tiny_family(tmp_path, "mistral", seed=7)
    window = FAMILIES["mistral"][2]["sliding_window"]  # 24
    engine = LLMEngine(
        engine_config(model_dir, block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK),
        overlap_steps=overlap_steps,
    )
    assert engine.scheduler.block_manager.sliding_window == window
    planned_ahead = []
    schedule_ahead = engine.scheduler.schedule_ahead

    def recording_schedule_ahead():
        planned_ahead.append(schedule_ahead())
        return planned_ahead[-1]

    engine.scheduler.schedule_ahead = recording_schedule_ahead
    held, in_use, tokens, prompt = _held_blocks_per_step(engine)
    assert (sum(p is not None for p in planned_ahead) >= 10) == overlap_steps
    # A decode's window, W positions, spans at most ceil(W / block) + 1 blocks; a prompt chunk's
    # queries together see W - 1 + CHUNK positions.
    bound = -(-window // BLOCK_SIZE) + 1
    decoding = [n for computed, n in held if computed > len(prompt)]
    # The second chunk samples the first token; the step sampling the last ends the sequence.
    assert len(decoding) == NEW_TOKENS - 2
    assert max(decoding) == bound  # reached, never passed
    assert max(n for _, n in held) <= -(-(window - 1 + CHUNK) // BLOCK_SIZE) + 1
    assert max(in_use) <= -(-(window - 1 + CHUNK) // BLOCK_SIZE) + 1
    # Without freeing, the 90 tokens would have held 23 blocks; the context was not capped.
    assert -(-(len(prompt) + NEW_TOKENS) // BLOCK_SIZE) > 3 * bound
    assert tokens == hf_greedy(model_dir, tuple(prompt), NEW_TOKENS)


def test_a_windowed_sequence_longer_than_the_kv_pool_is_served(tmp_path):
    model_dir = make_tiny_family(tmp_path, "mistral", seed=7)
    # 12 blocks of 4 hold 48 tokens; a chunk of 16 after 23 tokens of window needs 11 blocks.
    config = engine_config(
        model_dir, block_size=BLOCK_SIZE, num_device_blocks=12, max_num_batched_tokens=CHUNK
    )
    engine = LLMEngine(config)
    prompt = random_prompts([60], VOCAB, seed=22)[0]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    output = engine.generate([prompt], greedy, on_step=lambda e: e.scheduler.block_manager.check())
    assert output[0].outputs[0].token_ids == hf_greedy(model_dir, tuple(prompt), 40)
    assert engine.scheduler.num_preemptions == 0


def test_forked_samples_free_behind_the_window_without_changing_a_token(tmp_path):
    # n > 1: the samples fork from the prompt's blocks, copy the shared last one on write and
    # release the shared ones behind the window one by one. Seeded draws must not notice.
    model_dir = make_tiny_family(tmp_path, "mistral", seed=7)
    prompt = random_prompts([30], VOCAB, seed=23)
    sampling = SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    runs = []
    for free_blocks in (True, False):
        engine = LLMEngine(engine_config(model_dir, block_size=BLOCK_SIZE))
        if not free_blocks:
            engine.scheduler.block_manager.sliding_window = None  # attention is windowed still
        most: list[int] = []

        def on_step(e: LLMEngine, most: list[int] = most) -> None:
            e.scheduler.block_manager.check()
            most.append(e.scheduler.block_manager.device.num_used)

        out = engine.generate(prompt, sampling, on_step=on_step)
        runs.append(([o.token_ids for o in out[0].outputs], max(most)))
    (freed_tokens, freed_most), (kept_tokens, kept_most) = runs
    assert freed_tokens == kept_tokens
    assert len({tuple(t) for t in freed_tokens}) == 3
    assert freed_most < kept_most


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_samples_draw_what_they_draw_unpreempted(tmp_path, mode):
    # Seeded draws are keyed by (seed, sample, position): preemption must not change a token,
    # also when samples resume or recompute with blocks freed behind the window.
    model_dir = make_tiny_family(tmp_path, "mistral", seed=7)
    prompts = random_prompts([30, 34, 38, 41], VOCAB, seed=24)
    sampling = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=6, ignore_eos=True)
    runs = []
    for num_blocks in (256, 24):
        config = engine_config(
            model_dir,
            block_size=BLOCK_SIZE,
            num_device_blocks=num_blocks,
            max_num_batched_tokens=CHUNK,
            preemption_mode=mode,
        )
        engine = LLMEngine(config)
        out = engine.generate(
            prompts, sampling, on_step=lambda e: e.scheduler.block_manager.check()
        )
        runs.append(([[o.token_ids for o in r.outputs] for r in out], engine.scheduler))
    (free_run, free_scheduler), (tight_run, tight_scheduler) = runs
    assert free_scheduler.num_preemptions == 0 and tight_scheduler.num_preemptions >= 1
    assert tight_run == free_run


def test_a_model_with_full_context_layers_keeps_every_block(tmp_path):
    model_dir = make_tiny_family(tmp_path, "gemma2", seed=7)
    engine = LLMEngine(
        engine_config(model_dir, block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK)
    )
    assert engine.scheduler.block_manager.sliding_window is None
    held, _, tokens, prompt = _held_blocks_per_step(engine)
    assert all(n == -(-computed // BLOCK_SIZE) for computed, n in held)
    # Seen running last with all but its last two tokens' K/V: 22 blocks, past the window's 7.
    assert max(computed for computed, _ in held) == len(prompt) + NEW_TOKENS - 2
    assert tokens == hf_greedy(model_dir, tuple(prompt), NEW_TOKENS)
