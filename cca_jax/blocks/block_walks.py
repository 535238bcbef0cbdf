"""Which key blocks a block of query rows visits, and which query blocks a block of keys or
slots is seen by, from the row bounds of `rows`: the walks of the attention kernels (GPU
bounds, TPU visit tables and their static step counts), with the blocks that need no mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.blocks._arith import _as_count, _cdiv, _maximum, _minimum, _xp
from cca_jax.blocks.options import AttentionPattern


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


def raw_block_bounds(pattern: AttentionPattern, q_block, block_q: int, block_k: int,
                     length: int):
    """`raw_blocks_for_rows` for query block `q_block` of an unpacked sequence."""
    r0 = q_block * block_q
    r1 = _minimum(r0 + block_q, length) - 1
    return raw_blocks_for_rows(r0, r1, pattern.raw_start(r0), pattern.raw_start(r1), block_k)


def core_block_bounds(pattern: AttentionPattern, q_block, block_q: int, block_c: int,
                      length: int):
    """`core_blocks_for_rows` for query block `q_block` of an unpacked sequence."""
    r0 = q_block * block_q
    r1 = _minimum(r0 + block_q, length) - 1
    return core_blocks_for_rows(0, 0, pattern.num_slots(r0), pattern.num_slots(r1), block_c)


# ---- Narrow edge blocks ----------------------------------------------------------------------
# When a walk's first (or last) block holds visible members only in its last (first) few
# positions, a kernel visits just those as one narrow block instead of the whole block. This
# is what keeps CCA with sinks as fast as without: N sinks move every raw window by N rows,
# so most query blocks' windows start a few keys before a key-block boundary (and most raw
# key blocks are last seen a few rows past a query-block boundary).


def narrow_head(bounds, lo, block: int, narrow: int):
    """Split a narrow head off a walk `bounds = (first, full_first, full_last, last)` whose
    members visible in block `first` are all `>= lo`.

    Returns `(head, head_start, bounds)`: `head` is 1 when they all lie in the block's last
    `narrow` positions `[head_start, head_start + narrow)` (visit those, masked, as one
    narrow block), else 0; `bounds` walk the rest (`first + head` on).
    """
    first, full_first, full_last, last = bounds
    head_start = (first + 1) * block - narrow
    head = _as_count((lo >= head_start) & (first < last))
    first = first + head
    full_first = _maximum(full_first, first)
    return head, head_start, (first, full_first, _maximum(full_last, full_first), last)


def narrow_heads(pattern: AttentionPattern, length: int, block_q: int, block_k: int,
                 narrow: int) -> int:
    """Query blocks of one document of `length` tokens whose raw walk takes a narrow head.

    Zero (e.g. CCA without sinks at block-aligned windows) means a kernel gains nothing from
    compiling the narrow path in (host-side, Python ints).
    """
    if not 0 < narrow < block_k:
        return 0
    r0 = np.arange(0, length, block_q)
    r1 = np.minimum(r0 + block_q, length) - 1
    lo0, lo1 = (np.asarray(pattern.raw_start(r)) for r in (r0, r1))
    bounds = raw_blocks_for_rows(r0, r1, lo0, lo1, block_k)
    return int(np.sum(narrow_head(bounds, lo0, block_k, narrow)[0]))


def narrow_tail(bounds, hi, block: int, narrow: int):
    """Split a narrow tail off a walk whose members visible in block `last - 1` are all
    `<= hi`: `(tail, tail_start, bounds)`, `tail` 1 when they lie in its first `narrow`
    positions `[tail_start, tail_start + narrow)` (visit those, masked), `bounds` the rest."""
    first, full_first, full_last, last = bounds
    tail_start = (last - 1) * block
    tail = _as_count((hi < tail_start + narrow) & (first < last))
    last = last - tail
    full_last = _minimum(full_last, last)
    return tail, tail_start, (first, _minimum(full_first, full_last), full_last, last)


# ---- Query blocks per key block (backward passes over keys) --------------------------------
# The rows that see a raw key `u` or a core slot `c` form one interval `[a(x), b(x)]` whose ends
# are non-decreasing in `x` (a consequence of the monotone row bounds above), so a block of
# keys/slots `[x0, x1]` is described by the intervals of its first and last members.

def search_sorted(sorted_values, queries, side: str = "right"):
    """`jnp.searchsorted` with its binary search unrolled: the default runs it as a while
    loop, a few kernel launches per halving on a GPU (17 halvings at 128K rows), on the
    backward's host side of every layer."""
    return jnp.searchsorted(sorted_values, queries, side=side, method="scan_unrolled")


def raw_key_rows(raw_lo, keys=None):
    """`[B, L]` -> `[B, L]`: the last row that sees key `u` raw (rows `u .. last` all do);
    `keys` (int `[n]`): only those keys' (`[B, n]`), where a caller needs a few of them.

    Row `t` sees raw key `u` iff `raw_lo(t) <= u <= t`; with `raw_lo` non-decreasing that is
    `u <= t <= max{t : raw_lo(t) <= u}`.
    """
    raw_lo = jnp.asarray(raw_lo)
    if keys is None:
        keys = jnp.arange(raw_lo.shape[-1], dtype=raw_lo.dtype)
    keys = jnp.asarray(keys, raw_lo.dtype)
    find = lambda lo: search_sorted(lo, keys)  # noqa: E731
    return (jax.vmap(find)(raw_lo) - 1).astype(jnp.int32)


def core_slot_rows(core_lo, core_hi, num_slots: int, slots=None):
    """`(first_row, end_row)`, each `[B, num_slots]`: slot `c` is seen by rows
    `first_row[c] .. end_row[c]` (empty when `first_row > end_row`, e.g. padding slots);
    `slots` (int `[n]`): only those slots' (`[B, n]`).

    Row `t` sees slot `c` iff `core_lo(t) <= c < core_hi(t)`.
    """
    core_lo, core_hi = jnp.asarray(core_lo), jnp.asarray(core_hi)
    if slots is None:
        slots = jnp.arange(num_slots, dtype=core_lo.dtype)
    slots = jnp.asarray(slots, core_lo.dtype)
    first = jax.vmap(lambda hi: search_sorted(hi, slots))(core_hi)
    end = jax.vmap(lambda lo: search_sorted(lo, slots))(core_lo) - 1
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


# ---- Visit tables of kernels that walk blocks on a static grid (Pallas TPU) ----------------
# A TPU kernel's grid is static, so a kernel walks a fixed number of steps per output block
# and skips the steps past its own run-time count. The tables below give, per output block,
# `(first, full_first, full_last, last)` of the blocks to visit (from the block helpers
# above: bounds of the block's first and last rows, keys or slots), and the `*_steps`
# functions a static bound on `last - first` that holds for every packing of the row.

def query_block_visits(raw_lo, core_lo, core_hi, block_q: int, block_k: int, block_c: int):
    """int32 `[B, nq, 8]`: per query block, the raw key blocks `(first, full_first,
    full_last, last)` then the slot blocks (same four).

    raw_lo, core_lo, core_hi: `[B, Lp]` row bounds with `Lp` a multiple of `block_q` (padded
    rows as `padding.pad_row_bounds` makes them). numpy in, numpy out; else jnp.
    """
    xp = _xp(raw_lo)
    nq = raw_lo.shape[1] // block_q
    r0 = xp.arange(nq, dtype=xp.int32) * block_q
    r1 = r0 + block_q - 1
    raw = raw_blocks_for_rows(r0, r1, raw_lo[:, r0], raw_lo[:, r1], block_k)
    core = core_blocks_for_rows(core_lo[:, r0], core_lo[:, r1], core_hi[:, r0],
                                core_hi[:, r1], block_c)
    raw = [xp.broadcast_to(x, raw_lo[:, r0].shape) for x in raw]
    return xp.stack([*raw, *core], axis=-1).astype(xp.int32)


def key_block_visits(raw_lo, block_k: int, block_q: int):
    """int32 `[B, nk, 4]`: per raw key block, the query blocks that see it `(first,
    full_first, full_last, last)`. raw_lo: `[B, Lp]`, `Lp` a multiple of both blocks."""
    nk = raw_lo.shape[1] // block_k
    x0 = jnp.arange(nk, dtype=jnp.int32) * block_k
    x1 = x0 + block_k - 1
    last = raw_key_rows(raw_lo, jnp.concatenate([x0, x1]))   # each block's first and last key
    visits = row_blocks_for_interval(x0, x1, last[:, :nk], last[:, nk:], block_q)
    visits = [jnp.broadcast_to(x, last[:, :nk].shape) for x in visits]
    return jnp.stack(visits, axis=-1).astype(jnp.int32)


def slot_block_visits(core_lo, core_hi, num_slots: int, block_c: int, block_q: int):
    """int32 `[B, nc, 4]`: per block of `block_c` slots (`num_slots` a multiple of it), the
    query blocks that see some slot of it `(first, full_first, full_last, last)`."""
    nc = num_slots // block_c
    c0 = jnp.arange(nc, dtype=jnp.int32) * block_c
    c1 = c0 + block_c - 1
    first_row, end_row = core_slot_rows(core_lo, core_hi, num_slots,
                                        jnp.concatenate([c0, c1]))
    visits = row_blocks_for_interval(first_row[:, :nc], first_row[:, nc:], end_row[:, :nc],
                                     end_row[:, nc:], block_q)
    return jnp.stack(visits, axis=-1).astype(jnp.int32)


def query_block_steps(width: int, padded_len: int, block_q: int, block_k: int,
                      num_slot_blocks: int) -> tuple[int, int]:
    """Static `(raw, slot)` bounds on the blocks any query block visits, packed or not.

    Raw: every row sees at most `width` keys inside its document (`widest_window` of the
    option), so `raw_lo(t) >= t - width + 1` (padded rows see only themselves); slots: all
    slot blocks.
    """
    r0 = np.arange(padded_len // block_q) * block_q
    r1 = r0 + block_q - 1
    first = np.maximum(r0 - width + 1, 0) // block_k
    return int(np.max(r1 // block_k - first + 1)), int(num_slot_blocks)


def key_block_steps(width: int, padded_len: int, block_k: int, block_q: int) -> int:
    """Static bound on the query blocks that see one raw key block: key `u` is seen by rows
    `u .. u + width - 1` at most (`width`: `widest_window` of the option)."""
    nq = padded_len // block_q
    x0 = np.arange(padded_len // block_k) * block_k
    last = np.minimum((x0 + block_k - 1 + width - 1) // block_q, nq - 1)
    return int(np.max(last - x0 // block_q + 1))
