"""Perplexity of the served model per `--quantization`, by llama.cpp's method, beside transformers.

llama.cpp's `llama-perplexity -c 512`: the text is tokenized once and cut into consecutive
512-token chunks; each chunk is scored from an empty KV cache, and only its second half counts
(the tokens after position 256, each predicted from everything before it in the chunk:
255 per chunk, as llama.cpp does). Perplexity = exp(mean NLL). pagedserve scores through its own
path: one LLMEngine prefill per chunk with prompt logprobs, prefix caching off so that no chunk
reuses another's K/V. transformers fp32 on the same weights is the reference; with
`--llama-perplexity PATH`, llama.cpp's own estimate on the GGUF (it tokenizes the text itself).

    .venv/bin/python benchmarks/perplexity.py --llama-perplexity \
        /work/llama-build/build/bin/llama-perplexity

A mode `int8+fbgemm-rows` (or `int8+fbgemm-rows-reduced`) scores the int8 weights with every
token's linears computed the way a one-row decode step would compute them through fbgemm's
dynamic linear (its own asymmetric activation quantization per row; `-reduced`: 7-bit
activations, what fbgemm needs on AVX2 to keep its int16 pair sums from saturating): the
quality cost of that kernel for decode rows (benchmarks/decode_weight_streaming.py has its speed).
A mode `int8+int8-rows` scores every token through the CPU row kernels' int8 linear
(kernels/csrc/int8_rows.cpp), which computes each row on its own levels, so these are the
numerics of every decode and verify row where that kernel serves them. Mode `int4` scores
through the row kernels' 4-bit linear where they are built (kernels/csrc/int4_rows.cpp,
activations on 8-bit levels per 32 inputs); `int4+torch-int4` through torch's int4 kernel (fp32
activations): the cost of the 4-bit weights alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import torch

from services.engine.llm_engine import LLMEngine
from shared.config import CacheConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from shared.model_source import embedded_gguf_path, resolve_model
from shared.sampling import SamplingParams

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1-6.txt"


def chunk_tokens(token_ids: list[int], ctx: int, max_chunks: int | None) -> list[list[int]]:
    count = len(token_ids) // ctx
    if max_chunks is not None:
        count = min(count, max_chunks)
    return [token_ids[i * ctx : (i + 1) * ctx] for i in range(count)]


def scored_nll(logprobs: torch.Tensor, ctx: int) -> torch.Tensor:
    """[ctx - 1] logprobs of tokens 1..ctx-1 -> [ctx - 1 - ctx // 2] NLLs of the scored half."""
    # llama.cpp's `first = n_ctx / 2`: the logits at position first predict token first + 1.
    return -logprobs[ctx // 2 :]


def pagedserve_nll(
    model: str | None, mode: str, chunks: list[list[int]], threads: int
) -> tuple[torch.Tensor, float]:
    """Per scored token NLL [chunks * scored] and the seconds spent scoring."""
    ctx = len(chunks[0])
    quantization, _, row_kernel = mode.partition("+")
    if row_kernel not in ("", "fbgemm-rows", "fbgemm-rows-reduced", "int8-rows", "torch-int4"):
        raise SystemExit(f"unknown row kernel {row_kernel!r} in mode {mode!r}")
    if row_kernel == "int8-rows":
        rows = row_kernel_numerics()
    elif row_kernel == "torch-int4":
        rows = torch_int4_numerics()
    elif row_kernel:
        rows = one_row_numerics(reduce_range=row_kernel == "fbgemm-rows-reduced")
    else:
        rows = contextlib.nullcontext()
    config = EngineConfig(
        model=ModelConfig(
            model=model, quantization=quantization, device="cpu", num_threads=threads
        ),
        cache=CacheConfig(kv_cache_bytes=GiB // 8, swap_space_bytes=0),
        # One whole prefill per chunk, from an empty cache: no reuse of another chunk's blocks.
        scheduler=SchedulerConfig(max_num_batched_tokens=ctx, enable_prefix_caching=False),
    )
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    nlls = []
    with rows, LLMEngine(config) as engine:
        start = time.perf_counter()
        for chunk in chunks:  # one at a time: each chunk is its step's only prefill
            (output,) = engine.generate([chunk], sampling)
            scored = output.prompt_logprobs
            assert scored.start_pos == 1 and len(scored.tokens) == ctx - 1
            logprobs = torch.tensor([t.logprob for t in scored.tokens], dtype=torch.float64)
            nlls.append(scored_nll(logprobs, ctx))
        seconds = time.perf_counter() - start
    return torch.cat(nlls), seconds


@contextlib.contextmanager
def one_row_numerics(reduce_range: bool):
    """While open, Int8Linear computes each row alone through fbgemm's dynamic linear on the
    same int8 weights (packed once per layer): one-row decode numerics for every scored token."""
    from services.executor.quantized import exact_decode_kernel, pack_for_fbgemm

    if not reduce_range and not exact_decode_kernel():
        raise SystemExit(
            "fbgemm does not sum exactly on this CPU (no VNNI): int8+fbgemm-rows would score "
            "saturated sums; int8+fbgemm-rows-reduced is the variant that runs here"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        packed = self.__dict__.get("_fbgemm")
        if packed is None:  # the same int8 levels and scales, the layer's bias
            packed = pack_for_fbgemm(self.qweight_t.t(), self.scales, self.bias)
            self.__dict__["_fbgemm"] = packed
        dynamic = torch.ops.quantized.linear_dynamic
        return torch.cat([dynamic(row, packed, reduce_range) for row in x.float().split(1)])

    with _int8_forward(forward):
        yield


@contextlib.contextmanager
def row_kernel_numerics():
    """While open, Int8Linear computes every call through the row kernels' int8 linear, in
    calls of at most INT8_ROWS_MAX_ROWS rows (each row's result is the same alone)."""
    from kernels.cpu_rows import build_error, load_row_ops
    from services.executor.quantized import INT8_ROWS_MAX_ROWS, pack_int8_rows

    ops = load_row_ops()
    if ops is None:
        raise SystemExit(f"the CPU row kernels are not built here: {build_error()}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.rows_packed is None:
            self.rows_packed, self.rows_colsum = pack_int8_rows(self.qweight_t.t())
        parts = [
            ops.int8_rows_linear(part.contiguous(), self.rows_packed, self.rows_colsum, self.scales)
            for part in x.float().split(INT8_ROWS_MAX_ROWS)
        ]
        out = torch.cat(parts)
        return out if self.bias is None else out + self.bias

    with _int8_forward(forward):
        yield


@contextlib.contextmanager
def torch_int4_numerics():
    """While open, Int4Linear keeps torch's int4 kernel (fp32 activations) instead of the row
    kernels' 4-bit linear (activations on 8-bit levels per 32 inputs): the weights' own cost."""
    from services.executor.quantized import Int4Linear

    original = Int4Linear.use_row_ops
    Int4Linear.use_row_ops = lambda self, row_ops: original(self, None)
    try:
        yield
    finally:
        Int4Linear.use_row_ops = original


@contextlib.contextmanager
def _int8_forward(forward):
    """Int8Linear.forward replaced by `forward` while open."""
    from services.executor.quantized import Int8Linear

    original = Int8Linear.forward
    Int8Linear.forward = forward
    try:
        yield
    finally:
        Int8Linear.forward = original


def transformers_nll(model_dir: Path, chunks: list[list[int]]) -> tuple[torch.Tensor, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ctx = len(chunks[0])
    nlls = []
    start = time.perf_counter()
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk])
            logits = model(ids).logits[0, :-1].double()  # [ctx - 1, vocab]
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
            nlls.append(scored_nll(logprobs, ctx))
    return torch.cat(nlls), time.perf_counter() - start


def llama_cpp_tokens(binary: str, gguf: Path, text: Path) -> list[int] | None:
    """The text's token ids by llama.cpp's own tokenizer (llama-tokenize beside `binary`)."""
    tokenize = Path(binary).with_name("llama-tokenize")
    if not tokenize.is_file():
        return None
    command = [str(tokenize), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_perplexity(binary: str, gguf: Path, text: Path, ctx: int, threads: int) -> dict:
    command = [binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    log = done.stdout + done.stderr
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if final is None or chunks is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{log[-2000:]}")
    num_chunks = int(chunks.group(1))
    return {
        "perplexity": float(final.group(1)),
        "perplexity_stderr": float(final.group(2)),
        "chunks": num_chunks,
        "scored_tokens": num_chunks * (ctx - 1 - ctx // 2),
        "seconds": round(seconds, 2),
        "command": " ".join(command),
    }


def summarize(nll: torch.Tensor, seconds: float, reference: torch.Tensor | None) -> dict:
    mean = nll.mean().item()
    row = {"perplexity": math.exp(mean), "mean_nll": mean, "seconds": round(seconds, 2)}
    if reference is not None:
        diff = nll - reference  # the same tokens on both sides
        stderr = diff.std().item() / math.sqrt(len(diff))
        ref_ppl = math.exp(reference.mean().item())
        row["vs_reference_percent"] = (math.exp(mean) / ref_ppl - 1) * 100
        row["nll_diff_mean"] = diff.mean().item()
        row["nll_diff_stderr"] = stderr
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--ctx", type=int, default=512, help="chunk length (llama.cpp's -c)")
    parser.add_argument("--max-chunks", type=int, default=None)
    parser.add_argument("--modes", default="none,int8,int4", help="--quantization values")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers reference")
    parser.add_argument("--llama-perplexity", default=None, help="llama.cpp's binary")
    parser.add_argument("--gguf", default=None, help="for llama.cpp; default: the embedded one")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--output", default="benchmarks/results/perplexity.json")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)

    model_dir = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = Path(args.text).read_text()
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = chunk_tokens(token_ids, args.ctx, args.max_chunks)
    if not chunks:
        raise SystemExit(f"{args.text}: {len(token_ids)} tokens, fewer than one chunk")
    report = {
        "text": Path(args.text).name,
        "text_tokens": len(token_ids),
        "ctx": args.ctx,
        "chunks": len(chunks),
        "scored_tokens": len(chunks) * (args.ctx - 1 - args.ctx // 2),
        "threads": args.num_threads,
        "load": os.getloadavg(),
        "reference": None if args.skip_hf else "transformers fp32",
        "rows": {},
    }
    reference = None
    if not args.skip_hf:
        reference, seconds = transformers_nll(model_dir, chunks)
        report["rows"]["transformers fp32"] = summarize(reference, seconds, reference)
    for mode in args.modes.split(","):
        nll, seconds = pagedserve_nll(args.model, mode, chunks, args.num_threads)
        report["rows"][f"pagedserve {mode}"] = summarize(nll, seconds, reference)
        # Per chunk, so that a regression can be told from noise in one chunk.
        per_chunk = nll.view(len(chunks), -1).mean(dim=1)
        report["rows"][f"pagedserve {mode}"]["chunk_mean_nll"] = per_chunk.tolist()
    if args.llama_perplexity:
        gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
        row = llama_cpp_perplexity(
            args.llama_perplexity, gguf, Path(args.text), args.ctx, args.num_threads
        )
        llama_ids = llama_cpp_tokens(args.llama_perplexity, gguf, Path(args.text))
        if llama_ids is not None:
            row["text_tokens"] = len(llama_ids)
            row["same_token_ids"] = llama_ids == token_ids
        if reference is not None:
            ref_ppl = math.exp(reference.mean().item())
            row["vs_reference_percent"] = (row["perplexity"] / ref_ppl - 1) * 100
        report["rows"]["llama.cpp"] = row
    report["load_after"] = os.getloadavg()

    print(f"{len(chunks)} chunks of {args.ctx}, {report['scored_tokens']} tokens scored")
    print(f"{'path':24} {'ppl':>8} {'vs ref':>8} {'dNLL':>16} {'s':>7}")
    for name, row in report["rows"].items():
        vs = row.get("vs_reference_percent")
        diff = (
            f"{row['nll_diff_mean']:+.4f}±{row['nll_diff_stderr']:.4f}"
            if "nll_diff_mean" in row
            else ""
        )
        print(
            f"{name:24} {row['perplexity']:8.3f} {'' if vs is None else f'{vs:+.2f}%':>8}"
            f" {diff:>16} {row['seconds']:7.1f}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
