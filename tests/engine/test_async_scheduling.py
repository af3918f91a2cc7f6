"""Async scheduling: step N+1 planned and run before step N's result is applied gives the same
tokens as the synchronous loop, frees every block, and wastes at most one token per stop."""

from __future__ import annotations

import math

import pytest

from services.engine.llm_engine import LLMEngine
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import PENDING_TOKEN, ExecutorReady, SampledToken, StepResult
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.engine_runs import CONTENDED_GREEDY
from tests.support.reference_model import MAX_NEW_TOKENS


def _run(engine: LLMEngine, prompts, params) -> tuple[list, list]:
    """(outputs in prompt order, plans made ahead); checks the pools after every step."""
    ahead_plans = []
    original = engine.scheduler.schedule_ahead

    def recording():
        plan = original()
        if plan is not None:
            ahead_plans.append(plan)
        return plan

    engine.scheduler.schedule_ahead = recording
    outputs = engine.generate(prompts, params, on_step=lambda e: e.scheduler.block_manager.check())
    manager = engine.scheduler.block_manager
    assert manager.device.num_free == manager.device.num_blocks
    assert not engine.scheduler.plans.inflight
    return [
        [(o.token_ids, o.finish_reason, o.logprobs, o.cumulative_logprob) for o in out.outputs]
        for out in outputs
    ], ahead_plans


def _without_logprobs(outputs: list) -> list:
    """Each sample's tokens, finish reason, and the token ids of its logprob records."""
    return [
        [
            (
                tokens,
                finish,
                [(t.token_id, [i for i, _ in t.top_logprobs or []]) for t in lps or []],
            )
            for tokens, finish, lps, _ in samples
        ]
        for samples in outputs
    ]


def _logprobs(outputs: list) -> list[float]:
    """Every logprob of every sample, flat: each token's, its top ones', the cumulative."""
    flat = []
    for samples in outputs:
        for _, _, lps, cumulative in samples:
            for t in lps or []:
                flat.append(t.logprob)
                flat.extend(v for _, v in t.top_logprobs or [])
            flat.append(cumulative)
    return [math.nan if v is None else v for v in flat]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_overlapped_greedy_equals_transformers_under_preemption(
    tiny_model_dir, contended_prompts, hf_greedy_contended, mode
):
    config = engine_config(
        tiny_model_dir,
        num_device_blocks=12,
        max_num_batched_tokens=128,
        preemption_mode=mode,
    )
    engine = LLMEngine(config, overlap_steps=True)
    outputs, ahead = _run(engine, contended_prompts, CONTENDED_GREEDY)
    assert [out[0][0] for out in outputs] == hf_greedy_contended
    assert engine.scheduler.num_preemptions >= 5
    # Steps really ran ahead, each on tokens only the executor knew when it was planned.
    assert len(ahead) >= 10
    assert all(s.token_ids == [PENDING_TOKEN] for p in ahead for s in p.seqs)


def test_overlapped_sampling_features_equal_the_synchronous_loop(tiny_model_dir, prompts):
    # Seeded draws, top-p/top-k, logprobs, penalties, n > 1 forks, best_of, stop tokens that
    # end samples early (so a step ran ahead for a finished sample) and beam search, in one
    # batch: every output, logprob and finish reason must match the loop that waits.
    params = [
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, logprobs=2),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, n=3, seed=3),
        SamplingParams(max_tokens=16, temperature=1.0, n=2, best_of=3, seed=11),
        SamplingParams(max_tokens=30, temperature=1.0, seed=5, stop_token_ids=list(range(3, 60))),
        SamplingParams(max_tokens=18, temperature=0.7, presence_penalty=0.5, seed=1),
        SamplingParams(max_tokens=12, use_beam_search=True, n=2, temperature=0.0),
        SamplingParams(max_tokens=25, temperature=1.2, frequency_penalty=0.3, seed=9),
    ]
    batch = prompts[: len(params)]

    def run(overlap: bool):
        config = engine_config(tiny_model_dir, num_device_blocks=64, max_num_batched_tokens=128)
        return _run(LLMEngine(config, overlap_steps=overlap), batch, params)

    synchronous, none_ahead = run(False)
    overlapped, ahead = run(True)
    assert not none_ahead
    assert ahead  # once the beam search ended, the rest decoded ahead
    # The same tokens and finish reasons; logprobs equal up to float rounding: a step planned
    # ahead still holds a sample that has just stopped, and on some CPUs (AVX-512) fp32 GEMMs
    # round a row differently when the batch has another row.
    assert _without_logprobs(overlapped) == _without_logprobs(synchronous)
    assert _logprobs(overlapped) == pytest.approx(
        _logprobs(synchronous), rel=1e-5, abs=1e-5, nan_ok=True
    )
    stopped = [out for out in synchronous[4] if out[1] == "stop"]
    assert stopped  # the stop tokens did end the sample early


def test_overlap_is_off_in_process_unless_asked_and_honours_the_config(tiny_model_dir, prompts):
    config = engine_config(tiny_model_dir)
    assert not LLMEngine(config).overlap_steps
    off = config.__class__(
        **{**config.__dict__, "scheduler": SchedulerConfig(async_scheduling=False)}
    )
    assert not LLMEngine(off, overlap_steps=True).overlap_steps


def _scheduler(**overrides) -> Scheduler:
    ready = ExecutorReady(64, 0, 4, 128, 100, (2,))
    return Scheduler(SchedulerConfig(**overrides), ready)


def _result(plan, token: int = 5) -> StepResult:
    return StepResult(plan.step_id, [SampledToken(s.seq_id, token) for s in plan.seqs if s.sample])


def test_schedule_ahead_only_when_the_next_step_needs_no_result():
    scheduler = _scheduler(max_num_batched_tokens=6)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scheduler.add_request("a", [3, 4, 5, 6], greedy)
    scheduler.add_request("b", [7, 8, 9, 10, 11], greedy)
    first = scheduler.schedule()  # a's prompt and a chunk of b's
    assert scheduler.schedule_ahead() is None  # b's prompt is not done: its next chunk waits
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.schedule()
    scheduler.update(_result(first))
    second = scheduler.schedule()  # a decodes, b finishes its prompt
    scheduler.update(_result(second))
    third = scheduler.schedule()  # both decode: a its third and last token, b its second
    assert [s.seq_id for s in third.seqs] == [0, 1]
    ahead = scheduler.schedule_ahead()
    # a ends with the token in flight; b's third token can be computed before its second is
    # known to the scheduler, at the next position.
    assert [(s.seq_id, s.start_pos, s.token_ids) for s in ahead.seqs] == [
        (1, third.seqs[1].start_pos + 1, [PENDING_TOKEN])
    ]
    assert scheduler.schedule_ahead() is None  # one step ahead at most
    updates = scheduler.update(_result(third))
    assert [u.group.request_id for u in updates if u.finished] == ["a"]
    assert scheduler.schedule_ahead() is None  # b's token in flight is its last
    [update] = scheduler.update(_result(ahead))
    assert update.finished and len(update.group.seqs[0].output_token_ids) == 3
    scheduler.block_manager.check()
    assert scheduler.block_manager.device.num_free == 64


def test_schedule_ahead_waits_only_for_a_request_that_could_start():
    scheduler = _scheduler(max_num_seqs=1)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scheduler.add_request("a", [3, 4, 5], greedy)
    scheduler.add_request("b", [6, 7], greedy)  # no seat while a runs
    scheduler.update(_result(scheduler.schedule()))  # a's prompt; b waits
    second = scheduler.schedule()
    assert scheduler.waiting
    # b could not start now either (no seat): a's next token runs ahead regardless.
    ahead = scheduler.schedule_ahead()
    assert [s.seq_id for s in ahead.seqs] == [s.seq_id for s in second.seqs]
    scheduler.update(_result(second))
    [update] = scheduler.update(_result(ahead))
    assert update.finished and update.group.request_id == "a"
    # a has left: the next step is synchronous and admits b at once.
    third = scheduler.schedule()
    assert [s.token_ids for s in third.seqs] == [[6, 7]]

    roomy = _scheduler(max_num_seqs=4)
    roomy.add_request("a", [3, 4, 5], greedy)
    first = roomy.schedule()
    roomy.update(_result(first))
    roomy.schedule()
    roomy.add_request("b", [6, 7], greedy)  # arrives while a decodes; a seat is free
    assert roomy.schedule_ahead() is None  # b starts in the next step, which must wait


def test_a_plan_that_fails_on_its_pending_tokens_still_releases_freed_sequences(tiny_model_dir):
    # A step ahead can fail (its pending token's step failed first); the sequences the
    # scheduler freed with it are never named again, so the executor must drop them anyway.
    from shared.protocol import ScheduledSeq, StepPlan

    executor = LLMEngine(engine_config(tiny_model_dir)).executor
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = StepPlan(0, [ScheduledSeq(9, [3, 4, 5], 0, [1], True, True, sampling=greedy)])
    assert executor.execute(first).error is None
    assert 9 in executor.block_tables and 9 in executor.sampling.seqs
    ahead = StepPlan(1, [ScheduledSeq(5, [PENDING_TOKEN], 3, [2], True, True)], freed_seq_ids=[9])
    result = executor.execute(ahead)
    assert result.error is not None and "no sampled token" in result.error
    assert 9 not in executor.block_tables and 9 not in executor.sampling.seqs


def test_a_step_launched_behind_one_in_flight_reads_its_inputs_on_the_device(tiny_model_dir):
    # The executor queues step N+1 before N's samples reach the host: N+1's pending inputs
    # come from N's sampled-id tensor. Results equal running the two one after the other,
    # and a sequence that N+1's plan frees (N sampled for it) leaves no state behind.
    from shared.protocol import ScheduledSeq, StepPlan

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)

    def plans() -> list[StepPlan]:
        prompts = [
            ScheduledSeq(1, [3, 4, 5], 0, [1], True, True, sampling=greedy),
            ScheduledSeq(2, [6, 7, 8, 9], 0, [2], True, True, sampling=seeded),
            ScheduledSeq(3, [10, 11], 0, [3], True, True, sampling=greedy),
        ]
        second = [ScheduledSeq(i, [PENDING_TOKEN], n, [], False, True) for i, n in ((1, 3), (2, 4))]
        third = [ScheduledSeq(i, [PENDING_TOKEN], n, [], False, True) for i, n in ((1, 4), (2, 5))]
        return [
            StepPlan(0, prompts),
            StepPlan(1, second, freed_seq_ids=[3]),  # 3 finished after its prompt step
            StepPlan(2, third),
        ]

    serial = LLMEngine(engine_config(tiny_model_dir)).executor
    expected = [serial.execute(plan).tokens for plan in plans()]

    executor = LLMEngine(engine_config(tiny_model_dir)).executor
    first, second, third = plans()
    flight0 = executor.launch(first)
    flight1 = executor.launch(second)  # step 0 not collected: inputs from its device tensor
    result0 = executor.collect(flight0)
    flight2 = executor.launch(third)
    got = [result0.tokens, executor.collect(flight1).tokens, executor.collect(flight2).tokens]
    assert all(r.error is None for r in (result0, flight1.result, flight2.result))
    assert got == expected
    assert 3 not in executor.sampling.seqs and 3 not in executor._last_sampled


def test_penalised_sequences_stay_overlapped_with_their_counts_kept_on_the_device(tiny_model_dir):
    # A sequence with penalties used to make the executor wait for the step in flight (its
    # counts read the sampled token on the host). Now the token is counted on the device from
    # the filled-in inputs: step N+1 launches without collecting N, and every draw equals
    # running the plans one after the other.
    from shared.protocol import ScheduledSeq, StepPlan

    strong = SamplingParams(
        max_tokens=8, temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0
    )
    repeat = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=3.0)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3, frequency_penalty=1.5)

    def plans() -> list[StepPlan]:
        out = [
            StepPlan(
                0,
                [
                    ScheduledSeq(1, [3, 4, 5], 0, [1], True, True, sampling=strong),
                    ScheduledSeq(2, [6, 7, 8, 9], 0, [2], True, True, sampling=repeat),
                    ScheduledSeq(3, [10, 11], 0, [3], True, True, sampling=seeded),
                ],
            )
        ]
        for step in range(1, 6):
            entries = [(1, 3), (2, 4), (3, 2)]
            seqs = [
                ScheduledSeq(i, [PENDING_TOKEN], n + step - 1, [], False, True) for i, n in entries
            ]
            out.append(StepPlan(step, seqs))
        return out

    serial = LLMEngine(engine_config(tiny_model_dir)).executor
    expected = [serial.execute(plan).tokens for plan in plans()]

    executor = LLMEngine(engine_config(tiny_model_dir)).executor
    collected_inside_launch = []
    launch, collect = executor.launch, executor.collect
    inside = [False]

    def watched_collect(flight):
        if inside[0]:
            collected_inside_launch.append(flight.step_id)
        return collect(flight)

    def watched_launch(plan):
        inside[0] = True
        try:
            return launch(plan)
        finally:
            inside[0] = False

    executor.collect = watched_collect
    flights, got = [], []
    for plan in plans():
        flights.append(watched_launch(plan))
        if len(flights) == 2:  # keep one step in flight behind the newest
            got.append(executor.collect(flights.pop(0)).tokens)
    got.append(executor.collect(flights.pop(0)).tokens)
    assert collected_inside_launch == []
    assert got == expected
    # The counts are the generated tokens, each once (none doubled, none lost).
    generated = {1: [], 2: [], 3: []}
    for tokens in expected[:-1]:  # the last step's draws are not fed back yet
        for t in tokens:
            generated[t.seq_id].append(t.token_id)
    for seq_id, tokens in generated.items():
        slot = executor.sampling.seqs[seq_id].penalty_slot
        counts = executor.sampling.penalties.output_counts[slot]
        assert int(counts.sum()) == len(tokens)
        for token in set(tokens):
            assert int(counts[token]) == tokens.count(token)


def test_a_grammar_waits_for_its_token_only_after_the_forward_pass_is_queued(
    tiny_model_dir, prompts
):
    # A sequence with a grammar used to stop the scheduler from planning ahead, and the
    # executor from launching a step before the one in flight was collected. Now the step is
    # planned ahead, its forward pass is queued first, and only its draws wait for the
    # previous token (the matcher must take it before the next bitmask): the same outputs as
    # the loop that waits, grammar and all.
    params = [
        SamplingParams(max_tokens=14, temperature=0.0, guided=("regex", "[a-z]{3,12}")),
        SamplingParams(max_tokens=14, temperature=0.9, seed=4, guided=("regex", "(ab|cd)+e?")),
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=1.0, seed=2, frequency_penalty=0.5),
    ]
    batch = prompts[: len(params)]

    def run(overlap: bool):
        config = engine_config(tiny_model_dir, num_device_blocks=64, max_num_batched_tokens=128)
        engine = LLMEngine(config, overlap_steps=overlap)
        executor = engine.executor
        events = []
        launch, model_forward, collect = executor.launch, executor.model.forward, executor.collect

        def watched_launch(plan):
            events.append("launch")
            try:
                return launch(plan)
            finally:
                events.append("launched")

        def forward(*args, **kwargs):
            events.append("forward")
            return model_forward(*args, **kwargs)

        def watched_collect(flight):
            events.append("collect")
            return collect(flight)

        executor.launch, executor.collect = watched_launch, watched_collect
        executor.model.forward = forward
        outputs, _ = _run(engine, batch, params)
        return outputs, events

    synchronous, _ = run(False)
    overlapped, events = run(True)
    assert overlapped == synchronous
    assert all(o[0][0] for o in overlapped[:2])  # the grammars did produce tokens
    # The first grammar ended (its stop token) while the others ran on: a step planned ahead
    # drew once more for it, past its matcher's end, and that token was dropped.
    assert overlapped[0][0][1] == "stop" and len(overlapped[0][0][0]) < 14
    # Collects made inside a launch (a grammar's token wanted): each after that launch's
    # forward pass.
    inside = []
    for i, event in enumerate(events):
        if event == "launch":
            end = events.index("launched", i)
            inside.append(events[i:end])
    waited = [e for e in inside if "collect" in e]
    assert waited  # steps with grammar rows did run ahead of their predecessor's result
    assert all(e.index("forward") < e.index("collect") for e in waited)
