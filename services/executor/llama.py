"""Former home of the Llama-family decoder, now services/executor/models/; its names stay here
for the modules that import them."""

from __future__ import annotations

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.layers import (
    FLIPPED_ROWS,
    STATIC_ROPE_TYPES,
    RMSNorm,
    linear,
    linear_weight,
    rope_tables,
    rotate_half,
)
from services.executor.models.spec import ModelSpec

# Every decoder family shares the module names the quantizer replaces, so the base class is the
# type it takes; LlamaSpec is the spec of any family.
LlamaForCausalLM = DecoderForCausalLM
LlamaSpec = ModelSpec

__all__ = [
    "FLIPPED_ROWS",
    "STATIC_ROPE_TYPES",
    "LlamaForCausalLM",
    "LlamaSpec",
    "RMSNorm",
    "linear",
    "linear_weight",
    "rope_tables",
    "rotate_half",
]
