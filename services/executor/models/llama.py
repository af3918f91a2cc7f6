"""Llama 2/3/3.x and Mistral (and SmolLM2, a Llama): the plain pre-norm SwiGLU decoder."""

from __future__ import annotations

from services.executor.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)


class MistralForCausalLM(DecoderForCausalLM):
    # Every layer slides over the same window (sliding_window): the scheduler frees the blocks
    # that fall out of it.
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)
