"""The engine's flags are generated from the config fields: same defaults, every value parsed and
written back, and the whole config handed to a child process through --config-json."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from services.config_args import (
    add_config_json_arg,
    add_engine_args,
    config_json_argv,
    engine_argv,
    engine_config_from_args,
)
from shared.config import EngineConfig
from shared.flags import FLAG, GiB, add_config_args, flag
from shared.structured import GrammarLimits

# Every flag at a value other than its default.
EVERY_FLAG = (
    "--model /m --download-dir /d --dtype float16 --max-model-len 99 --engine-seed 7 "
    "--num-threads 3 --device cpu --generation-config vllm "
    "--attention-backend torch --enforce-eager --quantization int8 --int8-decode-kernel int_mm "
    "--cpu-row-kernels off "
    "--block-size 8 "
    "--num-device-blocks 40 --kv-cache-gb 0.5 --swap-space-gb 0.25 --context-mirror-gb 0.125 "
    "--max-num-seqs 9 "
    "--max-num-batched-tokens 300 --max-prefill-tokens-per-request 33 --no-chunked-prefill "
    "--max-decode-rows-per-request 5 "
    "--no-layer-parts "
    "--preemption-mode swap --budget-order arrival --scheduling-policy priority "
    "--kv-policy orca-max --no-prefix-caching --no-async-scheduling "
    "--grammar-compile-timeout 3.5 --grammar-cache-mb 12.5 --max-pending-grammars 4 "
    "--max-grammar-spec-bytes 1000 --max-grammar-choices 10 --max-grammar-regex-bytes 100 "
    "--max-grammar-depth 5 --executor sim --sim-gpu h100-80gb --sim-model llama-7b "
    "--sim-kv-gb 2.5 --sim-overhead-ms 3 --tensor-parallel-size 2 --tp-master-addr 10.0.0.1 "
    "--tp-master-port 29500 --tp-external-workers --speculative-method draft "
    "--num-speculative-tokens 5 --ngram-min 2 --ngram-max 6 --ngram-proposals-per-match 1 "
    "--speculative-max-batch 9 --no-speculative-adaptive "
    "--draft-model /dm"
).split()


def _parser(child: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    if child:
        add_config_json_arg(parser)
    return parser


def test_the_flags_defaults_are_the_configs_defaults():
    assert engine_config_from_args(_parser().parse_args([])) == EngineConfig()


def test_every_flag_reaches_its_field_in_its_unit():
    config = engine_config_from_args(_parser().parse_args(EVERY_FLAG))
    assert config.model.seed == 7 and config.model.device == "cpu"
    assert config.cache.kv_cache_bytes == GiB // 2 and config.cache.swap_space_bytes == GiB // 4
    assert config.cache.context_mirror_bytes == GiB // 8
    assert config.grammar.cache_bytes == int(12.5 * (1 << 20))
    assert config.grammar.limits == GrammarLimits(1000, 10, 100, 5)
    assert config.sim.kv_cache_bytes == int(2.5 * GiB) and config.sim.step_overhead_s == 3 / 1e3
    assert not config.scheduler.enable_chunked_prefill and not config.scheduler.async_scheduling
    assert config.scheduler.scheduling_policy == "priority" and config.executor == "sim"
    assert config.parallel == dataclasses.replace(
        config.parallel, tensor_parallel_size=2, master_addr="10.0.0.1", master_port=29500
    )
    assert config.parallel.external_workers
    # No flag is left at its default by EVERY_FLAG, so none is silently dropped on the way.
    flat, default = _leaves(config), _leaves(EngineConfig())
    unchanged = {name for name in flat if flat[name] == default[name]}
    assert unchanged == {"scheduler.watermark", "sim.realtime"}  # the fields without a flag


@pytest.mark.parametrize("argv", [[], EVERY_FLAG])
def test_a_command_line_written_from_parsed_flags_parses_back_the_same(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    written = engine_argv(args, args.model)
    assert engine_config_from_args(parser.parse_args(written)) == engine_config_from_args(args)


@pytest.mark.parametrize("argv", [[], EVERY_FLAG])
def test_a_config_reaches_a_child_process_whole_through_config_json(argv):
    config = engine_config_from_args(_parser().parse_args(argv))
    child = _parser(child=True).parse_args(config_json_argv(config))
    assert engine_config_from_args(child) == config
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_bool_flag_must_turn_its_default_around():
    @dataclasses.dataclass(frozen=True)
    class Wrong:
        on: bool = flag(True, "--on")

    with pytest.raises(TypeError, match="--on"):
        add_config_args(argparse.ArgumentParser(), Wrong)


def _leaves(config, prefix: str = "") -> dict:
    """Every non-config field of `config` by dotted name ("scheduler.watermark")."""
    found = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            found |= _leaves(value, f"{prefix}{field.name}.")
        else:
            assert FLAG in field.metadata or field.name in ("watermark", "realtime"), field.name
            found[prefix + field.name] = value
    return found
