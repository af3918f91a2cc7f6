"""Mixture of experts: routing as transformers' routers, the grouped CPU path against every
expert run densely, Qwen3-MoE's dense layers, and where each expert's checkpoint tensors go."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from services.executor.models import model_spec
from services.executor.models.checkpoint_names import place, rank_slice
from services.executor.models.mixtral import MixtralForCausalLM
from services.executor.models.moe import grouped_experts, route
from services.executor.tensor_parallel import Shard, check_divisible

_SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_equals_transformers_routers(norm_topk_prob):
    torch.manual_seed(0)
    x = torch.randn(9, 32)
    mixtral = MixtralTopKRouter(MixtralConfig(**_SHAPE, num_local_experts=8))
    qwen = Qwen3MoeTopKRouter(
        Qwen3MoeConfig(
            **_SHAPE, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
        )
    )
    for router, top_k, renormalize in ((mixtral, 2, True), (qwen, 3, norm_topk_prob)):
        torch.nn.init.normal_(router.weight)
        _, want_weights, want_ids = router(x)
        weights, ids = route(F.linear(x, router.weight), top_k, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights.float())


def _dense_reference(x, gate_up, down, weights, ids):
    """Every expert on every token, weighted by the routing (zero for experts not chosen)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[e].T
        w = (weights * (ids == e)).sum(dim=-1, keepdim=True)
        out += y * w
    return out


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"),
    [(1, 16, 2), (2, 8, 4), (33, 4, 1), (40, 3, 3), (5, 1, 1)],
)
def test_grouped_experts_equal_every_expert_run_densely(num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    x = torch.randn(num_tokens, 24, generator=gen)
    gate_up = torch.randn(num_experts, 40, 24, generator=gen) * 0.3
    down = torch.randn(num_experts, 24, 20, generator=gen) * 0.3
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    out = grouped_experts(x, gate_up, down, weights, ids, F.silu)
    torch.testing.assert_close(out, _dense_reference(x, gate_up, down, weights, ids))


def test_qwen3_moe_keeps_the_configured_layers_dense():
    config = Qwen3MoeConfig(
        **_SHAPE,
        num_experts=4,
        moe_intermediate_size=16,
        mlp_only_layers=[0],
        decoder_sparse_step=2,
    )
    spec = model_spec(config)
    # Layer 0 by mlp_only_layers; layer 2 because (2 + 1) % 2 != 0.
    assert spec.moe.sparse_layers == (False, True, False, True)
    assert spec.qk_norm and not spec.moe.renormalize and spec.moe.intermediate_size == 16


def test_each_experts_tensors_fill_their_slice_of_the_stacked_weights_per_rank():
    spec = model_spec(MixtralConfig(**_SHAPE, num_local_experts=4))
    shard = Shard(rank=1, size=2)
    prefix = "model.layers.3.block_sparse_moe"
    w3 = place(MixtralForCausalLM, spec, shard, f"{prefix}.experts.2.w3.weight")
    assert (w3.param, w3.expert) == ("layers.3.block_sparse_moe.experts.gate_up_proj.weight", 2)
    # Up rows follow this rank's 24 gate rows; the rank keeps rows 24..48 of the tensor.
    assert w3.dest_rows == (24, 48) and w3.source_rows == ((24, 48),)
    w2 = place(MixtralForCausalLM, spec, shard, f"{prefix}.experts.3.w2.weight")
    assert (w2.param, w2.expert) == ("layers.3.block_sparse_moe.experts.down_proj.weight", 3)
    full = torch.arange(32 * 48).reshape(32, 48)
    assert torch.equal(rank_slice(w2, full, shard), full[:, 24:])
    router = place(MixtralForCausalLM, spec, shard, f"{prefix}.gate.weight")
    assert (router.param, router.expert, router.source_rows) == (
        "layers.3.block_sparse_moe.gate.weight",
        None,
        None,
    )  # replicated: every rank routes alike


def test_an_expert_width_that_ranks_cannot_split_is_refused():
    spec = model_spec(Qwen3MoeConfig(**_SHAPE, num_experts=4, moe_intermediate_size=15))
    with pytest.raises(ValueError, match="an expert MLP width of 15"):
        check_divisible(spec, 2)


def test_the_one_expert_family_routes_every_token_to_expert_0(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_families import VOCAB, make_tiny_family

    model_dir = make_tiny_family(tmp_path, "mixtral-one-expert", seed=7)  # as the family tests
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chosen = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
    with torch.inference_mode():
        model(torch.randint(0, VOCAB, (3, 50), generator=torch.Generator().manual_seed(0)))
    assert len(chosen) == 2 and all(ids.numel() == 150 and (ids == 0).all() for ids in chosen)
