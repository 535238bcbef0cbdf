"""The decode step: one token per row through the KV cache (SPEC section 4, property 6).

The step runs the model's own layers (`LlamaForCausalLM.decode_layers`, unrolled so that every
weight and cache slice is static); only its attention core here reads and writes the
`KVCache`. Row `b`'s token at position `p` = its cache length: its key/value goes into ring
entry `p % R`, a slot completed by it is pooled from the ring, and its query runs one masked
softmax over the ring and the slots (the decode entry of a backend: the Pallas decode kernels
from `blocks.decode_bounds`, or XLA with `blocks.cache_raw_visible` / `cache_slot_visible`).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx

from cca_jax import blocks
from cca_jax.attention.backends import BACKENDS, blocked_backend, decode_backend
from cca_jax.attention.cached import cached_attention  # noqa: F401  (re-exported)
from cca_jax.attention.pooling import pool_ending_slot
from cca_jax.config import LlamaConfig
from cca_jax.kv_cache import CACHE_PROGRAM_COMPILER_OPTIONS, KVCache, check_cache, set_entries
from cca_jax.rope import rope_cos_sin

def offset_implementation(cfg: LlamaConfig) -> str:
    """The implementation of prefill chunks at an offset (a backend's blocked entry): the
    model's where it takes per-row bounds, else what `auto` picks for packed rows, else `xla`."""
    return blocked_backend(cfg.attention.implementation, cfg.attention.pattern,
                           head_dim=cfg.head_dim, dtype=cfg.dtype).name


def decode_implementation(cfg: LlamaConfig) -> str:
    """What a decode step runs: the decode entry of the backend the prefill's chunks use
    (`offset_implementation`) where it takes the call, else the XLA form
    (`backends.decode_backend`)."""
    return decode_backend(cfg.attention.implementation, cfg.attention.pattern,
                          head_dim=cfg.head_dim, dtype=cfg.dtype).name


def decode_step_traced(model_state, cache: KVCache, tokens, active=None, implementation=None,
                       pool_slots: bool = True, unroll_layers: bool = True):
    """`decode_step` unjitted, for a program that jits it with more around it (it must pass
    `DECODE_COMPILER_OPTIONS` to its own jit: a nested jit cannot carry them).
    `unroll_layers=False` scans the layers instead (`decode_layers`): compiled once, not once
    per layer, but XLA copies each layer's weights out of the stack (a research setting:
    benchmarks/research/decode_compile_probe.py)."""
    graphdef, state = model_state
    model = nnx.merge(graphdef, state)
    cfg = model.config
    check_cache(cfg, cache)
    implementation = implementation or decode_implementation(cfg)
    decoders = sorted(n for n, b in BACKENDS.items() if "decode" in b.entries)
    if implementation not in decoders:
        raise ValueError(f"decode implementation must be one of {decoders}, "
                         f"got {implementation!r}.")
    attention = BACKENDS[implementation].decode
    pat = cache.pattern
    ring, num_slots, size = cache.ring, cache.num_slots, pat.slot_size
    b = tokens.shape[0]
    active = jnp.ones((b,), bool) if active is None else active
    p = cache.lengths
    write = p % ring
    # Idle rows (a server's free or prefilling rows) attend at position 0: one entry, no
    # slots, so the kernels read nothing of their stale contexts; their outputs are unused.
    attend_at = jnp.where(active, p, 0)
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
        out = attention(q[:, 0], k_all, v_all, ck, cv, i, pat, attend_at)
        return out[:, None], cache.replace(k=k_all, v=v_all, ck=ck, cv=cv)

    with jax.named_scope("decode_step"):
        cos, sin = rope_cos_sin(p[:, None], cfg)
        x = model.embed(tokens[:, None])
        hidden, cache = model.decode_layers(x, cos, sin, attend, cache, unroll=unroll_layers)
        cache = cache.replace(lengths=p + active.astype(p.dtype))
        return model.logits(hidden[:, 0]), cache


# XLA options of every program that runs decode steps. A decode step is bound by reading the
# weights, and one matrix product per shared input reads them faster than several: XLA's dot
# merger joins products of one input (q/k/v, gate/up; the weights' concatenation fused into
# the product, not copied) up to this size, 32 MB by default (only k + v at the 7B shape).
# A GPU pass; the other backends ignore it. Plus `CACHE_PROGRAM_COMPILER_OPTIONS`.
DECODE_COMPILER_OPTIONS = types.MappingProxyType({**CACHE_PROGRAM_COMPILER_OPTIONS,
                                                  "xla_gpu_dot_merger_threshold_mb": 1024})

decode_step = jax.jit(decode_step_traced, donate_argnames=("cache",),
                      static_argnames=("implementation", "pool_slots", "unroll_layers"),
                      compiler_options=dict(DECODE_COMPILER_OPTIONS))
decode_step.__doc__ = """One token per row through the cache, jitted once, reused for every token:
`decode_step(model_state, cache, tokens [B], active [B] bool | None) -> (logits [B, V], cache)`.
`implementation`: a backend with a decode entry (default `decode_implementation(config)`).
`pool_slots=False` skips pooling: only for a step where no active row's token completes a
slot (`blocks.completes_slot`), which is 15 of 16 steps at g = 16; a second compiled program.

`model_state = nnx.split(model)`. Row `b`'s token sits at position `cache.lengths[b]`; rows
with `active[b]` False (finished sequences) write nothing and keep their length (their
logits are meaningless). The cache is donated; positions must stay below `cache.max_len`."""
