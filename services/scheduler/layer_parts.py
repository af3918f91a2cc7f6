"""Deep prompt chunks in layer parts: how many tokens such a chunk takes and how many decoder
layers each step computes of it (ScheduledSeq.layers; the executor's side is
services/executor/layer_parts.py).

Under the CPU's per-request cap a chunk at context c costs r (1 + c / K) context-free tokens for
its r rows (token_budget.share), plus one read of the whole cached context in every layer,
which costs as much as R rows (ExecutorReady.context_read_rows) whatever r is: R c / K. Deep
enough, that read alone outweighs the cap and shrinking the chunk cannot bring its step back
within it (benchmarks/deep_chunk_attention.py: a one-row chunk 7,800 tokens deep costs two decode
steps). Computing the chunk's layers over several steps divides the whole cost, the read
included, among them; and since the read is shared by the chunk's rows, a chunk in parts
takes as many rows as the cap allows context-free, so the prompt moves about as fast as before
(faster, deep in it) while no step carries more than one cap of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LayerPart:
    """A chunk of a sequence's prompt computed over several steps."""

    num_tokens: int  # the chunk's tokens, from the sequence's num_computed_tokens
    layers_per_step: int  # while others decode or wait (alone, a step finishes the chunk)
    done: int = 0  # layers computed by the parts reported so far
    step_end: int = 0  # the layer this step's part ends at (set when it is planned)


def plan_layer_part(
    context: int,  # tokens already cached: where the chunk starts
    uncomputed: int,  # tokens of the sequence still to compute
    budget: int,  # tokens left in this step's budget
    cap: int,  # this step's cap on one request's prompt tokens, context-free
    context_cost_tokens: int,  # K
    read_rows: float,  # R
    num_layers: int,
) -> LayerPart | None:
    """The chunk at this context in parts, or None where one step holds it as today: where a
    cap's rows (or what the prompt or the budget has left) would cost less than two caps, so
    that parts would be one big and one small step, or where the model is not priced.

    A chunk in parts takes as many rows as the cap holds context-free (fewer where even one
    layer per step would not keep a part within the cap), and each step as many layers as keep
    its share of the chunk's cost within the cap."""
    if not (context_cost_tokens and read_rows and num_layers > 1):
        return None
    depth = context / context_cost_tokens  # a row's attention, in context-free tokens
    read = read_rows * depth
    per_row = 1 + depth
    most = math.floor((num_layers * cap - read) / per_row)
    rows = max(1, min(uncomputed, budget, cap, most))
    layers_per_step = max(1, math.floor(num_layers * cap / (rows * per_row + read)))
    if 2 * layers_per_step > num_layers:
        return None
    return LayerPart(rows, layers_per_step)
