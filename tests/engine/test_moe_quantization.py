"""int8 and int4 refuse a mixture-of-experts model by name of the reason, before quantizing."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.llm_engine import LLMEngine
from tests.factories import engine_config
from tests.support.tiny_families import make_tiny_family


def test_quantizing_a_mixture_of_experts_model_is_refused(tmp_path):
    config = engine_config(make_tiny_family(tmp_path, "mixtral", seed=7))
    for mode in ("int8", "int4"):
        model = dataclasses.replace(config.model, quantization=mode)
        with pytest.raises(ValueError, match=f"--quantization {mode}: mixture-of-experts models"):
            LLMEngine(dataclasses.replace(config, model=model))
