"""The engine with the Triton backend (interpreted on CPU) gives the reference backend's tokens."""

from __future__ import annotations

import pytest

from kernels.ops import resolve_backend
from services.cli import main as cli_main
from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts


def test_triton_backend_greedy_tokens_equal_the_torch_backend(tiny_model_dir):
    # Prompts of 3, 17 and 40 tokens with a 32-token budget: a fresh prefill, a chunk that
    # continues a cached partial block, mixed prefill/decode steps and pure decode steps.
    prompts = random_prompts([3, 17, 40], 384, seed=9)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(backend: str) -> list[list[int]]:
        config = engine_config(
            tiny_model_dir, block_size=8, max_num_batched_tokens=32, attention_backend=backend
        )
        engine = LLMEngine(config)
        assert engine.executor.ops.name == backend
        return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]

    assert run("triton") == run("torch")


def test_triton_off_cuda_without_the_interpreter_is_a_clear_error(
    monkeypatch, tmp_path, capsys, tiny_model_dir
):
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    argv = ["generate", "--input", str(src), "--output", "-", "--model", str(tiny_model_dir)]
    assert cli_main([*argv, "--attention-backend", "triton", "--device", "cpu"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err
