"""Command-line flags for the engine's configs, shared by every pagedserve command."""

from __future__ import annotations

import argparse

from services.scheduler.policies import SCHEDULING_POLICIES
from shared.config import (
    CacheConfig,
    EngineConfig,
    GiB,
    GrammarConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SimConfig,
)
from shared.structured import GrammarLimits


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="local HF directory (config.json + safetensors + tokenizer) or .gguf file; "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    model.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"]
    )
    model.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    model.add_argument(
        "--engine-seed", type=int, default=0, help="seed for requests without a seed"
    )
    model.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    model.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    model.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="paged-attention kernels: auto = triton on CUDA, the torch reference on CPU",
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every decode step eagerly instead of replaying captured CUDA graphs",
    )
    model.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="CPU weight kernels: none = fp32; int8 = fbgemm int8; int4 = GGUF Q4_1 repacked; "
        "auto = int8 for the embedded model on a CPU, none otherwise",
    )

    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument("--num-device-blocks", type=int, default=None, help="KV pool size in blocks")
    cache.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool budget (GiB)")
    cache.add_argument("--swap-space-gb", type=float, default=1.0, help="CPU swap pool (GiB)")

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=int, default=256)
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: 512 on a CPU, 2048 on a GPU)",
    )
    sched.add_argument(
        "--max-prefill-tokens-per-request",
        type=int,
        default=None,
        help="while other sequences decode, the prompt tokens one request computes per step, at "
        "most, counted context-free and never below the number of decoding sequences (default: 64 "
        "on a CPU, no cap on a GPU; the token budget turns it off)",
    )
    sched.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="compute each prompt in one step instead of budget-sized chunks",
    )
    sched.add_argument("--preemption-mode", default="recompute", choices=["swap", "recompute"])
    sched.add_argument(
        "--budget-order",
        default="decode-first",
        choices=["decode-first", "arrival"],
        help="token budget: decoding sequences first, then prompt chunks by arrival (default), "
        "or running groups strictly by arrival",
    )
    sched.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=list(SCHEDULING_POLICIES),
        help="fcfs: first come, first served (the paper's); priority: the request's priority "
        "field first (lower is served first, the lowest yields first), then arrival",
    )
    sched.add_argument(
        "--kv-policy",
        default="paged",
        choices=["paged", "orca-max", "orca-pow2", "orca-oracle"],
        help="KV allocation: paged blocks, or an Orca baseline's contiguous reservation",
    )
    sched.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not reuse the K/V of prompt blocks that earlier requests computed",
    )

    sched.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="served: wait for each step's result before planning the next (default: plan the "
        "next decode step while the executor runs this one)",
    )

    grammar = parser.add_argument_group("structured output")
    grammar.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a grammar may take to compile; past it the request ends with a 400 and "
        "the compile worker is killed (compiles run beside the running streams, never in a step)",
    )
    grammar.add_argument(
        "--grammar-cache-mb", type=float, default=256.0, help="compiled grammars kept for reuse"
    )
    grammar.add_argument(
        "--max-pending-grammars", type=int, default=16,
        help="different grammars that may wait for a compile at once (compiles run one at a "
        "time); a request for another one is answered 429",
    )  # fmt: skip
    limits = GrammarLimits()
    grammar.add_argument(
        "--max-grammar-spec-bytes", type=int, default=limits.max_spec_bytes,
        help="largest structured-output spec (schema, regex, grammar, choice list) accepted",
    )  # fmt: skip
    grammar.add_argument(
        "--max-grammar-choices", type=int, default=limits.max_choices,
        help="most guided_choice items, or enum values in a JSON schema (all enums together)",
    )  # fmt: skip
    grammar.add_argument(
        "--max-grammar-regex-bytes", type=int, default=limits.max_regex_bytes,
        help="longest guided_regex, or pattern in a JSON schema",
    )  # fmt: skip
    grammar.add_argument(
        "--max-grammar-depth", type=int, default=limits.max_depth,
        help="deepest nesting of a JSON schema",
    )  # fmt: skip

    sim = parser.add_argument_group("simulated executor")
    sim.add_argument(
        "--executor",
        default="model",
        choices=["model", "sim"],
        help="sim: run no model; time each step by a cost model of --sim-gpu and --sim-model",
    )
    sim.add_argument("--sim-gpu", default="a100-40gb", help="a100-40gb, a100-80gb, h100-80gb, ...")
    sim.add_argument("--sim-model", default="opt-13b", help="opt-13b, opt-66b, llama-7b, ...")
    sim.add_argument(
        "--sim-kv-gb", type=float, default=None, help="KV pool (GiB); default: as on that GPU"
    )
    sim.add_argument(
        "--sim-overhead-ms", type=float, default=None, help="per-step overhead; default: the GPU's"
    )

    parallel = parser.add_argument_group("tensor parallelism")
    parallel.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="executor ranks sharing the model"
    )
    parallel.add_argument(
        "--tp-master-addr", default="127.0.0.1", help="address where rank 0 meets the others"
    )
    parallel.add_argument(
        "--tp-master-port", type=int, default=None, help="its port (default: a free one)"
    )
    parallel.add_argument(
        "--tp-external-workers",
        action="store_true",
        help="start ranks 1.. by hand (python -m services.executor.tp_worker) instead of locally",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.engine_seed,
            num_threads=args.num_threads,
            device=args.device,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            enforce_eager=args.enforce_eager,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_device_blocks=args.num_device_blocks,
            kv_cache_bytes=int(args.kv_cache_gb * GiB),
            swap_space_bytes=int(args.swap_space_gb * GiB),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_per_request=args.max_prefill_tokens_per_request,
            enable_chunked_prefill=args.chunked_prefill,
            preemption_mode=args.preemption_mode,
            kv_policy=args.kv_policy,
            enable_prefix_caching=args.prefix_caching,
            budget_order=args.budget_order,
            async_scheduling=args.async_scheduling,
            scheduling_policy=args.scheduling_policy,
        ),
        executor=args.executor,
        sim=SimConfig(
            gpu=args.sim_gpu,
            model=args.sim_model,
            kv_cache_bytes=int(args.sim_kv_gb * GiB) if args.sim_kv_gb else None,
            step_overhead_s=None if args.sim_overhead_ms is None else args.sim_overhead_ms / 1e3,
        ),
        grammar=GrammarConfig(
            compile_timeout_s=args.grammar_compile_timeout,
            cache_bytes=int(args.grammar_cache_mb * (1 << 20)),
            max_pending=args.max_pending_grammars,
            limits=GrammarLimits(
                max_spec_bytes=args.max_grammar_spec_bytes,
                max_choices=args.max_grammar_choices,
                max_regex_bytes=args.max_grammar_regex_bytes,
                max_depth=args.max_grammar_depth,
            ),
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            master_addr=args.tp_master_addr,
            master_port=args.tp_master_port,
            external_workers=args.tp_external_workers,
        ),
    )


def engine_argv(args: argparse.Namespace, model: str | None) -> list[str]:
    """The engine flags of `args` as a command line for a child process, with `model` swapped in."""
    argv = [
        "--dtype", args.dtype,
        "--engine-seed", str(args.engine_seed),
        "--block-size", str(args.block_size),
        "--kv-cache-gb", str(args.kv_cache_gb),
        "--swap-space-gb", str(args.swap_space_gb),
        "--max-num-seqs", str(args.max_num_seqs),
        "--preemption-mode", args.preemption_mode,
        "--kv-policy", args.kv_policy,
        "--device", args.device,
        "--attention-backend", args.attention_backend,
        "--quantization", args.quantization,
        "--budget-order", args.budget_order,
        "--scheduling-policy", args.scheduling_policy,
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--tp-master-addr", args.tp_master_addr,
        "--executor", args.executor,
        "--sim-gpu", args.sim_gpu,
        "--sim-model", args.sim_model,
        "--grammar-compile-timeout", str(args.grammar_compile_timeout),
        "--grammar-cache-mb", str(args.grammar_cache_mb),
        "--max-pending-grammars", str(args.max_pending_grammars),
        "--max-grammar-spec-bytes", str(args.max_grammar_spec_bytes),
        "--max-grammar-choices", str(args.max_grammar_choices),
        "--max-grammar-regex-bytes", str(args.max_grammar_regex_bytes),
        "--max-grammar-depth", str(args.max_grammar_depth),
    ]  # fmt: skip
    optional = {
        "--model": model,
        "--max-model-len": args.max_model_len,
        "--num-threads": args.num_threads,
        "--num-device-blocks": args.num_device_blocks,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--max-prefill-tokens-per-request": args.max_prefill_tokens_per_request,
        "--tp-master-port": args.tp_master_port,
        "--sim-kv-gb": args.sim_kv_gb,
        "--sim-overhead-ms": args.sim_overhead_ms,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if not args.chunked_prefill:
        argv.append("--no-chunked-prefill")
    if not args.prefix_caching:
        argv.append("--no-prefix-caching")
    if not args.async_scheduling:
        argv.append("--no-async-scheduling")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.tp_external_workers:
        argv.append("--tp-external-workers")
    return argv
