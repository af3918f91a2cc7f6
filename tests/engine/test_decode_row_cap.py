"""--max-decode-rows-per-request: beside other requests, a request's n samples take turns for a
step's decode rows (so one n = 64 request cannot make every other stream's step 64 rows long),
and each sample's tokens stay what they are without the cap."""

from __future__ import annotations

from dataclasses import replace

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config
from tests.support.engine_runs import record_plans

WIDE = SamplingParams(n=12, max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
STREAM = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)


def _engine(model_dir, row_cap: int | None) -> LLMEngine:
    config = engine_config(model_dir)
    scheduler = replace(config.scheduler, max_decode_rows_per_request=row_cap)
    return LLMEngine(replace(config, scheduler=scheduler))


def _samples(output) -> list[list[int]]:
    return [o.token_ids for o in output.outputs]


def test_wide_request_takes_turns_beside_a_stream_and_keeps_its_samples(tiny_model_dir, prompts):
    alone = _engine(tiny_model_dir, 4)
    [wide_alone] = alone.generate([prompts[3]], WIDE)
    [stream_alone] = alone.generate([prompts[4]], STREAM)

    engine = _engine(tiny_model_dir, 4)
    plans = record_plans(engine)
    wide, stream = engine.generate([prompts[3], prompts[4]], [WIDE, STREAM])
    # The stream outlives the wide request: its sequence is the last plan's only one.
    [last] = plans[-1].seqs
    wide_rows = [
        sum(1 for s in p.seqs if s.seq_id != last.seq_id)
        for p in plans
        if any(s.seq_id == last.seq_id and len(s.token_ids) == 1 for s in p.seqs)
    ]
    assert wide_rows and max(wide_rows) == 4  # the cap binds while the stream decodes
    # Taking turns changes no sample's tokens (draws are keyed by position) nor the stream's.
    assert _samples(wide) == _samples(wide_alone)
    assert all(len(t) == WIDE.max_tokens for t in _samples(wide))
    assert _samples(stream) == _samples(stream_alone)
    manager = engine.scheduler.block_manager
    manager.check()
    assert manager.device.num_free == manager.device.num_blocks


def test_a_wide_request_alone_and_a_beam_search_take_every_row(tiny_model_dir, prompts):
    engine = _engine(tiny_model_dir, 4)
    plans = record_plans(engine)
    engine.generate([prompts[3]], WIDE)
    assert max(len(p.seqs) for p in plans) == WIDE.n  # alone: no other request to wait for

    plans.clear()
    beams = SamplingParams(
        n=6, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True
    )
    engine.generate([prompts[3], prompts[4]], [beams, STREAM])
    beam_rows = max(len(p.seqs) for p in plans)
    assert beam_rows >= 6 + 1  # every beam beside the stream: beams step together
