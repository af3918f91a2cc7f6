"""Swap a loaded fp32 model's linear layers, embedding and LM head for quantized CPU ones."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from kernels.cpu_rows import load_row_ops
from services.executor.calibration_cache import cached_maxima
from services.executor.gguf_blocks import Q4_1, Q8_0, read_blocks
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.quantized import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    int_mm_has_fast_path,
)
from services.executor.smoothing import (
    ALPHA,
    CALIBRATION_TEXT,
    CALIBRATION_TOKENS,
    HEAD,
    input_maxima,
    smooth_layers,
    smoothed_head,
)
from shared.config import Int8DecodeKernel
from shared.model_source import is_embedded

QUANTIZATIONS = ("none", "int8", "int4")
# What `auto` means for the embedded model on a CPU, chosen from benchmarks/cpu_serving.py and
# benchmarks/quantized_quality.py (docs/benchmarks.md); every other model stays fp32.
EMBEDDED_CPU_DEFAULT = "int8"

log = logging.getLogger("pagedserve.executor")


def resolve_quantization(
    requested: str, model_dir: Path, device: torch.device, row_kernels: str = "auto"
) -> str:
    if requested != "auto":
        return requested
    if device.type != "cpu" or not is_embedded(model_dir):
        return "none"
    # Prompt chunks need a fast int8 GEMM: torch._int_mm where the CPU has VNNI, else the row
    # kernels (--cpu-row-kernels); with neither, int8 prefill is a plain loop, fp32 is faster.
    if int_mm_has_fast_path() or (row_kernels != "off" and load_row_ops() is not None):
        return EMBEDDED_CPU_DEFAULT
    log.warning("no fast int8 GEMM here (no VNNI, no CPU row kernels): the model stays fp32")
    return "none"


def quantize_model(
    model: DecoderForCausalLM,
    mode: str,
    gguf_path: Path | None = None,
    calibration_ids: list[int] | None = None,
    model_dir: Path | None = None,
    decode_kernel: Int8DecodeKernel = "auto",
) -> None:
    """In place. int8: int8 linears (activations quantized per row). int4: int4 linears,
    repacked from the GGUF's Q4_1 blocks when `gguf_path` holds them, else quantized from the
    fp32 weights. Both keep the embedding as int8 rows (the GGUF's Q8_0 blocks when present)
    and run the LM head as an int8 linear. With `calibration_ids` (calibration_token_ids), one
    fp32 pass over them first measures the activations, and SmoothQuant factors are folded into
    the int8 linears (int8) and the LM head (both): see smoothing.py. `model_dir`: where the
    weights came from, the key of the embedded model's cached maxima (calibration_cache.py).
    `decode_kernel` (--int8-decode-kernel): auto = int8 linears take calls of a few rows
    through fbgemm where it is exact (Int8Linear); int_mm = every call through _int_mm."""
    if mode == "none":
        return
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if model.shard.size > 1:
        raise ValueError("quantized weights are not supported with tensor parallelism")
    if model.cos.device.type != "cpu":
        raise ValueError("quantized weights use CPU kernels: run with --device cpu")
    few_rows = decode_kernel == "auto"
    spec = model.spec
    family = type(model)  # its declarations name the linears and how the checkpoint packs them
    linear_modules = family.quantizable_modules
    head_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if calibration_ids:
        maxima = cached_maxima(
            model_dir,
            calibration_ids,
            lambda: input_maxima(model, calibration_ids, linear_modules),
        )
        if mode == "int8":  # int4 keeps the GGUF's own blocks, which smoothing would change
            smooth_layers(model, maxima, ALPHA)
        smoothed = smoothed_head(model, maxima[HEAD], ALPHA)
        head_weight = head_weight if smoothed is None else smoothed
    blocks = (
        read_blocks(gguf_path, spec.num_heads, spec.num_kv_heads, family.packed_modules_mapping)
        if gguf_path
        else {}
    )
    for i, layer in enumerate(model.layers):
        for name in linear_modules:
            parent_name, child_name = name.split(".")
            parent = getattr(layer, parent_name)
            dense: nn.Linear = getattr(parent, child_name)
            parts = blocks.get(f"layers.{i}.{name}", [])
            if mode == "int4" and parts and all(isinstance(p, Q4_1) for p in parts):
                quantized = _int4_from_q4_1(parts, dense.bias)
            elif mode == "int4":
                quantized = Int4Linear.from_float(dense.weight, dense.bias)
            else:
                quantized = Int8Linear(dense.weight, dense.bias, few_rows)
            setattr(parent, child_name, quantized)
    embedding = blocks.get("embed_tokens", [None])[0]
    if isinstance(embedding, Q8_0):
        model.embed_tokens = Int8Embedding(embedding.q, embedding.d)
    else:
        model.embed_tokens = Int8Embedding.from_float(model.embed_tokens.weight)
    model.lm_head = Int8Linear(head_weight, None, few_rows)


def calibration_token_ids(model_dir: Path, max_model_len: int) -> list[int]:
    """The committed calibration text in the model's own tokens, at most CALIBRATION_TOKENS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tokenizer(CALIBRATION_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    return ids[: min(CALIBRATION_TOKENS, max_model_len)]


def _int4_from_q4_1(parts: list[Q4_1], bias: torch.Tensor | None) -> Int4Linear:
    return Int4Linear(
        torch.cat([p.q for p in parts]),
        torch.cat([p.d for p in parts]),
        torch.cat([p.m for p in parts]),
        bias,
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds: weights, quantized or not, and RoPE tables, and
    of the packed copies some layers keep for another kernel (Int8Linear.packed_bytes)."""
    tensors = [*model.parameters(), *model.buffers()]
    packed = sum(getattr(m, "packed_bytes", 0) for m in model.modules())
    return packed + sum(t.numel() * t.element_size() for t in tensors if t is not None)
