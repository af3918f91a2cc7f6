"""Latency summaries of a served trace: normalized latency, TTFT, TPOT, throughput, and the
highest request rate whose normalized latency stays under a bound."""

from __future__ import annotations

import math

import numpy as np


def summarize(records, duration_s: float) -> dict[str, float]:
    """records: objects with arrival_s, first_token_s, finish_s, output_len (RequestRecord)."""
    done = [r for r in records if r.finish_s is not None and r.output_len > 0]
    if not done:
        return {"num_finished": 0}
    e2e = np.array([r.finish_s - r.arrival_s for r in done])
    out = np.array([r.output_len for r in done])
    ttft = np.array([r.first_token_s - r.arrival_s for r in done])
    multi = out > 1
    tpot = (e2e[multi] - ttft[multi]) / (out[multi] - 1)
    return {
        "num_finished": len(done),
        "normalized_latency_s": float(np.mean(e2e / out)),  # the paper's metric, s/token
        "mean_e2e_s": float(e2e.mean()),
        "mean_ttft_s": float(ttft.mean()),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "mean_tpot_s": float(tpot.mean()) if len(tpot) else 0.0,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": float(out.sum()) / duration_s if duration_s > 0 else 0.0,
        "duration_s": duration_s,
    }


def max_sustainable_rate(rates: list[float], latencies: list[float], bound: float) -> float:
    """The rate where normalized latency crosses `bound`, linearly interpolated between the last
    swept rate under it and the next one; the highest rate if none crosses, 0 if the first does."""
    pairs = sorted(zip(rates, latencies))
    best = 0.0
    for i, (rate, latency) in enumerate(pairs):
        if latency > bound or math.isnan(latency):
            if i == 0:
                return 0.0
            r0, l0 = pairs[i - 1]
            if math.isnan(latency):
                return r0
            return r0 + (rate - r0) * (bound - l0) / (latency - l0)
        best = rate
    return best
