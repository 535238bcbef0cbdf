"""Visible ranges per query row of a whole sequence (packed documents included): the bounds
every self-attention implementation takes, and the dense masks tests check them with.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.blocks._arith import _maximum, _xp
from cca_jax.blocks.options import AttentionPattern, completed_slot


class RowRanges(NamedTuple):
    """Per query row `[B, L]` int32 bounds, plus where each slot's tokens start and end.

    raw_lo, core_lo, core_hi: see the module docstring.
    group_start, group_last: `[B, m]` first and last position of the tokens of slot `c` (a
    lead slot is one token: start == last), or None when the slots are those of one document
    starting at row 0 (`AttentionPattern.slot_first` / `slot_last`; no segment_ids).
    """

    raw_lo: jax.Array
    core_lo: jax.Array
    core_hi: jax.Array
    group_start: jax.Array | None
    group_last: jax.Array | None = None


def pattern_ranges(pattern: AttentionPattern, length: int,
                   segment_ids: jax.Array | None = None) -> RowRanges:
    """Visible raw and slot ranges of every query row under `pattern`."""
    t = jnp.arange(length, dtype=jnp.int32)
    if segment_ids is None:
        nc = pattern.num_slots(t)[None]
        return RowRanges(pattern.raw_start(t)[None], jnp.zeros_like(nc), nc, None)

    size = pattern.slot_size
    seg = jnp.asarray(segment_ids)
    batch = seg.shape[0]
    doc_start = document_starts(seg)
    is_doc_start = doc_start == t
    doc_index = jnp.cumsum(is_doc_start, axis=1) - 1
    doc_len = jax.vmap(lambda idx: jax.ops.segment_sum(
        jnp.ones_like(idx), idx, num_segments=length))(doc_index)
    doc_len = jnp.take_along_axis(doc_len, doc_index, axis=1)
    pos = t - doc_start
    nc = pattern.num_slots(pos)
    slots_in_doc = pattern.num_slots(doc_len - 1)
    # Slot ends: the last position of every slot some query of its document sees.
    in_doc = completed_slot(pattern, pos)
    is_slot_end = (in_doc >= 0) & (in_doc < slots_in_doc)
    slots_through = jnp.cumsum(is_slot_end.astype(jnp.int32), axis=1)
    slots_before = slots_through - is_slot_end
    core_lo = jnp.take_along_axis(slots_before, doc_start, axis=1)
    m = pattern.max_slots(length, packed=True)
    slot = jnp.where(is_slot_end, slots_through - 1, m)  # m: dropped by the scatter
    # Unused slots point at position 0 of the row: finite values that no query ever sees.
    rows = jnp.arange(batch)[:, None]
    first = t - size + 1 if not pattern.lead_slots else t + 1 - pattern.slot_length(in_doc)
    group_start = jnp.zeros((batch, m), jnp.int32).at[rows, slot].set(first, mode="drop")
    group_last = jnp.zeros((batch, m), jnp.int32).at[rows, slot].set(
        jnp.broadcast_to(t, (batch, length)), mode="drop")
    return RowRanges(doc_start + pattern.raw_start(pos), core_lo, core_lo + nc, group_start,
                     group_last)


def lead_rows(pattern: AttentionPattern, length: int) -> int:
    """N when an unpacked row of `length` under `pattern` can be split at its N lead slots
    (cca's sinks) by `sinks_as_slots`, else 0: the pattern has lead slots and all N of them
    are pooled (`max_slots`, so the row is at least `N + s + g - 1` long)."""
    n = pattern.lead_slots
    return n if n and pattern.max_slots(length) >= n else 0


def sinks_as_slots(pattern: AttentionPattern, raw_lo, core_lo, core_hi):
    """Bounds of unpacked rows (`pattern_ranges` without segment_ids, `[B, L]`) with the
    boundary between slots and raw keys moved over the N sinks: rows `t < N` see sinks only
    raw (`[0, t]`, no slots), later rows see all N only as their lead slots (exact copies of
    tokens `0 .. N-1`, `AttentionPattern.lead_slots`). Every row sees the same keys and values
    as before; now rows `t >= N` see no raw key below N, and in the frame of positions `t - N`
    their raw windows are CCA's without sinks (kernels' block edges again). Needs
    `lead_rows(pattern, L) == N > 0`."""
    n = pattern.lead_slots
    if not lead_rows(pattern, raw_lo.shape[-1]):
        raise ValueError(f"sinks_as_slots needs rows whose {n} sinks are all pooled as slots "
                         f"(length >= N + s + g - 1 under {pattern}); got length "
                         f"{raw_lo.shape[-1]}.")
    xp = _xp(raw_lo)
    t = xp.arange(raw_lo.shape[-1], dtype=raw_lo.dtype)
    # Rows t >= N seeing sinks raw from raw_lo have slots [0, raw_lo): those become [0, N).
    # Rows t < N seeing sinks as slots [0, core_hi) have raw keys from core_hi: from 0 now.
    moved = xp.where(t >= n, _maximum(n - raw_lo, 0), core_lo - core_hi)
    return raw_lo + moved, core_lo, core_hi + moved


def document_starts(segment_ids) -> jax.Array:
    """`[B, L]` -> `[B, L]`: the first position of each position's document, a document being
    a maximal run of equal ids."""
    seg = jnp.asarray(segment_ids)
    t = jnp.arange(seg.shape[1], dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]],
                               axis=1)
    return jax.lax.cummax(jnp.where(is_start, t, 0), axis=1)


def pattern_dense_visibility(pattern: AttentionPattern, length: int,
                             segment_ids=None) -> tuple[np.ndarray, np.ndarray]:
    """Boolean `[B, L, L]` raw mask and `[B, L, m]` slot mask built from `pattern_ranges`.

    For tests and the block tables' checks; O(L^2).
    """
    r = jax.tree.map(lambda x: None if x is None else np.asarray(x),
                     pattern_ranges(pattern, length, segment_ids))
    t = np.arange(length)
    m = pattern.max_slots(length, packed=segment_ids is not None)
    raw = (t[None, None, :] >= r.raw_lo[..., None]) & (t[None, None, :] <= t[None, :, None])
    j = np.arange(m)
    core = (j >= r.core_lo[..., None]) & (j < r.core_hi[..., None])
    return raw, core
