"""Load --draft-model as the target is loaded, refusing drafts that cannot serve the target."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.ops import KernelOps
from services.executor.models import model_spec
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.quantize_model import calibration_token_ids, quantize_model
from services.executor.weights import load_hf_config, load_model
from shared.config import EngineConfig
from shared.model_source import resolve_model, source_gguf


def load_draft_model(
    config: EngineConfig,
    target: DecoderForCausalLM,
    target_dir: Path,
    max_model_len: int,
    dtype: torch.dtype,
    quantization: str,  # the target's resolved mode: the draft runs the same kernels
    ops: KernelOps,
    device: torch.device,
) -> DecoderForCausalLM:
    if config.parallel.tensor_parallel_size > 1:
        # The draft fills the plan on rank 0, after the plan went to the other ranks.
        raise ValueError("--speculative-method draft does not run with tensor parallelism")
    if target.spec.shared_window is not None:
        # The scheduler frees a windowed target's blocks behind the window, and the draft
        # recomputes its KV from the tokens those blocks held.
        raise ValueError("--speculative-method draft does not serve a sliding-window target")
    draft_dir = resolve_model(config.speculative.draft_model, config.model.download_dir)
    hf_config = load_hf_config(draft_dir)
    spec = model_spec(hf_config)  # refuses an architecture the registry does not serve
    limit = hf_config.max_position_embeddings
    if limit < max_model_len:
        raise ValueError(
            f"the draft model's context limit ({limit}) is below the target's max_model_len "
            f"({max_model_len}): lower --max-model-len"
        )
    check_same_vocabulary(target_dir, draft_dir, target.spec.vocab_size, spec.vocab_size)
    model = load_model(draft_dir, dtype, max_model_len, ops, device)
    if quantization != "none":
        gguf_path = source_gguf(draft_dir) if quantization == "int4" else None
        calibration = calibration_token_ids(draft_dir, max_model_len)
        quantize_model(
            model, quantization, gguf_path, calibration, draft_dir,
            config.model.int8_decode_kernel,
        )  # fmt: skip
    return model


def check_same_vocabulary(
    target_dir: Path, draft_dir: Path, target_vocab: int, draft_vocab: int
) -> None:
    """Proposals are token ids: the draft's must mean what the target's mean."""
    from transformers import AutoTokenizer

    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
            f"({target_vocab}): a draft must share the target's tokenizer"
        )
    target = AutoTokenizer.from_pretrained(target_dir, local_files_only=True).get_vocab()
    draft = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True).get_vocab()
    if target != draft:
        differing = len(set(target.items()) ^ set(draft.items()))
        raise ValueError(
            f"the draft model's tokenizer differs from the target's ({differing} entries of "
            f"their vocabularies differ): a draft must share the target's tokenizer"
        )
