"""Top-k/top-p draws on a CPU: each row's best candidates against a sort of the vocabulary.

Real next-token logits of the embedded model (SmolLM2-135M-Instruct, 49,152 tokens) at the
ends of windows of a fixed English text, then the executor's sampler on batches of them,
side by side in one run:

- sort: the whole vocabulary sorted per row (the sampler before, and still its path on a GPU);
- candidates: a top-k of sampler.CANDIDATE_TIERS[0] per row, then of the next tier for the
  rows whose nucleus reaches past them, then the sort (reported: how many rows reached the
  second tier and the sort).

Both draw with the same keys; the script counts the rows where their tokens differ (the two
compute the nucleus's mass in a different order, so a boundary token could in principle flip).

    .venv/bin/python benchmarks/sampling_candidates.py \\
        --json benchmarks/results/sampling_candidates.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from services.executor import sampler
from services.executor.sampling_state import Draw, SamplingStates
from shared.model_source import resolve_model
from shared.sampling import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "services" / "executor" / "calibration_text.txt"
SETTINGS = {
    "top_p 0.9, temperature 1.0": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
    "top_p 0.95, temperature 0.7": SamplingParams(temperature=0.7, top_p=0.95, seed=1),
    "top_k 50, temperature 1.0": SamplingParams(temperature=1.0, top_k=50, seed=1),
    "top_k 40, top_p 0.9, temperature 0.8": SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, seed=1
    ),
}


def real_logits(model: str | None, rows: int, window: int) -> torch.Tensor:
    """[rows, vocab] fp32 next-token logits at the ends of `rows` windows of TEXT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(TEXT.read_text())["input_ids"]
    stride = max(1, (len(ids) - window) // rows)
    batch = torch.tensor([ids[i * stride : i * stride + window] for i in range(rows)])
    with torch.inference_mode():
        return model(batch).logits[:, -1, :].float()


def time_sample(logits: torch.Tensor, params: SamplingParams, tiers: tuple[int, ...], reps: int):
    """(median seconds of one sample() call, its token ids)."""
    vocab = logits.shape[1]
    states = SamplingStates(vocab, (2,), torch.device("cpu"), seed=0, make_matcher=None)
    for seq_id in range(logits.shape[0]):
        states.add(seq_id, params, sample_index=seq_id)
        states.observe(seq_id, [1], 0, samples=True)
    batch = states.build([Draw(i, i) for i in range(logits.shape[0])])
    sampler.CANDIDATE_TIERS = tiers
    times, tokens = [], None
    for _ in range(reps):
        work = logits.clone()  # sample() may edit its logits in place
        start = time.perf_counter()
        tokens = sampler.sample(work, batch).token_ids
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--window", type=int, default=48)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    logits = real_logits(args.model, max(batches), args.window)
    vocab = logits.shape[1]
    default = sampler.CANDIDATE_TIERS
    rows = []
    for name, params in SETTINGS.items():
        for b in batches:
            part = logits[:b]
            sort_s, sort_tokens = time_sample(part, params, (vocab,), args.reps)
            cand_s, cand_tokens = time_sample(part, params, default, args.reps)
            second, fallback = fallback_rows(part, params, default)
            row = {
                "setting": name,
                "batch": b,
                "sort_ms": sort_s * 1e3,
                "candidates_ms": cand_s * 1e3,
                "speedup": sort_s / cand_s,
                "rows_to_second_tier": second,
                "rows_to_sort": fallback,
                "tokens_differing": int((sort_tokens != cand_tokens).sum()),
            }
            rows.append(row)
            print(
                f"{name:38s} batch {b:3d}: sort {row['sort_ms']:8.2f} ms, candidates "
                f"{row['candidates_ms']:7.2f} ms ({row['speedup']:5.1f}x), second tier "
                f"{second}/{b}, sort {fallback}/{b}, tokens differing {row['tokens_differing']}",
                flush=True,
            )
    sampler.CANDIDATE_TIERS = default
    report = {
        "command": " ".join(["benchmarks/sampling_candidates.py", *sys.argv[1:]]),
        "candidate_tiers": list(default),
        "vocab": vocab,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def fallback_rows(
    logits: torch.Tensor, params: SamplingParams, tiers: tuple[int, ...]
) -> tuple[int, int]:
    """(rows that reached the second tier of candidates, rows drawn from the sort)."""
    entering, sorted_rows = [], []
    full, noise_at = sampler._top_k_top_p, sampler.gumbel_at

    def counting_sort(rows, top_k, top_p):
        sorted_rows.append(rows.shape[0])
        return full(rows, top_k, top_p)

    def counting_tier(keys, ids):
        entering.append(ids.shape[0])
        return noise_at(keys, ids)

    sampler._top_k_top_p, sampler.gumbel_at = counting_sort, counting_tier
    try:
        time_sample(logits, params, tiers, 1)
    finally:
        sampler._top_k_top_p, sampler.gumbel_at = full, noise_at
    return (entering[1] if len(entering) > 1 else 0), sum(sorted_rows)


if __name__ == "__main__":
    sys.exit(main())
