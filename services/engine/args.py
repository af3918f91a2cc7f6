"""Moved: the engine's flags are generated from shared/config.py by services/engine_flags.py."""

from services.engine_flags import add_engine_args, engine_argv, engine_config_from_args

__all__ = ["add_engine_args", "engine_argv", "engine_config_from_args"]
