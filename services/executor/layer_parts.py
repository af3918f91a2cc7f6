"""Deep prompt chunks computed a few decoder layers per step (CPU reference backend).

A prompt chunk deep into a long prompt reads its whole cached context in every layer, however
few its rows: at 7,800 tokens of SmolLM2's context that read alone costs about two decode steps
(benchmarks/deep_chunk_attention.py), so no chunk size keeps the streams decoding beside it
within one step's time. The scheduler instead plans such a chunk in parts
(ScheduledSeq.layers): each step runs some of the chunk's layers and keeps its hidden states
here for the next part, so the read spreads over several steps while the chunk stays large
enough to share it among many rows. Parts come last in a plan; the rest of the step runs as
one batch, as always.
"""

from __future__ import annotations

import torch

from services.executor.input_batch import build_inputs
from shared.protocol import ScheduledSeq


def num_trailing_parts(seqs: list[ScheduledSeq]) -> int:
    """How many entries at the end of a plan are layer parts (the scheduler puts them last);
    a look at the last entry on most steps."""
    n = 0
    while n < len(seqs) and seqs[len(seqs) - 1 - n].layers is not None:
        n += 1
    return n


class LayerParts:
    """The hidden states of chunks between their parts, one per sequence."""

    def __init__(self, model: torch.nn.Module) -> None:  # the executor's DecoderForCausalLM
        self.model = model
        self.num_layers = model.spec.num_layers
        self.hidden: dict[int, torch.Tensor] = {}  # seq_id -> [chunk tokens, hidden]

    def run(
        self,
        parts: list[ScheduledSeq],
        tables: torch.Tensor,  # [len(parts), max_blocks] int64, same order
        mirrors: list[torch.Tensor | None] | None,  # [len(parts)] each part's context mirror
        kv_cache: torch.Tensor,  # the device pool, as the model takes it
        block_size: int,
    ) -> list[torch.Tensor]:  # per part that ends the chunk and samples: [1, hidden]
        """Run each part's layers; keep what the next part starts from."""
        last_rows = []
        for index, seq in enumerate(parts):
            first, end = seq.layers
            if not 0 <= first < end <= self.num_layers:
                raise ValueError(f"sequence {seq.seq_id}: layers {seq.layers} out of range")
            start = None
            if first > 0:
                start = self.hidden.pop(seq.seq_id, None)
                if start is None or start.shape[0] != len(seq.token_ids):
                    raise ValueError(
                        f"sequence {seq.seq_id}: layers from {first} without the part before"
                    )
            else:
                self.hidden.pop(seq.seq_id, None)  # a chunk started again (after a preemption)
            inputs = build_inputs(
                [seq],
                tables[index : index + 1],
                block_size,
                reference_views=True,
                mirrors=None if mirrors is None else mirrors[index : index + 1],
            )
            hidden = self.model(
                inputs.input_ids,
                inputs.positions,
                kv_cache,
                inputs.attention,
                layers=(first, end),
                hidden=start,
            )
            if end < self.num_layers:
                self.hidden[seq.seq_id] = hidden
            elif seq.sample:
                last_rows.append(hidden[-1:])
        return last_rows

    def forget(self, seq_id: int) -> None:
        self.hidden.pop(seq_id, None)
