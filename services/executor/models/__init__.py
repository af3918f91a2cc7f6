"""The model registry: decoder families keyed by their Hugging Face `architectures` name."""

from __future__ import annotations

from services.executor.models.decoder import DecoderForCausalLM
from services.executor.models.gemma2 import Gemma2ForCausalLM
from services.executor.models.gemma3 import Gemma3ForCausalLM
from services.executor.models.llama import LlamaForCausalLM, MistralForCausalLM
from services.executor.models.mixtral import MixtralForCausalLM
from services.executor.models.olmo2 import Olmo2ForCausalLM
from services.executor.models.phi3 import Phi3ForCausalLM
from services.executor.models.qwen2 import Qwen2ForCausalLM
from services.executor.models.qwen3 import Qwen3ForCausalLM
from services.executor.models.qwen3_moe import Qwen3MoeForCausalLM
from services.executor.models.spec import KVLayout, ModelSpec

FAMILIES: tuple[type[DecoderForCausalLM], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Phi3ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    MixtralForCausalLM,
    Qwen3MoeForCausalLM,
    Olmo2ForCausalLM,
)
ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    name: family for family in FAMILIES for name in family.architectures
}
_BY_MODEL_TYPE = {kind: family for family in FAMILIES for kind in family.model_types}

__all__ = ["ARCHITECTURES", "FAMILIES", "KVLayout", "ModelSpec", "model_class", "model_spec"]


def model_class(hf_config) -> tuple[type[DecoderForCausalLM], str]:
    """The family class serving a transformers config, and the architecture name it matched.

    `architectures` decides; a config without it (built in code, never saved) falls back to its
    model_type."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name], name
    kind = getattr(hf_config, "model_type", None)
    if not names and kind in _BY_MODEL_TYPE:
        family = _BY_MODEL_TYPE[kind]
        return family, family.architectures[0]
    asked = ", ".join(names) if names else f"model_type {kind!r}"
    raise ValueError(
        f"architecture {asked} is not supported; pagedserve runs {', '.join(sorted(ARCHITECTURES))}"
    )


def model_spec(hf_config) -> ModelSpec:
    family, name = model_class(hf_config)
    return family.spec_from_config(hf_config, name)
