"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens, searched in its own prompt and output, with no second model.

As vLLM's prompt_lookup_min/max: among the suffixes of n_min .. n_max tokens that occur earlier,
the longest wins (the latest occurrence of it); up to k tokens that followed it are proposed,
and with per_match > 0 at most per_match tokens per matched token: a 1-token match is weak
evidence that the text is being copied, a 4-token match strong, so a short match proposes few
tokens and a long one many (benchmarks/ngram_replay.py measured the rule on recorded outputs).
Only the last WINDOW tokens are searched: the scheduler runs this for every speculating sequence
on the step's critical path, so its cost must not grow with the context; the repetition that
pays (a quoted passage, code being edited, a list's pattern) is nearly always recent.
"""

from __future__ import annotations

WINDOW = 1024


def propose_ngram(
    token_ids: list[int], k: int, n_min: int, n_max: int, per_match: int = 0
) -> list[int]:
    """Up to k (and with per_match > 0, up to per_match * the match's length) proposed next
    tokens for a sequence of token_ids; [] when no n-gram matches.

    One backward pass over the window: at each earlier occurrence of the last token, how far
    the match extends backwards (up to n_max); the first occurrence reaching n_max ends it.
    """
    tokens = token_ids[-WINDOW:] if len(token_ids) > WINDOW else token_ids
    last_index = len(tokens) - 1
    if last_index < 1 or k <= 0:
        return []
    last = tokens[last_index]
    best_len, best_end = 0, -1
    for end in range(last_index - 1, -1, -1):
        if tokens[end] != last:
            continue
        length = 1
        while (
            length < n_max
            and end - length >= 0
            and tokens[end - length] == tokens[last_index - length]
        ):
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length == n_max:
                break
    if best_len < n_min:
        return []
    if per_match > 0:
        k = min(k, per_match * best_len)
    return tokens[best_end + 1 : best_end + 1 + k]
