"""Every registry family through `pagedserve generate` (the CLI's argument parsing, engine config
and JSONL output) gives transformers' greedy tokens; two families also under block size 1,
forced swap and forced recompute. The in-process family tests cover the full variant matrix."""

from __future__ import annotations

import json

import pytest

from services.cli import main as cli_main
from services.engine import offline
from tests.factories import random_prompts
from tests.support.tiny_families import FAMILIES, VOCAB, hf_greedy, make_tiny_family

NEW_TOKENS = 12
# fp32 weights on the torch reference, as transformers runs them; no --quantization auto guess.
EXACT = ["--device", "cpu", "--dtype", "float32", "--quantization", "none"]
EXACT += ["--attention-backend", "torch", "--max-tokens", str(NEW_TOKENS), "--ignore-eos"]
# Single tokens, a block boundary, and prompts longer than the 32-token budget (chunked prefill)
# and than the sliding families' windows; then a 48-token prompt and two that extend it, so
# prefix caching (on by default) has blocks to hit.
LENGTHS = [1, 16, 17, 77]
SHARED_PREFIX = 48
# Mid-length requests that outgrow the small pools below together: preemptions.
CONTENDED = [5, 20, 35, 47, 60, 16, 33]
# Families whose variants also run through the CLI: alternating sliding/global layers with
# soft-capping, and a mixture of experts with more experts than a decode step's tokens.
VARIANT_FAMILIES = ["gemma2", "qwen3-moe"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp(request.param), request.param, seed=7)


@pytest.fixture(scope="module", params=VARIANT_FAMILIES)
def variant_family_dir(request, tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp(request.param), request.param, seed=7)


def _shared_prefix_prompts() -> list[list[int]]:
    shared = random_prompts([SHARED_PREFIX], VOCAB, seed=13)[0]
    return [shared] + [shared + tail for tail in random_prompts([3, 21], VOCAB, seed=14)]


def _generate(model_dir, prompts, tmp_path, monkeypatch, *flags: str):
    """One `pagedserve generate` run over `prompts`: each prompt's tokens and the engine it ran
    (kept by wrapping run_generate, to read its preemption and prefix-cache counters)."""
    engines = []

    def keep_engine(args, engine):
        engines.append(engine)
        return run_generate(args, engine)

    run_generate = offline.run_generate
    monkeypatch.setattr(offline, "run_generate", keep_engine)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    argv = ["generate", "--model", str(model_dir), "--input", str(src), "--output", str(dst)]
    assert cli_main(argv + EXACT + list(flags)) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert all(row["finish_reason"] == "length" for row in rows)
    (engine,) = engines
    return [row["token_ids"] for row in rows], engine


def _reference(model_dir, prompts) -> list[list[int]]:
    return [hf_greedy(model_dir, tuple(p), NEW_TOKENS) for p in prompts]


def test_family_generate_matches_transformers(family_dir, tmp_path, monkeypatch):
    prompts = random_prompts(LENGTHS, VOCAB, seed=11) + _shared_prefix_prompts()
    flags = ["--num-device-blocks", "256", "--max-num-batched-tokens", "32"]
    tokens, engine = _generate(family_dir, prompts, tmp_path, monkeypatch, *flags)
    assert tokens == _reference(family_dir, prompts)
    # Each later prompt of the shared prefix reused at least two of its three shared blocks.
    assert engine.scheduler.prefix_cache_hit_tokens >= 2 * 32


@pytest.mark.parametrize(
    "flags",
    [
        # Pools of 80 token slots: the longest request fits alone (72), not beside the others.
        ["--block-size", "1", "--num-device-blocks", "80", "--preemption-mode", "swap"],
        ["--block-size", "16", "--num-device-blocks", "5", "--preemption-mode", "recompute"],
    ],
    ids=["block-size-1-swap", "recompute"],
)
def test_family_generate_matches_transformers_under_preemption(
    variant_family_dir, flags, tmp_path, monkeypatch
):
    prompts = random_prompts(CONTENDED, VOCAB, seed=12)
    flags = [*flags, "--max-num-batched-tokens", "64"]
    tokens, engine = _generate(variant_family_dir, prompts, tmp_path, monkeypatch, *flags)
    assert tokens == _reference(variant_family_dir, prompts)
    assert engine.scheduler.num_preemptions >= 1
