"""A LLaMA-family decoder in Flax NNX whose attention is swappable (full / cca / sliding / streaming).

embed -> [scan over layers: RMSNorm -> attention -> RMSNorm -> SwiGLU MLP] -> RMSNorm -> logits

Layers are created stacked (leading layer axis on every parameter) and run with one
`lax.scan` over that axis, so the layer body is compiled once; `config.remat` wraps the body
in `jax.checkpoint`. For inference on a GPU, `unstack_layers` holds them one array per layer
and weight instead: XLA then tunes each GEMM of an unrolled program once, not once per layer.
Parameters and activations use `param_dtype` / `dtype`; norms, softmax and logits are float32.

`model.sequence_sharding` (None, or an `attention.SequenceSharding` that whoever shards the
model sets) is handed to every attention call: with it, cca / sliding / streaming run with
the sequence split over a mesh axis (halos and gathered slots), and with its "zigzag" layout
the model's inputs and outputs are in that row order (positions default to it).

Under a mesh set with `jax.set_mesh` (`sharding.mesh_context`), the embeddings, each layer's
output, q / k / v and the logits are pinned to `sharding.ACTIVATION_AXES` (`sharding.constrain`);
without one nothing is added.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cca_jax.attention import SequenceSharding, run_attention
from cca_jax.config import REMAT_POLICIES, LlamaConfig
from cca_jax.rope import apply_rope, rope_cos_sin
from cca_jax.sharding import constrain


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
    """Self-attention: q/k/v projections, RoPE, an attention core, the output projection.

    `__call__` runs the core over the whole sequence (`run_attention`: training, the
    model's forward). `decode` runs the same projections and RoPE around a core that reads
    and writes a KV cache (prefill chunks and decode steps, `cca_jax.prefill` /
    `cca_jax.decode`), so both paths share every weight and every line of the layer.
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(cfg, h, cfg.num_attention_heads * d, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, h, cfg.num_key_value_heads * d, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, h, cfg.num_key_value_heads * d, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, cfg.num_attention_heads * d, h, cfg.attention_bias, rngs)

    def qkv(self, x, cos, sin):
        """q `[B, n, Hq, D]`, k and v `[B, n, Hkv, D]` of `x` `[B, n, hidden]`, RoPE on q, k."""
        cfg = self.cfg
        b, length, _ = x.shape
        q = constrain(self.q_proj(x).reshape(b, length, cfg.num_attention_heads, cfg.head_dim),
                      "q")
        k = constrain(self.k_proj(x).reshape(b, length, cfg.num_key_value_heads, cfg.head_dim),
                      "kv")
        v = constrain(self.v_proj(x).reshape(b, length, cfg.num_key_value_heads, cfg.head_dim),
                      "kv")
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out):
        """The output projection of the core's `[B, m, Hq, D]` -> `[B, m, hidden]` (`o_proj`
        computes in the model's dtype whatever the core's)."""
        b, m = out.shape[:2]
        return self.o_proj(out.reshape(b, m, -1))

    def __call__(self, x, cos, sin, segment_ids, sequence_sharding=None):
        q, k, v = self.qkv(x, cos, sin)
        a = self.cfg.attention
        out = run_attention(q, k, v, a.pattern, pooling=a.pooling,
                            implementation=a.implementation, segment_ids=segment_ids,
                            sequence_sharding=sequence_sharding)
        return self.output(out)

    def decode(self, x, cos, sin, core):
        """Attention through a KV cache: `core(q, k, v) -> (out [B, m, Hq, D], carry)` reads
        and writes the cache (`m` = n, or 1 when the core returns one row per batch row).
        -> `(output [B, m, hidden], carry)`."""
        q, k, v = self.qkv(x, cos, sin)
        out, carry = core(q, k, v)
        return self.output(out), carry


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, h, i, cfg.mlp_bias, rngs)
        self.up_proj = _linear(cfg, h, i, cfg.mlp_bias, rngs)
        self.down_proj = _linear(cfg, i, h, cfg.mlp_bias, rngs)

    def __call__(self, x):
        with jax.named_scope("mlp"):
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """x + attention(norm(x)), then + MLP(norm(.)): `__call__` over a whole sequence,
    `decode` through a KV cache (`Attention.decode`)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                cfg.jnp_param_dtype)
        self.mlp = MLP(cfg, rngs)

    def _feed_forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, cos, sin, segment_ids, sequence_sharding=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, sequence_sharding)
        return constrain(self._feed_forward(x), "hidden")

    def decode(self, x, cos, sin, core, rows=None):
        """The layer with `core` as its cached attention (`Attention.decode`). `rows` (int
        `[B]`): the core returns the output of row `rows[b]` only (`[B, 1, Hq, D]`), and the
        residual and MLP run for that row alone -> `[B, 1, hidden]`. -> `(x, carry)`."""
        out, carry = self.self_attn.decode(self.input_layernorm(x), cos, sin, core)
        if rows is not None:
            x = jnp.take_along_axis(x, rows[:, None, None], axis=1)
        return constrain(self._feed_forward(x + out), "hidden"), carry


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
        x = self.embed(input_ids)
        graphdef, weights = self._split_layers()

        def layer_step(x, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return layer(x, cos, sin, segment_ids, sharding), None

        if REMAT_POLICIES[cfg.remat] is not None:
            layer_step = jax.checkpoint(layer_step, policy=REMAT_POLICIES[cfg.remat])
        if cfg.scan_layers and self.layers_unstacked:
            x, _ = jax.lax.scan(lambda x, i: layer_step(x, _layer_state(weights, i)), x,
                                jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32))
        elif cfg.scan_layers:
            x, _ = jax.lax.scan(layer_step, x, weights)
        else:
            for i in range(cfg.num_hidden_layers):
                x, _ = layer_step(x, _layer_state(weights, i))
        return self.norm(x)

    @property
    def layers_unstacked(self) -> bool:
        """Whether the layers are held one array per layer and weight (`unstack_layers`)."""
        return isinstance(self.layers, nnx.List)

    def _split_layers(self):
        """(a decoder layer's graphdef, the layers' weights: one stacked state `[L, ...]`,
        or unstacked a list of the layers' states)."""
        if self.layers_unstacked:
            return nnx.graphdef(self.layers[0]), [nnx.state(layer) for layer in self.layers]
        return nnx.split(self.layers)

    def decode_layers(self, x, cos, sin, attend, carry, *, unroll: bool = False,
                      last_rows=None):
        """The decoder stack on `x` `[B, n, hidden]` through a KV cache (`carry`), each layer
        by `DecoderLayer.decode` with `attend` as its attention core -> `(final normed hidden
        states, carry)`.

        attend(i, q, k, v, carry, out_rows=None) -> (out `[B, n, Hq, D]`, carry), with q
        `[B, n, Hq, D]` and k, v `[B, n, Hkv, D]` of layer `i`, RoPE applied.
        `unroll`: a Python loop with static layer indices instead of one `lax.scan`, so every
        weight is a static slice of the stacked parameters, read in place (a decode step is
        bound by reading the weights; the scan's dynamic slices are copied first). The scan
        compiles faster, and a prefill is compute-bound. Unstacked layers (`unstack_layers`)
        scan by picking layer `i`'s arrays (`_layer_state`): one layer copied a step, as the
        stack's dynamic slice is.
        `last_rows` (int `[B]`): only row `last_rows[b]` of each batch row is
        wanted from the last layer, whose keys/values still go into the cache but whose
        attention, output projection and MLP run for that row alone (`attend(...,
        out_rows=last_rows)` -> `[B, 1, Hq, D]`); returns `[B, 1, hidden]`. A prefill needs no
        more: 1/L of the last layer's work.
        """
        graphdef, weights = self._split_layers()
        num_layers = self.config.num_hidden_layers

        def layer_at(i):
            return nnx.merge(graphdef, _layer_state(weights, i))

        def body(state, i, rows=None):
            x, carry = state
            if rows is None:
                core = lambda q, k, v: attend(i, q, k, v, carry)  # noqa: E731
            else:
                core = lambda q, k, v: attend(i, q, k, v, carry, out_rows=rows)  # noqa: E731
            return layer_at(i).decode(x, cos, sin, core, rows=rows)

        trimmed = last_rows is not None
        if unroll:
            state = (x, carry)
            for i in range(num_layers - trimmed):
                state = body(state, i)
            x, carry = state
            if trimmed:
                x, carry = body((x, carry), num_layers - 1, rows=last_rows)
            return self.norm(x), carry
        layers = jnp.arange(num_layers - trimmed, dtype=jnp.int32)
        (x, carry), _ = jax.lax.scan(lambda state, i: (body(state, i), None), (x, carry),
                                     layers)
        if trimmed:
            x, carry = body((x, carry), num_layers - 1, rows=last_rows)
        return self.norm(x), carry

    def embed(self, input_ids):
        """Token embeddings `[B, L, hidden]` in `dtype`."""
        with jax.named_scope("embed"):
            return constrain(self.embed_tokens(input_ids), "hidden")

    def output_weight(self):
        """The `[hidden, vocab]` output projection (the embedding's transpose when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden):
        """float32 logits from hidden states `[B, L, hidden]` or `[B, hidden]`."""
        weight = self.output_weight()
        logits = jnp.dot(hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, "logits" if logits.ndim == 3 else "last_logits")

    def __call__(self, input_ids, segment_ids=None, positions=None, *, last_only: bool = False):
        """Logits `[B, L, V]`, or `[B, 1, V]` for the last position when `last_only`."""
        hidden = self.hidden_states(input_ids, segment_ids, positions)
        if last_only:
            hidden = hidden[:, -1:]
        return self.logits(hidden)


def _layer_state(weights, i):
    """Layer `i`'s state from `_split_layers`'s weights. `i` static: a slice of the stack,
    read in place (or the layer's own arrays). `i` traced (a scan): a dynamic slice of the
    stack, or of unstacked layers the branch of `lax.switch` that returns layer `i`'s arrays,
    so that a scan copies one layer a step and never builds the stack."""
    if isinstance(weights, list):
        if isinstance(i, int):
            return weights[i]
        leaves = [jax.tree.leaves(state) for state in weights]
        picked = jax.lax.switch(i, [lambda layer=layer: layer for layer in leaves])
        return jax.tree.unflatten(jax.tree.structure(weights[0]), picked)
    if isinstance(i, int):
        return jax.tree.map(lambda p: p[i], weights)
    return jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, i, 0, keepdims=False),
                        weights)


def unstack_layers(model: LlamaForCausalLM, *, consume: bool = False) -> LlamaForCausalLM:
    """The model with its decoder layers held one array per layer and weight, for inference
    on a GPU; every other parameter is shared with `model`. The same computation (bit-equal
    on the CPU; a GPU may pick other GEMM algorithms for unsliced weights).

    Why: sliced out of a stack, each layer's GEMM fusion is unlike the others, and XLA tunes
    all of them: the 7B decode step's two programs compile in 6.2 s against 37.7, at the
    same speed (benchmarks/results/research/h100_2026-12-06h.md). Unrolled, large prefill
    chunks compile for minutes: they scan these layers as they scan the stack
    (`_layer_state`). Training keeps the stack. Checkpoints are saved stacked.
    `consume`: delete each stacked weight once its layers are copied (the peak is the
    weights plus one stacked weight, not twice the weights); `model` is unusable after.
    Already unstacked: returned as is."""
    if model.layers_unstacked:
        return model
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)   # a second module over the same arrays
    layer_def, stacked = nnx.split(model.layers)
    leaves, treedef = jax.tree.flatten(stacked)
    num_layers = model.config.num_hidden_layers
    per_layer: list[list] = [[] for _ in range(num_layers)]
    for leaf in leaves:
        for i in range(num_layers):
            per_layer[i].append(leaf[i])
        if consume:
            leaf.delete()
    out.layers = nnx.List([nnx.merge(layer_def, jax.tree.unflatten(treedef, weights))
                           for weights in per_layer])
    return out


def inference_layers(model: LlamaForCausalLM, *, consume: bool = False) -> LlamaForCausalLM:
    """The model as inference holds it on this backend: unstacked on a GPU (`unstack_layers`,
    whose GEMMs XLA tunes), else as it is (XLA:CPU and TPU tune no GEMM fusions: nothing to
    gain there)."""
    return unstack_layers(model, consume=consume) if jax.default_backend() == "gpu" else model


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
