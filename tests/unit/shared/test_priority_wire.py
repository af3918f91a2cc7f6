"""The priority field travels from the gateway to the scheduler with the sampling parameters."""

from __future__ import annotations

import msgpack
import pytest

from shared import wire
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams


def test_priority_survives_the_wire():
    request = GenerateRequest("r", [1, 2], SamplingParams(priority=-7), 0.0)
    assert wire.decode(wire.encode(request)).sampling.priority == -7


def test_a_priority_of_the_wrong_type_is_refused_at_the_wire():
    plain = msgpack.unpackb(wire.encode(GenerateRequest("r", [1], SamplingParams(), 0.0)))
    sampling = plain[2][2]  # [version, name, [request_id, prompt, sampling, arrival]]
    assert sampling[-1] == 0
    sampling[-1] = "high"
    with pytest.raises(wire.WireError, match="field priority is a str"):
        wire.decode(msgpack.packb(plain))
