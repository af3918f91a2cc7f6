"""When a sequence ends: the stop and length rules, written once for every caller."""

from __future__ import annotations

from collections.abc import Collection

from services.scheduler.sequence import Sequence
from shared.sampling import SamplingParams


def check_stop(
    sampling: SamplingParams,
    seq: Sequence,
    token_id: int,
    eos_token_ids: Collection[int],
    max_seq_len: int,
) -> str | None:
    """The finish reason once `seq` has taken `token_id` as its last token, or None: "stop" for a
    stop token or (unless ignored) the model's end of sequence, "length" at max_tokens or when
    the sequence fills the context. Stop strings are the gateway's: they need the text."""
    if token_id in sampling.stop_token_ids:
        return "stop"
    if not sampling.ignore_eos and token_id in eos_token_ids:
        return "stop"
    num_tokens = len(seq.token_ids)  # (not the properties: once per sampled token)
    if reaches_length(sampling, num_tokens - seq.prompt_len, num_tokens, max_seq_len):
        return "length"
    return None


def reaches_length(
    sampling: SamplingParams, num_output_tokens: int, num_tokens: int, max_seq_len: int
) -> bool:
    """Whether a sequence of this many tokens (output, and in all) has ended by length."""
    return num_output_tokens >= sampling.max_tokens or num_tokens >= max_seq_len


def max_output_tokens(sampling: SamplingParams, prompt_len: int, max_seq_len: int) -> int:
    """The most tokens a sequence with this prompt may generate."""
    return min(sampling.max_tokens, max_seq_len - prompt_len)
