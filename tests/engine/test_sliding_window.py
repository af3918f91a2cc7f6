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
