"""What the scheduler tells a gateway per step: each sample's new tokens, its finish reason
once ended, the prompt's length; the one-sample, one-token delta of most steps the same as the
general path's."""

from __future__ import annotations

from services.scheduler.outputs import group_delta
from services.scheduler.scheduler import GroupUpdate
from services.scheduler.sequence import SeqStatus, Sequence, SequenceGroup
from shared.protocol import RequestDelta, SampledToken, SeqDelta
from shared.sampling import SamplingParams


def _group(n: int = 1, logprobs: int | None = None) -> SequenceGroup:
    seqs = [Sequence(10 + i, i, [5, 6, 7, 8], prompt_len=3) for i in range(n)]
    return SequenceGroup("r", 0, SamplingParams(n=n, logprobs=logprobs), seqs, forked=n > 1)


def test_one_sample_one_token():
    group = _group()
    seq = group.seqs[0]
    update = GroupUpdate(group, [(seq, SampledToken(seq.seq_id, 8))])
    assert group_delta(update) == RequestDelta("r", [SeqDelta(0, [8])], False, None, 3)


def test_one_sample_one_token_that_ends_it():
    group = _group()
    seq = group.seqs[0]
    seq.status, seq.finish_reason = SeqStatus.FINISHED, "stop"
    update = GroupUpdate(group, [(seq, SampledToken(seq.seq_id, 8))], finished=True)
    expected = RequestDelta("r", [SeqDelta(0, [8], [], "stop")], True, None, 3)
    assert group_delta(update) == expected


def test_logprobs_travel_with_their_tokens():
    group = _group(logprobs=1)
    seq = group.seqs[0]
    token = SampledToken(seq.seq_id, 8, -0.25, [(8, -0.25)])
    update = GroupUpdate(group, [(seq, token)])
    assert group_delta(update) == RequestDelta("r", [SeqDelta(0, [8], [token])], False, None, 3)


def test_parallel_samples_in_index_order_with_an_ended_one():
    group = _group(n=2)
    first, second = group.seqs
    second.status, second.finish_reason = SeqStatus.FINISHED, "length"
    update = GroupUpdate(
        group, [(second, SampledToken(second.seq_id, 4)), (first, SampledToken(first.seq_id, 9))]
    )
    delta = group_delta(update)
    assert delta.seqs == [SeqDelta(0, [9]), SeqDelta(1, [4], [], "length")]
    assert delta.num_prompt_tokens == 3


def test_step_deltas_put_plain_tokens_in_columns_that_stand_for_the_same_deltas():
    from services.scheduler.outputs import step_deltas

    plain, ended, with_logprobs, two = _group(), _group(), _group(logprobs=0), _group(n=2)
    for group, request_id in ((plain, "p"), (ended, "e"), (with_logprobs, "l"), (two, "t")):
        group.request_id = request_id
    ended.seqs[0].status, ended.seqs[0].finish_reason = SeqStatus.FINISHED, "length"
    updates = [
        GroupUpdate(plain, [(plain.seqs[0], SampledToken(10, 4))]),
        GroupUpdate(ended, [(ended.seqs[0], SampledToken(10, 5))], finished=True),
        GroupUpdate(with_logprobs, [(with_logprobs.seqs[0], SampledToken(10, 6, -0.5))]),
        GroupUpdate(two, [(two.seqs[1], SampledToken(11, 7))]),
    ]
    deltas, columns = step_deltas(updates)
    assert columns.request_ids == ["p"]
    assert columns.delta(0) == group_delta(updates[0])
    assert deltas == [group_delta(u) for u in updates[1:]]
