"""Per-request sampling parameters: validated once on construction, then plain immutable data."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError

# Upper bound on requested top logprobs; OpenAI allows 20 for chat and 5 for completions.
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # bounds integer fields so every value fits the wire and torch tensors
# Below this temperature sampling is greedy: dividing by it would overflow fp32 logits.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # parallel samples; they share the prompt's KV blocks
    max_tokens: int = 16  # generated tokens per sequence, at most
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    seed: int | None = None  # same seed, same prompt, same params -> same output
    stop_token_ids: tuple[int, ...] = ()  # end a sequence when it samples one of these
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob plus top k

    def __post_init__(self) -> None:
        _require_int("n", self.n, 1, 64)
        _require_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _require_number("temperature", self.temperature, 0.0, 100.0)
        _require_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        _require_int("top_k", self.top_k, -1, INT32_MAX)
        if self.seed is not None:
            _require_int("seed", self.seed, -(2**63), 2**63 - 1)
        if not isinstance(self.stop_token_ids, tuple | list):
            raise InvalidRequestError("stop_token_ids must be a list of integers", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id, 0, INT32_MAX)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a boolean", param="ignore_eos")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @classmethod
    def from_dict(
        cls, values: dict[str, Any], base: SamplingParams | None = None
    ) -> SamplingParams:
        """Build from user-supplied values over `base`, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling field(s): {', '.join(unknown)}", param=unknown[0]
            )
        merged = dataclasses.asdict(base) if base is not None else {}
        merged.update(values)
        if isinstance(merged.get("stop_token_ids"), list):
            merged["stop_token_ids"] = tuple(merged["stop_token_ids"])
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["stop_token_ids"] = list(self.stop_token_ids)
        return values


def _require_int(name: str, value: Any, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be {bounds}, got {value}", param=name)


def _require_number(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)
