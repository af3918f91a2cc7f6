"""How often a layer-skip draft of the embedded model (its first N layers, then its final norm and
head) picks the full model's greedy token, teacher-forced over the calibration text: the
acceptance a greedy draft of N layers can reach at its first proposal. Writes JSON.

    .venv/bin/python benchmarks/layer_skip_agreement.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from shared.model_source import resolve_model

CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "services/executor/calibration_text.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", default="2,4,6,8,12,16,20,24,28")
    parser.add_argument("--output", default="benchmarks/results/layer_skip_agreement.json")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(CALIBRATION_TEXT.read_text(), return_tensors="pt").input_ids
    ids = ids[:, : args.tokens]
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
        full = out.logits.argmax(dim=-1)  # [1, tokens]
        agreement = {}
        for n in (int(x) for x in args.layers.split(",")):
            # hidden_states[n]: after the first n layers; the head reads it through the norm.
            exit_logits = model.lm_head(model.model.norm(out.hidden_states[n]))
            agreement[n] = (exit_logits.argmax(dim=-1) == full).float().mean().item()
    num_layers = model.config.num_hidden_layers
    for n, rate in agreement.items():
        print(f"first {n:2} of {num_layers} layers: {rate:.3f} of greedy tokens agree")
    report = {"model": str(model_dir), "tokens": ids.shape[1], "agreement": agreement}
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
