"""Engine configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from shared.structured import GrammarLimits

PreemptionMode = Literal["swap", "recompute"]
BudgetOrder = Literal["decode-first", "arrival"]
DTypeName = Literal["float32", "float16", "bfloat16", "float64"]

GiB = 1 << 30


def _positive(name: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # local HF directory or .gguf file; None means the embedded model
    dtype: DTypeName = "float32"  # fp32 is the fast dtype on AVX2 CPUs
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # seeds the seeds drawn for requests that bring none
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    device: str = "auto"  # auto: cuda when available, else cpu
    attention_backend: str = "auto"  # auto: triton on cuda, the torch reference elsewhere
    # Weights of linear layers, embedding and LM head: none (fp32, the reference), int8, int4
    # (CPU kernels); auto picks the measured default for the embedded model on a CPU and none
    # otherwise (services/executor/quantize_model.py).
    quantization: str = "auto"
    # On CUDA, decode steps replay captured graphs (services/executor/cuda_graphs.py); True
    # runs every step eagerly.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(
                f"quantization must be auto, none, int8 or int4, got {self.quantization!r}"
            )
        if self.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(
                f"dtype must be float32, float16, bfloat16 or float64, got {self.dtype!r}"
            )
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("num_threads", self.num_threads, allow_none=True)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_device_blocks: int | None = None  # explicit pool size; wins over kv_cache_bytes
    kv_cache_bytes: int = 1 * GiB  # budget for the device KV pool when num_device_blocks is None
    swap_space_bytes: int = 1 * GiB  # CPU swap pool; capped at the device pool's size

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be an integer, got {self.block_size!r}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        _positive("num_device_blocks", self.num_device_blocks, allow_none=True)
        _positive("kv_cache_bytes", self.kv_cache_bytes)
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences per step, at most
    # Tokens computed per step, at most (the token budget); None: 512 on a CPU, 2048 elsewhere
    # (see token_budget).
    max_num_batched_tokens: int | None = None
    # While other sequences decode, the prompt tokens one request computes per step, at most,
    # counted context-free and raised to the number of decoding sequences (a long prompt alone
    # still takes the whole budget); None: 64 on a CPU, no cap elsewhere.
    max_prefill_tokens_per_request: int | None = None
    enable_chunked_prefill: bool = True  # split long prompts across steps to fit the budget
    preemption_mode: PreemptionMode = "recompute"
    # Fraction of device blocks kept free at admission so that admitted groups can grow a little
    # before someone has to be preempted (avoids admit-then-preempt thrash).
    watermark: float = 0.01
    # KV allocation: "paged" blocks on demand, or an Orca baseline that reserves a contiguous
    # region per request ("orca-max", "orca-pow2", "orca-oracle"); see services/scheduler.
    kv_policy: str = "paged"
    # Reuse the K/V of full prompt blocks that earlier requests computed (paged policy only).
    enable_prefix_caching: bool = True
    # Who gets the step's token budget first: "decode-first" gives every decoding sequence its
    # token, then prompt chunks in arrival order (vLLM v1), so long prefills do not stall
    # running streams; "arrival" serves running groups strictly in arrival order (the paper's).
    budget_order: BudgetOrder = "decode-first"
    # The scheduler service plans step N+1 while the executor runs step N whenever N+1 needs
    # nothing of N's result but its sampled tokens, which the executor fills in itself
    # (services/scheduler/lookahead.py); the host's work then hides behind the device's.
    async_scheduling: bool = True
    # Who is served first and who yields under memory pressure: "fcfs" (the paper's) or
    # "priority" (the request's priority, then FCFS); the names and their checks live in
    # services/scheduler/policies.py, where the scheduler builds the policy.
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        if self.budget_order not in ("decode-first", "arrival"):
            raise ValueError(
                f"budget_order must be decode-first or arrival, got {self.budget_order!r}"
            )
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _positive(
            "max_prefill_tokens_per_request", self.max_prefill_tokens_per_request, allow_none=True
        )
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be swap or recompute, got {self.preemption_mode!r}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_policy not in ("paged", "orca-max", "orca-pow2", "orca-oracle"):
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
        # delays the running streams' next token; 64 gave the shortest gaps beside a 7,800-token
        # prompt of 32-256 without slowing it (benchmarks/long_prompt_fairness.py).
        return 64 if device_type == "cpu" else None


@dataclass(frozen=True)
class GrammarConfig:
    """Structured output: the time a grammar may take to compile (its request then ends with an
    error; the compile worker is killed), the compiled grammars the executor keeps, and the size
    of specs the gateway and the scheduler accept."""

    compile_timeout_s: float = 10.0
    cache_bytes: int = 256 << 20  # compiled grammars kept for reuse (xgrammar's own accounting)
    limits: GrammarLimits = field(default_factory=GrammarLimits)
    # Different grammars waiting for a compile (one worker compiles them in turn); a request
    # for yet another one past it is answered 429 (one for a grammar already waited for is not).
    max_pending: int = 16

    def __post_init__(self) -> None:
        _positive("compile_timeout_s", self.compile_timeout_s)
        _positive("max_pending", self.max_pending)
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int):
            raise ValueError(f"cache_bytes must be an integer, got {self.cache_bytes!r}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")

    @classmethod
    def from_dict(cls, values: dict) -> GrammarConfig:
        values = dict(values)
        values["limits"] = GrammarLimits(**values.get("limits", {}))
        return cls(**values)


@dataclass(frozen=True)
class SimConfig:
    """The simulated executor: no model runs; a cost model of this GPU and model times each step."""

    gpu: str = "a100-40gb"
    model: str = "opt-13b"
    kv_cache_bytes: int | None = None  # None: the pool as on that GPU
    step_overhead_s: float | None = None  # None: the GPU entry's default
    realtime: bool = False  # sleep for the modeled time (serving) instead of only counting it

    def __post_init__(self) -> None:
        _positive("kv_cache_bytes", self.kv_cache_bytes, allow_none=True)
        if self.step_overhead_s is not None and self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the executor as tensor_parallel_size ranks (torch.distributed)."""

    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"  # where rank 0 listens for the other ranks
    master_port: int | None = None  # None: a free port, chosen by rank 0 (local ranks only)
    external_workers: bool = False  # ranks 1.. are started by hand (e.g. on other machines)

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.external_workers and self.master_port is None:
            raise ValueError("ranks started by hand need a fixed master_port to find rank 0")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    executor: Literal["model", "sim"] = "model"  # sim: services/executor/sim.py
    sim: SimConfig = field(default_factory=SimConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> EngineConfig:
        return cls(
            model=ModelConfig(**values["model"]),
            cache=CacheConfig(**values["cache"]),
            scheduler=SchedulerConfig(**values["scheduler"]),
            parallel=ParallelConfig(**values["parallel"]),
            executor=values.get("executor", "model"),
            sim=SimConfig(**values.get("sim", {})),
            grammar=GrammarConfig.from_dict(values.get("grammar", {})),
        )
