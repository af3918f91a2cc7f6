"""A stream that falls behind gets what has queued as one delta: tokens, logprobs and finish
reasons merged per sample, never across an error; and the text it streams is unchanged."""

from __future__ import annotations

import asyncio
import time

from services.gateway.backend import BackendGone
from services.gateway.zmq_backend import coalesce
from shared.protocol import GenerateRequest, RequestDelta, SampledToken, SeqDelta, TokenDeltas
from shared.sampling import SamplingParams
from tests.service.stand_in_scheduler import STATS, stand_in_scheduler
from tests.support.polling import eventually


def _token(seq_id: int, token_id: int) -> SampledToken:
    return SampledToken(seq_id, token_id, logprob=-0.5)


def test_consecutive_deltas_merge_per_sample():
    ack = RequestDelta("r", [], False, num_prompt_tokens=7)
    one = RequestDelta(
        "r", [SeqDelta(0, [5], [_token(1, 5)]), SeqDelta(1, [6], [_token(2, 6)])], False
    )
    two = RequestDelta("r", [SeqDelta(1, [8], [_token(2, 8)], "stop")], False)
    three = RequestDelta("r", [SeqDelta(0, [9], [_token(1, 9)], "length")], True)
    [merged] = coalesce([ack, one, two, three])
    assert merged.finished and merged.num_prompt_tokens == 7
    assert [(s.index, s.token_ids, s.finish_reason) for s in merged.seqs] == [
        (0, [5, 9], "length"),
        (1, [6, 8], "stop"),
    ]
    assert [t.token_id for t in merged.seqs[0].logprobs] == [5, 9]
    assert one.seqs[0].token_ids == [5]  # the inputs are not changed


def test_errors_and_a_lost_backend_are_never_merged():
    one = RequestDelta("r", [SeqDelta(0, [5])], False)
    failed = RequestDelta("r", [], True, error={"message": "boom", "type": "server_error"})
    gone = BackendGone("gone")
    assert coalesce([one, failed]) == [one, failed]
    out = coalesce([one, RequestDelta("r", [SeqDelta(0, [6])], False), gone])
    assert len(out) == 2 and out[0].seqs[0].token_ids == [5, 6] and out[1] is gone


def test_a_sample_ended_by_error_or_abort_is_not_merged_into_the_tokens_before_it():
    # The gateway raises at such a sample: the tokens before it must come in their own delta.
    tokens = RequestDelta("r", [SeqDelta(0, [5]), SeqDelta(1, [6])], False)
    for reason in ("error", "abort"):
        ended = RequestDelta("r", [SeqDelta(0, [], [], reason)], True)
        assert coalesce([tokens, ended]) == [tokens, ended]


async def test_a_stream_that_fell_behind_reads_one_merged_delta(tmp_path):
    async with stand_in_scheduler(str(tmp_path / "ipc")) as stand_in:
        backend = stand_in.backend
        request = GenerateRequest("r1", [5, 6], SamplingParams(max_tokens=5), time.time())
        stream = backend.generate(request)
        first = asyncio.ensure_future(stream.__anext__())
        await stand_in.next_request()
        ack = RequestDelta("r1", [], False, num_prompt_tokens=2)
        await stand_in.send(TokenDeltas([ack], STATS))
        assert (await first).seqs == []
        # Five steps' deltas arrive before the consumer reads again.
        for i in range(5):
            reason = "length" if i == 4 else None
            delta = RequestDelta("r1", [SeqDelta(0, [10 + i], [], reason)], i == 4)
            await stand_in.send(TokenDeltas([delta], STATS))
        await eventually(lambda: len(backend._queues["r1"]._queue) >= 5)
        rest = [delta async for delta in stream]
        assert len(rest) == 1
        assert rest[0].finished and rest[0].seqs[0].token_ids == [10, 11, 12, 13, 14]
        assert rest[0].seqs[0].finish_reason == "length"
