"""Which keys each query sees under CCA: the single source of the visibility arithmetic.

SPEC section 2, with packed documents: a query at position `t` of a document that starts at
`d` (`p = t - d` its position inside the document) sees
  * raw keys `u` with  `d + g * n_core(p) <= u <= t`, and
  * the core tokens of its own document with index `j < n_core(p)`.
Core tokens of all documents of a row are stored back to back ("slots", ordered by position),
so both visible sets are contiguous index ranges: raw `[raw_lo(t), t]`, core
`[core_lo(t), core_hi(t))`. Without `segment_ids`: `raw_lo = g * n_core(t)`, `core_lo = 0`,
`core_hi = n_core(t)`.

Everything here is plain integer arithmetic that works on Python ints, numpy and jnp arrays
(traced or not). The XLA implementation, the Pallas kernels (GPU bounds, TPU prefetch tables)
and the KV cache all take their bounds from this module.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def n_core(t, group_size: int, window_size: int):
    """Number of core tokens visible to the query at in-document position `t` (SPEC 2).

    The clamp comes before the division so truncating integer division (Triton, C) gives the
    same result as Python's floor division.
    """
    return _maximum(t + 1 - window_size, 0) // group_size


def raw_start(t, group_size: int, window_size: int):
    """First raw key position visible to in-document position `t`: `g * n_core(t)`."""
    return group_size * n_core(t, group_size, window_size)


def num_pooled_groups(length: int, group_size: int, window_size: int) -> int:
    """Groups pooled for a sequence of `length`: those some query can see (SPEC 1)."""
    return max(0, (length - window_size) // group_size)


def visible_score_count(length: int, group_size: int, window_size: int) -> int:
    """Query-key scores per head CCA needs for one unpacked sequence (core + raw window)."""
    t = np.arange(length, dtype=np.int64)
    nc = n_core(t, group_size, window_size)
    return int(np.sum(nc + (t - group_size * nc + 1)))


def _elementwise(python_fn, numpy_fn, jax_fn):
    """One binary op on Python ints (stays an int), numpy arrays or jax values alike."""
    def op(a, b):
        if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
            return python_fn(a, b)
        if isinstance(a, np.ndarray):
            return numpy_fn(a, b)
        return jax_fn(a, b)
    return op


_maximum = _elementwise(max, np.maximum, jnp.maximum)
_minimum = _elementwise(min, np.minimum, jnp.minimum)


class RowRanges(NamedTuple):
    """Per query row `[B, L]` int32 bounds, plus where each core slot's group starts.

    raw_lo, core_lo, core_hi: see the module docstring.
    group_start: `[B, m]` first position of the group pooled into slot `c`, or None when
    slots are the plain groups `[c*g, (c+1)*g)` (no segment_ids).
    """

    raw_lo: jax.Array
    core_lo: jax.Array
    core_hi: jax.Array
    group_start: jax.Array | None


def row_ranges(length: int, group_size: int, window_size: int,
               segment_ids: jax.Array | None = None) -> RowRanges:
    """Visible raw and core ranges of every query row; see the module docstring."""
    g, s = group_size, window_size
    t = jnp.arange(length, dtype=jnp.int32)
    if segment_ids is None:
        nc = n_core(t, g, s)[None]
        return RowRanges(g * nc, jnp.zeros_like(nc), nc, None)

    seg = jnp.asarray(segment_ids)
    batch = seg.shape[0]
    is_doc_start = jnp.concatenate(
        [jnp.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    doc_start = jax.lax.cummax(jnp.where(is_doc_start, t, 0), axis=1)
    doc_index = jnp.cumsum(is_doc_start, axis=1) - 1
    doc_len = jax.vmap(lambda idx: jax.ops.segment_sum(
        jnp.ones_like(idx), idx, num_segments=length))(doc_index)
    doc_len = jnp.take_along_axis(doc_len, doc_index, axis=1)
    pos = t - doc_start
    nc = n_core(pos, g, s)
    groups_in_doc = n_core(doc_len - 1, g, s)
    # Slot ends: the last position of every pooled group of every document.
    is_slot_end = ((pos + 1) % g == 0) & ((pos + 1) // g <= groups_in_doc)
    slots_through = jnp.cumsum(is_slot_end.astype(jnp.int32), axis=1)
    slots_before = slots_through - is_slot_end
    core_lo = jnp.take_along_axis(slots_before, doc_start, axis=1)
    m = num_pooled_groups(length, g, s)
    slot = jnp.where(is_slot_end, slots_through - 1, m)  # m: dropped by the scatter
    # Unused slots point at group 0 of the row: finite values that no query ever sees.
    group_start = jnp.zeros((batch, m), jnp.int32).at[
        jnp.arange(batch)[:, None], slot].set(t - g + 1, mode="drop")
    return RowRanges(doc_start + g * nc, core_lo, core_lo + nc, group_start)


def dense_visibility(length: int, group_size: int, window_size: int,
                     segment_ids=None) -> tuple[np.ndarray, np.ndarray]:
    """Boolean `[B, L, L]` raw mask and `[B, L, m]` core mask built from `row_ranges`.

    For tests and the block tables' checks; O(L^2).
    """
    r = jax.tree.map(lambda x: None if x is None else np.asarray(x),
                     row_ranges(length, group_size, window_size, segment_ids))
    t = np.arange(length)
    m = num_pooled_groups(length, group_size, window_size)
    raw = (t[None, None, :] >= r.raw_lo[..., None]) & (t[None, None, :] <= t[None, :, None])
    j = np.arange(m)
    core = (j >= r.core_lo[..., None]) & (j < r.core_hi[..., None])
    return raw, core


# ---- Block-level bounds ------------------------------------------------------------------
# All bounds below rely on raw_lo, core_lo and core_hi being non-decreasing along a row (true
# with and without segment_ids), so a block of query rows [r0, r1] is described by its first
# and last rows. They work on Python ints and on traced scalars inside kernels.

def raw_blocks_for_rows(r0, r1, raw_lo_r0, raw_lo_r1, block_k: int):
    """Raw key blocks a query block of rows `[r0, r1]` must visit.

    Returns (first, full_first, full_last, last): visit `[first, last)`; blocks in
    `[full_first, full_last)` are visible to every row (no mask needed), the others need one.
    """
    first = raw_lo_r0 // block_k
    last = r1 // block_k + 1
    # Fully visible: k0 >= raw_lo(r1) (the largest lower bound) and k1 <= r0.
    full_first = _minimum(_cdiv(raw_lo_r1, block_k), last)
    full_last = _minimum(_maximum((r0 + 1) // block_k, full_first), last)
    return first, full_first, full_last, last


def core_blocks_for_rows(core_lo_r0, core_lo_r1, core_hi_r0, core_hi_r1, block_c: int):
    """Core-slot blocks a query block must visit: (first, full_first, full_last, last).

    Visit `[first, last)`; `[full_first, full_last)` need no mask. `last == first` when no row
    sees a core token.
    """
    first = core_lo_r0 // block_c
    last = _maximum(_cdiv(core_hi_r1, block_c), first)
    full_first = _minimum(_cdiv(core_lo_r1, block_c), last)
    full_last = _minimum(_maximum(core_hi_r0 // block_c, full_first), last)
    return first, full_first, full_last, last


def raw_block_bounds(q_block, block_q: int, block_k: int, length: int, group_size: int,
                     window_size: int):
    """`raw_blocks_for_rows` for query block `q_block` of an unpacked sequence."""
    r0 = q_block * block_q
    r1 = _minimum(r0 + block_q, length) - 1
    return raw_blocks_for_rows(r0, r1, raw_start(r0, group_size, window_size),
                               raw_start(r1, group_size, window_size), block_k)


def core_block_bounds(q_block, block_q: int, block_c: int, length: int, group_size: int,
                      window_size: int):
    """`core_blocks_for_rows` for query block `q_block` of an unpacked sequence."""
    r0 = q_block * block_q
    r1 = _minimum(r0 + block_q, length) - 1
    return core_blocks_for_rows(0, 0, n_core(r0, group_size, window_size),
                                n_core(r1, group_size, window_size), block_c)


def _cdiv(a, b):
    return (a + b - 1) // b


# ---- Query blocks per key block (backward passes over keys) --------------------------------
# The rows that see a raw key `u` or a core slot `c` form one interval `[a(x), b(x)]` whose ends
# are non-decreasing in `x` (a consequence of the monotone row bounds above), so a block of
# keys/slots `[x0, x1]` is described by the intervals of its first and last members.

def raw_key_rows(raw_lo):
    """`[B, L]` -> `[B, L]`: the last row that sees key `u` raw (rows `u .. last` all do).

    Row `t` sees raw key `u` iff `raw_lo(t) <= u <= t`; with `raw_lo` non-decreasing that is
    `u <= t <= max{t : raw_lo(t) <= u}`.
    """
    raw_lo = jnp.asarray(raw_lo)
    keys = jnp.arange(raw_lo.shape[-1], dtype=raw_lo.dtype)
    find = lambda lo: jnp.searchsorted(lo, keys, side="right")  # noqa: E731
    return (jax.vmap(find)(raw_lo) - 1).astype(jnp.int32)


def core_slot_rows(core_lo, core_hi, num_slots: int):
    """`(first_row, end_row)`, each `[B, num_slots]`: slot `c` is seen by rows
    `first_row[c] .. end_row[c]` (empty when `first_row > end_row`, e.g. padding slots).

    Row `t` sees slot `c` iff `core_lo(t) <= c < core_hi(t)`.
    """
    core_lo, core_hi = jnp.asarray(core_lo), jnp.asarray(core_hi)
    slots = jnp.arange(num_slots, dtype=core_lo.dtype)
    first = jax.vmap(lambda hi: jnp.searchsorted(hi, slots, side="right"))(core_hi)
    end = jax.vmap(lambda lo: jnp.searchsorted(lo, slots, side="right"))(core_lo) - 1
    return first.astype(jnp.int32), end.astype(jnp.int32)


def row_blocks_for_interval(a0, a1, b0, b1, block_q: int):
    """Query blocks to visit for a block of keys/slots `[x0, x1]`: (first, full_first,
    full_last, last).

    `a0, a1` are the first rows and `b0, b1` the last rows that see `x0` and `x1` (rows
    `[a(x), b(x)]` see `x`; for raw keys `a(u) = u`, `b(u) = raw_key_rows(...)[u]`; for core
    slots `core_slot_rows`). Visit `[first, last)`; every row of the blocks in
    `[full_first, full_last)` sees every member (no mask needed).
    """
    first = a0 // block_q
    last = _maximum(b1 // block_q + 1, first)
    full_first = _minimum(_cdiv(a1, block_q), last)
    full_last = _minimum(_maximum((b0 + 1) // block_q, full_first), last)
    return first, full_first, full_last, last
