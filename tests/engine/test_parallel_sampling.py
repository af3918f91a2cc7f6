"""n > 1: forked samples share the prompt's blocks, copy on write, and stay reproducible."""

from __future__ import annotations

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.engine_runs import record_plans
from tests.support.reference_model import MAX_NEW_TOKENS, PROMPT_LENGTHS


def test_forked_samples_share_prompt_blocks_and_copy_on_write(tiny_model_dir, prompts, hf_greedy):
    # Greedy samples must all equal transformers' continuation: the copied last block carries
    # the right K/V and no sample writes into another's block.
    index = PROMPT_LENGTHS.index(33)  # 33 tokens: two full blocks and one partial block
    engine = LLMEngine(engine_config(tiny_model_dir, block_size=16))
    plans = record_plans(engine)
    manager = engine.scheduler.block_manager
    at_fork = {}

    def after_step(e: LLMEngine) -> None:
        manager.check()
        for group in e.scheduler.running:
            if group.forked and not at_fork:
                tables = [list(manager.tables[s.seq_id]) for s in group.seqs]
                at_fork["tables"] = tables
                at_fork["refs"] = [manager.device.ref_counts[b] for b in tables[0]]

    sampling = SamplingParams(n=3, max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    [output] = engine.generate([prompts[index]], sampling, on_step=after_step)

    # Right after the fork the three samples hold the same three blocks, each with ref count 3.
    assert at_fork["tables"][0] == at_fork["tables"][1] == at_fork["tables"][2]
    assert at_fork["refs"] == [3, 3, 3]
    copies = [pair for p in plans for pair in p.copies]
    # Two samples copied the shared partial block; the third then owned it and wrote in place.
    assert [src for src, _ in copies] == [at_fork["tables"][0][2]] * 2
    assert len({dst for _, dst in copies}) == 2
    assert [o.token_ids for o in output.outputs] == [hf_greedy[index]] * 3
    assert [o.index for o in output.outputs] == [0, 1, 2]
    assert manager.device.num_free == manager.device.num_blocks


def test_seeded_parallel_sampling_is_reproducible(tiny_model_dir, prompts):
    def run(seed: int) -> list[list[int]]:
        engine = LLMEngine(engine_config(tiny_model_dir))
        sampling = SamplingParams(n=4, max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        [output] = engine.generate([prompts[3]], sampling)
        return [o.token_ids for o in output.outputs]

    first = run(seed=42)
    assert first == run(seed=42)
    assert len({tuple(t) for t in first}) == 4  # the four samples are distinct streams
    assert first != run(seed=43)


def test_seeded_request_is_unaffected_by_its_batch(tiny_model_dir, prompts):
    # A seeded request's tokens depend on its seed, not on who shares the batch with it.
    sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    alone = LLMEngine(engine_config(tiny_model_dir)).generate([prompts[5]], sampling)
    crowd = LLMEngine(engine_config(tiny_model_dir)).generate(
        [prompts[2], prompts[5], prompts[9]],
        [SamplingParams(max_tokens=12, temperature=1.0), sampling, SamplingParams(max_tokens=5)],
    )
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
