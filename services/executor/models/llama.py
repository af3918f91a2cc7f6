"""Llama 2/3/3.x and Mistral (and SmolLM2, a Llama): the plain pre-norm SwiGLU decoder."""

from __future__ import annotations

from services.executor.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)


class MistralForCausalLM(DecoderForCausalLM):
    # Its sliding window is not applied by the attention kernels: model_setup.max_model_len
    # caps the context at the window, where windowed and full attention agree.
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)
