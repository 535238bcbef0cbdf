"""Globality-aware pooling (SPEC section 1): groups of raw keys/values -> core tokens.

Core tokens are per query head: `ck, cv: [B, m, Hq, D]`, in the dtype of `k`/`v`. The pooling
weights are a float32 softmax of the group's last query against the group's keys. Plain XLA,
differentiable: gradients reach `q` (through the weights), `k` and `v`.

A pattern's slots (`blocks.AttentionPattern`) are groups of `slot_size` tokens, led in each
document by `lead_slots` slots of one raw token each (cca's sinks, SPEC 6): those are
copies of their token's key/value per query head, exact whatever the pooling.
`pool_pattern_slots` and `pool_ending_slot` pool both kinds; `pool_core_tokens` one group
size.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp

from cca_jax.blocks import CCA, AttentionPattern, pattern_ranges


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
    """Softmax over the group of (last query . keys) / sqrt(D), float32 -> `[B, m, g, Hkv, G]`.

    Broadcast multiply-sums in the members' own layout, not einsums: XLA fuses each into one
    reduction reading k in place, where an einsum materializes transposed 16-row operands
    (H200, 128K, Hkv 8: pooling 1.01 ms against 1.52, with its vjp 2.77 against 4.45,
    `benchmarks/results/research/mosaic_backward_parts_h200.md`). Products of bf16 values
    are exact in float32, so only the summation order differs from a float32-accumulating dot.
    """
    f32 = jnp.float32
    scale = 1.0 / math.sqrt(q_last.shape[-1])
    # [B, m, 1, Hkv, G, D] * [B, m, g, Hkv, 1, D], summed over D
    logits = jnp.sum(q_last.astype(f32)[:, :, None] * k_members.astype(f32)[:, :, :, :, None],
                     axis=-1)
    return jax.nn.softmax(logits * scale, axis=2)


def _pool_cca(q_last, k_members, v_members):
    a = _cca_weights(q_last, k_members)[..., None]                  # [B, m, g, Hkv, G, 1]
    ck = jnp.sum(a * k_members.astype(jnp.float32)[:, :, :, :, None], axis=2)
    cv = jnp.sum(a * v_members.astype(jnp.float32)[:, :, :, :, None], axis=2)
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


POOLING_FNS = types.MappingProxyType({"cca": _pool_cca, "mean": _pool_mean, "max": _pool_max})


def pool_core_tokens(q, k, v, *, group_size: int, num_groups: int, pooling: str = "cca",
                     group_start: jax.Array | None = None):
    """Core keys and values `[B, m, Hq, D]` for the `num_groups` pooled groups.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]`. `group_start` `[B, m]` (from
    `blocks.pattern_ranges`) places groups inside packed documents; None = plain groups.
    A group of one token is that token whatever the pooling (streaming's sinks, CCA g = 1).
    Runs under `jax.named_scope("pooling")`.
    """
    with jax.named_scope("pooling"):
        return _pool_core_tokens(q, k, v, group_size, num_groups, pooling, group_start)


def _pool_core_tokens(q, k, v, group_size: int, num_groups: int, pooling: str, group_start):
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


def _pool_mixed(q, k, v, group_size: int, start, single, pooling: str):
    """Slots starting at rows `start` `[B, n]`: one raw token where `single`, else a group of
    `group_size` (starts clipped into the sequence, so that candidates a caller drops are
    finite)."""
    length, n = k.shape[1], start.shape[1]
    sk, sv = pool_core_tokens(q, k, v, group_size=1, num_groups=n,
                              group_start=jnp.clip(start, 0, length - 1))
    if length < group_size:    # no group fits: every slot is a single token
        return sk, sv
    ck, cv = pool_core_tokens(q, k, v, group_size=group_size, num_groups=n, pooling=pooling,
                              group_start=jnp.clip(start, 0, length - group_size))
    pick = single[:, :, None, None]
    return jnp.where(pick, sk, ck), jnp.where(pick, sv, cv)


def pool_pattern_slots(q, k, v, pattern: AttentionPattern, num_slots: int, *,
                       pooling: str = "cca", group_start=None, group_last=None):
    """`num_slots` slots of `pattern` from rows `q, k, v`: `ck, cv [B, m, Hq, D]`.

    group_start, group_last None: the first slots of one document starting at row 0
    (`pattern.slot_first` ...); else `[B, m]` first and last rows of each slot's tokens
    (`blocks.pattern_ranges` of packed rows, a prefill chunk's slots; a slot of one token is
    a lead slot). Starts of candidates the caller drops may lie anywhere.
    """
    size, lead = pattern.slot_size, pattern.lead_slots
    if not lead:
        return pool_core_tokens(q, k, v, group_size=size, num_groups=num_slots,
                                pooling=pooling, group_start=group_start)
    if group_start is not None:
        return _pool_mixed(q, k, v, size, group_start, group_last == group_start, pooling)
    sinks = min(lead, num_slots)
    sk, sv = pool_core_tokens(q, k, v, group_size=1, num_groups=sinks)
    rest = (x[:, lead:] for x in (q, k, v))
    ck, cv = pool_core_tokens(*rest, group_size=size, num_groups=num_slots - sinks,
                              pooling=pooling)
    return jnp.concatenate([sk, ck], axis=1), jnp.concatenate([sv, cv], axis=1)


def pool_ending_slot(q, k, v, pattern: AttentionPattern, slot, *, pooling: str = "cca"):
    """The slot `slot` `[B]` completed by the last of `slot_size` rows (a decode step's group):
    `ck, cv [B, 1, Hq, D]`, a group of all the rows, or the last row alone for a lead slot."""
    ck, cv = pool_core_tokens(q, k, v, group_size=pattern.slot_size, num_groups=1,
                              pooling=pooling)
    if not pattern.lead_slots:
        return ck, cv
    sk, sv = pool_core_tokens(q[:, -1:], k[:, -1:], v[:, -1:], group_size=1, num_groups=1)
    pick = (slot < pattern.lead_slots)[:, None, None, None]
    return jnp.where(pick, sk, ck), jnp.where(pick, sv, cv)


def slots_and_bounds(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                     segment_ids=None, min_slots: int = 0):
    """What every blocked implementation starts from: the slots' keys/values and row bounds.

    Returns `ck, cv [B, m, Hq, D]` (CCA's sinks and core tokens, streaming's sinks; m = 0 for
    full and sliding) and int32 `raw_lo, core_lo, core_hi [B, L]` (`blocks.pattern_ranges`,
    broadcast over the batch). `min_slots` (unpacked rows): pool at least that many slots,
    e.g. all a cache keeps; no row reads the ones past its `core_hi`.
    """
    b, length = q.shape[:2]
    m = pattern.max_slots(length, packed=segment_ids is not None)
    if min_slots > m:
        if segment_ids is not None:
            raise ValueError("min_slots is for unpacked rows (segment_ids=None).")
        m = min(min_slots, pattern.slots_ending_before(length))
    ranges = pattern_ranges(pattern, length, segment_ids)
    ck, cv = pool_pattern_slots(q, k, v, pattern, m, pooling=pooling,
                                group_start=ranges.group_start, group_last=ranges.group_last)
    bounds = tuple(jnp.broadcast_to(x, (b, length)).astype(jnp.int32)
                   for x in (ranges.raw_lo, ranges.core_lo, ranges.core_hi))
    return (ck, cv, *bounds)


def core_tokens_and_bounds(q, k, v, *, group_size: int, window_size: int, pooling: str,
                           segment_ids=None, sink_tokens: int = 0):
    """`slots_and_bounds` for CCA with group `g`, window `s` and `N` sinks."""
    return slots_and_bounds(q, k, v, CCA(group_size, window_size, sink_tokens),
                            pooling=pooling, segment_ids=segment_ids)
