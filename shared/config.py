"""Engine configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from shared.flags import GIB, MIB, MS, GiB, config_from_dict, flag, section
from shared.structured import GrammarLimits

PreemptionMode = Literal["swap", "recompute"]
BudgetOrder = Literal["decode-first", "arrival"]
DTypeName = Literal["auto", "float32", "float16", "bfloat16", "float64"]
DeviceName = Literal["auto", "cpu", "cuda"]
AttentionBackend = Literal["auto", "torch", "triton"]
Quantization = Literal["auto", "none", "int8", "int4"]
Int8DecodeKernel = Literal["auto", "int_mm"]
CpuRowKernels = Literal["auto", "off"]
KVPolicy = Literal["paged", "orca-max", "orca-pow2", "orca-oracle"]
GenerationConfigSource = Literal["auto", "vllm"]
ExecutorKind = Literal["model", "sim"]
SpeculativeMethod = Literal["ngram", "draft"]


def _positive(name: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    # Local HF directory, .gguf file or Hub id; None means the embedded model.
    model: str | None = flag(
        None, "--model",
        "local HF directory (config.json + safetensors + tokenizer), .gguf file, or Hugging "
        "Face Hub id org/name[@revision] (its cache; downloaded unless HF_HUB_OFFLINE=1); "
        "default: the embedded SmolLM2-135M-Instruct",
    )  # fmt: skip
    # Where Hub ids are cached and downloaded; None: the Hub's cache (HF_HUB_CACHE, HF_HOME).
    download_dir: str | None = flag(
        None, "--download-dir",
        "cache directory for Hub models (default: HF_HUB_CACHE, else HF_HOME/hub)",
    )  # fmt: skip
    # auto: fp32 on a CPU (the fast dtype on AVX2), the checkpoint's torch_dtype elsewhere.
    dtype: DTypeName = flag(
        "auto", "--dtype",
        "weights and KV dtype; auto = float32 on a CPU, the checkpoint's dtype on CUDA",
    )  # fmt: skip
    # Sampling defaults of requests that leave them unset: auto takes the checkpoint's
    # generation_config.json (as vLLM's --generation-config auto), vllm the built-in ones.
    generation_config: GenerationConfigSource = flag(
        "auto", "--generation-config",
        "default temperature, top_p, top_k, min_p and repetition_penalty of requests that set "
        "none: auto = the checkpoint's generation_config.json, vllm = the built-in defaults",
    )  # fmt: skip
    # None: the model's max_position_embeddings.
    max_model_len: int | None = flag(None, "--max-model-len", "context length cap")
    # Seeds the seeds drawn for requests that bring none.
    seed: int = flag(0, "--engine-seed", "seed for requests without a seed")
    # Torch intra-op threads; None leaves torch's default.
    num_threads: int | None = flag(None, "--num-threads", "torch CPU threads")
    device: DeviceName = flag("auto", "--device")  # auto: cuda when available, else cpu
    attention_backend: AttentionBackend = flag(
        "auto", "--attention-backend",
        "paged-attention kernels: auto = triton on CUDA, the torch reference on CPU",
    )  # fmt: skip
    # Weights of linear layers, embedding and LM head: none (fp32, the reference), int8, int4
    # (CPU kernels); auto picks the measured default for the embedded model on a CPU and none
    # otherwise (services/executor/quantize_model.py).
    quantization: Quantization = flag(
        "auto", "--quantization",
        "CPU weight kernels: none = fp32; int8 = int8 weights and activations; int4 = GGUF "
        "Q4_1 repacked; auto = int8 for the embedded model on a CPU, none otherwise",
    )  # fmt: skip
    # int8 calls of up to 32 rows (decode and verify steps of a few sequences): auto = fbgemm's
    # dynamic linear where it sums exactly (CPUs with VNNI), else _int_mm as every larger call
    # (services/executor/quantized.py); int_mm = always _int_mm (no second packed copy).
    int8_decode_kernel: Int8DecodeKernel = flag(
        "auto", "--int8-decode-kernel",
        "int8 kernel for calls of up to 32 rows (decode and verify steps of a few sequences): "
        "auto = fbgemm where it sums exactly (VNNI CPUs), else _int_mm; int_mm = _int_mm always",
    )  # fmt: skip
    # Steps whose sequences compute up to 16 tokens each (decodes, verify steps) run each layer's
    # norms, rotary, KV write, attention and gate as C++ ops on a CPU (kernels/cpu_rows.py);
    # off keeps the reference ops for every step.
    cpu_row_kernels: CpuRowKernels = flag(
        "auto", "--cpu-row-kernels",
        "CPU: auto = C++ ops for a layer's small ops in decode and verify steps (built on first "
        "use; the reference ops where they cannot be built); off = the reference ops always",
    )  # fmt: skip
    # On CUDA, decode steps replay captured graphs (services/executor/cuda_graphs.py); True
    # runs every step eagerly.
    enforce_eager: bool = flag(
        False, "--enforce-eager",
        "CUDA: run every decode step eagerly instead of replaying captured CUDA graphs",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.device not in typing.get_args(DeviceName):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in typing.get_args(AttentionBackend):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.quantization not in typing.get_args(Quantization):
            raise ValueError(
                f"quantization must be auto, none, int8 or int4, got {self.quantization!r}"
            )
        if self.dtype not in typing.get_args(DTypeName):
            raise ValueError(
                f"dtype must be auto, float32, float16, bfloat16 or float64, got {self.dtype!r}"
            )
        if self.generation_config not in typing.get_args(GenerationConfigSource):
            raise ValueError(
                f"generation_config must be auto or vllm, got {self.generation_config!r}"
            )
        if self.cpu_row_kernels not in typing.get_args(CpuRowKernels):
            raise ValueError(f"cpu_row_kernels must be auto or off, got {self.cpu_row_kernels!r}")
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("num_threads", self.num_threads, allow_none=True)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = flag(16, "--block-size", "tokens per KV block")
    # Explicit pool size; wins over kv_cache_bytes.
    num_device_blocks: int | None = flag(None, "--num-device-blocks", "KV pool size in blocks")
    # Budget for the device KV pool when num_device_blocks is None.
    kv_cache_bytes: int = flag(1 * GiB, "--kv-cache-gb", "KV pool budget (GiB)", unit=GIB)
    # CPU swap pool; capped at the device pool's size.
    swap_space_bytes: int = flag(1 * GiB, "--swap-space-gb", "CPU swap pool (GiB)", unit=GIB)
    # CPU (the reference attention): host memory for contiguous copies of the cached K/V of
    # prompts computed chunk by chunk deep into their context, so that such a chunk reads its
    # context in place instead of gathering it from the blocks every step
    # (services/executor/context_mirror.py). 0: always gather.
    context_mirror_bytes: int = flag(
        GiB // 2, "--context-mirror-gb",
        "CPU: memory for contiguous copies of long prompts' K/V while they are computed in "
        "chunks (GiB; 0: gather from the blocks every step)", unit=GIB,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be an integer, got {self.block_size!r}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        _positive("num_device_blocks", self.num_device_blocks, allow_none=True)
        _positive("kv_cache_bytes", self.kv_cache_bytes)
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.context_mirror_bytes < 0:
            raise ValueError(f"context_mirror_bytes must be >= 0, got {self.context_mirror_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = flag(256, "--max-num-seqs")  # running sequences per step, at most
    # Tokens computed per step, at most (the token budget); None: 512 on a CPU, 2048 elsewhere
    # (see token_budget).
    max_num_batched_tokens: int | None = flag(
        None, "--max-num-batched-tokens",
        "token budget per step (default: 512 on a CPU, 2048 on a GPU)",
    )  # fmt: skip
    # While other sequences decode, the prompt tokens one request computes per step, at most,
    # counted context-free and raised to the number of decoding sequences (a long prompt alone
    # still takes the whole budget); None: 32 on a CPU, no cap elsewhere.
    max_prefill_tokens_per_request: int | None = flag(
        None, "--max-prefill-tokens-per-request",
        "while other sequences decode, the prompt tokens one request computes per step, at "
        "most, counted context-free and never below the number of decoding sequences (default: 32 "
        "on a CPU, no cap on a GPU; the token budget turns it off)",
    )  # fmt: skip
    # While other requests run, the decode rows one request's samples take per step, at most
    # (n > 1: its sequences take turns, the least advanced first); None: 8 on a CPU, no cap
    # elsewhere. Beam search is exempt: its beams step together.
    max_decode_rows_per_request: int | None = flag(
        None, "--max-decode-rows-per-request",
        "while other requests run, the decode rows one request (n > 1) takes per step, at most; "
        "its samples take turns (default: 8 on a CPU, no cap on a GPU; beam search is exempt)",
    )  # fmt: skip
    # CPU: a prompt chunk deep enough that reading its context would outweigh the cap is
    # computed a few decoder layers per step (services/scheduler/layer_parts.py).
    layer_parts: bool = flag(
        True, "--no-layer-parts",
        "CPU: compute each deep prompt chunk in one step, however long its context read "
        "(default: in layer parts over several steps while others decode)",
    )  # fmt: skip
    # Split long prompts across steps to fit the budget.
    enable_chunked_prefill: bool = flag(
        True, "--no-chunked-prefill",
        "compute each prompt in one step instead of budget-sized chunks",
    )  # fmt: skip
    preemption_mode: PreemptionMode = flag("recompute", "--preemption-mode")
    # Fraction of device blocks kept free at admission so that admitted groups can grow a little
    # before someone has to be preempted (avoids admit-then-preempt thrash).
    watermark: float = 0.01
    # KV allocation: "paged" blocks on demand, or an Orca baseline that reserves a contiguous
    # region per request ("orca-max", "orca-pow2", "orca-oracle"); see services/scheduler.
    kv_policy: KVPolicy = flag(
        "paged", "--kv-policy",
        "KV allocation: paged blocks, or an Orca baseline's contiguous reservation",
    )  # fmt: skip
    # Reuse the K/V of full prompt blocks that earlier requests computed (paged policy only).
    enable_prefix_caching: bool = flag(
        True, "--no-prefix-caching",
        "do not reuse the K/V of prompt blocks that earlier requests computed",
    )  # fmt: skip
    # Who gets the step's token budget first: "decode-first" gives every decoding sequence its
    # token, then prompt chunks in arrival order (vLLM v1), so long prefills do not stall
    # running streams; "arrival" serves running groups strictly in arrival order (the paper's).
    budget_order: BudgetOrder = flag(
        "decode-first", "--budget-order",
        "token budget: decoding sequences first, then prompt chunks by arrival (default), "
        "or running groups strictly by arrival",
    )  # fmt: skip
    # The scheduler service plans step N+1 while the executor runs step N whenever N+1 needs
    # nothing of N's result but its sampled tokens, which the executor fills in itself
    # (services/scheduler/lookahead.py); the host's work then hides behind the device's.
    async_scheduling: bool = flag(
        True, "--no-async-scheduling",
        "served: wait for each step's result before planning the next (default: plan the "
        "next decode step while the executor runs this one)",
    )  # fmt: skip
    # Who is served first and who yields under memory pressure: "fcfs" (the paper's) or
    # "priority" (the request's priority, then FCFS); the names and their checks live in
    # services/scheduler/policies.py, where the scheduler builds the policy.
    scheduling_policy: str = flag(
        "fcfs", "--scheduling-policy",
        "fcfs: first come, first served (the paper's); priority: the request's priority "
        "field first (lower is served first, the lowest yields first), then arrival",
    )  # fmt: skip

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        if self.budget_order not in typing.get_args(BudgetOrder):
            raise ValueError(
                f"budget_order must be decode-first or arrival, got {self.budget_order!r}"
            )
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _positive(
            "max_prefill_tokens_per_request", self.max_prefill_tokens_per_request, allow_none=True
        )
        _positive("max_decode_rows_per_request", self.max_decode_rows_per_request, allow_none=True)
        if self.preemption_mode not in typing.get_args(PreemptionMode):
            raise ValueError(
                f"preemption_mode must be swap or recompute, got {self.preemption_mode!r}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_policy not in typing.get_args(KVPolicy):
            raise ValueError(
                "kv_policy must be paged, orca-max, orca-pow2 or orca-oracle, "
                f"got {self.kv_policy!r}"
            )

    def token_budget(self, device_type: str) -> int:
        """max_num_batched_tokens on this executor's device type ("cpu", "cuda", "sim")."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        # A CPU step's time grows with its tokens: 512 served best of 256-2048 (the chunk size
        # sweep in docs/benchmarks.md); a GPU needs large steps to keep its matmuls busy.
        return 512 if device_type == "cpu" else 2048

    def prefill_cap(self, device_type: str) -> int | None:
        """max_prefill_tokens_per_request on this device type; None: no cap."""
        if self.max_prefill_tokens_per_request is not None:
            return self.max_prefill_tokens_per_request
        # On a CPU a step's time grows with its tokens, so every prompt token a step holds
        # delays the running streams' next token. Against the same stream alone, 32 kept the
        # gaps beside a 7,800-token prompt within 2x in every round, 64 in half of them; the
        # prompt takes about 1.8x as long (benchmarks/long_prompt_fairness.py, docs/benchmarks.md).
        return 32 if device_type == "cpu" else None

    def decode_row_cap(self, device_type: str) -> int | None:
        """max_decode_rows_per_request on this device type; None: no cap."""
        if self.max_decode_rows_per_request is not None:
            return self.max_decode_rows_per_request
        # On a CPU a decode step's time grows with its rows: beside one request with n = 64 a
        # stream's longest gap was 3.4-7.3x its idle gap, with 8 rows 1.3-1.7x, the n = 64
        # request taking about 1.5x as long (docs/reliability.md, "The n = 64 rows"). A GPU
        # step's time hardly grows with its rows: no cap there.
        return 8 if device_type == "cpu" else None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: proposals verified in one target step, rejected slots rolled back."""

    # None: off. ngram proposes from the request's own tokens (services/scheduler/
    # ngram_proposer.py); draft runs --draft-model in the executor.
    method: SpeculativeMethod | None = flag(
        None, "--speculative-method",
        "propose tokens and verify them in one step: ngram (prompt lookup in the request's own "
        "tokens) or draft (a smaller model of the same tokenizer, --draft-model); default: off",
    )  # fmt: skip
    num_tokens: int = flag(
        3, "--num-speculative-tokens", "tokens proposed per speculating sequence and step, at most"
    )
    # As vLLM's prompt_lookup_min/max: the longest suffix of n in [min, max] tokens that occurs
    # earlier in the request wins. 3 (llama.cpp's ngram-simple n): matches of one or two tokens
    # proposed more and were accepted less; with engines in lockstep at concurrency 1, 3 beat
    # 1 in every round on code and repeated text (int8 and int4) and tied on random prompts
    # (docs/benchmarks.md, "4-bit weights on the CPU").
    ngram_min: int = flag(3, "--ngram-min", "shortest n-gram the ngram proposer matches")
    ngram_max: int = flag(4, "--ngram-max", "longest n-gram the ngram proposer matches")
    # At most this many proposals per matched n-gram token (0: K whatever the match): a short
    # match is weak evidence of copying (services/scheduler/ngram_proposer.py). Off by default:
    # on recorded outputs K = 8 with 2 per match projected 1.89 tokens per verify step where
    # K = 3 made 1.74 (benchmarks/ngram_replay.py), but served at concurrency 1 its TPOT was no
    # better on repeated text and 20% worse on code (docs/benchmarks.md).
    ngram_proposals_per_match: int = flag(
        0, "--ngram-proposals-per-match",
        "ngram: propose at most this many tokens per token of the matched n-gram (0: always "
        "--num-speculative-tokens)",
    )  # fmt: skip
    # A verification step costs K+1 query rows per sequence: worth it while the step is bound
    # by reading the weights (small batches), not once the batch itself fills the step. 2: on
    # the CPU, since one-row steps got cheaper, speculating at batch 3 and 4 lost up to a
    # quarter on repeat and code prompts while batch 1 and 2 gained on all three workloads
    # (benchmarks/results/speculative_int8_rows*.json, docs/benchmarks.md); at 64 it lost 10-35%.
    max_batch: int = flag(
        2, "--speculative-max-batch",
        "speculate only while the running batch has at most this many sequences",
    )  # fmt: skip
    # Off: every eligible sequence proposes at every step under max_batch. On: proposals join
    # a step only while their measured acceptance and cost say they raise its tokens per second
    # (services/scheduler/speculation_gate.py), so a draft that rarely agrees stops costing.
    adaptive: bool = flag(
        True, "--no-speculative-adaptive",
        "propose at every step under --speculative-max-batch, whether or not it has been paying",
    )  # fmt: skip
    draft_model: str | None = flag(
        None, "--draft-model",
        "the draft model of --speculative-method draft: a local HF directory, .gguf file or "
        "Hub id sharing the target's tokenizer",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in typing.get_args(SpeculativeMethod):
            raise ValueError(f"speculative method must be ngram or draft, got {self.method!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("--speculative-method draft needs --draft-model (the draft model)")
        _positive("num_speculative_tokens", self.num_tokens)
        if self.ngram_proposals_per_match < 0:
            raise ValueError(
                f"ngram_proposals_per_match must be >= 0, got {self.ngram_proposals_per_match}"
            )
        _positive("ngram_min", self.ngram_min)
        _positive("ngram_max", self.ngram_max)
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be at most ngram_max ({self.ngram_max})"
            )
        _positive("speculative_max_batch", self.max_batch)

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class GrammarConfig:
    """Structured output: the time a grammar may take to compile (its request then ends with an
    error; the compile worker is killed), the compiled grammars the executor keeps, and the size
    of specs the gateway and the scheduler accept."""

    compile_timeout_s: float = flag(
        10.0, "--grammar-compile-timeout",
        "seconds a grammar may take to compile, and to wait for other compiles before its own "
        "starts: a compile past it ends the request with a 400 and the compile worker is "
        "killed, a wait past it with a 429 (compiles run beside the running streams, never "
        "in a step)",
    )  # fmt: skip
    # Compiled grammars kept for reuse (xgrammar's own accounting).
    cache_bytes: int = flag(
        256 << 20, "--grammar-cache-mb", "compiled grammars kept for reuse", unit=MIB
    )
    # Different grammars waiting for a compile (one worker compiles them in turn); a request
    # for yet another one past it is answered 429 (one for a grammar already waited for is not).
    max_pending: int = flag(
        16, "--max-pending-grammars",
        "different grammars that may wait for a compile at once (compiles run one at a "
        "time); a request for another one is answered 429",
    )  # fmt: skip
    limits: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self) -> None:
        _positive("compile_timeout_s", self.compile_timeout_s)
        _positive("max_pending", self.max_pending)
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int):
            raise ValueError(f"cache_bytes must be an integer, got {self.cache_bytes!r}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")

    @classmethod
    def from_dict(cls, values: dict) -> GrammarConfig:
        return config_from_dict(cls, values)


@dataclass(frozen=True)
class SimConfig:
    """The simulated executor: no model runs; a cost model of this GPU and model times each step."""

    gpu: str = flag("a100-40gb", "--sim-gpu", "a100-40gb, a100-80gb, h100-80gb, ...")
    model: str = flag("opt-13b", "--sim-model", "opt-13b, opt-66b, llama-7b, ...")
    # None: the pool as on that GPU.
    kv_cache_bytes: int | None = flag(
        None, "--sim-kv-gb", "KV pool (GiB); default: as on that GPU", unit=GIB
    )
    # None: the GPU entry's default.
    step_overhead_s: float | None = flag(
        None, "--sim-overhead-ms", "per-step overhead; default: the GPU's", unit=MS
    )
    realtime: bool = False  # sleep for the modeled time (serving) instead of only counting it

    def __post_init__(self) -> None:
        _positive("kv_cache_bytes", self.kv_cache_bytes, allow_none=True)
        if self.step_overhead_s is not None and self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the executor as tensor_parallel_size ranks (torch.distributed)."""

    tensor_parallel_size: int = flag(
        1, "--tensor-parallel-size", "executor ranks sharing the model"
    )
    # Where rank 0 listens for the other ranks.
    master_addr: str = flag(
        "127.0.0.1", "--tp-master-addr", "address where rank 0 meets the others"
    )
    # None: a free port, chosen by rank 0 (local ranks only).
    master_port: int | None = flag(None, "--tp-master-port", "its port (default: a free one)")
    # Ranks 1.. are started by hand (e.g. on other machines).
    external_workers: bool = flag(
        False, "--tp-external-workers",
        "start ranks 1.. by hand (python -m services.executor.tp_worker) instead of locally",
    )  # fmt: skip

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.external_workers and self.master_port is None:
            raise ValueError("ranks started by hand need a fixed master_port to find rank 0")


@dataclass(frozen=True)
class EngineConfig:
    # Each nested config is one section of the flags' help, in this order.
    model: ModelConfig = section("model", ModelConfig)
    cache: CacheConfig = section("KV cache", CacheConfig)
    scheduler: SchedulerConfig = section("scheduler", SchedulerConfig)
    grammar: GrammarConfig = section("structured output", GrammarConfig)
    speculative: SpeculativeConfig = section("speculative decoding", SpeculativeConfig)
    # sim: services/executor/sim.py
    executor: ExecutorKind = flag(
        "model", "--executor",
        "sim: run no model; time each step by a cost model of --sim-gpu and --sim-model",
        group="simulated executor",
    )  # fmt: skip
    sim: SimConfig = section("simulated executor", SimConfig)
    parallel: ParallelConfig = section("tensor parallelism", ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> EngineConfig:
        """The config that to_dict() (and a JSON round trip) made; missing sections: defaults."""
        return config_from_dict(cls, values)
