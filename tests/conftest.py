"""Shared fixtures: one tiny seeded model per session and its transformers greedy reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests run tiny models, where intra-op threads only add synchronisation: one thread is several
# times faster, more so when other work shares the cores. Set before torch loads, so that the
# server processes the service tests start inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Without a GPU, Triton kernels can only run interpreted; the variable must be set before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.factories import make_tiny_llama, random_prompts
from tests.support.reference_model import (
    CONTENDED_LENGTHS,
    CONTENDED_NEW_TOKENS,
    MAX_NEW_TOKENS,
    PROMPT_LENGTHS,
    VOCAB,
    hf_generate,
)

# Fixtures shared by tiers that live in different folders (the gateway app over a fake backend).
pytest_plugins = ["tests.support.gateway_fixtures"]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items) -> None:
    """`make test` spreads tests over two xdist workers one by one, except those that share a
    module- or class-scoped fixture (a served stack, mostly): a module's such tests form a
    group that one worker runs, so its stack starts once. Session fixtures start once per
    worker.

    PAGEDSERVE_TEST_IDS=FILE keeps only the node ids listed in FILE (one per line): how the
    suite's time is compared like for like with an older commit's tests."""
    if ids_file := os.environ.get("PAGEDSERVE_TEST_IDS"):
        keep = {line.strip() for line in Path(ids_file).read_text().splitlines()}
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
        items[:] = [item for item in items if item.nodeid in keep]
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None or item.get_closest_marker("xdist_group"):
            continue
        shared = any(
            fixturedefs[-1].scope in ("module", "class", "package")
            for fixturedefs in fixtures.name2fixturedefs.values()
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB)


@pytest.fixture(scope="session")
def small_draft_dir(tmp_path_factory) -> Path:
    """A smaller random model of the target's tokenizer, unrelated to it: its proposals are
    mostly rejected (the speculative decoding tests' draft that disagrees)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("small-draft"), seed=1, hidden_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1,
    )  # fmt: skip


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, VOCAB, seed=1)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir, prompts) -> list[list[int]]:
    """transformers' generate(do_sample=False) continuations: the numerical reference."""
    return [hf_generate(tiny_model_dir, tuple(p), MAX_NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="session")
def contended_prompts() -> list[list[int]]:
    return random_prompts(CONTENDED_LENGTHS, VOCAB, seed=2)


@pytest.fixture(scope="session")
def hf_greedy_contended(tiny_model_dir, contended_prompts) -> list[list[int]]:
    return [hf_generate(tiny_model_dir, tuple(p), CONTENDED_NEW_TOKENS) for p in contended_prompts]
