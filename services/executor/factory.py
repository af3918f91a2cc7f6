"""make_executor: the real executor or the simulator, as the config names."""

from __future__ import annotations

import dataclasses

from shared.config import EngineConfig
from shared.model_source import resolve_model


def make_executor(config: EngineConfig, served: bool = False):
    """served: requests see real latencies, so a simulated step sleeps for its modeled time
    (an offline replay reads the virtual clock instead)."""
    if config.executor == "sim":
        from services.executor.sim import SimExecutor

        if served:
            config = dataclasses.replace(config, sim=dataclasses.replace(config.sim, realtime=True))
        return SimExecutor(config)
    from services.executor.executor import Executor

    return Executor(config, resolve_model(config.model.model, config.model.download_dir))
