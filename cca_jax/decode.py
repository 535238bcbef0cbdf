"""The decode step: one token per row through the KV cache (SPEC section 4, property 6).

The step runs the model's own layers (`LlamaForCausalLM.decode_layers`, unrolled so that every
weight and cache slice is static); only its attention core here reads and writes the
`KVCache`. Row `b`'s token at position `p` = its cache length: its key/value goes into ring
entry `p % R`, a slot completed by it is pooled from the ring, and its query runs one masked
softmax over the ring and the slots (`DECODE_IMPLEMENTATIONS`: the Pallas decode kernels
from `blocks.decode_bounds`, or XLA with `blocks.cache_raw_visible` / `cache_slot_visible`).
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
from flax import nnx

from cca_jax import blocks
from cca_jax.attention.blocked import blocked_implementation
from cca_jax.attention.pooling import pool_ending_slot
from cca_jax.config import LlamaConfig
from cca_jax.kv_cache import KVCache, check_cache, layer_of, set_entries
from cca_jax.rope import rope_cos_sin

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


def _decode_xla(q, k_all, v_all, ck, cv, i, pat, p):
    ring, num_slots = k_all.shape[2], ck.shape[2]
    return cached_attention(q, layer_of(k_all, i), layer_of(v_all, i), layer_of(ck, i),
                            layer_of(cv, i),
                            blocks.cache_raw_visible(pat, p, ring),
                            blocks.cache_slot_visible(pat, p, num_slots))


def _decode_pallas_gpu(q, k_all, v_all, ck, cv, i, pat, p):
    from pallas_kernels.gpu import decode_attention_pallas_gpu  # lazy: kernels import us
    bounds = blocks.decode_bounds(pat, p, k_all.shape[2], ck.shape[2])
    return decode_attention_pallas_gpu(q, k_all, v_all, ck, cv, bounds, layer=i,
                                       out_dtype=q.dtype)


def _decode_pallas_tpu(q, k_all, v_all, ck, cv, i, pat, p):
    from pallas_kernels.tpu import decode_attention_pallas_tpu
    bounds = blocks.decode_bounds(pat, p, k_all.shape[2], ck.shape[2])
    return decode_attention_pallas_tpu(q, k_all, v_all, ck, cv, bounds, layer=i)


# Decode attention of one query per row against the stacked cache: the XLA form (masks over
# one layer's ring and slots) and the Pallas kernels (per-row bounds, layer read in place).
DECODE_IMPLEMENTATIONS = {"xla": _decode_xla, "pallas_gpu": _decode_pallas_gpu,
                          "pallas_tpu": _decode_pallas_tpu}
_KERNEL_DECODE_HEAD_DIMS = (64, 128, 256)


def offset_implementation(cfg: LlamaConfig) -> str:
    """The implementation of prefill chunks at an offset (`attention.blocked`): the model's
    where it takes per-row bounds, else what `auto` picks for packed rows, else `xla`."""
    return blocked_implementation(cfg.attention.implementation, pattern=cfg.attention.pattern,
                                  head_dim=cfg.head_dim, dtype=cfg.dtype)


def decode_implementation(cfg: LlamaConfig) -> str:
    """What a decode step runs: the Pallas kernel of the backend the prefill's chunks use
    (`offset_implementation`), for head dims it takes; else the XLA form."""
    name = offset_implementation(cfg)
    if name in DECODE_IMPLEMENTATIONS and cfg.head_dim in _KERNEL_DECODE_HEAD_DIMS:
        return name
    return "xla"


def decode_step_traced(model_state, cache: KVCache, tokens, active=None, implementation=None,
                       pool_slots: bool = True):
    """`decode_step` unjitted, for a program that jits it with more around it (it must pass
    `DECODE_COMPILER_OPTIONS` to its own jit: a nested jit cannot carry them)."""
    graphdef, state = model_state
    model = nnx.merge(graphdef, state)
    cfg = model.config
    check_cache(cfg, cache)
    implementation = implementation or decode_implementation(cfg)
    if implementation not in DECODE_IMPLEMENTATIONS:
        raise ValueError(f"decode implementation must be one of "
                         f"{sorted(DECODE_IMPLEMENTATIONS)}, got {implementation!r}.")
    attention = DECODE_IMPLEMENTATIONS[implementation]
    pat = cache.pattern
    ring, num_slots, size = cache.ring, cache.num_slots, pat.slot_size
    b = tokens.shape[0]
    active = jnp.ones((b,), bool) if active is None else active
    p = cache.lengths
    write = p % ring
    rows = jnp.arange(b)[:, None]
    pool_slots = pool_slots and num_slots > 0
    if pool_slots:
        c = blocks.completed_slot(pat, p)
        pooled = active & blocks.completes_slot(pat, p, num_slots)
        slot = jnp.clip(c, 0, num_slots - 1)
        members = (p[:, None] - size + 1 + jnp.arange(size)) % ring

    def attend(i, q, k, v, cache):
        k_all = set_entries(cache.k, i, write, k[:, 0], active)
        v_all = set_entries(cache.v, i, write, v[:, 0], active)
        q = q.astype(k_all.dtype)
        ck, cv = cache.ck, cache.cv
        if pool_slots:
            k_members, v_members = k_all[i, rows, members], v_all[i, rows, members]
            q_group = jnp.concatenate([jnp.zeros((b, size - 1, *q.shape[2:]), q.dtype), q], 1)
            new_ck, new_cv = pool_ending_slot(q_group, k_members, v_members, pat, c,
                                              pooling=cfg.attention.pooling)
            ck = set_entries(ck, i, slot, new_ck[:, 0], pooled)
            cv = set_entries(cv, i, slot, new_cv[:, 0], pooled)
        out = attention(q[:, 0], k_all, v_all, ck, cv, i, pat, p)
        return out[:, None], cache.replace(k=k_all, v=v_all, ck=ck, cv=cv)

    with jax.named_scope("decode_step"):
        cos, sin = rope_cos_sin(p[:, None], cfg)
        x = model.embed(tokens[:, None])
        hidden, cache = model.decode_layers(x, cos, sin, attend, cache, unroll=True)
        cache = cache.replace(lengths=p + active.astype(p.dtype))
        return model.logits(hidden[:, 0]), cache


# XLA options of every program that runs decode steps. A decode step is bound by reading the
# weights, and one matrix product per shared input reads them faster than several: XLA's dot
# merger joins products of one input (q/k/v, gate/up; the weights' concatenation fused into
# the product, not copied) up to this size, 32 MB by default (only k + v at the 7B shape).
# A GPU pass; the other backends ignore it.
DECODE_COMPILER_OPTIONS = types.MappingProxyType({"xla_gpu_dot_merger_threshold_mb": 1024})

decode_step = jax.jit(decode_step_traced, donate_argnames=("cache",),
                      static_argnames=("implementation", "pool_slots"),
                      compiler_options=dict(DECODE_COMPILER_OPTIONS))
decode_step.__doc__ = """One token per row through the cache, jitted once, reused for every token:
`decode_step(model_state, cache, tokens [B], active [B] bool | None) -> (logits [B, V], cache)`.
`implementation`: a `DECODE_IMPLEMENTATIONS` name (default `decode_implementation(config)`).
`pool_slots=False` skips pooling: only for a step where no active row's token completes a
slot (`blocks.completes_slot`), which is 15 of 16 steps at g = 16; a second compiled program.

`model_state = nnx.split(model)`. Row `b`'s token sits at position `cache.lengths[b]`; rows
with `active[b]` False (finished sequences) write nothing and keep their length (their
logits are meaningless). The cache is donated; positions must stay below `cache.max_len`."""
