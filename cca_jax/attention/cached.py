"""Decode attention in plain XLA: one query per row against a KV cache (SPEC section 4).

The cache is a ring of raw keys/values plus pooled slots (`cca_jax.kv_cache`); what a query
sees of it comes from `blocks.cache_raw_visible` / `cache_slot_visible` as dense masks, and
one float32 softmax runs over both. The Pallas decode kernels compute the same from
`blocks.decode_bounds`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from cca_jax import blocks

_MASKED = -1e30  # finite, as in the blocked attention: no inf - inf


def cached_attention(q, k_ring, v_ring, ck, cv, raw_visible, slot_visible):
    """One query per row against the cache: q `[B, Hq, D]`, ring `[B, R, Hkv, D]`, slots
    `[B, C, Hq, D]`, masks `[B, R]` / `[B, C]`; one float32 softmax over both. -> `[B, Hq, D]`."""
    b, hq, d = q.shape
    hkv = k_ring.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scale = 1.0 / math.sqrt(d)
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    s_raw = f32("bhgd,brhd->bhgr", qg, k_ring) * scale
    s_raw = jnp.where(raw_visible[:, None, None], s_raw, _MASKED)
    cg = lambda x: x.reshape(b, x.shape[1], hkv, hq // hkv, d)  # noqa: E731
    s_slot = f32("bhgd,bchgd->bhgc", qg, cg(ck)) * scale
    s_slot = jnp.where(slot_visible[:, None, None], s_slot, _MASKED)
    top = jnp.maximum(s_raw.max(-1), s_slot.max(-1, initial=_MASKED))[..., None]
    p_raw = jnp.where(raw_visible[:, None, None], jnp.exp(s_raw - top), 0.0)
    p_slot = jnp.where(slot_visible[:, None, None], jnp.exp(s_slot - top), 0.0)
    denom = p_raw.sum(-1) + p_slot.sum(-1)
    out = (f32("bhgr,brhd->bhgd", p_raw.astype(v_ring.dtype), v_ring)
           + f32("bhgc,bchgd->bhgd", p_slot.astype(cv.dtype), cg(cv)))
    return (out / denom[..., None]).reshape(b, hq, d)


def layer_of(x, i):
    """Layer `i` (static or traced) of a stacked cache array."""
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def decode_attention_xla(q, k_all, v_all, ck, cv, layer, pattern, positions):
    """`cached_attention` of layer `layer` of the stacked `[L, B, ...]` cache arrays for
    queries at `positions` `[B]` under `pattern`."""
    ring, num_slots = k_all.shape[2], ck.shape[2]
    return cached_attention(q, layer_of(k_all, layer), layer_of(v_all, layer), layer_of(ck, layer),
                            layer_of(cv, layer), blocks.cache_raw_visible(pattern, positions, ring),
                            blocks.cache_slot_visible(pattern, positions, num_slots))
