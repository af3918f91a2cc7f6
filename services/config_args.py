"""The engine's command-line flags, generated from shared/config.py, and the --config-json by
which one pagedserve process hands its whole engine config to another."""

from __future__ import annotations

import argparse
import dataclasses
import json

from services.scheduler.policies import SCHEDULING_POLICIES
from shared.config import EngineConfig
from shared.flags import add_config_args, config_argv, config_from_args


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    # The policies register themselves under services/scheduler, which shared/ cannot import.
    add_config_args(parser, EngineConfig, choices={"scheduling_policy": list(SCHEDULING_POLICIES)})


def add_config_json_arg(parser: argparse.ArgumentParser) -> None:
    """--config-json, which a parent process passes instead of the engine flags."""
    parser.add_argument(
        "--config-json",
        default=None,
        help="the whole engine config as JSON (EngineConfig.to_dict()); the engine flags are "
        "then ignored",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config in --config-json when given (see add_config_json_arg), else the flags'."""
    config_json = getattr(args, "config_json", None)
    if config_json is not None:
        return EngineConfig.from_dict(json.loads(config_json))
    return config_from_args(EngineConfig, args)


def config_json_argv(config: EngineConfig) -> list[str]:
    """The command-line arguments that hand `config` to a child process."""
    return ["--config-json", json.dumps(dataclasses.asdict(config))]


def engine_argv(args: argparse.Namespace, model: str | None) -> list[str]:
    """The engine flags of `args` as a command line for a pagedserve command (whose parser takes
    no --config-json), with `model` swapped in."""
    return config_argv(EngineConfig, args, model=model)
