"""Every protocol message survives a msgpack round trip; foreign or stale envelopes are refused."""

from __future__ import annotations

import msgpack
import pytest

from shared.packed import pack_ints
from shared.protocol import (
    AbortRequest,
    CompileGrammar,
    ExecutorHeartbeat,
    ExecutorReady,
    ForgetGrammars,
    GatewayHello,
    GenerateRequest,
    GrammarCompiled,
    KvRequestState,
    KvState,
    KvStateRequest,
    PreemptionEvent,
    RequestDelta,
    SampledToken,
    ScheduledSeq,
    SchedulerReady,
    SchedulerStats,
    SeqDelta,
    Shutdown,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from shared.sampling import SamplingParams
from shared.structured import GrammarLimits
from shared.wire import MESSAGE_TYPES, PROTOCOL_VERSION, WireError, decode, encode

READY = ExecutorReady(1456, 1456, 16, 8192, 49152, (2,))
SAMPLING = SamplingParams(n=2, max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, seed=-3,
                          stop_token_ids=(7, 8), ignore_eos=True, logprobs=2)  # fmt: skip
TOKEN = SampledToken(4, 17, -0.25, [(17, -0.25), (3, -1.5)])

EXAMPLES = [
    READY,
    StepPlan(
        step_id=12,
        seqs=[
            ScheduledSeq(4, [1, 2, 3], 0, [5, 6], True, True, [9, 10], SAMPLING),
            ScheduledSeq(5, [7], 33, [8], False, True),
        ],
        swap_out=[(1, 0)],
        swap_in=[(2, 3)],
        copies=[(5, 11)],
        freed_seq_ids=[1, 2],
    ),
    StepResult(12, [TOKEN, SampledToken(5, 1)], {"forward": 0.5}, None),
    StepResult(13, [], {}, "RuntimeError: boom"),
    SchedulerReady(READY, 256, "SmolLM2-135M-Instruct"),
    SchedulerReady(READY, 8, "tiny", GrammarLimits(100, 5, 10, 3)),
    SchedulerReady(READY, 8, "tiny", GrammarLimits(), ("gpt-4o", "small")),
    CompileGrammar(7, "json_schema", '{"enum": ["a", "b"]}', [4, 9]),
    GrammarCompiled(7),
    GrammarCompiled(8, "compiling the regex constraint took longer than ..."),
    GrammarCompiled(9, "the grammar compiler crashed", "service_unavailable_error"),
    ForgetGrammars([4, 9]),
    GenerateRequest("req-1", [1, 2, 3], SAMPLING, 1764420000.5),
    AbortRequest("req-1"),
    TokenDeltas(
        [
            RequestDelta(
                "req-1",
                [SeqDelta(0, [17], [TOKEN], None), SeqDelta(1, [], [], "stop")],
                False,
                None,
                3,
            ),  # fmt: skip
            RequestDelta(
                "req-2",
                [],
                True,
                {
                    "message": "bad",
                    "type": "invalid_request_error",
                    "param": "prompt",
                    "code": None,
                },
            ),  # fmt: skip
        ],
        SchedulerStats(3, 1, 0, 40, 1456, 2, 99, 0.001, 0.2, 0.21, True),
    ),
    ExecutorHeartbeat(1234),
    Shutdown("bye"),
    KvStateRequest(),
    GatewayHello(),
    KvState(
        1764420001.25,
        16,
        pack_ints([1, 2, 0]),
        pack_ints([0, 0, -1]),
        pack_ints([1]),
        pack_ints([1]),
        [],
        [
            KvRequestState("req-1", "running", 2, 20, 3, 2),
            KvRequestState("req-2", "swapped", 1, 9, 4, 1),
        ],
        [PreemptionEvent(1764420000.75, "req-2", "swap")],
        1,
    ),  # fmt: skip
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message)) == message


def test_every_message_type_has_an_example():
    assert {type(m).__name__ for m in EXAMPLES} == set(MESSAGE_TYPES)


def test_tuples_and_nested_records_come_back_typed():
    plan = decode(encode(EXAMPLES[1]))
    assert isinstance(plan.seqs[0].sampling, SamplingParams)
    assert plan.seqs[0].sampling.stop_token_ids == (7, 8)
    assert plan.swap_out == [(1, 0)] and isinstance(plan.swap_out[0], tuple)


def test_foreign_and_stale_envelopes_are_refused():
    with pytest.raises(WireError, match="protocol"):
        decode(msgpack.packb([PROTOCOL_VERSION + 1, "Shutdown", [""]]))
    with pytest.raises(WireError, match="protocol"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "t": "Shutdown", "d": {"reason": ""}}))
    with pytest.raises(WireError, match="unknown message type"):
        decode(msgpack.packb([PROTOCOL_VERSION, "Pickle", []]))
    with pytest.raises(WireError, match="not a protocol message"):
        encode({"some": "dict"})


def test_malformed_records_are_wire_errors_not_crashes():
    # A record with a field missing, or a nested record that is not a list, is refused as a
    # WireError (a ValueError: the receiving loops drop the message and go on).
    with pytest.raises(WireError, match="malformed GenerateRequest"):
        decode(msgpack.packb([PROTOCOL_VERSION, "GenerateRequest", ["req-1", [1, 2]]]))
    with pytest.raises(WireError, match="malformed StepPlan"):
        decode(msgpack.packb([PROTOCOL_VERSION, "StepPlan", [1, [7], [], [], [], []]]))
    with pytest.raises(WireError, match="not a msgpack message"):
        decode(b"\xc1")
    # Requests are checked field by field: no sampling parameters, an unhashable id.
    with pytest.raises(WireError, match="field sampling"):
        decode(msgpack.packb([PROTOCOL_VERSION, "GenerateRequest", ["r", [5, 6], None, 0.0]]))
    with pytest.raises(WireError, match="field request_id"):
        decode(msgpack.packb([PROTOCOL_VERSION, "AbortRequest", [["r"]]]))
    # A fixed-length tuple of the wrong length.
    bad_swap = [1, [], [[1, 2, 3]], [], [], []]
    with pytest.raises(WireError, match="tuple of 2"):
        decode(msgpack.packb([PROTOCOL_VERSION, "StepPlan", bad_swap]))


def test_records_travel_as_positional_lists():
    # No field names on the wire: a 256-sequence decode plan stays small.
    plan = StepPlan(1, [ScheduledSeq(i, [5], 300, [], False, True) for i in range(256)])
    data = encode(plan)
    assert len(data) < 16 * 256
    assert b"seq_id" not in data
    assert decode(data) == plan
