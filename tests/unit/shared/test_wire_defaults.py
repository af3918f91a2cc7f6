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


def _reference_record(value) -> list:
    """What a record encodes to, written out plainly: its field values (records inside encoded
    the same way), then the trailing ones equal to their defaults, in value and type, left off;
    requests from clients (checked on arrival) whole."""
    import dataclasses

    def plain(v):
        if dataclasses.is_dataclass(v):
            return _reference_record(v)
        if isinstance(v, list | tuple) and any(dataclasses.is_dataclass(x) for x in v):
            return [plain(x) for x in v]
        return v

    fields = dataclasses.fields(value)
    out = [plain(getattr(value, f.name)) for f in fields]
    if type(value) in wire._CHECKED:
        return out
    while out:
        f = fields[len(out) - 1]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            break
        default = plain(default)
        if type(out[-1]) is not type(default) or out[-1] != default:
            break
        out.pop()
    return out


def test_generated_record_encoders_write_what_the_plain_rule_says():
    from shared.protocol import PromptTargets, SeqDelta
    from shared.sampling import SamplingParams

    records = [
        ScheduledSeq(3, [5], 300, [], False, True),
        ScheduledSeq(3, [5], 300, [], False, True, sample_index=0, num_spec_tokens=0),
        ScheduledSeq(3, [5, 6], 0, [1, 2], True, False, [9], SamplingParams(n=2), 0, 2),
        ScheduledSeq(3, [5], 7, [], False, True, prompt_targets=PromptTargets(0, [4])),
        ScheduledSeq(3, [5], 7, [], False, True, rope_len=0),  # 0 is not the default None
        SampledToken(1, 2),
        SampledToken(1, 2, 0.0),
        SampledToken(1, 2, None, [(3, -0.5)]),
        SeqDelta(0, [1, 2]),
        SeqDelta(0, [], finish_reason="stop"),
        StepResult(1, [SampledToken(3, 7)], num_accepted=1),
        StepResult(1, [], num_proposed=False),  # a bool is not the default int 0
        StepPlan(2, [ScheduledSeq(3, [5], 300, [], False, True)], copies=[(1, 2)]),
        SamplingParams(temperature=0.0, stop_token_ids=(3,)),
    ]
    for record in records:
        assert wire._encoder(type(record))(record) == _reference_record(record), record
