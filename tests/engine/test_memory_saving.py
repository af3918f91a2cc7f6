"""The sharing benchmark's memory saving, on cases whose answer is known."""

from __future__ import annotations

from services.bench.memory_saving import measure
from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config


def _engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(engine_config(tiny_model_dir, block_size=16, num_device_blocks=64))


def test_two_samples_of_a_two_block_prompt_save_half(tiny_model_dir):
    # After the prompt step the two samples' tables list the prompt's 2 blocks each (4 listed,
    # 2 in use); the next step ends both, so that is the only step that counts: 1 - 2/4.
    sampling = SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=0, ignore_eos=True)
    run = measure(_engine(tiny_model_dir), [(list(range(3, 35)), sampling)])
    assert run["saving"] == 0.5 and run["saving_step_mean"] == 0.5


def test_a_single_sequence_saves_nothing_and_beams_save_more_than_samples(tiny_model_dir):
    prompt = list(range(3, 43))
    single = measure(
        _engine(tiny_model_dir), [(prompt, SamplingParams(max_tokens=20, ignore_eos=True))]
    )
    assert single["saving"] == 0.0
    samples = measure(
        _engine(tiny_model_dir),
        [(prompt, SamplingParams(n=4, max_tokens=20, seed=1, ignore_eos=True))],
    )
    beams = measure(
        _engine(tiny_model_dir),
        [
            (
                prompt,
                SamplingParams(
                    n=4, max_tokens=20, temperature=0.0, use_beam_search=True, ignore_eos=True
                ),
            )
        ],
    )
    # Samples share the prompt's 2 full blocks only; beams also share common output prefixes.
    assert 0 < samples["saving"] < beams["saving"] < 1


def test_text_prompts_are_windows_of_the_instructions_at_the_asked_length(tiny_model_dir):
    import random

    from transformers import AutoTokenizer

    from services.bench.text_prompts import INSTRUCTIONS, text_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    corpus = " ".join(INSTRUCTIONS)
    for length in (4, 19, 161):
        ids = text_prompt(tokenizer, length, random.Random(length))
        assert len(ids) == length
        words = tokenizer.decode(ids).split()
        # Every whole word inside the window is one of the text's (the ends may be cut).
        assert all(w in corpus for w in words[1:-1])
