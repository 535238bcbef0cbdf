"""Which keys each query sees, for every attention option: the single source of that arithmetic.

An attention option is an `AttentionPattern`: one of the frozen types `Full`, `Sliding`,
`Streaming` and `CCA`, each holding its rule below (`parse_option` builds one from a kind
string: the one parse of CLI and config strings). Inside one document (a row, or a maximal
run of equal `segment_ids` in a packed row), a query at in-document position `p` sees
  * raw keys at in-document positions `raw_start(p) .. p`, and
  * the first `num_slots(p)` *slots* of its document: slot `c` summarises the `slot_size`
    tokens `[c * slot_size, (c + 1) * slot_size)` (pooled by `cca_jax.attention.pooling`).
The options:
  full       raw_start = 0, no slots.
  sliding    raw_start = max(0, p - W + 1) (W keys including itself), no slots.
  streaming  the sliding window plus the first N tokens (attention sinks) as slots of one
             token each, for those sinks that have left the window.
  cca        SPEC section 2: num_slots = n_core(p), raw_start = g * n_core(p), slots of g.
             With N sink tokens (SPEC 6) a document's slots are its N sinks (one raw token
             each: `lead_slots`) and then its core tokens (groups of g from position N); a
             sink is seen through its slot once it has left the widest raw window (s + g - 1,
             as streaming's sinks leave theirs), so the raw window stays at most s + g - 1
             keys and the ring at s + g. N = 0 is the paper's CCA exactly.
Slots and the window never overlap and leave no gap, so every option is one softmax over two
contiguous ranges.

Slots of all documents of a row are stored back to back ("slots", ordered by position), so
both visible sets are contiguous index ranges: raw `[raw_lo(t), t]`, slots
`[core_lo(t), core_hi(t))`. Without `segment_ids`: `raw_lo = raw_start(t)`, `core_lo = 0`,
`core_hi = num_slots(t)`.

Everything here is plain integer arithmetic that works on Python ints, numpy and jnp arrays
(traced or not); `_arith._xp` is the one place that picks numpy or jax.numpy. The XLA
implementation, the Pallas kernels (GPU bounds, TPU prefetch tables) and the KV cache all take
their bounds from this package, one module per question:
  options      the options' rules and sizes, `parse_option`;
  rows         visible ranges per row of a sequence (`pattern_ranges`), packed or not;
  block_walks  the blocks a kernel visits per query block, key block or slot block;
  cache        what a query at any position sees of a KV cache (ring and slots), in chunks
               and one token at a time (`decode_bounds`).
"""

from __future__ import annotations

from cca_jax.blocks.options import (n_core, raw_start, num_pooled_groups, AttentionPattern,
                                    Full, Sliding, Streaming, CCA, ATTENTION_KINDS,
                                    default_sink_tokens, parse_option, completed_slot,
                                    completes_slot, slot_ends_bound)
from cca_jax.blocks.rows import (RowRanges, pattern_ranges, lead_rows, sinks_as_slots,
                                 document_starts, pattern_dense_visibility)
from cca_jax.blocks.block_walks import (raw_blocks_for_rows, core_blocks_for_rows,
                                        raw_block_bounds, core_block_bounds, narrow_head,
                                        narrow_heads, narrow_tail, search_sorted, raw_key_rows,
                                        core_slot_rows, row_blocks_for_interval,
                                        query_block_visits, key_block_visits,
                                        slot_block_visits, query_block_steps, key_block_steps)
from cca_jax.blocks.cache import (ring_size, widest_window, ring_positions, ring_order,
                                  cache_raw_visible, cache_slot_visible, chunk_ranges,
                                  chunk_slots, DecodeBounds, decode_bounds,
                                  decode_block_visits, ring_entry_visible)

__all__ = [
    "n_core", "raw_start", "num_pooled_groups", "AttentionPattern", "Full", "Sliding",
    "Streaming", "CCA", "ATTENTION_KINDS", "default_sink_tokens", "parse_option",
    "completed_slot", "completes_slot", "slot_ends_bound", "RowRanges", "pattern_ranges",
    "lead_rows", "sinks_as_slots", "document_starts", "pattern_dense_visibility",
    "raw_blocks_for_rows", "core_blocks_for_rows", "raw_block_bounds", "core_block_bounds",
    "narrow_head", "narrow_heads", "narrow_tail", "search_sorted", "raw_key_rows",
    "core_slot_rows", "row_blocks_for_interval", "query_block_visits", "key_block_visits",
    "slot_block_visits", "query_block_steps", "key_block_steps", "ring_size", "widest_window",
    "ring_positions", "ring_order", "cache_raw_visible", "cache_slot_visible", "chunk_ranges",
    "chunk_slots", "DecodeBounds", "decode_bounds", "decode_block_visits",
    "ring_entry_visible",
]
