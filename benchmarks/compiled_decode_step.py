"""Decode-step time with each layer's dense parts compiled by torch.compile, against eager (CPU).

An experiment for single-stream latency (issue #26): a one-sequence decode step of the embedded
model spends about half its time in the int8 matmuls and the rest in hundreds of small per-layer
ops (activation quantization, norms, rotary, the MLP's gate) and their dispatch. Here each
decoder layer runs as two compiled functions (norm, q/k/v and rotary before attention; o_proj,
residuals, norm and MLP after it: inductor fuses the small ops into C++ loops) around the paged
attention, which stays eager. Same engine, same prompts, eager and compiled steps alternated.

.venv/bin/python benchmarks/compiled_decode_step.py  # benchmarks/results/compiled_decode_step.json

Writes the compile time, the mean decode step per batch size for both, their ratio, and how many
greedy outputs the compiled layers changed (inductor's fused loops may round differently).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from services.engine.llm_engine import LLMEngine
from services.executor.models.layers import DecoderLayer, apply_rotary, linear
from shared.config import EngineConfig, ModelConfig
from shared.sampling import SamplingParams


def before_attention(layer: DecoderLayer, h, cos, sin):  # h: [num_tokens, hidden]
    q, k, v = layer.self_attn.project(layer.input_layernorm(h))
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def after_attention(layer: DecoderLayer, h, o):  # o: [num_tokens, heads, head_dim]
    h = h + linear(o.reshape(o.shape[0], -1), layer.self_attn.o_proj)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def compiled_layer_forward():
    before = torch.compile(before_attention, dynamic=True)
    after = torch.compile(after_attention, dynamic=True)

    def forward(self, h, cos, sin, kv_cache, meta):
        q, k, v = before(self, h, cos, sin)
        return after(self, h, self.self_attn.attend(q, k, v, kv_cache, meta))

    return forward


def decode_run(engine: LLMEngine, batch: int, steps: int, prompt_len: int) -> tuple[float, list]:
    """Mean seconds per decode step of `batch` greedy sequences, and their output tokens."""
    rng = random.Random(batch)
    vocab = engine.executor.model.spec.vocab_size
    sampling = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    ids = [engine.add_request(p, sampling) for p in prompts]
    outputs: dict[str, list[int]] = {}
    first = None
    num_steps = 0
    while engine.has_unfinished():
        for update in engine.step():
            if update.finished:
                outputs[update.group.request_id] = list(update.group.seqs[0].output_token_ids)
        if (
            first is None
            and all(s.num_uncomputed_tokens <= 1 for g in engine.scheduler.running for s in g.seqs)
            and not engine.scheduler.waiting
        ):
            first = time.perf_counter()  # every prompt prefilled: decode steps from here
            num_steps = 0
        else:
            num_steps += 1
    elapsed = time.perf_counter() - first
    return elapsed / max(num_steps, 1), [outputs[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the embedded model when not given")
    parser.add_argument("--quantization", default="int8", help="none (fp32), int8")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/compiled_decode_step.json")
    args = parser.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    torch._dynamo.config.cache_size_limit = 64
    model = ModelConfig(model=args.model, quantization=args.quantization)
    engine = LLMEngine(EngineConfig(model=model))
    eager, compiled = DecoderLayer.forward, compiled_layer_forward()
    DecoderLayer.forward = compiled
    start = time.perf_counter()
    for batch in sorted(set(sizes) | {1, 2}):  # batch 1 and the rest compile separately
        decode_run(engine, batch, 2, args.prompt_len)
    compile_s = time.perf_counter() - start
    print(f"compiled (and warmed up) in {compile_s:.1f} s", flush=True)
    times = {b: {"eager": [], "compiled": []} for b in sizes}
    outputs = {b: {} for b in sizes}
    for _ in range(args.rounds):
        for batch in sizes:
            for mode, forward in (("eager", eager), ("compiled", compiled)):
                DecoderLayer.forward = forward
                step_s, tokens = decode_run(engine, batch, args.steps, args.prompt_len)
                times[batch][mode].append(step_s * 1000)
                outputs[batch][mode] = tokens
                print(f"batch {batch} {mode}: {step_s * 1000:.1f} ms per decode step", flush=True)
    DecoderLayer.forward = eager
    rows = []
    for batch in sizes:
        e, c = statistics.median(times[batch]["eager"]), statistics.median(times[batch]["compiled"])
        same = sum(a == b for a, b in zip(outputs[batch]["eager"], outputs[batch]["compiled"]))
        rows.append(
            {
                "batch": batch,
                "eager_ms_per_step": round(e, 2),
                "compiled_ms_per_step": round(c, 2),
                "compiled_over_eager": round(c / e, 3),
                "eager_ms_each_round": [round(t, 2) for t in times[batch]["eager"]],
                "compiled_ms_each_round": [round(t, 2) for t in times[batch]["compiled"]],
                "greedy_outputs_identical": f"{same} of {batch}",
            }
        )
        print(rows[-1], flush=True)
    result = {
        "command": "benchmarks/compiled_decode_step.py " + " ".join(sys.argv[1:]),
        "quantization": args.quantization,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "compile_and_warmup_s": round(compile_s, 1),
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.json)


if __name__ == "__main__":
    main()
