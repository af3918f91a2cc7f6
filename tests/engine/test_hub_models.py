"""Hub ids `org/name[@revision]` served offline from a Hugging Face cache built in the test."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.cli import main as cli_main
from services.engine.llm_engine import LLMEngine
from shared.errors import ModelNotFoundError
from shared.model_source import model_name, resolve_model
from shared.sampling import SamplingParams
from tests.factories import engine_config, make_tiny_llama, random_prompts
from tests.support.hub_cache import add_to_hub_cache
from tests.support.reference_model import VOCAB, hf_generate

MAIN = "a" * 40  # commit hashes: 40 hex digits
OTHER = "b" * 40
NEW_TOKENS = 10


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dir):
    """A cache holding org/tiny: main -> MAIN (the session's tiny model), and commit OTHER (a
    model of other weights) reachable only by its hash. Offline, as where no Hub is reachable."""
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "org/tiny", tiny_model_dir, MAIN)
    other = make_tiny_llama(tmp_path / "other", seed=11, vocab_size=VOCAB)
    add_to_hub_cache(cache, "org/tiny", other, OTHER, branch=None)
    # huggingface_hub reads these once at import; the lookup reads them at each call.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, other


def _greedy(engine_dir, model: str, prompts: list[list[int]]) -> list[list[int]]:
    config = engine_config(engine_dir, block_size=8, max_num_batched_tokens=64)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=model))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLMEngine(config).generate(prompts, params)]


def test_generate_serves_a_hub_id_from_the_cache_as_transformers_does(
    hub_cache, tiny_model_dir, tmp_path
):
    prompts = random_prompts([3, 17, 40], VOCAB, seed=8)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", "org/tiny", "--input", str(src), "--output", str(dst)]
    argv += ["--dtype", "float32", "--device", "cpu", "--attention-backend", "torch"]
    argv += ["--num-device-blocks", "64", "--max-tokens", str(NEW_TOKENS), "--ignore-eos"]
    assert cli_main(argv) == 0
    ours = [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()]
    assert ours == [hf_generate(tiny_model_dir, tuple(p), NEW_TOKENS) for p in prompts]


def test_a_commit_hash_revision_picks_that_snapshot(hub_cache, tiny_model_dir):
    cache, other = hub_cache
    assert resolve_model("org/tiny") == cache / "models--org--tiny" / "snapshots" / MAIN
    assert resolve_model(f"org/tiny@{OTHER}").name == OTHER
    prompts = random_prompts([5, 23], VOCAB, seed=9)
    ours = _greedy(tiny_model_dir, f"org/tiny@{OTHER}", prompts)
    assert ours == [hf_generate(other, tuple(p), NEW_TOKENS) for p in prompts]
    # The two snapshots really differ: the revision was not ignored.
    assert ours != [hf_generate(tiny_model_dir, tuple(p), NEW_TOKENS) for p in prompts]


def test_download_dir_replaces_the_hub_cache(hub_cache, tmp_path, monkeypatch):
    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError):
        resolve_model("org/tiny")
    assert resolve_model("org/tiny", download_dir=str(cache)).name == MAIN


def test_a_missing_hub_id_is_refused_naming_it_and_the_cache(hub_cache, tmp_path, capsys):
    cache, _ = hub_cache
    with pytest.raises(ModelNotFoundError) as refused:
        resolve_model("org/absent")
    message = str(refused.value)
    assert "'org/absent'" in message and str(cache) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelNotFoundError, match="at revision 'v9'"):
        resolve_model("org/tiny@v9")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1]}\n')
    argv = ["generate", "--model", "org/absent", "--input", str(src), "--output", "-"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve: error: model 'org/absent'") and "Traceback" not in err


def test_a_local_directory_shaped_like_a_hub_id_stays_local(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tiny_model_dir.parent.parent)
    local = f"{tiny_model_dir.parent.name}/{tiny_model_dir.name}"  # org/name-shaped
    assert resolve_model(local).resolve() == tiny_model_dir.resolve()
    assert model_name(local) == model_name(str(tiny_model_dir)) == tiny_model_dir.name
    assert model_name("org/tiny@" + OTHER) == "org/tiny"


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(hub_cache, tmp_path, monkeypatch):
    cache, _ = hub_cache
    home = tmp_path / "hf-home"
    home.mkdir()
    cache.rename(home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model("org/tiny") == home / "hub" / "models--org--tiny" / "snapshots" / MAIN
