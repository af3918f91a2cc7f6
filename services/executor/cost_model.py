"""A roofline cost model of one engine step on a named GPU and model, for the simulated executor.

A step reads every weight once and the K/V of every scheduled sequence's context, writes the new
tokens' K/V, and does 2 FLOPs per weight per token plus attention; it takes the longer of bytes
over HBM bandwidth and FLOPs over peak, plus a fixed per-step overhead (scheduling, input
preparation, kernel launches, sampling) and any swap traffic over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import StepPlan

GiB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float  # peak memory bandwidth
    peak_flops: float  # dense fp16/bf16 tensor-core peak (fp32 GEMM rate for a CPU)
    pcie_bytes_per_s: float  # host <-> device, for swaps
    step_overhead_s: float  # per-step fixed cost; see docs/benchmarks.md for its calibration


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_params: int
    dtype_bytes: int
    max_model_len: int
    eos_token_id: int

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


GPUS = {
    g.name: g
    for g in (
        # Vendor peaks. The overhead of 5 ms per step is an assumption for a GPU host (not
        # measured on one); the CPU entry's overhead is fitted to a measured run.
        GpuSpec("a100-40gb", 40 * GiB, 1.555e12, 312e12, 25e9, 0.005),
        GpuSpec("a100-80gb", 80 * GiB, 2.039e12, 312e12, 25e9, 0.005),
        GpuSpec("h100-80gb", 80 * GiB, 3.35e12, 989e12, 50e9, 0.005),
        # This machine's two cores, fp32, quiet: copy bandwidth, GEMM rate and the per-step
        # overhead fitted by benchmarks/calibrate_sim.py (docs/benchmarks.md, 2026-11-30).
        GpuSpec("cpu-2core", 24 * GiB, 49e9, 152e9, 49e9, 0.074),
    )
}

MODELS = {
    m.name: m
    for m in (
        ModelSpec("opt-13b", 40, 5120, 40, 40, 128, 50272, 12_850_000_000, 2, 2048, 2),
        ModelSpec("opt-66b", 64, 9216, 72, 72, 128, 50272, 65_700_000_000, 2, 2048, 2),
        ModelSpec("llama-7b", 32, 4096, 32, 32, 128, 32000, 6_740_000_000, 2, 4096, 2),
        ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 49152, 134_515_008, 4, 8192, 2),
    )
}

# KV pool as the paper sizes it for OPT-13B on one A100-40GB: 12 GB (~15.7K token slots).
PAPER_KV_BYTES = {("a100-40gb", "opt-13b"): 12 * GiB}


def kv_cache_bytes(gpu: GpuSpec, model: ModelSpec) -> int:
    """The KV pool on that GPU: the paper's figure where it gives one, else 90% of memory less
    the weights and a 10% activation reserve (vLLM's default memory utilisation)."""
    if (gpu.name, model.name) in PAPER_KV_BYTES:
        return PAPER_KV_BYTES[(gpu.name, model.name)]
    left = int(0.9 * gpu.memory_bytes) - model.weight_bytes - int(0.1 * model.weight_bytes)
    if left <= 0:
        raise ValueError(f"{model.name} does not fit on one {gpu.name}")
    return left


@dataclass(frozen=True)
class StepCost:
    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float
    swap_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.swap_s + self.overhead_s


def step_cost(
    plan: StepPlan, gpu: GpuSpec, model: ModelSpec, block_size: int, overhead_s: float
) -> StepCost:
    num_tokens = plan.num_tokens
    kv = model.kv_bytes_per_token
    # Every sequence reads its whole context's K/V (new tokens included) and writes its new ones.
    context = sum(s.start_pos + len(s.token_ids) for s in plan.seqs)
    bytes_moved = model.weight_bytes + (context + num_tokens) * kv if plan.seqs else 0
    bytes_moved += 2 * len(plan.copies) * block_size * kv  # copy-on-write: read and write
    # Linear layers: 2 FLOPs per weight per token, except the LM head (tied to the embedding),
    # computed for sampling rows only; attention: QK^T and PV over each token's context.
    head = model.vocab_size * model.hidden_size
    num_sampled = sum(1 + len(s.fork_seq_ids) for s in plan.seqs if s.sample)
    attn_pairs = sum(
        len(s.token_ids) * s.start_pos + len(s.token_ids) * (len(s.token_ids) + 1) // 2
        for s in plan.seqs
    )
    flops = (
        2 * (model.num_params - head) * num_tokens
        + 2 * head * num_sampled
        + 4 * model.num_layers * model.num_heads * model.head_dim * attn_pairs
    )
    swapped = len(plan.swap_in) + len(plan.swap_out)
    return StepCost(
        bytes_moved=bytes_moved,
        flops=flops,
        memory_s=bytes_moved / gpu.hbm_bytes_per_s,
        compute_s=flops / gpu.peak_flops,
        swap_s=swapped * block_size * kv / gpu.pcie_bytes_per_s,
        overhead_s=overhead_s if plan.seqs or swapped else 0.0,
    )
