"""A step's grammar bitmask reaches the logits' device through host_to_device (pinned and
non-blocking on a GPU): a pageable upload would wait for the step in flight."""

from __future__ import annotations

import torch

from services.executor import sampling_state
from services.executor.sampling_state import Draw, SamplingStates
from shared.sampling import SamplingParams


class _AllowEven:
    """A matcher that allows the even token ids."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0x55555555  # bits 0, 2, 4, ... of every 32-token word

    def is_terminated(self) -> bool:
        return False


def test_the_bitmask_is_uploaded_through_host_to_device(monkeypatch):
    uploads = []
    upload = sampling_state.host_to_device

    def watched(tensor, device):
        uploads.append((tuple(tensor.shape), tensor.dtype))
        return upload(tensor, device)

    monkeypatch.setattr(sampling_state, "host_to_device", watched)
    vocab = 64
    states = SamplingStates(vocab, (1,), torch.device("cpu"), 0, lambda seq, g: _AllowEven())
    states.add(0, SamplingParams(max_tokens=4, guided=("regex", "a+")))
    states.add(1, SamplingParams(max_tokens=4))
    batch = states.build([Draw(0, 0), Draw(1, 1)])
    assert ((2, vocab // 32), torch.int32) in uploads
    assert batch.grammar_rows == [0]
    assert batch.grammar_bitmask[0, 0].item() == 0x55555555
