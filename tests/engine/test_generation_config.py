"""The checkpoint's generation_config.json: its eos ids are stop ids, and its sampling values
become the executor's announced request defaults under --generation-config auto only."""

from __future__ import annotations

import dataclasses
import json

from services.executor.factory import make_executor
from tests.factories import engine_config, make_tiny_llama


def test_generation_config_eos_ids_and_sampling_defaults(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    path = model_dir / "generation_config.json"
    saved = json.loads(path.read_text())
    saved |= {"eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    saved |= {"top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 99}
    path.write_text(json.dumps(saved))
    config = engine_config(model_dir, num_device_blocks=16)
    ready = make_executor(config).ready()
    assert ready.eos_token_ids == (2, 7)
    assert ready.default_sampling == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
    }  # fmt: skip
    builtin = dataclasses.replace(
        config, model=dataclasses.replace(config.model, generation_config="vllm")
    )
    ready = make_executor(builtin).ready()
    assert ready.default_sampling == {} and ready.eos_token_ids == (2, 7)
