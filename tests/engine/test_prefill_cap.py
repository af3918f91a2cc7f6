"""A long prompt's share of each step while other streams decode, and the per-device defaults."""

from __future__ import annotations

from dataclasses import replace

from services.config_args import engine_argv, engine_config_from_args
from services.engine.llm_engine import LLMEngine
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import ExecutorReady
from tests.factories import engine_config
from tests.support.engine_runs import generate_recording_plans
from tests.support.scheduler_steps import add, make_scheduler, step


def capped(cap: int | None, budget: int = 32, context_cost_tokens: int = 0) -> Scheduler:
    scheduler = make_scheduler(
        num_device_blocks=64, max_num_batched_tokens=budget, max_model_len=128
    )
    config = replace(scheduler.config, max_prefill_tokens_per_request=cap)
    ready = ExecutorReady(
        64, 16, 4, 128, 100, (2,), device_type="cuda", context_cost_tokens=context_cost_tokens
    )
    return Scheduler(config, ready)


def shares(plan) -> dict[int, int]:
    return {s.seq_id: len(s.token_ids) for s in plan.seqs}


def test_a_long_prompt_beside_decoding_streams_takes_at_most_the_cap_per_step():
    scheduler = capped(cap=8)
    for name in ("s1", "s2"):
        add(scheduler, name, 3, max_tokens=40)
    step(scheduler)  # both prompts in one step: nobody decodes yet, so no cap
    long = add(scheduler, "long", 70, first=20, max_tokens=2)
    seq = long.seqs[0]
    chunks = []
    while seq.num_computed_tokens < seq.prompt_len:
        plan, _ = step(scheduler)
        share = shares(plan)
        assert share[0] == share[1] == 1  # each stream gets its token every step
        chunks.append(share[seq.seq_id])
    # Capped at 8 of the budget's 32 while the streams decode (the budget has room for more).
    assert chunks == [8] * 8 + [6]


def test_chunks_deep_into_a_prompt_are_smaller_by_their_attention_cost():
    # context_cost_tokens 20: a chunk at context c costs (1 + c/20) times a context-free one,
    # so the cap of 16 context-free tokens buys 16 * 20 // (20 + c) tokens at context c.
    scheduler = capped(cap=16, context_cost_tokens=20)
    add(scheduler, "s", 3, max_tokens=60)
    step(scheduler)
    long = add(scheduler, "long", 60, first=20, max_tokens=2)
    seq = long.seqs[0]
    chunks = []
    while seq.num_computed_tokens < seq.prompt_len:
        context = seq.num_computed_tokens
        plan, _ = step(scheduler)
        chunks.append(shares(plan)[seq.seq_id])
        assert chunks[-1] == min(max(1, 16 * 20 // (20 + context)), seq.prompt_len - context)
    assert chunks[:4] == [16, 8, 7, 6]  # at contexts 0, 16, 24 and 31


def test_a_lone_prompt_deep_into_its_context_takes_the_budget_context_free():
    scheduler = capped(cap=8, context_cost_tokens=20)
    long = add(scheduler, "long", 75, first=20, max_tokens=2)
    seq = long.seqs[0]
    chunks = []
    while seq.num_computed_tokens < seq.prompt_len:
        plan, _ = step(scheduler)
        chunks.append(shares(plan)[seq.seq_id])
    # 32 context-free tokens: 32 * 20 // (20 + c) at contexts 0, 32, 44 and 54
    assert chunks[:4] == [32, 12, 10, 8] and sum(chunks) == 75


def test_the_cap_grows_to_the_number_of_decoding_sequences():
    # Ten streams decode: a step already computes ten tokens, so a prompt may add as many.
    scheduler = capped(cap=4, budget=64)
    for i in range(10):
        add(scheduler, f"s{i}", 2, max_tokens=40)
    step(scheduler)
    long = add(scheduler, "long", 60, first=20, max_tokens=2)
    plan, _ = step(scheduler)
    assert shares(plan)[long.seqs[0].seq_id] == 10


def test_the_cap_grows_to_the_decode_rows_not_to_a_wide_requests_samples():
    # Beside other requests a request of n = 10 decodes at most 6 of its samples per step
    # (the decode-row cap): a prompt's chunk grows to those 6 rows, not to the 10 samples.
    scheduler = capped(cap=4, budget=64)
    scheduler.decode_row_cap = 6
    add(scheduler, "wide", 3, n=10, temperature=1.0, max_tokens=40)
    step(scheduler)
    step(scheduler)  # its ten samples decode, alone: every row
    long = add(scheduler, "long", 60, first=20, max_tokens=2)
    seq = long.seqs[0]
    rows, chunks = [], []
    for _ in range(3):
        plan, _ = step(scheduler)
        share = shares(plan)
        chunks.append(share.pop(seq.seq_id))
        rows.append(len(share))
    # Joining, the prompt meets the wide request alone in the running set: all ten rows, and a
    # chunk of ten. Then the wide request takes turns for six rows, and the chunk is six.
    assert rows == [10, 6, 6]
    assert chunks == [10, 6, 6]


def test_a_lone_long_prompt_still_takes_the_whole_budget():
    scheduler = capped(cap=8)
    long = add(scheduler, "long", 70, first=20, max_tokens=2)
    plan, _ = step(scheduler)
    assert shares(plan) == {long.seqs[0].seq_id: 32}


def test_a_request_arriving_beside_a_long_prompt_starts_at_once():
    # Without the cap while requests wait, the long prompt would take every step's budget
    # until it was done, and the newcomer's first token would wait for all of it.
    scheduler = capped(cap=8)
    long = add(scheduler, "long", 75, first=20, max_tokens=2)
    step(scheduler)
    short = add(scheduler, "short", 5, first=50, max_tokens=4)
    plan, _ = step(scheduler)
    assert shares(plan) == {long.seqs[0].seq_id: 8, short.seqs[0].seq_id: 5}
    plan, _ = step(scheduler)  # the newcomer decodes: the long prompt stays capped
    assert shares(plan) == {long.seqs[0].seq_id: 8, short.seqs[0].seq_id: 1}


def test_no_cap_and_a_cap_at_the_budget_leave_chunks_as_they_were():
    for cap in (None, 32, 1000):
        scheduler = capped(cap)
        add(scheduler, "s", 3, max_tokens=40)
        step(scheduler)
        long = add(scheduler, "long", 70, first=20, max_tokens=2)
        plan, _ = step(scheduler)
        assert shares(plan)[long.seqs[0].seq_id] == 31, cap


def test_defaults_depend_on_the_executors_device():
    config = SchedulerConfig()
    assert (config.token_budget("cpu"), config.prefill_cap("cpu")) == (512, 32)
    for device in ("cuda", "sim"):
        assert (config.token_budget(device), config.prefill_cap(device)) == (2048, None)
    explicit = SchedulerConfig(max_num_batched_tokens=2048, max_prefill_tokens_per_request=64)
    assert (explicit.token_budget("cpu"), explicit.prefill_cap("cuda")) == (2048, 64)
    ready = ExecutorReady(64, 16, 4, 128, 100, (2,), device_type="cpu")
    scheduler = Scheduler(config, ready)
    assert (scheduler.token_budget, scheduler.prefill_cap) == (512, 32)
    # Without chunked prefill no prompt is split, so there is nothing to cap.
    whole = Scheduler(replace(config, enable_chunked_prefill=False), ready)
    assert whole.prefill_cap is None


def test_the_flags_default_to_the_device_and_pass_on_to_child_processes():
    import argparse

    from services.config_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    scheduler = engine_config_from_args(args).scheduler
    assert scheduler.max_num_batched_tokens is None
    assert scheduler.max_prefill_tokens_per_request is None
    assert "--max-num-batched-tokens" not in engine_argv(args, None)
    args = parser.parse_args(["--max-num-batched-tokens", "64"])
    args = parser.parse_args(engine_argv(args, None) + ["--max-prefill-tokens-per-request", "16"])
    scheduler = engine_config_from_args(parser.parse_args(engine_argv(args, None))).scheduler
    assert (scheduler.max_num_batched_tokens, scheduler.max_prefill_tokens_per_request) == (64, 16)


def test_greedy_output_with_capped_chunks_equals_transformers(tiny_model_dir, prompts, hf_greedy):
    config = engine_config(tiny_model_dir, max_num_batched_tokens=96)
    config = replace(config, scheduler=replace(config.scheduler, max_prefill_tokens_per_request=8))
    engine = LLMEngine(config)
    # Shortest first: they decode while longer ones fill.
    outputs, plans = generate_recording_plans(engine, prompts)
    assert outputs == hf_greedy
    # Some prompt was computed 8 tokens at a time beside streams that decoded.
    assert any(
        any(len(s.token_ids) == 8 and not s.sample for s in p.seqs)
        and any(len(s.token_ids) == 1 for s in p.seqs)
        for p in plans
    )


def test_int8_weights_price_context_higher(tiny_model_dir):
    # Attention stays fp32 while int8 linear layers run ~5x faster: a context token costs a
    # chunk 5x more of its linear work, so deep chunks get smaller.
    config = engine_config(tiny_model_dir)
    plain = LLMEngine(config).executor.ready().context_cost_tokens
    int8 = replace(config, model=replace(config.model, quantization="int8"))
    assert LLMEngine(int8).executor.ready().context_cost_tokens == plain // 5 > 0
