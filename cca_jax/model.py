"""A LLaMA-family decoder in Flax NNX whose attention is swappable (full / cca / sliding / streaming).

embed -> [scan over layers: RMSNorm -> attention -> RMSNorm -> SwiGLU MLP] -> RMSNorm -> logits

Layers are created stacked (leading layer axis on every parameter) and run with one
`lax.scan` over that axis, so the layer body is compiled once; `config.remat` wraps the body
in `jax.checkpoint`. Parameters and activations use `param_dtype` / `dtype`; norms, softmax
and logits are float32.

`model.sequence_sharding` (None, or an `attention.SequenceSharding` that whoever shards the
model sets) is handed to every attention call: with it, cca / sliding / streaming run with
the sequence split over a mesh axis (halos and gathered slots), and with its "zigzag" layout
the model's inputs and outputs are in that row order (positions default to it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cca_jax.attention import SequenceSharding, run_attention
from cca_jax.config import REMAT_POLICIES, LlamaConfig
from cca_jax.rope import apply_rope, rope_cos_sin


def _init(std: float = 0.02):
    return nnx.initializers.normal(std)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight: normalized in float32, cast back, then scaled (HF's order)."""

    def __init__(self, size: int, eps: float, param_dtype):
        self.weight = nnx.Param(jnp.ones((size,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * xf.astype(x.dtype)).astype(x.dtype)


def _linear(cfg: LlamaConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=cfg.jnp_dtype,
                      param_dtype=cfg.jnp_param_dtype, kernel_init=_init(), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(cfg, h, cfg.num_attention_heads * d, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, h, cfg.num_key_value_heads * d, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, h, cfg.num_key_value_heads * d, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, cfg.num_attention_heads * d, h, cfg.attention_bias, rngs)

    def __call__(self, x, cos, sin, segment_ids, sequence_sharding=None):
        cfg = self.cfg
        b, length, _ = x.shape
        q = self.q_proj(x).reshape(b, length, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, length, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, length, cfg.num_key_value_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = cfg.attention
        out = run_attention(q, k, v, a.pattern, pooling=a.pooling,
                            implementation=a.implementation, segment_ids=segment_ids,
                            sequence_sharding=sequence_sharding)
        return self.o_proj(out.reshape(b, length, -1))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, h, i, cfg.mlp_bias, rngs)
        self.up_proj = _linear(cfg, h, i, cfg.mlp_bias, rngs)
        self.down_proj = _linear(cfg, i, h, cfg.mlp_bias, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                cfg.jnp_param_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, segment_ids, sequence_sharding=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, sequence_sharding)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nnx.Module):
    """`model(input_ids, segment_ids=None, positions=None) -> logits [B, L, V]` (float32).

    sequence_sharding: see the module docstring; a static attribute, settable after
    construction (it travels in `nnx.split`'s graphdef).
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs | None = None,
                 sequence_sharding: SequenceSharding | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.sequence_sharding = sequence_sharding
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                                      param_dtype=cfg.jnp_param_dtype, embedding_init=_init(),
                                      rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return DecoderLayer(cfg, rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

    def hidden_states(self, input_ids, segment_ids=None, positions=None):
        """Final normed hidden states `[B, L, hidden]` in `dtype`."""
        cfg = self.config
        sharding = self.sequence_sharding
        _check_ids(input_ids, segment_ids, positions, cfg)
        if positions is None:
            order = (np.arange(input_ids.shape[1]) if sharding is None
                     else sharding.row_order(input_ids.shape[1]))
            positions = jnp.broadcast_to(jnp.asarray(order), input_ids.shape)
        cos, sin = rope_cos_sin(positions, cfg)
        x = self.embed_tokens(input_ids)
        graphdef, stacked = nnx.split(self.layers)

        def layer_step(x, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return layer(x, cos, sin, segment_ids, sharding), None

        if REMAT_POLICIES[cfg.remat] is not None:
            layer_step = jax.checkpoint(layer_step, policy=REMAT_POLICIES[cfg.remat])
        if cfg.scan_layers:
            x, _ = jax.lax.scan(layer_step, x, stacked)
        else:
            for i in range(cfg.num_hidden_layers):
                x, _ = layer_step(x, jax.tree.map(lambda p, i=i: p[i], stacked))
        return self.norm(x)

    def output_weight(self):
        """The `[hidden, vocab]` output projection (the embedding's transpose when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden):
        """float32 logits from hidden states."""
        weight = self.output_weight()
        return jnp.dot(hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def __call__(self, input_ids, segment_ids=None, positions=None, *, last_only: bool = False):
        """Logits `[B, L, V]`, or `[B, 1, V]` for the last position when `last_only`."""
        hidden = self.hidden_states(input_ids, segment_ids, positions)
        if last_only:
            hidden = hidden[:, -1:]
        return self.logits(hidden)


def _check_ids(input_ids, segment_ids, positions, cfg: LlamaConfig) -> None:
    """Clear errors for bad inputs before any compute.

    Shapes and the length are checked always. Token id values are checked only when they are
    concrete (eager calls); inside `jit` they cannot be: an id >= vocab_size then gives NaN
    logits and a negative id wraps around, as in `jnp.take`.
    """
    _check_ids_array(input_ids)
    for name, x in (("segment_ids", segment_ids), ("positions", positions)):
        if x is not None and getattr(x, "shape", None) != input_ids.shape:
            raise ValueError(f"{name} must have the shape of input_ids {input_ids.shape}, "
                             f"got {getattr(x, 'shape', None)}.")
    length = input_ids.shape[1]
    cfg.check_length(length)
    longest = length if positions is None else _concrete_max(positions)
    if longest is not None and longest > cfg.max_position_embeddings:
        raise ValueError(
            f"{longest} positions exceed max_position_embeddings={cfg.max_position_embeddings}."
            " To run longer contexts, raise max_position_embeddings in the config (usually with "
            "a larger rope_theta or a rope scaling, as long-context fine-tuning does).")
    if not isinstance(input_ids, jax.core.Tracer):
        ids = np.asarray(input_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {cfg.vocab_size}) (vocab_size), got min {ids.min()} "
                f"max {ids.max()}: is the tokenizer the checkpoint's own?")


def _check_ids_array(input_ids) -> None:
    """input_ids must be integer ids of shape [batch, seq]: one line naming what is wrong."""
    want = "input_ids must be integer token ids (int32) of shape [batch, seq]"
    if not hasattr(input_ids, "ndim") or not hasattr(input_ids, "dtype"):
        raise ValueError(f"{want}, not a {type(input_ids).__name__}: pass "
                         "jnp.asarray(ids, jnp.int32).")
    got = f"got dtype {input_ids.dtype} shape {tuple(input_ids.shape)}"
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"{want}, {got}: pass the tokenizer's ids, or cast them with "
                         ".astype(jnp.int32).")
    if input_ids.ndim != 2:
        fix = "add the batch axis (ids[None])" if input_ids.ndim == 1 else "reshape them"
        raise ValueError(f"{want}, {got}: {fix}.")


def _concrete_max(positions) -> int | None:
    if isinstance(positions, jax.core.Tracer):
        return None
    return int(np.max(np.asarray(positions))) + 1 if np.size(positions) else 0
