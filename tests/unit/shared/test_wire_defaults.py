"""Per-step records leave off their trailing default fields on the wire and come back whole."""

from __future__ import annotations

import msgpack

from shared import wire
from shared.protocol import SampledToken, ScheduledSeq, StepPlan, StepResult


def test_trailing_defaults_are_left_off_and_restored():
    decode_seq = ScheduledSeq(3, [5], 300, [], False, True)
    speculating = ScheduledSeq(4, [5, 6, 7], 300, [9], False, True, num_spec_tokens=2)
    # A deep chunk's layer part: the last field, a tuple that comes back a tuple.
    part = ScheduledSeq(5, [1, 2], 40, [], False, False, layers=(2, 4))
    plan = StepPlan(1, [decode_seq, speculating, part])
    data = wire.encode(plan)
    seqs = msgpack.unpackb(data)[2][1]
    assert len(seqs[0]) == 6  # through `sample`: every later field is at its default
    assert seqs[1][-1] == 2  # a set field keeps every field before it
    assert wire.decode(data) == plan
    assert wire.decode(data).seqs[2].layers == (2, 4)
    result = StepResult(1, [SampledToken(3, 7)] * 3, num_proposed=2, num_accepted=1)
    assert wire.decode(wire.encode(result)) == result
