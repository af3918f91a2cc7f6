"""Engine runs for the speculative decoding tests: every step checks the block pool, and the
run must leave it exact and empty (rolled-back slots included)."""

from __future__ import annotations

import itertools

from services.engine.llm_engine import LLMEngine
from services.scheduler import speculation
from shared.config import EngineConfig
from shared.sampling import SamplingParams


def run_checked(config: EngineConfig, prompts, sampling: SamplingParams):
    """(each request's samples' tokens, the engine), the pool checked after every step and
    left exact and empty."""
    engine = LLMEngine(config)
    outputs = engine.generate(
        prompts, sampling, on_step=lambda e: e.scheduler.block_manager.check()
    )
    manager = engine.scheduler.block_manager
    manager.check()
    assert manager.device.num_free == manager.device.num_blocks
    assert manager.cpu.num_free == manager.cpu.num_blocks
    assert not manager.tables and not manager.cpu_tables
    return [[c.token_ids for c in o.outputs] for o in outputs], engine


def oracle_proposals(monkeypatch, prompts, continuations, vocab_size: int, wrong_every: int = 2):
    """Make n-gram speculation propose each sequence's own next tokens, read from a plain run
    (`continuations[i]`: prompt i's greedy output), the last proposal of every
    `wrong_every`-th call changed to another token: verify steps then accept proposals and
    reject others whatever the CPU's rounding. (A random model's own n-gram matches are rarely
    accepted: 0 to 4 in 120 greedy tokens, and which ones depends on the CPU's instruction
    set.) A sequence off its prompt's continuation proposes nothing."""
    calls = itertools.count()
    known = [(tuple(p), list(c)) for p, c in zip(prompts, continuations)]

    def propose(token_ids, k, *args):
        for prompt, continuation in known:
            done = len(token_ids) - len(prompt)
            if (
                0 <= done
                and tuple(token_ids[: len(prompt)]) == prompt
                and token_ids[len(prompt) :] == continuation[:done]
            ):
                proposals = continuation[done : done + k]
                if proposals and next(calls) % wrong_every == 0:
                    proposals[-1] = (proposals[-1] + 1) % vocab_size
                return proposals
        return []

    monkeypatch.setattr(speculation, "propose_ngram", propose)
