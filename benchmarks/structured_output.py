"""Cost of structured output in a shared batch: half the requests under a JSON schema, vs none.

Both runs use the same chat prompts, the same seeded sampling and the same engine settings; in
the constrained run every other request carries a JSON schema (xgrammar's bitmask applied in
the batched sampler), so constrained and free rows share every step. Reported per run: output
tokens/s, mean step time, and the sampler's share of it; the runs alternate (A B A B) so slow
phases of a shared machine hit both.

    .venv/bin/python benchmarks/structured_output.py
    .venv/bin/python benchmarks/structured_output.py --model PATH --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z ]{1,20}$"},
        "country": {"type": "string", "pattern": "^[a-z ]{1,20}$"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population_millions", "is_capital"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe Paris as JSON.",
    "Describe Tokyo as JSON.",
    "Give me facts about Lima as JSON.",
    "What do you know about Oslo? Answer in JSON.",
]


def run(engine: LLMEngine, prompts: list[list[int]], constrained: bool, max_tokens: int) -> dict:
    guided = ("json_schema", json.dumps(SCHEMA))
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            guided=guided if constrained and i % 2 == 0 else None,
        )
        for i in range(len(prompts))
    ]
    engine.stats.seconds.clear()
    engine.stats.num_steps = 0
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    valid = None
    if constrained:
        texts = [
            engine.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
            for i, o in enumerate(outputs)
            if i % 2 == 0
        ]
        valid = sum(_is_valid(t) for t in texts)
    steps = engine.stats.num_steps
    return {
        "constrained": constrained,
        "seconds": elapsed,
        "output_tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "steps": steps,
        "ms_per_step": 1000 * elapsed / steps,
        "sample_ms_per_step": 1000 * engine.stats.seconds["sample"] / steps,
        "constrained_outputs_valid": valid,
    }


def _is_valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/structured_output.json")
    args = parser.parse_args()

    config = EngineConfig(
        model=ModelConfig(model=args.model, device=args.device),
        cache=CacheConfig(kv_cache_bytes=int(0.5 * GiB)),
        scheduler=SchedulerConfig(max_num_seqs=args.num_requests),
    )
    engine = LLMEngine(config)
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(args.num_requests)
    ]
    run(engine, prompts[:2], True, 4)  # warm-up: compiles the schema once, loads the tokenizer
    rounds = []
    for _ in range(args.rounds):
        for constrained in (False, True):
            result = run(engine, prompts, constrained, args.max_tokens)
            rounds.append(result)
            print(
                f"{'half JSON schema' if constrained else 'no constraint   '}: "
                f"{result['tok_per_s']:6.1f} tok/s, {result['ms_per_step']:6.1f} ms/step "
                f"(sampler {result['sample_ms_per_step']:5.1f} ms), "
                f"{result['output_tokens']} tokens"
                + (
                    f", {result['constrained_outputs_valid']}/{args.num_requests // 2} valid"
                    if constrained
                    else ""
                )
            )
    free = [r for r in rounds if not r["constrained"]]
    half = [r for r in rounds if r["constrained"]]
    summary = {
        "step_time_ratio": sum(r["ms_per_step"] for r in half)
        / sum(r["ms_per_step"] for r in free),
        "throughput_ratio": sum(r["tok_per_s"] for r in half) / sum(r["tok_per_s"] for r in free),
    }
    print(
        f"half constrained / unconstrained: step time x{summary['step_time_ratio']:.3f}, "
        f"throughput x{summary['throughput_ratio']:.3f}"
    )
    result = {
        "device": torch.cuda.get_device_name()
        if engine.executor.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "schema": SCHEMA,
        "rounds": rounds,
        "summary": summary,
    }
    engine.close()  # and its grammar compile worker process
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
