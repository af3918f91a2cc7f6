"""Per-step cost of logit_bias in the executor: building the step's SamplingBatch and applying it.

A batch of rows that all carry a logit_bias (by default one request with n=64 parallel samples,
each biasing every token of the embedded model's 49,152-token vocabulary: the worst a client
can send), and smaller biases, are built and sampled repeatedly. Side by side in one run:

- per-entry (the executor before): every step lists each (row, token, bias) in Python and the
  sampler adds them with one index_put_;
- dense: each request's bias is one [vocab] fp32 row on the device, built when the sequence is
  added; a step stacks the rows of the biased draws and adds them with index_add_;
- sparse: each request's bias is an ids tensor and a values tensor on the device, built once;
  a step concatenates them and adds them with index_put_;
- now: the executor's choice, dense from vocab / DENSE_BIAS_DIVISOR entries up, else sparse.

    .venv/bin/python benchmarks/logit_bias_cost.py --json benchmarks/results/logit_bias_cost.json

`build` is SamplingStates.build (the per-step host work, plus on a GPU the launches it makes);
`sample` is the sampler's whole pass over the batch's logits (greedy rows), synchronised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.metadata import host_to_device
from services.executor import sampling_state
from services.executor.sampler import SamplingBatch, sample
from services.executor.sampling_state import Draw, SamplingStates, SeqSampling
from shared.sampling import SamplingParams


class PerEntryStates(SamplingStates):
    """The executor before: logit_bias rebuilt entry by entry every step."""

    def _add_edits(self, batch: SamplingBatch, states: list[SeqSampling]) -> None:
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for i, state in enumerate(states):
            p = state.params
            for token, bias in p.logit_bias:
                rows.append(i)
                tokens.append(token)
                values.append(bias)
            if state.num_outputs < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(self.eos_token_ids)
                for token in sorted(t for t in banned if t < self.vocab_size):
                    rows.append(i)
                    tokens.append(token)
                    values.append(float("-inf"))
        if rows:
            edits = host_to_device(torch.tensor([rows, tokens], dtype=torch.int64), self.device)
            batch.edit_rows, batch.edit_tokens = edits[0], edits[1]
            batch.edit_values = host_to_device(
                torch.tensor(values, dtype=torch.float32), self.device
            )


def _forced(divisor: float):
    """The executor's code with every bias dense (divisor inf) or sparse (divisor 0)."""

    class Forced(SamplingStates):
        def _logit_bias(self, logit_bias):
            saved = sampling_state.DENSE_BIAS_DIVISOR
            sampling_state.DENSE_BIAS_DIVISOR = divisor
            try:
                return super()._logit_bias(logit_bias)
            finally:
                sampling_state.DENSE_BIAS_DIVISOR = saved

    return Forced


VARIANTS = {
    "per-entry (before)": PerEntryStates,
    "now": SamplingStates,
    "dense": _forced(float("inf")),
    "sparse": _forced(0),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cls, args, device: torch.device, num_entries: int) -> dict[str, float]:
    rng = torch.Generator().manual_seed(0)
    tokens = torch.randperm(args.vocab, generator=rng)[:num_entries].sort().values.tolist()
    values = (torch.rand(num_entries, generator=rng) * 20 - 10).tolist()
    params = SamplingParams(temperature=0.0, logit_bias=list(zip(tokens, values)))
    states = cls(args.vocab, (0,), device, seed=0, make_matcher=None)
    draws = []
    for r in range(args.requests):
        parent = r * args.n
        states.add(parent, params)
        states.observe(parent, [1, 2, 3], 0, samples=True)
        draws.append(Draw(r, parent))
        for index in range(1, args.n):
            states.fork(parent, parent + index, index)
            draws.append(Draw(r, parent + index))
    logits = torch.randn(args.requests, args.vocab, generator=rng).to(device)
    build_s, sample_s = [], []
    for step in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        batch = states.build(draws)
        _sync(device)
        t1 = time.perf_counter()
        out = sample(logits.clone(), batch).token_ids
        _sync(device)
        t2 = time.perf_counter()
        if step >= args.warmup:
            build_s.append(t1 - t0)
            sample_s.append(t2 - t1)
    return {
        "build_ms": statistics.median(build_s) * 1e3,
        "sample_ms": statistics.median(sample_s) * 1e3,
        "tokens": out.tolist()[:4],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--n", type=int, default=64, help="parallel samples per request")
    parser.add_argument(
        "--entries", default="49152,8192,4096,300,2", help="bias entries per request"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for entries in [int(e) for e in args.entries.split(",")]:
        results = {name: measure(cls, args, device, entries) for name, cls in VARIANTS.items()}
        tokens = {tuple(r.pop("tokens")) for r in results.values()}
        assert len(tokens) == 1, f"the variants disagree: {tokens}"
        before = results["per-entry (before)"]
        for name, r in results.items():
            r["build_ratio_before_over_this"] = before["build_ms"] / r["build_ms"]
            r["step_ratio_before_over_this"] = (before["build_ms"] + before["sample_ms"]) / (
                r["build_ms"] + r["sample_ms"]
            )
            rows.append({"entries": entries, "variant": name, **r})
    print(
        f"{args.requests} request(s) x n={args.n}, vocab {args.vocab}, {device}, "
        f"{args.threads} thread(s); medians of {args.steps} steps; "
        f"now = dense from {args.vocab // sampling_state.DENSE_BIAS_DIVISOR} entries"
    )
    print(f"{'entries':>8} | {'variant':<20} | {'build ms':>9} | {'sample ms':>9} | before/this")
    for r in rows:
        print(
            f"{r['entries']:>8} | {r['variant']:<20} | {r['build_ms']:>9.2f} | "
            f"{r['sample_ms']:>9.2f} | build {r['build_ratio_before_over_this']:.1f}x, "
            f"build+sample {r['step_ratio_before_over_this']:.1f}x"
        )
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k != "json"}
        setup["torch"] = torch.__version__
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
