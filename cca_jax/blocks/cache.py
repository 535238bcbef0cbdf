"""What a query at any position sees of a KV cache (a ring of raw keys plus the slots): ring
positions and order, per-entry visibility, chunked prefill's row bounds and completed slots,
and the decode kernels' bounds and block walks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.blocks._arith import _cdiv, _where, _xp
from cca_jax.blocks.options import AttentionPattern, slot_ends_bound


# ---- Queries at any position against a KV cache (ring of raw keys + slots) -----------------
# The KV cache of one sequence (`cca_jax.kv_cache`) holds
#   * a ring of `R = ring_size(pattern, max_len)` raw keys/values: position `u` lives in
#     entry `u % R`, so once positions `0 .. t` are written, entry `i` holds the latest
#     `u <= t` with `u % R == i` (`ring_positions`);
#   * slots `0 .. C-1`, `C = pattern.max_slots(max_len)`: slot `c` summarises positions
#     `[slot_first(c), slot_last(c)]` (`[c * slot_size, (c + 1) * slot_size)` without lead
#     slots; cca's sinks: the token `c` itself, kept raw) and is written when its last token
#     is processed (`completed_slot`), pooled with that token's query.
# What a query at absolute in-sequence position `t` sees of it comes from
# `AttentionPattern.raw_start` / `num_slots` only: ring entries whose position `u` satisfies
# `raw_start(t) <= u <= t` (`u > t - R` holds by construction, and `R` covers the widest
# window: `widest_window`), and slots `c < num_slots(t)`.

def ring_size(pattern: AttentionPattern, max_len: int) -> int:
    """Raw keys/values the cache keeps per KV head for sequences of up to `max_len` tokens."""
    return max(1, min(max_len, pattern.ring_size(max_len)))


def widest_window(pattern: AttentionPattern, max_len: int) -> int:
    """The most raw keys any query `t < max_len` sees: `max(t - raw_start(t) + 1)`."""
    t = np.arange(max_len, dtype=np.int64)
    return int(np.max(t - pattern.raw_start(t) + 1)) if max_len else 0


def _arange_like(n: int, t):
    xp = _xp(t)
    return np.arange(n) if xp is np else jnp.arange(n, dtype=jnp.asarray(t).dtype)


def _expand(t):
    return _xp(t).asarray(t)[..., None]


def ring_positions(t, ring: int):
    """`[..., R]`: the position held by each ring entry once positions `0 .. t` are written
    (negative: never written). `t`: int or int array of any shape."""
    t = _expand(t)
    i = _arange_like(ring, t)
    return t - (t - i) % ring


def ring_order(p0, ring: int):
    """`[..., R]`: the ring entries holding positions `p0 - R .. p0 - 1`, in position order
    (entry `v` holds position `p0 - R + v`, meaningful when that is >= 0)."""
    p0 = _expand(p0)
    return (p0 + _arange_like(ring, p0)) % ring


def cache_raw_visible(pattern: AttentionPattern, t, ring: int):
    """`[..., R]` bool: ring entries the query at position `t` sees (positions 0 .. t
    written): those holding `u` with `u >= 0` and `raw_start(t) <= u` (`u <= t` always)."""
    u = ring_positions(t, ring)
    return (u >= 0) & (u >= _expand(pattern.raw_start(t)))


def cache_slot_visible(pattern: AttentionPattern, t, num_slots: int):
    """`[..., C]` bool: slots the query at position `t` sees: `c < num_slots(t)`."""
    return _arange_like(num_slots, t) < _expand(pattern.num_slots(t))


def chunk_ranges(pattern: AttentionPattern, p0, chunk: int, front: int, num_slots: int):
    """Row bounds for a chunk of queries at positions `[p0, p0 + chunk)` against the cache.

    The chunk is laid out as one "virtual" self-attention sequence of `front + chunk` rows:
    index `x` holds position `x - front + p0` (`front >= R`: rows `front - R .. front - 1` are
    the ring in position order, `ring_order(p0, R)`; rows before are never visible). Query row
    `front + r` is the query at position `p0 + r`; rows `0 .. front - 1` are padding that sees
    only itself (fill whole query blocks with them: the bounds restart there).
    p0: int array `[B]` (numpy in, numpy out; else jnp). Returns int32 `raw_lo, core_lo,
    core_hi` `[B, front + chunk]` (core: the cache's slots, `[0, num_slots(t))`).
    """
    xp = _xp(p0)
    p0 = xp.asarray(p0, dtype=xp.int32)[:, None]
    t = p0 + xp.arange(chunk, dtype=xp.int32)
    pad = xp.broadcast_to(xp.arange(front, dtype=xp.int32), (p0.shape[0], front))
    raw_lo = xp.concatenate([pad, pattern.raw_start(t) - p0 + front], axis=1)
    core_hi = xp.minimum(pattern.num_slots(t), num_slots)
    core_hi = xp.concatenate([xp.zeros_like(pad), core_hi], axis=1).astype(xp.int32)
    return raw_lo.astype(xp.int32), xp.zeros_like(core_hi), core_hi


def chunk_slots(pattern: AttentionPattern, p0, chunk: int, front: int):
    """Slots completed by a chunk at positions `[p0, p0 + chunk)` (layout of `chunk_ranges`).

    Returns `(slot, start)`, int32 `[B, n]` with `n = slot_ends_bound(pattern, chunk)`
    candidates: slot indices, in order, whose last token may fall in the chunk, and the
    virtual index of each one's first token. A candidate is real iff its last token
    `pattern.slot_last(slot)` is `< p0 + (tokens of the chunk)`.
    """
    xp = _xp(p0)
    n = slot_ends_bound(pattern, chunk)
    p0 = xp.asarray(p0, dtype=xp.int32)[:, None]
    first = pattern.slots_ending_before(p0)   # the first slot ending at or after p0
    slot = first + xp.arange(n, dtype=xp.int32)
    return slot, pattern.slot_first(slot) - p0 + front


# ---- Decode bounds: one query per row against the cache (Pallas GPU decode kernel) --------
# The same visible sets as `cache_raw_visible` / `cache_slot_visible`, as three integers per
# row instead of dense masks, so a kernel walks only the visible ring entries and slots.

class DecodeBounds(NamedTuple):
    """int32 bounds of what the query at position `t` sees of the cache, each shaped like `t`.

    ring_first: the ring entry holding the oldest visible position; ring_count (>= 1): how
    many positions are visible, in entries `(ring_first + i) % R` for `i < ring_count`, oldest
    to newest (the newest, entry `t % R`, holds the query's own key). num_slots: slots
    `[0, num_slots)` are visible (at most the cache's `C`).
    """

    ring_first: jax.Array
    ring_count: jax.Array
    num_slots: jax.Array


def decode_bounds(pattern: AttentionPattern, t, ring: int, num_slots: int) -> DecodeBounds:
    """`DecodeBounds` of queries at positions `t` (int or int array, numpy in -> numpy out)
    against a cache with a ring of `ring` entries and `num_slots` slots.

    Visible raw positions are `[lo, t]` with `lo = max(raw_start(t), t - R + 1, 0)`: the
    ring holds the last `R` positions (`ring_positions`), as `cache_raw_visible` says.
    """
    xp = _xp(t)
    t = xp.asarray(t).astype(xp.int32)
    lo = xp.maximum(xp.maximum(xp.asarray(pattern.raw_start(t)), t - ring + 1), 0)
    slots = xp.clip(xp.asarray(pattern.num_slots(t)), 0, num_slots)
    return DecodeBounds((lo % ring).astype(xp.int32), (t - lo + 1).astype(xp.int32),
                        slots.astype(xp.int32))


def decode_block_visits(bounds: DecodeBounds, ring: int, block_r: int, block_c: int):
    """int32 `[..., 6]` per row for a kernel walking the cache in blocks of `block_r` ring
    entries and `block_c` slots: `(ring_first, ring_count, num_slots, ring_block_first,
    ring_blocks, slot_blocks)` (the `DecodeBounds` of `decode_bounds`, then the blocks to
    visit: ring blocks `ring_block_first ..` (all `ceil(R / block_r)` of them when the
    visible entries wrap around the ring's end) and slot blocks `[0, slot_blocks)`)."""
    first, count, slots = bounds
    xp = _xp(first)
    wraps = first + count > ring
    block_first = xp.where(wraps, 0, first // block_r)
    ring_blocks = xp.where(wraps, _cdiv(ring, block_r),
                           (first + count - 1) // block_r + 1 - block_first)
    fields = (first, count, slots, block_first, ring_blocks, _cdiv(slots, block_c))
    return xp.stack([xp.broadcast_to(xp.asarray(x), xp.shape(first)) for x in fields],
                    axis=-1).astype(xp.int32)


def ring_entry_visible(entry, ring_first, ring_count, ring: int):
    """Ring `entry` holds a visible position (`DecodeBounds`): `(entry - ring_first) mod R <
    ring_count`, written without a vector remainder (for kernels); entries `>= R` (a block's
    overhang past the ring) are not."""
    offset = entry - ring_first
    offset = _where(offset < 0, offset + ring, offset)
    return (offset < ring_count) & (entry < ring)
