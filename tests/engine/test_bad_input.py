"""Bad input gets a clear error and leaves the engine serving everyone else."""

from __future__ import annotations

import json

import pytest

from services.cli import main as cli_main
from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, ModelConfig
from shared.errors import InvalidRequestError, ModelNotFoundError
from shared.sampling import SamplingParams
from tests.factories import engine_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def small_pool_engine(tiny_model_dir) -> LLMEngine:
    # 8 blocks of 16 tokens: a 200-token prompt fits the model (512) but not the pool (128).
    return LLMEngine(engine_config(tiny_model_dir, num_device_blocks=8))


def test_bad_requests_are_rejected_and_the_rest_complete(small_pool_engine, prompts):
    engine = small_pool_engine
    good_before = engine.add_request(prompts[3], GREEDY)
    cases = {
        "empty": ([], "empty"),
        "too long for the pool": ([5] * 200, "no room"),
        "too long for the model": ([5] * 600, "no room"),
        "outside vocabulary": ([5, 384], "vocabulary"),
    }
    for prompt, message in cases.values():
        with pytest.raises(InvalidRequestError, match=message) as info:
            engine.add_request(prompt, GREEDY)
        assert info.value.to_dict()["error"]["type"] == "invalid_request_error"
        assert info.value.param == "prompt"
    good_after = engine.add_request(prompts[4], GREEDY)
    finished = {}
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                finished[update.group.request_id] = update.group
    assert set(finished) == {good_before, good_after}
    assert all(len(g.seqs[0].output_token_ids) == 8 for g in finished.values())
    assert engine.scheduler.block_manager.device.num_free == 8


@pytest.mark.parametrize(
    "values, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"colour": "red"}, "colour"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ],
)
def test_sampling_values_are_validated(values, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(values)
    assert info.value.param == param


def test_unknown_model_path_is_a_clear_error(tmp_path):
    config = EngineConfig(model=ModelConfig(model=str(tmp_path / "no-such-model")))
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLMEngine(config)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)


def test_cli_reports_bad_lines_and_runs_the_others(tiny_model_dir, tmp_path, capsys):
    lines = [
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        {"prompt_token_ids": []},
        "not json",
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 0},
        {"prompt_token_ids": [9, 10], "n": 2, "max_tokens": 3, "seed": 1},
        {"prompt_token_ids": [5], "prompt": "both"},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(dst)]
    assert cli_main(argv + ["--num-device-blocks", "32", "--ignore-eos"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    assert len(rows[0]["token_ids"]) == 4 and rows[0]["finish_reason"] == "length"
    assert [len(o["token_ids"]) for o in rows[4]["outputs"]] == [3, 3]
    for bad, param in [(1, "prompt"), (2, None), (3, "max_tokens"), (5, None)]:
        assert rows[bad]["error"]["type"] == "invalid_request_error"
        assert rows[bad]["error"]["param"] == param
    assert "4 of 6 lines were rejected" in capsys.readouterr().err


def test_cli_unknown_model_exits_nonzero(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1]}\n')
    argv = ["generate", "--model", str(tmp_path / "missing"), "--input", str(src), "--output", "-"]
    assert cli_main(argv) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_text_and_chat_prompts_use_the_tokenizer(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        {"prompt": "the capital of france is"},
        {"messages": [{"role": "user", "content": "what is the capital"}]},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(dst)]
    assert cli_main(argv + ["--max-tokens", "5", "--ignore-eos", "--num-device-blocks", "32"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert rows[0]["prompt_tokens"] == len(tokenizer.encode("the capital of france is"))
    chat = tokenizer.apply_chat_template(
        lines[1]["messages"], add_generation_prompt=True, tokenize=False
    )
    assert rows[1]["prompt_tokens"] == len(tokenizer.encode(chat))
    for row in rows:
        assert len(row["token_ids"]) == 5
        assert row["text"] == tokenizer.decode(row["token_ids"], skip_special_tokens=True)


def test_cli_lines_carry_the_api_sampling_fields(tiny_model_dir, tmp_path):
    lines = [
        {"prompt_token_ids": [5, 6], "max_tokens": 12, "temperature": 1.0, "seed": 2,
         "guided_regex": "[a-c]{3}-[0-9]{2}"},
        {"prompt_token_ids": [5, 6], "max_tokens": 3, "logit_bias": {"40": 100}},
        {"prompt_token_ids": [5, 6], "max_tokens": 4, "n": 1, "best_of": 3, "seed": 1},
        {"prompt_token_ids": [5, 6], "guided_regex": "(bad"},
    ]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(dst)]
    assert cli_main(argv + ["--num-device-blocks", "32"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    import re

    assert re.fullmatch("[a-c]{3}-[0-9]{2}", rows[0]["text"]), rows[0]["text"]
    assert rows[1]["token_ids"] == [40, 40, 40]
    assert isinstance(rows[2]["cumulative_logprob"], float) and 1 <= len(rows[2]["token_ids"]) <= 4
    assert rows[3]["error"]["param"] == "guided_regex"


def test_cli_beam_width_applies_to_lines_without_their_own(tiny_model_dir, tmp_path):
    lines = [
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt_token_ids": [5, 6, 7], "use_beam_search": True, "n": 2, "length_penalty": 0.5},
        {"prompt_token_ids": [5, 6, 7], "use_beam_search": False},
        {"prompt_token_ids": [5, 6, 7], "temperature": 0.9},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(dst)]
    extra = ["--num-device-blocks", "64", "--beam-width", "3", "--max-tokens", "5", "--ignore-eos"]
    assert cli_main(argv + extra) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    for row, width in [(rows[0], 3), (rows[1], 2)]:
        scores = [o["cumulative_logprob"] for o in row["outputs"]]
        assert len(scores) == width and all(len(o["token_ids"]) == 5 for o in row["outputs"])
        assert len({tuple(o["token_ids"]) for o in row["outputs"]}) == width  # distinct beams
    assert len(rows[2]["token_ids"]) == 5  # an ordinary greedy line
    assert rows[3]["error"]["param"] == "temperature"  # beam search is deterministic
