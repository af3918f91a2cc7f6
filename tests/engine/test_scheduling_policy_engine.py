"""--scheduling-policy and the priority request field, end to end through the in-process engine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.cli import main as cli_main
from services.engine.llm_engine import LLMEngine
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from tests.factories import engine_config


def _engine(tiny_model_dir, policy: str) -> LLMEngine:
    config = engine_config(tiny_model_dir, max_num_seqs=1)
    scheduler = dataclasses.replace(config.scheduler, scheduling_policy=policy)
    return LLMEngine(dataclasses.replace(config, scheduler=scheduler))


def _finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [u.group.request_id for u in engine.step() if u.finished]
    return order


def test_priority_serves_a_late_urgent_request_first(tiny_model_dir, prompts):
    engine = _engine(tiny_model_dir, "priority")
    ids = {}
    for name, priority in [("a", 0), ("b", 0), ("urgent", -5), ("c", 0), ("low", 3)]:
        sampling = SamplingParams(max_tokens=2, temperature=0.0, priority=priority)
        ids[engine.add_request(prompts[2], sampling)] = name
    assert [ids[r] for r in _finish_order(engine)] == ["urgent", "a", "b", "c", "low"]


def test_fcfs_refuses_a_priority_and_keeps_serving(tiny_model_dir, prompts):
    engine = _engine(tiny_model_dir, "fcfs")
    with pytest.raises(InvalidRequestError, match="scheduling-policy priority") as info:
        engine.add_request(prompts[2], SamplingParams(max_tokens=2, priority=1))
    assert info.value.param == "priority"
    request_id = engine.add_request(prompts[2], SamplingParams(max_tokens=2, priority=0))
    assert _finish_order(engine) == [request_id]


@pytest.mark.parametrize("policy", [None, "priority"])
def test_the_flag_and_the_jsonl_priority_field(tiny_model_dir, tmp_path, policy):
    src = tmp_path / "in.jsonl"
    lines = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [5, 6, 7], "priority": -2}]
    lines.append({"prompt_token_ids": [5, 6, 7], "priority": "high"})
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(dst)]
    argv += ["--num-device-blocks", "32", "--max-tokens", "2"]
    if policy is not None:
        argv += ["--scheduling-policy", policy]
    assert cli_main(argv) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert "error" not in rows[0]
    assert rows[2]["error"]["param"] == "priority"  # not an integer: refused under any policy
    if policy == "priority":
        assert "error" not in rows[1] and rows[1]["token_ids"] == rows[0]["token_ids"]
    else:  # FCFS, the default, refuses a priority it would not honour
        assert rows[1]["error"]["param"] == "priority"
