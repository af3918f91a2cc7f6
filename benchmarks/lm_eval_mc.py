"""lm-eval's multiple-choice accuracy through a served model (local-completions: echo + logprobs)
against the same task scored by transformers (lm-eval's hf model), item by item.

    python benchmarks/lm_eval_mc.py --base-url http://127.0.0.1:8000 --model NAME \
        --model-dir PATH [--out results.json]

Needs the `lm-eval` package (the dev extra) and OPENAI_API_KEY when the server has --api-key.
Run from the repository root: the task's data file path is relative to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
TASK = "pagedserve_tiny_mc"


def evaluate(model: str, model_args: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's accuracy and each item's chosen answer for one model backend."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True,
        batch_size=1,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    chosen = [max(range(len(s["filtered_resps"])), key=lambda i: s["filtered_resps"][i][0])
              for s in samples]  # fmt: skip
    loglikelihoods = [[r[0] for r in s["filtered_resps"]] for s in samples]
    return {
        "acc": results["results"][TASK]["acc,none"],
        "chosen": chosen,
        "loglikelihoods": loglikelihoods,  # [item][choice] summed over the choice's tokens
    }


def compare(base_url: str, model: str, model_dir: str) -> dict[str, Any]:
    served = evaluate(
        "local-completions",
        {"model": model, "base_url": f"{base_url}/v1/completions", "tokenizer": model_dir},
    )
    reference = evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"})
    return {"served": served, "transformers": reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--model-dir", required=True, help="the same weights for transformers")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = compare(args.base_url, args.model, args.model_dir)
    print(f"{'backend':<14}{'acc':>8}")
    for name in ("served", "transformers"):
        print(f"{name:<14}{result[name]['acc']:>8.3f}")
    same = result["served"]["chosen"] == result["transformers"]["chosen"]
    print(f"same answer on every item: {same}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
