"""Build the draft model of the embedded SmolLM2-135M-Instruct for --speculative-method draft:
its first few decoder layers with its embedding, final norm and (tied) head, saved as a
checkpoint with its tokenizer (layer-skip self-speculation; no smaller model of its tokenizer
is stored here).

    .venv/bin/python benchmarks/make_layer_skip_draft.py --layers 6 \
        --out ~/.cache/pagedserve/models/SmolLM2-135M-Instruct-first6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from services.bench.layer_skip_draft import make_layer_skip_draft
from shared.model_source import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded model)")
    parser.add_argument("--layers", type=int, default=6, help="keep the first N layers")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None, help="also write what was built here")
    args = parser.parse_args()
    target = resolve_model(args.model)
    out = make_layer_skip_draft(target, args.out.expanduser(), list(range(args.layers)))
    print(f"draft with the first {args.layers} layers of {target}: {out}")
    if args.json is not None:
        config = json.loads((Path(out) / "config.json").read_text())
        report = {"target": str(target), "draft": str(out), "layers": args.layers,
                  "num_hidden_layers": config["num_hidden_layers"]}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
