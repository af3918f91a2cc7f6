"""The numbers a decoder family reads from its transformers config, and its KV layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """What one rank's KV pool holds per block: every layer's K and V for its KV heads."""

    num_layers: int
    num_kv_heads: int  # this rank's KV heads (all of them without tensor parallelism)
    head_dim: int
    # Per layer: the attention window in tokens, None for full context; each layer's attention
    # masks its own (mixed sliding/global models keep every block for the global layers).
    windows: tuple[int | None, ...]


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts feed-forward: each token runs `top_k` of `num_experts` gated MLPs."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's MLP width
    renormalize: bool  # the top-k softmax weights are rescaled to sum to one (Mixtral)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (False)


@dataclass(frozen=True)
class ModelSpec:
    """One checkpoint's shape and the per-family switches the shared layers read."""

    architecture: str  # the HF `architectures` name the registry chose the family by
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gate's activation: silu, or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rotary
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + weight)
    norm_scale_fp32: bool = False  # OLMo 2: norms scale by the weight before the cast back
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    final_softcap: float | None = None  # Gemma 2: tanh soft-capping of the logits
    rotary_dim: int | None = None  # rotary applies to the first rotary_dim of a head; None: all
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty: every layer full context
    moe: MoESpec | None = None  # Mixtral, Qwen3-MoE: the experts replacing the dense MLP
    # longrope (Phi-3): a sequence longer than this many tokens rotates by the long factors' rows
    # of the rotary tables (the second half), and transformers recomputes its whole cache with
    # them once it outgrows this length; the scheduler does the same (ExecutorReady).
    rope_switch_len: int | None = None

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.sliding_windows or (None,) * self.num_layers

    @property
    def context_cost_tokens(self) -> int:
        """Context tokens whose attention (q.k and p.v, every layer) costs one query token the
        multiply-adds of its linear layers and LM head; see ExecutorReady."""
        kv_dim = self.num_kv_heads * self.head_dim
        per_layer = self.hidden_size * (self.num_heads * self.head_dim + 2 * kv_dim)  # q, k, v
        per_layer += self.num_heads * self.head_dim * self.hidden_size  # o
        # gate, up, down: a mixture of experts runs top_k experts' MLPs per token
        moe = self.moe
        width = self.intermediate_size if moe is None else moe.top_k * moe.intermediate_size
        per_layer += 3 * self.hidden_size * width
        linear = self.num_layers * per_layer + self.hidden_size * self.vocab_size
        attention_per_context_token = 2 * self.num_layers * self.num_heads * self.head_dim
        return max(1, linear // attention_per_context_token)

    @property
    def shared_window(self) -> int | None:
        """The largest window when every layer has one (blocks behind it can be freed); None when
        any layer attends to the whole context (Gemma 2's global layers need every block)."""
        windows = self.windows
        return None if None in windows else max(windows)

    def kv_layout(self, num_kv_heads: int | None = None) -> KVLayout:
        """The KV pool's layout; num_kv_heads: a rank's share when tensor-parallel."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return KVLayout(self.num_layers, heads, self.head_dim, self.windows)


def base_spec_fields(config, architecture: str) -> dict:
    """The fields every family reads the same way from its transformers config."""
    heads = config.num_attention_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    return dict(
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        hidden_act=getattr(config, "hidden_act", None) or "silu",
        sliding_windows=layer_windows(config),
    )


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's attention window from the config: `layer_types` where the config has it
    (Gemma 2, Qwen2/3), else `sliding_window` on every layer unless use_sliding_window is off."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * config.num_hidden_layers
