"""What one request may ask of a server, checked the same way by the gateway and the scheduler.

The gateway checks before it forwards a request (and before tokenizing what cannot fit); the
scheduler checks again for callers without a gateway (the offline engine, benchmarks) and as the
last line before a request takes blocks. Both build their limits from the executor's
announcement, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError
from shared.protocol import ExecutorReady
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_seq_len: int  # prompt + generated tokens: the model context and the KV pool hold this
    max_num_seqs: int  # sequences running at once: a request's samples must fit together

    @classmethod
    def of(cls, executor: ExecutorReady, max_num_seqs: int) -> RequestLimits:
        max_seq_len = min(executor.max_model_len, executor.num_device_blocks * executor.block_size)
        if executor.sliding_window:
            # Blocks behind the window are freed: a sequence holds its window, not its length.
            max_seq_len = executor.max_model_len
        return cls(executor.vocab_size, max_seq_len, max_num_seqs)

    def check_prompt(self, prompt_token_ids: list[Any], param: str = "prompt") -> None:
        """A prompt is non-empty, made of token ids, and leaves room for one generated token."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        # Plain ints within the vocabulary (nearly every prompt) are found with C-level passes
        # (type, min, max) instead of a Python test per token: on a long prompt that test is
        # the slow part, and the scheduler runs it on its loop while every stream waits.
        # Anything else (a bool, another type, an id out of range) takes the per-token test,
        # which names the first bad id.
        plain = set(map(type, prompt_token_ids)) == {int}
        if plain and min(prompt_token_ids) >= 0 and max(prompt_token_ids) < self.vocab_size:
            bad = []
        else:
            bad = [t for t in prompt_token_ids if not self._is_token_id(t)]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                param=param,
            )
        if len(prompt_token_ids) >= self.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate: "
                f"at most {self.max_seq_len - 1} prompt tokens fit this server's context (the "
                "model's and the KV cache's)",
                param=param,
                code="context_length_exceeded",
            )

    def check_num_samples(self, sampling: SamplingParams) -> None:
        """n or best_of: every sample needs a seat at once, so more than max_num_seqs never run."""
        self.check_samples("best_of" if sampling.best_of else "n", sampling.num_samples)

    def check_samples(self, param: str, value: int) -> None:
        if value > self.max_num_seqs:
            raise InvalidRequestError(
                f"{param}={value} exceeds this server's max_num_seqs={self.max_num_seqs}",
                param=param,
            )

    def check_token_ids(self, sampling: SamplingParams) -> None:
        """The token ids sampling parameters name (logit_bias, stop_token_ids) are this model's."""
        fields = [("logit_bias", [t for t, _ in sampling.logit_bias])]
        fields.append(("stop_token_ids", list(sampling.stop_token_ids)))
        for param, token_ids in fields:
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise InvalidRequestError(
                        f"{param} token id {token_id} is outside the vocabulary "
                        f"[0, {self.vocab_size})",
                        param=param,
                    )

    def _is_token_id(self, value: Any) -> bool:
        return (
            not isinstance(value, bool) and isinstance(value, int) and 0 <= value < self.vocab_size
        )
