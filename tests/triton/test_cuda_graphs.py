"""Decode steps through the CUDA-graph path: padded to a bucket, static buffers, same tokens.

On the CPU the padded static-buffer path runs eagerly with the Triton kernels interpreted (all
but the capture itself); on a GPU, captured graphs against --enforce-eager.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine.llm_engine import LLMEngine
from services.executor.cuda_graphs import DecodeGraphs, batch_buckets
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts

INTERPRETED = not torch.cuda.is_available()


def test_buckets_are_powers_of_two_then_steps_of_eight():
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(256)[-2:] == [248, 256]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


def test_padded_static_decode_path_gives_the_eager_tokens(tiny_model_dir):
    # Five prompts, two of them short-lived: decode batches of 5, then 3 (bucket 4: one padding
    # row that must write nowhere and attend to nothing), with block tables of several widths.
    prompts = random_prompts([3, 9, 17, 2, 30], 384, seed=4)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3, 6, 2, 6)
    ]
    config = engine_config(tiny_model_dir, block_size=8, max_num_seqs=6, attention_backend="triton")

    def run(graphs: bool) -> tuple[list[list[int]], list[int]]:
        engine = LLMEngine(config)
        batches = []
        if graphs:
            executor = engine.executor
            static = DecodeGraphs(
                executor.model,
                executor.cache.device,
                executor.cache.block_size,
                executor.block_tables.max_blocks,
                config.scheduler.max_num_seqs,
                capture=False,
            )
            original = static.run

            def recording(input_ids, meta):
                batches.append(input_ids.shape[0])
                return original(input_ids, meta)

            static.run = recording
            executor.graphs = static
        outputs = engine.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outputs], batches

    eager, none = run(False)
    padded, batches = run(True)
    assert not none
    assert padded == eager
    assert 5 in batches and 3 in batches  # full and padded buckets both ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_on_and_off_give_identical_greedy_tokens(tiny_model_dir):
    prompts = random_prompts([3, 9, 17, 2, 30, 64, 1, 40, 5, 12], 384, seed=4)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = engine_config(tiny_model_dir, block_size=16, max_num_seqs=16)

    def run(enforce_eager: bool) -> list[list[int]]:
        model = dataclasses.replace(
            base.model, device="cuda", attention_backend="triton", enforce_eager=enforce_eager
        )
        engine = LLMEngine(dataclasses.replace(base, model=model))
        assert (engine.executor.graphs is None) == enforce_eager
        return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]

    assert run(False) == run(True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steps_launched_behind_the_one_in_flight_give_the_serial_tokens(tiny_model_dir):
    # On a GPU a launch returns before the device has run the step: the next step's inputs
    # come from the previous step's sampled-id tensor, ordered by the stream alone.
    prompts = random_prompts([3, 9, 17, 2, 30, 64, 1, 40, 5, 12], 384, seed=5)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=9, ignore_eos=True)
    base = engine_config(tiny_model_dir, block_size=16, max_num_seqs=16)
    model = dataclasses.replace(base.model, device="cuda", attention_backend="triton")
    config = dataclasses.replace(base, model=model)

    def run(overlap: bool, sampling: SamplingParams) -> list[list[int]]:
        engine = LLMEngine(config, overlap_steps=overlap)
        return [o.outputs[0].token_ids for o in engine.generate(prompts, sampling)]

    for sampling in (greedy, seeded):
        assert run(True, sampling) == run(False, sampling)
    # Prompt chunks that sample nothing (a step whose only copy-out is its timings) too.
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=16)
    )
    assert run(True, greedy) == run(False, greedy)
