"""Every benchmark script runs at tiny sizes and writes the JSON it promises, so none can rot.

Each script runs in this process (runpy, its own argv) where it can, sharing the imports and
the tiny model; the ones that start servers start them as they always do. Outputs go to a
temporary folder, never over the committed figures under benchmarks/results.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@dataclass(frozen=True)
class Case:
    script: str
    argv: Callable[[Path, Path], list[str]]  # (tiny model dir, JSON path) -> arguments
    # Dotted paths into the JSON ("rows.0.x"), each of which must hold a value that is not
    # None and not empty: the figure the script exists to report.
    required: tuple[str, ...]
    marks: tuple = field(default=())


CASES = [
    Case(
        "attention_kernels",
        lambda m, out: ["--batches", "1", "--contexts", "64", "--prefill-batches", "1",
                        "--prefill-lens", "128", "--output", str(out)],
        ("device", "rows.0.paged_us", "prefill_rows.0.paged_tflop_per_s"),
        (pytest.mark.gpu,
         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ),
    Case(
        "calibrate_sim",
        lambda m, out: ["--smoke", "--repeats", "1", "--threads", "1", "--json", str(out)],
        ("cpu_gemm_flops", "repeats.0.runs.fit.num_steps", "repeats.0.runs.check.num_steps"),
        (pytest.mark.slow,),  # its cost model is the embedded SmolLM2's
    ),
    Case(
        "layer_skip_agreement",
        lambda m, out: ["--model", str(m), "--tokens", "16", "--layers", "1", "--output", str(out)],
        ("tokens", "agreement.1"),
    ),
    Case(
        "make_layer_skip_draft",
        lambda m, out: ["--model", str(m), "--layers", "1", "--out", str(out.parent / "draft"),
                        "--json", str(out)],
        ("draft", "num_hidden_layers"),
    ),
    Case(
        "cpu_linear_kernels",
        lambda m, out: ["--rows", "1", "--repeats", "1", "--threads", "1", "--json", str(out)],
        ("shape", "int_mm_fast_path", "ms.1.fp32 mm", "ms.1._int_mm int8 x int8",
         "ms.1.Int8Linear (the executor's int8 layer)"),
    ),
    Case(
        "decode_weight_streaming",
        lambda m, out: ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "2",
                        "--kv-heads", "1", "--head-dim", "32", "--vocab", "256", "--rows", "1,3",
                        "--passes", "1", "--threads", "1", "--json", str(out)],
        ("int8_weight_mb", "median_per_pass.read floor.gb_per_s",
         "median_per_pass._int_mm, 1 row(s).ms",
         "median_per_pass.fbgemm dynamic, 1 row(s).max_relative_diff_vs_int_mm_gaussian",
         "median_per_pass.fbgemm rows, 3 row(s).max_relative_diff_vs_int_mm_gaussian"),
    ),
    Case(
        "cpu_serving",
        lambda m, out: [f"--pagedserve=tiny=--model {m}", "--tokenizer", str(m),
                        "--num-requests", "2", "--input-len", "8", "--output-len", "4",
                        "--warmup", "0", "--runs", "1", "--threads", "1", "--output", str(out)],
        ("workload", "servers.pagedserve tiny.runs.0.output_throughput"),
    ),
    Case(
        "executor_host_cost",
        lambda m, out: ["--batch", "4", "--input-len", "4", "--output-len", "4",
                        "--rounds", "1", "--json", str(out)],
        ("best_ms.current.greedy.host", "best_ms.current.seeded_top_p.host"),
        (pytest.mark.slow,),  # the random model carries the embedded model's tokenizer
    ),
    Case(
        "gateway_cost",
        lambda m, out: ["--streams", "4", "--max-tokens", "8", "--rounds", "1",
                        "--gateways", "1", "--step-ms", "1", "--json", str(out)],
        ("runs.1 gateways.0.0.tokens", "best_cpu_us_per_token.1 gateways"),
        (pytest.mark.slow,),  # the gateway detokenizes with the embedded model's tokenizer
    ),
    Case(
        "gpu_throughput",
        # Its CPU path: the tiny shape, in-process only.
        lambda m, out: ["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                        "--tokenizer", str(m), "--num-requests", "2", "--input-len", "4",
                        "--output-len", "2", "--workloads", "fixed", "--skip-hf",
                        "--skip-served", "--kv-cache-gb", "0.01", "--json", str(out)],
        ("device", "results.fixed.in_process.tok_per_s"),
    ),
    Case(
        "gpu_step_profile",
        # Its CPU path: the tiny shape.
        lambda m, out: ["--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                        "--tokenizer", str(m), "--num-requests", "2", "--input-len", "4",
                        "--output-len", "2", "--kv-cache-gb", "0.01", "--json", str(out)],
        ("plain.steps", "python.by_self.0.function", "ops.0.count"),
    ),
    Case(
        "scheduler_host_cost",
        lambda m, out: ["--batch", "4", "--input-len", "8", "--output-len", "8",
                        "--rounds", "1", "--json", str(out)],
        ("best_ms.current.async.plan", "best_ms.current.sync.update",
         "best_ms.current.async.plan_wire", "best_ms.current.sync.deltas"),
    ),
    Case(
        "gpu_sync_points",
        lambda m, out: ["--tokenizer", str(m), "--num-requests", "2", "--input-len", "8",
                        "--output-len", "4", "--json", str(out)],
        ("device", "greedy.steps", "penalties.steps"),
        (pytest.mark.gpu,
         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ),
    Case(
        "int8_smoothing_cost",
        lambda m, out: ["--model", str(m), "--rows", "1", "--decode-batches", "2",
                        "--prefill-len", "16", "--repeats", "1", "--threads", "1",
                        "--json", str(out)],
        ("calibration_pass_s", "layers.lm_head rows=1.new_over_old",
         "steps.decode batch=2.new_over_old"),
    ),
    Case(
        "batch_invariance",
        lambda m, out: ["--model", str(m), "--quantizations", "none", "--random-prompts", "2",
                        "--output-len", "4", "--companions", "1", "--threads", "1",
                        "--json", str(out)],
        ("modes.0.summary.batched", "modes.0.prompts.1.speculating",
         "modes.0.prompts.1.prompt_cached", "sdpa.contexts"),
    ),
    Case(
        "triton_config_sweep",
        lambda m, out: ["--warps", "4", "--stages", "2,3", "--no-write-config",
                        "--json", str(out)],
        ("device", "results.decode.best", "results.prefill.best_over_default"),
        (pytest.mark.gpu,
         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ),
    Case(
        "deep_chunk_attention",
        lambda m, out: ["--model", str(m), "--rows", "1,2", "--contexts", "32,64",
                        "--repeats", "1", "--threads", "1", "--json", str(out)],
        # The fit's two terms; their ratio (context_read_rows) is None when noise at these
        # sizes gives no per-row cost.
        ("points.3.seconds", "read_s_per_context_token", "row_s_per_context_token"),
    ),
    Case(
        "kv_state_cost",
        lambda m, out: ["--blocks", "64", "--num-requests", "8", "--repeats", "1",
                        "--json", str(out)],
        ("0.num_device_blocks", "0.snapshot_ms", "0.json_kib"),
    ),
    Case(
        "linear_orientation",
        lambda m, out: ["--rows", "1", "--seconds", "0.001", "--threads", "1",
                        "--output", str(out)],
        ("results.0.x_wt", "results.0.w_xt"),
    ),
    Case(
        "logit_bias_cost",
        lambda m, out: ["--vocab", "512", "--n", "2", "--entries", "64,2", "--steps", "1",
                        "--warmup", "0", "--json", str(out)],
        ("setup", "rows.0.build_ms", "rows.0.sample_ms"),
    ),
    Case(
        "sampling_candidates",
        lambda m, out: ["--model", str(m), "--batches", "1,2", "--window", "8", "--reps", "1",
                        "--json", str(out)],
        ("rows.0.speedup", "rows.0.tokens_differing", "candidate_tiers"),
    ),
    Case(
        # Interpreted on a CPU (tests/conftest.py sets TRITON_INTERPRET): a few rows only.
        "sampling_kernel",
        lambda m, out: ["--device", "cpu", "--batch", "2", "--vocabs", "200", "--reps", "1",
                        "--json", str(out)],
        ("results.1.fused_ms", "results.1.torch_ms"),
    ),
    Case(
        "long_prompt_fairness",
        lambda m, out: ["--setting", "tiny=", "--common", f"--model {m}", "--vocab-size", "384",
                        "--long-len", "64", "--short-len", "4", "--idle-tokens", "32",
                        "--stream-tokens", "200", "--json", str(out)],
        ("rows.0.long_prompt_latency_s", "rows.0.idle_max_gap_s", "rows.0.idle_matched_p99_gap_s"),
    ),
    Case(
        "ngram_replay",
        lambda m, out: ["--model", str(m), "--streams", str(out.parent / "streams.json"),
                        "--levels", "1:1", "--output-len", "8", "--passage-words", "5",
                        "--threads", "1", "--k", "3", "--ngram-min", "1", "--ngram-max", "4",
                        "--per-match", "0,2", "--engine-check", "3:1:4:0", "--output", str(out)],
        ("streams.num_streams", "rows.0.results.all.tokens_per_step",
         "engine_checks.2.engine_proposed", "lookup_bound_by_k.3.all"),
    ),
    Case(
        "offline_throughput",
        lambda m, out: ["--model", str(m), "--num-prompts", "2", "--input-len", "8",
                        "--output-len", "4", "--threads", "1", "--output", str(out)],
        ("ours.tokens_per_s", "transformers.tokens_per_s", "identical_greedy_sequences"),
    ),
    Case(
        "perplexity",
        lambda m, out: ["--model", str(m), "--ctx", "64", "--max-chunks", "2",
                        "--modes", "none,int8", "--num-threads", "1", "--output", str(out)],
        ("rows.transformers fp32.perplexity", "rows.pagedserve int8.perplexity",
         "rows.pagedserve int8.nll_diff_mean"),
    ),
    Case(
        "prefix_cache_overhead",
        lambda m, out: ["--num-requests", "4", "--json", str(out)],
        ("unique.0.ms_per_step", "system-prompt.1.hit_rate"),
    ),
    Case(
        "cpu_row_kernels",
        lambda m, out: ["--model", str(m), "--quantization", "none", "--batch-sizes", "2",
                        "--steps", "2", "--prompt-len", "4", "--warmup", "1", "--json", str(out)],
        ("rows.0.kernels_over_reference", "rows.0.reference_ms"),
    ),
    Case(
        "int8_rows_linear",
        lambda m, out: ["--model", str(m), "--quantization", "int8", "--batch-sizes", "2",
                        "--steps", "2", "--prompt-len", "4", "--warmup", "1", "--json", str(out)],
        ("rows.0.int8_rows_over_baseline", "rows.0.baseline_ms"),
    ),
    Case(
        "compiled_decode_step",
        lambda m, out: ["--model", str(m), "--quantization", "none", "--batch-sizes", "2",
                        "--steps", "2", "--prompt-len", "4", "--rounds", "1", "--json", str(out)],
        ("rows.0.compiled_over_eager", "rows.0.greedy_outputs_identical"),
    ),
    Case(
        "profile_decode_step",
        lambda m, out: ["--model", str(m), "--num-seqs", "2", "--prompt-len", "4",
                        "--steps", "1", "--json", str(out)],
        ("ms_per_decode_step", "top_ops_self_cpu.0.op"),
    ),
    Case(
        "profile_prefill_chunk",
        lambda m, out: ["--model", str(m), "--modes", "none", "--chunk", "16",
                        "--prompt-len", "8", "--steps", "1", "--threads", "1",
                        "--json", str(out)],
        ("modes.none.ms_per_step", "modes.none.profiled_ms_by_group"),
    ),
    Case(
        "quantized_quality",
        lambda m, out: ["--model", str(m), "--modes", "none,int8", "--max-tokens", "2",
                        "--num-threads", "1", "--output", str(out)],
        ("modes.none.of", "modes.int8.weight_bytes"),
    ),
    Case(
        "serving_overhead",
        lambda m, out: ["--model", str(m), "--num-requests", "2", "--input-len", "4",
                        "--output-len", "4", "--rounds", "1", "--output", str(out)],
        ("best_tokens_per_s.async", "best_tokens_per_s.sync", "runs.async.0.mean_ms.executor"),
    ),
    Case(
        "sim_capacity",
        lambda m, out: ["--num-requests", "8", "--overheads-ms", "5",
                        "--policies", "paged,orca-oracle", "--json", str(out)],
        ("by_overhead_ms.5.paged.output_tokens_per_s",
         "by_overhead_ms.5.paged.throughput_over_oracle"),
    ),
    Case(
        "speculative",
        lambda m, out: ["--model", str(m), "--workloads", "repeat,random",
                        "--concurrency", "1:1,2:2", "--output-len", "4", "--passage-words", "5",
                        "--random-input-len", "8", "--threads", "1", "--repeats", "2",
                        "--output", str(out)],
        ("workload", "servers.pagedserve off.results.random.1.output_throughput",
         "servers.pagedserve ngram.results.repeat.2.output_throughput",
         "servers.pagedserve ngram.results.repeat.2.rounds.1.output_throughput"),
    ),
    Case(
        "speculation_batch_cost",
        lambda m, out: ["--model", str(m), "--engine", "off=",
                        "--engine", "ngram=--speculative-method ngram", "--workloads", "random",
                        "--num-requests", "3", "--max-num-seqs", "2", "--output-len", "4",
                        "--rounds", "2", "--threads", "1", "--output", str(out)],
        ("runs.ngram.random.1.output_throughput", "summary.ngram.random.median_ratio_to_first"),
    ),
    Case(
        "structured_output",
        lambda m, out: ["--model", str(m), "--device", "cpu", "--num-requests", "2",
                        "--max-tokens", "4", "--rounds", "1", "--json", str(out)],
        ("rounds.1.tok_per_s", "summary.step_time_ratio"),
    ),
    Case(
        "tensor_parallel_cpu",
        lambda m, out: ["--smoke", "--num-requests", "2", "--input-len", "4",
                        "--output-len", "2", "--json", str(out)],
        ("size_1.tok_per_s", "size_2.tok_per_s", "identical_greedy_outputs"),
    ),
    Case(
        "triton_launch_overhead",
        lambda m, out: ["--calls", "2", "--repeats", "1", "--rounds", "1", "--json", str(out)],
        ("triton", "best_us.current.decode 1b, 256 rows", "best_us.current.sampler 256 rows, top-p",
         "best_us.current.prefill 8b, 2 chunks"),
    ),
    Case(
        "wire_cost",
        lambda m, out: ["--seqs", "4", "--repeats", "1", "--json", str(out)],
        ("by_seqs.4.plan.current.encode_ms", "by_seqs.4.deltas.current.bytes",
         "by_seqs.4.columns.current.decode_ms"),
    ),
]  # fmt: skip


def _at(data, dotted: str):
    for key in dotted.split("."):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


# Scripts that need a served model run, at tiny sizes, in the test that checks their figure.
SMOKED_ELSEWHERE = {
    "lm_eval_mc": ROOT / "tests" / "service" / "test_lm_eval.py",
    "load_memory": ROOT / "tests" / "service" / "test_load_memory.py",  # its figure checked there
    # On the Ray test cluster that module starts anyway (a cluster of its own would cost more).
    "ray_startup": ROOT / "tests" / "service" / "test_ray_cluster.py",
}


def test_every_benchmark_script_has_a_smoke_case():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert scripts == {case.script for case in CASES} | set(SMOKED_ELSEWHERE)
    for script, test in SMOKED_ELSEWHERE.items():
        assert f"{script}.py" in test.read_text()  # that test runs the script itself


@pytest.fixture
def restored_process_state():
    """The scripts set torch's thread count for their own process; this one is shared."""
    threads = torch.get_num_threads()
    argv = sys.argv
    try:
        yield
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)


def _live_children() -> set[int]:
    children = psutil.Process().children(recursive=True)
    return {c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.script, marks=c.marks) for c in CASES])
def test_benchmark_script_writes_its_json(
    case, tiny_model_dir, tmp_path, monkeypatch, restored_process_state
):
    out = tmp_path / "out.json"
    script = BENCHMARKS / f"{case.script}.py"
    children_before = _live_children()
    # Anything the script writes by a relative default lands here, not in the checkout.
    monkeypatch.chdir(tmp_path)
    sys.argv = [str(script), *case.argv(tiny_model_dir, out)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        assert done.code in (None, 0), f"{case.script} exited with {done.code}"
    data = json.loads(out.read_text())
    for dotted in case.required:
        value = _at(data, dotted)
        assert value is not None and value != [] and value != {}, dotted
    # A script stops what it started (servers, ranks, workers) before it returns.
    assert _live_children() <= children_before


@pytest.mark.parametrize(
    "script",
    sorted([*BENCHMARKS.glob("*.sh"), ROOT / "loadtest" / "run.sh"]),
    ids=lambda p: p.name,
)
def test_shell_script_parses(script):
    # These run minutes-long measurements (or need a GPU or Locust); bash -n checks their syntax.
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
