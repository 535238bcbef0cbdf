"""Globality-aware pooling (SPEC section 1): groups of raw keys/values -> core tokens.

Core tokens are per query head: `ck, cv: [B, m, Hq, D]`, in the dtype of `k`/`v`. The pooling
weights are a float32 softmax of the group's last query against the group's keys. Plain XLA,
differentiable: gradients reach `q` (through the weights), `k` and `v`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cca_jax.blocks import AttentionPattern, cca_pattern, pattern_ranges


def group_members(x: jax.Array, group_start: jax.Array | None, num_groups: int,
                  group_size: int) -> jax.Array:
    """`[B, L, H, D]` -> `[B, m, g, H, D]`: the `g` rows of every pooled group.

    `group_start=None` means groups are the consecutive blocks `[c*g, (c+1)*g)`.
    """
    b, _, h, d = x.shape
    if group_start is None:
        return x[:, : num_groups * group_size].reshape(b, num_groups, group_size, h, d)
    idx = group_start[:, :, None] + jnp.arange(group_size, dtype=group_start.dtype)
    rows = jnp.take_along_axis(x, idx.reshape(b, -1)[:, :, None, None], axis=1)
    return rows.reshape(b, num_groups, group_size, h, d)


def _cca_weights(q_last, k_members):
    """Softmax over the group of (last query . keys) / sqrt(D), float32. -> [B, m, Hkv, G, g]."""
    scale = 1.0 / math.sqrt(q_last.shape[-1])
    logits = jnp.einsum("bmhgd,bmuhd->bmhgu", q_last, k_members,
                        preferred_element_type=jnp.float32) * scale
    return jax.nn.softmax(logits, axis=-1)


def _pool_cca(q_last, k_members, v_members):
    a = _cca_weights(q_last, k_members)
    ck = jnp.einsum("bmhgu,bmuhd->bmhgd", a, k_members.astype(jnp.float32))
    cv = jnp.einsum("bmhgu,bmuhd->bmhgd", a, v_members.astype(jnp.float32))
    return ck, cv


def _pool_mean(q_last, k_members, v_members):
    shape = q_last.shape
    ck = jnp.mean(k_members.astype(jnp.float32), axis=2)[:, :, :, None]
    cv = jnp.mean(v_members.astype(jnp.float32), axis=2)[:, :, :, None]
    return jnp.broadcast_to(ck, shape), jnp.broadcast_to(cv, shape)


def _pool_max(q_last, k_members, v_members):
    shape = q_last.shape
    ck = jnp.max(k_members, axis=2)[:, :, :, None]
    cv = jnp.max(v_members, axis=2)[:, :, :, None]
    return jnp.broadcast_to(ck, shape), jnp.broadcast_to(cv, shape)


POOLING_FNS = {"cca": _pool_cca, "mean": _pool_mean, "max": _pool_max}


def pool_core_tokens(q, k, v, *, group_size: int, num_groups: int, pooling: str = "cca",
                     group_start: jax.Array | None = None):
    """Core keys and values `[B, m, Hq, D]` for the `num_groups` pooled groups.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]`. `group_start` `[B, m]` (from
    `blocks.pattern_ranges`) places groups inside packed documents; None = plain groups.
    A group of one token is that token whatever the pooling (streaming's sinks, CCA g = 1).
    """
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    if num_groups == 0:
        empty = jnp.zeros((b, 0, hq, d), k.dtype)
        return empty, empty.astype(v.dtype)
    if group_size == 1:
        pooling = "mean"   # exact, and needs no query
    k_members = group_members(k, group_start, num_groups, group_size)
    v_members = group_members(v, group_start, num_groups, group_size)
    if group_start is None:
        q_last = q[:, group_size - 1: num_groups * group_size: group_size]
    else:
        last = (group_start + group_size - 1)[:, :, None, None]
        q_last = jnp.take_along_axis(q, last, axis=1)
    q_last = q_last.reshape(b, num_groups, hkv, hq // hkv, d)
    ck, cv = POOLING_FNS[pooling](q_last, k_members, v_members)
    return (ck.reshape(b, num_groups, hq, d).astype(k.dtype),
            cv.reshape(b, num_groups, hq, d).astype(v.dtype))


def slots_and_bounds(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                     segment_ids=None, min_slots: int = 0):
    """What every blocked implementation starts from: the slots' keys/values and row bounds.

    Returns `ck, cv [B, m, Hq, D]` (CCA's core tokens, streaming's sinks; m = 0 for full and
    sliding) and int32 `raw_lo, core_lo, core_hi [B, L]` (`blocks.pattern_ranges`, broadcast
    over the batch). `min_slots` (unpacked rows): pool at least that many slots, e.g. all a
    cache keeps; no row reads the ones past its `core_hi`.
    """
    b, length = q.shape[:2]
    m = pattern.max_slots(length, packed=segment_ids is not None)
    if min_slots > m:
        if segment_ids is not None:
            raise ValueError("min_slots is for unpacked rows (segment_ids=None).")
        m = min(min_slots, length // pattern.slot_size)
    ranges = pattern_ranges(pattern, length, segment_ids)
    ck, cv = pool_core_tokens(q, k, v, group_size=pattern.slot_size, num_groups=m,
                              pooling=pooling, group_start=ranges.group_start)
    bounds = tuple(jnp.broadcast_to(x, (b, length)).astype(jnp.int32)
                   for x in (ranges.raw_lo, ranges.core_lo, ranges.core_hi))
    return (ck, cv, *bounds)


def core_tokens_and_bounds(q, k, v, *, group_size: int, window_size: int, pooling: str,
                           segment_ids=None):
    """`slots_and_bounds` for CCA with group `g` and window `s`."""
    return slots_and_bounds(q, k, v, cca_pattern(group_size, window_size), pooling=pooling,
                            segment_ids=segment_ids)
