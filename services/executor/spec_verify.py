"""Speculative decoding's verification: which proposed tokens one target step accepts, and the
token that follows them, so that the output distribution is the target model's own.

Deterministic proposals (n-gram lookup, a greedy draft; draft_probs None) are verified by the
target's own draw at each of the K+1 rows: d_i is accepted iff the target, drawing at that
position exactly as it would without speculation (same counter-RNG key, same filters), drew d_i;
the first draw that differs is the output. That accepts d_i with probability p_i(d_i), and on a
rejection the token is distributed as p_i with d_i removed, renormalised: the rule of a
deterministic proposal. Coupling it to the plain draw has one more property: a seeded request
draws token for token what it draws without speculation. Greedy rows draw the argmax, so they
accept the longest prefix that matches the argmax.

Sampled proposals with their draft distribution q (draft_probs) use Leviathan et al.'s rule:
accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), else draw from max(0, p_i - q_i)
renormalised; when all K are accepted the target's own draw at row K is the bonus token.
"""

from __future__ import annotations

import torch

from services.executor.counter_rng import gumbel, uniform

# Mixed into a row's key for the residual draw, so that it is independent of the coin (element
# d_i of the row's uniforms) and of the row's own draw.
_RESIDUAL_SALT = 0x5DEECE66D


def verify(
    sampled: list[int],
    proposals: list[int],
    draft_probs: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
    greedy: bool = True,
) -> list[int]:
    """The tokens a speculating sequence takes this step: its accepted proposals, then the
    corrected (or bonus) token; 1 .. K + 1 of them.

    sampled: [K + 1] the target's own draw at each row (the argmax for a greedy request);
    proposals: [K] d_1 .. d_K (row i verifies d_{i+1});
    draft_probs: [K, vocab] fp32 q_i, only for sampled proposals of a sampled request;
    target_logits: [K + 1, vocab] fp32 the rows' logits after every filter and the temperature
    (what the draw raced over), needed with draft_probs;
    keys: [K + 1] int64 the rows' counter-RNG keys, needed with draft_probs.
    """
    if len(sampled) != len(proposals) + 1:
        raise ValueError(f"{len(proposals)} proposals need {len(proposals) + 1} draws")
    if draft_probs is None or greedy:
        out = []
        for drawn, proposed in zip(sampled, proposals):
            out.append(drawn)
            if drawn != proposed:
                return out
        out.append(sampled[-1])
        return out
    if target_logits is None or keys is None:
        raise ValueError("draft_probs need the target's filtered logits and the rows' keys")
    return _leviathan(sampled, proposals, draft_probs, target_logits, keys)


def _leviathan(
    sampled: list[int],
    proposals: list[int],
    draft_probs: torch.Tensor,  # [K, vocab] fp32
    target_logits: torch.Tensor,  # [K + 1, vocab] fp32
    keys: torch.Tensor,  # [K + 1] int64
) -> list[int]:
    k = len(proposals)
    vocab = target_logits.shape[-1]
    p = torch.softmax(target_logits[:k].float(), dim=-1)  # [K, vocab]
    q = draft_probs.to(p.device, torch.float32)
    index = torch.arange(k, device=p.device)
    d = torch.tensor(proposals, dtype=torch.int64, device=p.device)
    coins = uniform(keys[:k], vocab)[index, d]  # [K] one uniform per row, keyed by its position
    ratio = p[index, d] / q[index, d].clamp_min(torch.finfo(torch.float32).tiny)
    accepted = (coins < ratio).tolist()
    out = []
    for i, ok in enumerate(accepted):
        if ok:
            out.append(proposals[i])
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any rejection is a rounding artefact
            residual = p[i]
        noise = gumbel((keys[i : i + 1] ^ _RESIDUAL_SALT), vocab)[0]
        out.append(int((residual.log() + noise).argmax()))
        return out
    out.append(sampled[-1])
    return out
