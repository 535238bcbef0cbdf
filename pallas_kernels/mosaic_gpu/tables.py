"""Host-side (XLA) block-visit tables of the Mosaic GPU forward, from `cca_jax.blocks`.

A CTA's consumer warpgroups share one ring of key/value buffers, so they walk the same steps:
the blocks the whole CTA's rows see (`cta` table). Each warpgroup masks what its own rows do
not see, and skips the mask only on the blocks all its rows see fully (`wg` table). Both are
`blocks.query_block_visits` (the one place that arithmetic lives) at two row-block sizes;
the kernel reads a few scalars of them per CTA.

With a narrow head (`narrow` keys, `blocks.narrow_head`), a CTA whose raw window starts in
the last `narrow` keys of its first key block visits only those, as one narrow step before
the ring's: CCA with sinks (N % g != 0) starts nearly every window just off the block grid,
which would otherwise cost a whole extra masked block per CTA.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from cca_jax import blocks

# Columns of `blocks.query_block_visits`: raw key blocks, then slot blocks; the CTA table
# adds RAW_HEAD: 1 where the CTA takes a narrow head (keys `[RAW_FIRST * block_kv - narrow,
# RAW_FIRST * block_kv)`, always masked) before its raw blocks, else 0.
RAW_FIRST, RAW_FULL_FIRST, RAW_FULL_LAST, RAW_LAST = 0, 1, 2, 3
CORE_FIRST, CORE_FULL_FIRST, CORE_FULL_LAST, CORE_LAST = 4, 5, 6, 7
RAW_HEAD = 8


class VisitTables(NamedTuple):
    """int32 tables: `cta` `[B, Lp / cta_rows, 9]`, `wg` `[B, Lp / block_q, 8]` (warpgroup w
    of CTA i is row `i * compute_wgs + w`)."""
    cta: object
    wg: object


def visit_tables(raw_lo, core_lo, core_hi, *, block_q: int, compute_wgs: int,
                 block_kv: int, narrow: int = 0) -> VisitTables:
    """The tables for padded bounds `[B, Lp]` (`padding.pad_row_bounds`; Lp a multiple of
    `block_q * compute_wgs` and of `block_kv`). Raw keys and core slots both come in blocks
    of `block_kv` (one ring of buffers); `narrow` (0: off, else < block_kv) sizes the CTAs'
    narrow heads. numpy in, numpy out; else jnp."""
    def visits(rows: int):
        return blocks.query_block_visits(raw_lo, core_lo, core_hi, rows, block_kv, block_kv)
    cta_rows = block_q * compute_wgs
    cta = visits(cta_rows)
    xp = np if isinstance(cta, np.ndarray) else jnp
    head = xp.zeros_like(cta[..., RAW_FIRST])
    if 0 < narrow < block_kv:
        raw = tuple(cta[..., i] for i in range(RAW_FIRST, RAW_LAST + 1))
        # the CTA's first row has the smallest raw_lo of its rows
        head, _, raw = blocks.narrow_head(raw, raw_lo[:, ::cta_rows], block_kv, narrow)
        cta = xp.concatenate([xp.stack(raw, axis=-1), cta[..., CORE_FIRST:]], axis=-1)
    cta = xp.concatenate([cta, head[..., None]], axis=-1).astype(xp.int32)
    return VisitTables(cta=cta, wg=visits(block_q))


def walk_steps(cta_row, wg_rows, block_kv: int,
               narrow: int = 0) -> list[tuple[str, int, int, tuple]]:
    """The steps one CTA's warpgroups take, as the kernel derives them from one row of each
    table (numpy, for tests): per step `(kind, first, width, masked_for_each_warpgroup)`,
    the step covering keys (kind "raw") or slots ("core") `[first, first + width)`.
    Mirrors the kernel's walk: the narrow head (masked for all) if any, then CTA ranges, each
    warpgroup unmasked only on its own full range clipped into the CTA's."""
    steps = []
    if int(cta_row[RAW_HEAD]):
        steps.append(("raw", int(cta_row[RAW_FIRST]) * block_kv - narrow, narrow,
                      (True,) * len(wg_rows)))
    for kind, (first, last, ff, fl) in (
            ("raw", (RAW_FIRST, RAW_LAST, RAW_FULL_FIRST, RAW_FULL_LAST)),
            ("core", (CORE_FIRST, CORE_LAST, CORE_FULL_FIRST, CORE_FULL_LAST))):
        lo, hi = int(cta_row[first]), int(cta_row[last])
        for block in range(lo, hi):
            masked = []
            for row in wg_rows:
                full_first = min(max(int(row[ff]), lo), hi)
                full_last = min(max(int(row[fl]), full_first), hi)
                masked.append(not full_first <= block < full_last)
            steps.append((kind, block * block_kv, block_kv, tuple(masked)))
    return steps


# Columns of `blocks.key_block_visits` / `slot_block_visits`: the query blocks to visit.
Q_FIRST, Q_FULL_FIRST, Q_FULL_LAST, Q_LAST = 0, 1, 2, 3


def key_visit_tables(raw_lo, core_lo, core_hi, num_slots: int, *, key_rows: int,
                     compute_wgs: int, block_q: int) -> tuple[VisitTables, VisitTables]:
    """(raw keys, slots) tables of the backward's key-side kernels: per CTA of
    `key_rows * compute_wgs` keys (slots) and per warpgroup of `key_rows`, the query blocks
    of `block_q` rows that see them (`blocks.key_block_visits` / `slot_block_visits`, int32
    `[B, n, 4]`). Bounds `[B, Lp]` padded; `num_slots` padded to whole CTAs (jnp)."""
    def raw(rows):
        return blocks.key_block_visits(raw_lo, rows, block_q)

    def slots(rows):
        return blocks.slot_block_visits(core_lo, core_hi, num_slots, rows, block_q)
    cta = key_rows * compute_wgs
    return (VisitTables(cta=raw(cta), wg=raw(key_rows)),
            VisitTables(cta=slots(cta), wg=slots(key_rows)))


def key_walk_steps(cta_row, wg_rows, groups: int) -> list[tuple[int, int, tuple]]:
    """The steps one key-side CTA's warpgroups take (numpy, for tests), as the kernel
    (`keys`) derives them from one row of each table: per step `(group_head, query_block,
    masked_for_each_warpgroup)`, the CTA's query blocks once per query head of the group,
    each warpgroup unmasked only on its own full range clipped into the CTA's."""
    first, last = int(cta_row[Q_FIRST]), int(cta_row[Q_LAST])
    steps = []
    for gi in range(groups):
        for block in range(first, last):
            masked = []
            for row in wg_rows:
                full_first = min(max(int(row[Q_FULL_FIRST]), first), last)
                full_last = min(max(int(row[Q_FULL_LAST]), full_first), last)
                masked.append(not full_first <= block < full_last)
            steps.append((gi, block, tuple(masked)))
    return steps
