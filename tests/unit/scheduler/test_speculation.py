"""Speculation in the scheduler: prompt-lookup proposals, who may speculate, and the rollback
of rejected slots in the block tables."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.ngram_proposer import WINDOW, propose_ngram
from services.scheduler.sequence import Sequence, SequenceGroup
from services.scheduler.speculation import Speculation, may_speculate
from shared.config import SpeculativeConfig
from shared.protocol import DRAFT_TOKEN
from shared.sampling import SamplingParams


def test_ngram_proposes_what_followed_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 4) == [4, 1, 2]
    # Suffix [2, 3] occurs once; [3] alone would match later, but the longer match wins.
    assert propose_ngram([5, 1, 2, 3, 7, 1, 9, 3, 8, 2, 3], 2, 1, 4) == [7, 1]
    assert propose_ngram([1, 2, 3], 3, 1, 4) == []  # no earlier occurrence
    assert propose_ngram([5, 1, 2, 3, 7, 3], 3, 2, 4) == []  # only 1-grams match; min is 2
    assert propose_ngram([9, 1, 2, 9, 1, 2], 5, 1, 2) == [9, 1, 2]  # fewer near the end


def test_ngram_searches_only_the_window():
    old = [7, 8] + [1] * (WINDOW + 5)
    assert propose_ngram(old + [7], 2, 1, 4) == []  # the earlier 7 is past the window


def _group(**sampling) -> SequenceGroup:
    params = SamplingParams(max_tokens=10, **sampling)
    return SequenceGroup("r", 0, params, [Sequence(0, 0, [1, 2, 3, 1, 2], 3)])


def test_requests_needing_their_history_inside_the_run_do_not_speculate():
    assert may_speculate(_group())
    assert may_speculate(_group(temperature=0.8, n=2, logprobs=2))
    assert not may_speculate(_group(repetition_penalty=1.2))
    assert not may_speculate(_group(presence_penalty=0.5))
    assert not may_speculate(_group(min_tokens=3))
    assert not may_speculate(_group(guided=("regex", "a+")))


def test_proposals_never_reach_past_max_tokens():
    spec = Speculation(
        SpeculativeConfig(method="ngram", ngram_min=1, num_tokens=5, adaptive=False),
        max_seq_len=100,
    )
    group = _group()
    seq = group.seqs[0]  # 2 outputs of 10: the step may return 8 tokens, so 7 proposals
    assert spec.propose(group, seq, room=100) == [3, 1, 2]  # all the lookup has
    seq.token_ids += [3, 1, 2, 3, 1, 2]  # 8 outputs: one proposal and the token after it
    assert spec.propose(group, seq, room=100) == [3]
    seq.token_ids.append(3)
    assert spec.propose(group, seq, room=100) == []
    draft = Speculation(
        SpeculativeConfig(method="draft", num_tokens=3, draft_model="d", adaptive=False),
        max_seq_len=100,
    )
    assert draft.propose(_group(), _group().seqs[0], room=2) == [DRAFT_TOKEN] * 2


def test_trim_returns_rejected_blocks_and_resends_the_table():
    manager = BlockManager(block_size=4, num_device_blocks=8, num_cpu_blocks=0)
    manager.allocate_slots(0, 0, 6)  # two blocks
    manager.take_table_update(0)
    manager.allocate_slots(0, 5, 4)  # speculation: positions 5 .. 8, a third block
    manager.take_table_update(0)
    assert len(manager.tables[0]) == 3 and manager.device.num_free == 5
    manager.trim(0, 7)  # positions 0 .. 6 valid: the third block held only rejected slots
    assert len(manager.tables[0]) == 2 and manager.device.num_free == 6
    manager.check()
    assert manager.take_table_update(0) == (manager.tables[0], True)  # stale copy replaced
    manager.trim(0, 7)  # nothing more to give back
    assert manager.device.num_free == 6
