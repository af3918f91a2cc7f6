"""Does a request's greedy output depend on what it is computed with? In-process, on the CPU.

For each prompt, per quantization, prefix caching off: greedy decoding alone; the same beside
companion prompts in one batch; alone with ngram speculation (whose verify steps compute the
request's own proposed tokens as extra rows); and, prefix caching on, the same request a second
time (its prompt's full blocks then come from the cache, and only the rest is computed). For
each of the last three: where the output first differs from alone, and the largest difference
of the chosen tokens' logprobs before that point (0 when the logits are bit for bit the same).
Then the attention op alone: SDPA for one decode row, by itself and as the first of a batch of
four at the same padded length, compared bit for bit.

    .venv/bin/python benchmarks/batch_invariance.py \\
        --json benchmarks/results/batch_invariance.json

The embedded model's prompts are the concurrency-1 prompts of benchmarks/data/ngram_streams.json
(the `repeat` and `code` workloads of benchmarks/speculative.py); another model gets seeded
random ones (--random-prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

STREAMS = Path(__file__).resolve().parent / "data" / "ngram_streams.json"
KINDS = ("batched", "speculating", "prompt_cached")  # each against the request alone


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    if args.random_prompts:
        rng = random.Random(args.seed)
        return [
            [rng.randrange(vocab_size) for _ in range(rng.randrange(8, 64))]
            for _ in range(args.random_prompts)
        ]
    streams = json.loads(STREAMS.read_text())["streams"]
    return [s["prompt"] for s in streams if s["concurrency"] == 1]


def _companions(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """Prompts of other lengths, so the batch pads each step differently from the request."""
    rng = random.Random(args.seed + 1)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randrange(20, 300))]
        for _ in range(args.companions)
    ]


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list]]:
    from shared.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = engine.generate(prompts, greedy)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _compare(alone: tuple[list[int], list], other: tuple[list[int], list]) -> dict:
    (a, a_logprobs), (b, b_logprobs) = alone, other
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    upto = len(a) if first is None else first
    deltas = [abs(a_logprobs[i].logprob - b_logprobs[i].logprob) for i in range(upto)]
    return {"first_difference": first, "max_logprob_delta_before": max(deltas, default=0.0)}


def run_mode(args: argparse.Namespace, quantization: str) -> dict:
    from services.engine.llm_engine import LLMEngine
    from shared.config import EngineConfig, ModelConfig, SpeculativeConfig

    cached = EngineConfig(
        model=ModelConfig(model=args.model, quantization=quantization, num_threads=args.threads)
    )
    # Every prompt computed from its first token, unless a run is about the cache.
    base = dataclasses.replace(
        cached, scheduler=dataclasses.replace(cached.scheduler, enable_prefix_caching=False)
    )
    speculative = dataclasses.replace(
        base, speculative=SpeculativeConfig(method="ngram", num_tokens=3, max_batch=1)
    )
    with LLMEngine(base) as engine:
        vocab_size = engine.executor.model.spec.vocab_size
        prompts, companions = _prompts(args, vocab_size), _companions(args, vocab_size)
        alone = [_greedy(engine, [p], args.output_len)[0] for p in prompts]
        batched = [_greedy(engine, [p, *companions], args.output_len)[0] for p in prompts]
    with LLMEngine(speculative) as engine:
        speculating = [_greedy(engine, [p], args.output_len)[0] for p in prompts]
    with LLMEngine(cached) as engine:
        again = []
        for p in prompts:
            _greedy(engine, [p], args.output_len)  # fills the cache with its prompt's blocks
            again.append(_greedy(engine, [p], args.output_len)[0])
    rows = [
        {
            "prompt_len": len(p),
            "batched": _compare(alone[i], batched[i]),
            "speculating": _compare(alone[i], speculating[i]),
            "prompt_cached": _compare(alone[i], again[i]),
        }
        for i, p in enumerate(prompts)
    ]
    summary = {
        kind: {
            "outputs_differing": sum(r[kind]["first_difference"] is not None for r in rows),
            "max_logprob_delta_before": max(r[kind]["max_logprob_delta_before"] for r in rows),
        }
        for kind in KINDS
    }
    return {"quantization": quantization, "summary": summary, "prompts": rows}


def _decode_sdpa(
    q: torch.Tensor,  # [batch, heads, 1, head_dim]
    k: torch.Tensor,  # [batch, kv_heads, padded, head_dim]
    v: torch.Tensor,  # [batch, kv_heads, padded, head_dim]
    mask: torch.Tensor,  # [batch, 1, 1, padded] bool
) -> torch.Tensor:  # [batch, heads, 1, head_dim]
    """The decode call of kernels/reference.py's paged_attention."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


def sdpa_bitwise(seed: int, contexts: list[int]) -> dict:
    """One decode row's SDPA alone and first in a batch of four, same padded length (SmolLM2's
    9 query heads over 3 KV heads of 64): how many of the cases differ, and by how much."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = 9, 3, 64
    differing, largest = 0, 0.0
    for length in contexts:
        padded = -(-length // 16) * 16  # whole blocks, as the decode gather reads them
        q = torch.randn(4, heads, 1, head_dim, generator=gen)
        k = torch.randn(4, kv_heads, padded, head_dim, generator=gen)
        v = torch.randn(4, kv_heads, padded, head_dim, generator=gen)
        mask = torch.ones(4, 1, 1, padded, dtype=torch.bool)
        mask[0, ..., length:] = False
        alone = _decode_sdpa(q[:1], k[:1], v[:1], mask[:1])
        in_batch = _decode_sdpa(q, k, v, mask)[:1]
        if not torch.equal(alone, in_batch):
            differing += 1
            largest = max(largest, (alone - in_batch).abs().max().item())
    return {"contexts": contexts, "differing": differing, "max_abs_difference": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--quantizations", default="none,int8")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--companions", type=int, default=3)
    parser.add_argument("--random-prompts", type=int, default=0, help="N seeded random prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/batch_invariance.json")
    args = parser.parse_args()
    if args.model is not None and not args.random_prompts:
        parser.error("the recorded prompts are the embedded model's tokens: pass --random-prompts")
    torch.set_num_threads(args.threads)
    modes = [run_mode(args, q) for q in args.quantizations.split(",")]
    for mode in modes:
        print(f"{mode['quantization']}: {json.dumps(mode['summary'])}", flush=True)
    sdpa = sdpa_bitwise(args.seed, [5, 17, 100, 160, 300, 511, 700, 1500])
    print(f"SDPA, one decode row alone vs in a batch of 4: {json.dumps(sdpa)}", flush=True)
    result = {
        "command": "benchmarks/batch_invariance.py " + " ".join(sys.argv[1:]),
        "model": args.model or "embedded",
        "output_len": args.output_len,
        "companions": args.companions,
        "threads": args.threads,
        "modes": modes,
        "sdpa": sdpa,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
