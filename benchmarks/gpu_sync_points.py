"""GPU: where an overlapped step's launch waits for the device, found with torch's sync debug mode.

Async scheduling launches step N+1 behind step N; any synchronising CUDA call while N+1 is
launched (a pageable copy, an .item(), a stream synchronise) makes the host wait for N and the
overlap is lost. This runs the in-process engine with overlapped steps on a small random Llama
(bf16), turns on `torch.cuda.set_sync_debug_mode("warn")` inside the executor's launch() and,
separately, inside collect() (which waits once per step by design), and counts the warnings by
the innermost project source line of each. Workloads: greedy; seeded sampling with top-p and
top-k; penalties; n=2 (copy-on-write of the shared last block); chunked prefill mixed with
decodes. Writes JSON; prints the launch-time sync points, which should be none.

    python benchmarks/gpu_sync_points.py --tokenizer DIR --json /tmp/sync_points.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from services.bench.random_models import SHAPES, build_model
from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "seeded_top_p_top_k": dict(temperature=1.0, top_p=0.9, top_k=50, seed=7),
    "penalties": dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5,
                      frequency_penalty=0.5),
    "n2_copy_on_write": dict(temperature=1.0, n=2, seed=3),
}  # fmt: skip


class SyncCounter:
    """Counts sync-debug warnings by the innermost project source line, per phase."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.phase: str | None = None

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self.phase is None or "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f for f in stack if f.filename.startswith(str(ROOT) + "/services")]
        ours += [f for f in stack if f.filename.startswith(str(ROOT) + "/kernels")]
        # The innermost frame of the project's own code (else the innermost of any).
        f = max(ours, key=stack.index) if ours else stack[-1]
        self.counts[self.phase][
            f"{f.filename.removeprefix(str(ROOT) + '/')}:{f.lineno} {f.name}"
        ] += 1

    def around(self, phase: str, call):
        def run(arg):
            self.phase = phase
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return call(arg)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                self.phase = None

        return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--json", default="benchmarks/results/gpu_sync_points.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: it counts a GPU's synchronising calls", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="pagedserve-sync-points-"))
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        model_dir = build_model(args.shape, "cuda", torch.bfloat16, args.tokenizer, work / "m")
        vocab = SHAPES[args.shape]["vocab_size"]
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.input_len)]
            for _ in range(args.num_requests)
        ]
        runs = {name: (params, 8192) for name, params in WORKLOADS.items()}
        runs["chunked_prefill_mixed"] = (dict(temperature=0.0), 64)  # decodes beside chunks
        for name, (params, budget) in runs.items():
            config = EngineConfig(
                model=ModelConfig(model=str(model_dir), dtype="bfloat16", device="cuda"),
                cache=CacheConfig(kv_cache_bytes=int(1 * GiB)),
                scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget),
            )
            try:
                report[name] = count_sync_points(config, prompts, params, args.output_len)
            except Exception as error:  # noqa: BLE001 - recorded; the next workload runs
                report[name] = {"error": f"{type(error).__name__}: {error}"}
            print(name, json.dumps(report[name], indent=1), flush=True)
            torch.cuda.empty_cache()
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print("wrote", args.json)
    return 0


def count_sync_points(config: EngineConfig, prompts, params: dict, output_len: int) -> dict:
    """One workload on a fresh overlapped engine: its steps and sync warnings per phase."""
    engine = LLMEngine(config, overlap_steps=True)
    try:
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0))
        counter = SyncCounter()
        executor = engine.core.executor.executor
        executor.launch = counter.around("launch", executor.launch)
        executor.collect = counter.around("collect", executor.collect)
        sampling = [
            SamplingParams(max_tokens=output_len, ignore_eos=True, **params) for _ in prompts
        ]
        steps_before = engine.stats.num_steps
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = counter.showwarning
            engine.generate(prompts, sampling)
        return {
            "steps": engine.stats.num_steps - steps_before,
            "launch": dict(counter.counts["launch"].most_common()),
            "collect": dict(counter.counts["collect"].most_common()),
        }
    finally:
        engine.close()


if __name__ == "__main__":
    raise SystemExit(main())
