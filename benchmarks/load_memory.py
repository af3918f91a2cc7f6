"""Peak host memory while the executor loads a checkpoint, against the checkpoint's largest tensor.

Builds a seeded random Llama of about 1 GB of fp32 safetensors in one file (a wide embedding and
head, two wide layers), then loads it with services/executor/weights.py in a fresh process and
reads that process's resident memory just before loading and its peak (VmHWM, reset before the
load) after. On a CPU the loaded parameters live in host memory themselves, so the figure that
must stay small is the loader's own share: peak - baseline - the parameters' bytes, which the
lazy loader keeps below 1.5 x the largest tensor. A tiny model of the same family is loaded
first, so that what any first load imports (torch._dynamo, about 95 MiB) counts as baseline.
Writes benchmarks/results/load_memory.json.

    .venv/bin/python benchmarks/load_memory.py
    .venv/bin/python benchmarks/load_memory.py --device cuda --dtype bfloat16  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def build_checkpoint(out: Path, hidden: int, intermediate: int, layers: int, vocab: int) -> Path:
    """config.json and one model.safetensors of seeded random fp32 weights, written tensor by
    tensor from a dict (the builder's memory is not what is measured)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    heads = hidden // 64
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 4,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(out)
    kv = heads // 4 * 64
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.empty(shape).normal_(0.0, 0.02, generator=generator)
        for name, shape in shapes.items()
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(model_dir: Path, warm_up_dir: Path, device: str, dtype: str) -> dict:
    """Load in this process (a fresh one, warmed up by loading `warm_up_dir`) and report its
    memory around the load."""
    from safetensors import safe_open

    from kernels.ops import select_ops
    from services.executor.weights import load_hf_config, load_model

    load_hf_config(model_dir)
    target = torch.device(device)
    ops = select_ops("torch" if target.type == "cpu" else "auto", target)
    load_model(warm_up_dir, getattr(torch, dtype), 256, ops, target)  # dropped at once
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        sizes = [f.get_slice(n).get_shape() for n in f.keys()]
    largest = max(torch.Size(s).numel() for s in sizes) * 4  # fp32 on disk
    checkpoint = sum(torch.Size(s).numel() for s in sizes) * 4
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    baseline = _status_kib("VmRSS") * 1024
    model = load_model(model_dir, getattr(torch, dtype), 256, ops, target)
    peak = _status_kib("VmHWM") * 1024
    tensors = [*model.parameters(), *model.buffers()]
    on_host = sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")
    overhead = peak - baseline - on_host
    return {
        "device": device,
        "dtype": dtype,
        "checkpoint_mib": round(checkpoint / MiB, 1),
        "largest_tensor_mib": round(largest / MiB, 1),
        "baseline_rss_mib": round(baseline / MiB, 1),
        "peak_rss_mib": round(peak / MiB, 1),
        "parameters_on_host_mib": round(on_host / MiB, 1),
        "loader_overhead_mib": round(overhead / MiB, 1),
        "overhead_over_largest_tensor": round(overhead / largest, 3),
        "bound_largest_tensor_x": 1.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=40960)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the dtype loaded into")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/load_memory.json"))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.measure:
        model_dir, warm_up_dir = (Path(p) for p in args.measure.split(","))
        print(json.dumps(measure(model_dir, warm_up_dir, args.device, args.dtype)))
        return
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        model_dir = build_checkpoint(
            Path(tmp) / "model", args.hidden, args.intermediate, args.layers, args.vocab
        )
        warm_up_dir = build_checkpoint(Path(tmp) / "warm-up", 256, 512, 1, 1000)
        child = [sys.executable, __file__, "--measure", f"{model_dir},{warm_up_dir}"]
        child += ["--device", args.device, "--dtype", args.dtype]
        done = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    result["command"] = " ".join(["benchmarks/load_memory.py", *sys.argv[1:]])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
