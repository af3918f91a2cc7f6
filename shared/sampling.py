"""Per-request sampling parameters: validated once on construction, then plain immutable data."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError
from shared.sampling_fields import (
    BOOL,
    INT,
    INTS,
    NUM,
    by_name_fields,
    history_defaults,
    request_field,
)

# Upper bound on requested top logprobs; OpenAI allows 20 for chat and 5 for completions.
MAX_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20  # vLLM's default bound on prompt_logprobs
INT32_MAX = 2**31 - 1  # bounds integer fields so every value fits the wire and torch tensors
_MAX_TOKEN_ID_CHARS = len(str(INT32_MAX))
# Below this temperature sampling is greedy: dividing by it would overflow fp32 logits.
MIN_TEMPERATURE = 1e-5
MAX_SAMPLES = 64  # n and best_of: sequences of one request, all sharing the prompt's blocks
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value
# Structured-output kinds and what their spec string holds.
GUIDED_KINDS = {
    "json_object": "ignored: any JSON object",
    "json_schema": "a JSON schema, serialised as JSON",
    "regex": "a regular expression the whole output must match",
    "choice": "a JSON list of the strings the output must be one of",
    "grammar": "an EBNF grammar (GBNF style, root rule `root`)",
}


@dataclass(frozen=True)
class SamplingParams:
    """Each field declares how a request gives it (shared/sampling_fields.py): the OpenAPI
    schema, the gateway's and the offline reader's parsing and the wire format follow from the
    fields, so a new option is one field here plus its sampler code."""

    # Parallel samples; they share the prompt's KV blocks.
    n: int = request_field(1, {**INT, "minimum": 1, "maximum": MAX_SAMPLES})
    # Generated tokens per sequence, at most.
    max_tokens: int = request_field(16, {**INT, "minimum": 1})
    temperature: float = request_field(1.0, {**NUM, "minimum": 0, "maximum": 100})  # 0: greedy
    # Nucleus mass kept, in (0, 1].
    top_p: float = request_field(1.0, {**NUM, "exclusiveMinimum": 0, "maximum": 1})
    top_k: int = request_field(0, INT)  # keep the k most likely tokens; 0 or -1 disables
    seed: int | None = request_field(None, INT)  # same seed, prompt, params -> same output
    # End a sequence when it samples one of these.
    stop_token_ids: tuple[int, ...] = request_field((), INTS)
    # Keep generating past the model's end-of-sequence token.
    ignore_eos: bool = request_field(False, BOOL)
    # None: none; k >= 0: sampled token's logprob plus top k. Its request field differs per
    # endpoint (an integer on completions; logprobs + top_logprobs on chat).
    logprobs: int | None = request_field(None, None)
    # None: none; k >= 0: every prompt token's logprob (the first has none) plus its top k. It
    # needs every prompt token computed (no prefix-cache reuse), as the history fields do.
    prompt_logprobs: int | None = request_field(
        None, {**INT, "minimum": 0, "maximum": MAX_PROMPT_LOGPROBS}, needs_history=True
    )
    # Drop tokens below min_p x the top token's probability.
    min_p: float = request_field(0.0, {**NUM, "minimum": 0, "maximum": 1})
    # Eos and stop_token_ids are masked until this many tokens exist.
    min_tokens: int = request_field(0, {**INT, "minimum": 0})
    # OpenAI: subtracted once from every generated token's logit.
    presence_penalty: float = request_field(
        0.0, {**NUM, "minimum": -2, "maximum": 2}, needs_history=True
    )
    # OpenAI: subtracted per occurrence in the generated tokens.
    frequency_penalty: float = request_field(
        0.0, {**NUM, "minimum": -2, "maximum": 2}, needs_history=True
    )
    # transformers: divides (>0) or multiplies seen tokens' logits.
    repetition_penalty: float = request_field(
        1.0, {**NUM, "exclusiveMinimum": 0, "maximum": 10}, needs_history=True
    )
    # (token_id, bias in [-100, 100]) pairs.
    logit_bias: tuple[tuple[int, float], ...] = request_field(
        (),
        {
            "type": "object",
            "additionalProperties": {**NUM, "minimum": -100, "maximum": 100},
            "description": "token id (as a string) -> bias added to its logit",
        },
    )
    # Sample this many, return the n of highest cumulative logprob.
    best_of: int | None = request_field(
        None,
        {**INT, "minimum": 1, "maximum": MAX_SAMPLES, "description": "candidates; n best kept"},
    )
    # (kind in GUIDED_KINDS, spec): structured output, from the body's response_format or
    # guided_json/regex/choice/grammar (shared/structured.py's guided_from_body).
    guided: tuple[str, str] | None = request_field(None, None, by_name=False, needs_history=True)
    # Beam search (the paper's section 4.4): n beams, the n best hypotheses returned. Scores as
    # transformers ranks them: cumulative logprob / generated_length ** length_penalty.
    use_beam_search: bool = request_field(
        False,
        {
            **BOOL,
            "description": "beam search: n beams, the n best hypotheses returned best first; "
            "not streamable; temperature must be 0 or omitted",
        },
    )
    length_penalty: float = request_field(
        1.0, {**NUM, "description": "beam score = cumulative logprob / length ** x"}
    )
    # True, False (transformers' heuristic) or "never".
    early_stopping: bool | str = request_field(False, {"oneOf": [BOOL, {"enum": ["never"]}]})
    # vLLM's request priority: lower is served first. Only the `priority` scheduling policy reads
    # it; under FCFS a non-zero value is refused rather than silently ignored.
    priority: int = request_field(
        0,
        {
            **INT,
            "minimum": -(2**31),
            "maximum": 2**31 - 1,
            "description": "lower is served first; needs --scheduling-policy priority",
        },
    )

    def __post_init__(self) -> None:
        _require_int("n", self.n, 1, MAX_SAMPLES)
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
        if self.prompt_logprobs is not None:
            _require_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_PROMPT_LOGPROBS)
        _require_number("min_p", self.min_p, 0.0, 1.0)
        _require_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        _require_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _require_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _require_number("repetition_penalty", self.repetition_penalty, 0.0, 10.0)
        if self.repetition_penalty == 0.0:
            raise InvalidRequestError("repetition_penalty must be > 0", param="repetition_penalty")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.best_of is not None:
            _require_int("best_of", self.best_of, self.n, MAX_SAMPLES)
        if self.guided is not None:
            _check_guided(self.guided)
            object.__setattr__(self, "guided", tuple(self.guided))
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise InvalidRequestError(
                        f"{name} cannot be combined with structured output: the grammar decides "
                        "when the output ends (with the end-of-sequence token)",
                        param=name,
                    )
        _check_beam_search(self)
        _require_int("priority", self.priority, -INT32_MAX - 1, INT32_MAX)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: best_of candidates, of which n are returned."""
        return self.best_of or self.n

    @property
    def wants_logprob(self) -> bool:
        """Whether the sampled tokens' logprobs are needed (asked for, to rank best_of, or to
        score beams)."""
        return self.logprobs is not None or self.num_samples > self.n or self.use_beam_search

    @property
    def reports_at_end(self) -> bool:
        """Whether the returned sequences are known only once the request ends (best_of > n,
        beam search), so nothing can be streamed before."""
        return self.num_samples > self.n or self.use_beam_search

    def ending_token_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """Tokens that end a sequence: the model's eos (unless ignored) and stop_token_ids."""
        ending = set(self.stop_token_ids)
        if not self.ignore_eos:
            ending.update(eos_token_ids)
        return frozenset(ending)

    def num_top_logprobs(self, eos_token_ids: tuple[int, ...]) -> int:
        """Top logprobs the executor returns per drawn token: what the request asked for, and
        for beam search as many as transformers keeps candidates per step, max(2, 1 + ending
        tokens) x width, so that width of them survive even if the best all end."""
        asked = self.logprobs or 0
        if self.use_beam_search:
            ending = len(self.ending_token_ids(eos_token_ids))
            asked = max(asked, max(2, 1 + ending) * self.n)
        return asked

    @property
    def needs_history(self) -> bool:
        """Whether the executor must be fed every token of the sequence: it learns penalty
        counts and grammar state from the tokens plans feed it, and scores every prompt token
        for prompt logprobs (the fields that say so)."""
        return any(getattr(self, name) != default for name, default in _HISTORY_DEFAULTS)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

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
        values["logit_bias"] = [list(pair) for pair in self.logit_bias]
        values["guided"] = list(self.guided) if self.guided is not None else None
        return values


# The fields a request body, or a line of `pagedserve generate`'s input, gives by name.
BY_NAME_FIELDS = by_name_fields(SamplingParams)
_HISTORY_DEFAULTS = history_defaults(SamplingParams)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """Normalise {token_id: bias} (JSON keys are strings) or [(id, bias)] into sorted pairs."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, tuple | list):
        items = list(value)
    else:
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        key, bias = item
        if isinstance(key, str):
            # Measured before int(), which takes quadratic time on long digit strings.
            if len(key) > _MAX_TOKEN_ID_CHARS:
                raise InvalidRequestError(
                    f"logit_bias key {key[:20]!r}... ({len(key)} characters) is not a token id",
                    param="logit_bias",
                )
            try:
                key = int(key)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias key {key!r} is not a token id", param="logit_bias"
                ) from None
        _require_int("logit_bias", key, 0, INT32_MAX)
        _require_number("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        pairs[key] = float(bias)
    return tuple(sorted(pairs.items()))


# What beam search cannot honour: it ranks by the model's own logprobs, deterministically.
_BEAM_NEUTRAL = {
    "top_p": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": (),
    "guided": None,
}


def _check_beam_search(params: SamplingParams) -> None:
    if not isinstance(params.use_beam_search, bool):
        raise InvalidRequestError("use_beam_search must be a boolean", param="use_beam_search")
    _require_number("length_penalty", params.length_penalty, -100.0, 100.0)
    if not (isinstance(params.early_stopping, bool) or params.early_stopping == "never"):
        raise InvalidRequestError(
            'early_stopping must be true, false or "never"', param="early_stopping"
        )
    if not params.use_beam_search:
        return
    if not params.greedy:
        raise InvalidRequestError(
            "beam search is deterministic: temperature must be 0 (or omitted)",
            param="temperature",
        )
    if params.best_of is not None and params.best_of != params.n:
        raise InvalidRequestError(
            "with beam search n is the beam width: best_of must be omitted", param="best_of"
        )
    if params.top_k not in (0, -1):
        raise InvalidRequestError("top_k cannot be combined with beam search", param="top_k")
    for name, neutral in _BEAM_NEUTRAL.items():
        if getattr(params, name) != neutral:
            raise InvalidRequestError(f"{name} cannot be combined with beam search", param=name)


def _check_guided(guided: Any) -> None:
    if not isinstance(guided, tuple | list) or len(guided) != 2:
        raise InvalidRequestError("guided must be a (kind, spec) pair", param="guided")
    kind, spec = guided
    if kind not in GUIDED_KINDS:
        raise InvalidRequestError(
            f"unknown structured-output kind {kind!r}; one of {sorted(GUIDED_KINDS)}",
            param="guided",
        )
    if not isinstance(spec, str):
        raise InvalidRequestError("the structured-output spec must be a string", param="guided")


def _require_int(name: str, value: Any, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be {bounds}, got {value}", param=name)


def _require_number(name: str, value: Any, low: float, high: float) -> None:
    # An int is never NaN, and math.isnan() cannot convert one past a float's range.
    nan = isinstance(value, float) and math.isnan(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or nan:
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)
