"""What the sinks tests share (SPEC section 6, `sink_tokens = N`): `sinks_reference`, a dense
construction of section 6 written from the SPEC text (sinks seen raw, groups from position N,
`n_core(t) = max(0, (t - N + 1 - s) // g)`) that never calls cca_jax; the small cases, inputs
and float64 runner; and a tiny float32 model with sharp attention for the cache tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.config import LlamaConfig

# ---- the reference: SPEC section 6 by dense masks ------------------------------------------

def _documents(segment_ids, b: int, length: int):
    """(document index, in-document position), numpy `[B, L]` each."""
    seg = np.zeros((b, length), int) if segment_ids is None else np.asarray(segment_ids)
    new = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    doc = np.cumsum(new, axis=1)
    t = np.arange(length)
    start = np.maximum.accumulate(np.where(new, t, 0), axis=1)
    return doc, t - start


def spec_masks(length, g, s, n, segment_ids=None, b=1):
    """SPEC 6 visibility, numpy: raw `[B, L, L]` (sinks and the local window) and core
    `[B, L, L]` (query t sees the core token of the group ending at key position e)."""
    doc, pos = _documents(segment_ids, b, length)
    same = doc[:, :, None] == doc[:, None, :]
    causal = np.tril(np.ones((length, length), bool))[None]
    n_core = np.maximum(0, (pos - n + 1 - s) // g)                   # [B, L]
    key = pos[:, None, :]
    raw = same & causal & ((key < n) | (key >= n + g * n_core[:, :, None]))
    ends = (pos >= n + g - 1) & ((pos - n + 1) % g == 0)             # group j = (p-n+1)/g - 1
    group = (pos - n + 1) // g - 1
    core = same & causal & ends[:, None, :] & (group[:, None, :] < n_core[:, :, None])
    return raw, core


def sinks_reference(q, k, v, g, s, n, segment_ids=None, pooling="cca"):
    """SPEC 6 by dense masks in the inputs' dtype (float64 under x64): one softmax over the
    sinks, the core tokens (pooled with the query of each group's last position) and the
    local window. Differentiable (`jax.grad` gives the reference gradients)."""
    b, length, hq, d = q.shape
    reps = hq // k.shape[2]
    k, v = jnp.repeat(k, reps, axis=2), jnp.repeat(v, reps, axis=2)
    raw, core = spec_masks(length, g, s, n, segment_ids, b)
    members = np.clip(np.arange(length)[:, None] - g + 1 + np.arange(g), 0, length - 1)
    km, vm = k[:, members], v[:, members]                            # [B, L, g, H, D]
    if pooling == "cca":
        a = jax.nn.softmax(jnp.einsum("behd,beuhd->behu", q, km) / np.sqrt(d), axis=-1)
        ck, cv = jnp.einsum("behu,beuhd->behd", a, km), jnp.einsum("behu,beuhd->behd", a, vm)
    else:
        ck, cv = km.mean(axis=2), vm.mean(axis=2)
    low = jnp.finfo(q.dtype).min
    logits = jnp.concatenate([
        jnp.where(core[:, None], jnp.einsum("bthd,behd->bhte", q, ck), low),
        jnp.where(raw[:, None], jnp.einsum("bthd,buhd->bhtu", q, k), low)], axis=-1)
    p = jax.nn.softmax(logits / np.sqrt(d), axis=-1)
    return (jnp.einsum("bhte,behd->bthd", p[..., :length], cv)
            + jnp.einsum("bhtu,buhd->bthd", p[..., length:], v))


def causal_reference(q, k, v, segment_ids=None):
    """Causal full attention inside each document (what properties 1 and 2 reduce CCA to)."""
    b, length, hq, d = q.shape
    return sinks_reference(q, k, v, 1, length + 1, length, segment_ids)   # every key a sink


def make_inputs(b, length, hq, hkv, d, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((b, length, h, d)), jnp.float32)
                   for h in (hq, hkv, hkv, hq))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), ct


def make_segments(b, length, cuts):
    """Row 0 one document; the others cut at `cuts` (an id reused: 0 1 0 ...)."""
    seg = np.zeros((b, length), np.int32)
    for row in range(1, b):
        seg[row] = np.searchsorted(np.asarray(cuts), np.arange(length), side="right") % 2
    return seg


def in_float64(fn, *args):
    with jax.enable_x64(True):
        return jax.device_get(fn(*(jnp.asarray(np.asarray(x, np.float64)) for x in args)))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# name: (B, L, Hq, Hkv, g, s, N, packed cuts or None)
CASES = {
    "ragged_gqa": (1, 37, 4, 2, 4, 6, 2, None),           # L % g != 0, s % g != 0, G = 2
    "n_above_s_packed": (2, 40, 2, 1, 3, 5, 7, (9, 31)),  # N > s, documents shorter than N
    "one_sink_packed": (2, 29, 4, 1, 5, 3, 1, (6, 17)),   # N = 1, s < g, G = 4
}
# Against float32 naive / xla on the same inputs (|out| <= ~3): measured max 4e-7 -> x5.
OUT_TOL = 2e-6
# Gradients (|grad| <= ~10): measured max 1.9e-6 -> x5.
GRAD_TOL = 1e-5


def sinks_case(name, seed=0, d=16):
    b, length, hq, hkv, g, s, n, cuts = CASES[name]
    q, k, v, ct = make_inputs(b, length, hq, hkv, d, seed)
    seg = None if cuts is None else make_segments(b, length, cuts)
    return (q, k, v, ct, seg), dict(group_size=g, window_size=s, sink_tokens=n)


def out_and_grads(attend):
    def run(q, k, v, ct):
        def loss(q, k, v):
            out = attend(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * ct), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads
    return run


@functools.lru_cache(maxsize=None)
def reference_out_and_grads(name):
    (q, k, v, ct, seg), kw = sinks_case(name)
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    return in_float64(out_and_grads(lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg)),
                      q, k, v, ct)


# ---- a tiny model for the cache tests -----------------------------------------------------

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            dtype="float32", param_dtype="float32")
LOGIT_TOL = 2e-5


def tiny_model(cfg=None, **attention):
    """A tiny float32 model with sharper attention than the 0.02 init (weights x 4), so that
    sinks, groups and windows show in the logits; the same weights for the same config."""
    from flax import nnx

    from cca_jax.model import LlamaForCausalLM
    cfg = cfg or LlamaConfig(**TINY, attention=dict(attention, implementation="naive"))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim > 1 else p, params))
    return model

