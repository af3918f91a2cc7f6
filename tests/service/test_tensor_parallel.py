"""Tensor parallelism on the CPU with gloo: sharded ranks give the tokens one rank gives."""

from __future__ import annotations

import dataclasses
import time

import pytest

from services.engine.llm_engine import LLMEngine
from shared.config import ParallelConfig
from shared.sampling import SamplingParams
from tests.factories import engine_config, make_tiny_llama
from tests.support.reference_model import CONTENDED_NEW_TOKENS, MAX_NEW_TOKENS


def _parallel(config, size: int):
    return dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=size))


def _tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outputs]


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_greedy_equals_transformers(tiny_model_dir, prompts, hf_greedy, size):
    # The tiny model has 4 heads and 2 KV heads: size 4 also replicates each KV head twice.
    greedy = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLMEngine(_parallel(engine_config(tiny_model_dir), size)) as engine:
        outputs = engine.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_sharded_preemption_and_parallel_samples_match_one_rank(
    tiny_model_dir, contended_prompts, mode
):
    params = [
        SamplingParams(
            n=1 + i % 2,
            temperature=0.0 if i % 3 == 0 else 0.9,
            seed=i,
            max_tokens=CONTENDED_NEW_TOKENS,
            ignore_eos=True,
        )
        for i in range(len(contended_prompts))
    ]
    expected = LLMEngine(engine_config(tiny_model_dir)).generate(contended_prompts, params)
    tight = engine_config(tiny_model_dir, block_size=8, num_device_blocks=40, preemption_mode=mode)
    with LLMEngine(_parallel(tight, 2)) as engine:
        got = engine.generate(contended_prompts, params)
        assert engine.scheduler.num_preemptions >= 3
        engine.scheduler.block_manager.check()
    assert _tokens(got) == _tokens(expected)


def test_a_split_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(
    tiny_model_dir,
):
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide 4 attention"):
        LLMEngine(_parallel(engine_config(tiny_model_dir), 3))


def test_a_dead_rank_fails_the_step_and_ends_its_requests(tmp_path, prompts):
    model_dir = make_tiny_llama(tmp_path / "m", seed=3)
    engine = LLMEngine(_parallel(engine_config(model_dir), 2))
    try:
        engine.add_request(prompts[3], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        [worker] = engine.executor.ranks.workers
        worker.kill()
        worker.wait(30)
        assert not engine.executor.ranks_alive()
        deadline = time.monotonic() + 60
        finished = []
        while engine.has_unfinished() and time.monotonic() < deadline:
            finished += [u for u in engine.step() if u.finished]
        assert [u.group.seqs[0].finish_reason for u in finished] == ["error"]
        assert engine.scheduler.block_manager.device.num_free == (
            engine.scheduler.block_manager.device.num_blocks
        )
    finally:
        engine.close()


def test_a_failed_step_on_rank_0_stops_the_sharded_executor(tmp_path, prompts, monkeypatch):
    # The other rank may be waiting in a collective rank 0 will never issue: no way to go on.
    model_dir = make_tiny_llama(tmp_path / "m", seed=4)
    engine = LLMEngine(_parallel(engine_config(model_dir), 2))
    try:
        monkeypatch.setattr(engine.executor.sampling, "build", _raise)
        engine.add_request(prompts[2], SamplingParams(max_tokens=5))
        finished = [u for u in engine.step() if u.finished]
        assert [u.group.seqs[0].finish_reason for u in finished] == ["error"]
        assert not engine.executor.ranks_alive()
        [worker] = engine.executor.ranks.workers
        calls = _record_calls(monkeypatch, worker, "kill", "wait")
    finally:
        engine.close()
    # The waiting rank is stopped, not waited for: killed before close() first waits on it.
    assert calls[0] == "kill", calls


def _raise(*args, **kwargs):
    raise RuntimeError("injected failure on rank 0")


def _record_calls(monkeypatch, target, *names: str) -> list[str]:
    """The order in which `names` are called on `target` (each still does its work)."""
    calls: list[str] = []
    for name in names:
        method = getattr(target, name)

        def recorded(*args, _name=name, _method=method, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(target, name, recorded)
    return calls
