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
(traced or not); `_xp` is the one place that picks numpy or jax.numpy. The XLA
implementation, the Pallas kernels (GPU bounds, TPU prefetch tables) and the KV cache all take
their bounds from this module.
"""

from __future__ import annotations

import dataclasses
import types
from typing import ClassVar, NamedTuple

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


def _xp(*values):
    """The one switch between numpy and jax.numpy here: numpy when every value is a Python
    or numpy integer/bool or a numpy array (host-side tables, tests), else jax.numpy."""
    host = all(isinstance(v, (int, np.integer, np.bool_, np.ndarray)) for v in values)
    return np if host else jnp


def _elementwise(name: str):
    """numpy/jax.numpy op `name` through `_xp`; Python scalars in, a Python scalar out."""
    def op(*args):
        out = getattr(_xp(*args), name)(*args)
        scalars = all(isinstance(a, (int, np.integer, np.bool_)) for a in args)
        return out.item() if scalars else out
    return op


_maximum = _elementwise("maximum")
_minimum = _elementwise("minimum")
_where = _elementwise("where")


# ---- attention options ----------------------------------------------------------------------

def _window_start(p, window: int):
    return _maximum(p - window + 1, 0)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _non_negative(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """Which keys a query sees: the base of the attention options `Full`, `Sliding`,
    `Streaming` and `CCA` (frozen, hashable, static under jit). Each option holds its rule
    (`raw_start`, `num_slots`), its slots' sizes, its slot bound and its KV-cache ring size;
    the shared slot arithmetic is here. `parse_option` builds one from a kind string.

    The size fields every option answers (1, 1, 0 where it has none): group_size (`g`, cca),
    window_size (`s` for cca, `W` for sliding and streaming), sink_tokens (`N`).
    """

    kind: ClassVar[str] = ""
    default_sinks: ClassVar[int] = 0   # sink_tokens when a configuration leaves it unset

    def raw_start(self, p):
        """First raw key (in-document position) visible to in-document position `p`."""
        raise NotImplementedError

    def num_slots(self, p):
        """Slots `0 .. num_slots(p) - 1` of its document are visible to position `p`."""
        return 0 * p

    @property
    def slot_size(self) -> int:
        """Tokens summarised by one pooled slot (g for cca; 1 for streaming's sinks)."""
        return 1

    @property
    def lead_slots(self) -> int:
        """Slots of one raw token each that lead a document's slots, before the pooled ones
        (cca's sinks: N). Slot `c` of a document covers in-document positions
        `[slot_first(c), slot_last(c)]`."""
        return 0

    def max_slots(self, length: int, packed: bool = False) -> int:
        """Slots a row of `length` needs (all documents together when `packed`)."""
        return 0

    def ring_size(self, max_len: int) -> int:
        """Raw keys/values the KV cache keeps per KV head for sequences of up to `max_len`
        tokens, before clipping to `[1, max_len]` (`blocks.ring_size`): the widest raw window
        a query sees (cca: SPEC section 4's `s + g`)."""
        raise NotImplementedError

    def slot_first(self, c):
        """First in-document position of the tokens of slot `c`."""
        n = self.lead_slots
        if not n:
            return c * self.slot_size
        return _minimum(c, n) + _maximum(c - n, 0) * self.slot_size

    def slot_last(self, c):
        """Last in-document position of slot `c`: its slot is pooled with that token's query."""
        return self.slot_first(c + 1) - 1

    def slot_length(self, c):
        """Tokens of slot `c`: 1 for a lead slot, else `slot_size`."""
        return self.slot_first(c + 1) - self.slot_first(c)

    def slots_ending_before(self, p):
        """How many slots end before in-document position `p` (their last token `< p`); also
        the index of the first slot that ends at or after `p`."""
        n = self.lead_slots
        if not n:
            return p // self.slot_size
        return _minimum(p, n) + _maximum(p - n, 0) // self.slot_size

    def visible_scores(self, length: int) -> int:
        """Query-key scores per head for one unpacked sequence of `length`."""
        t = np.arange(length, dtype=np.int64)
        return int(np.sum(self.num_slots(t) + t - self.raw_start(t) + 1))


@dataclasses.dataclass(frozen=True)
class Full(AttentionPattern):
    """Causal attention over every earlier key; no slots."""

    kind: ClassVar[str] = "full"
    group_size: ClassVar[int] = 1
    window_size: ClassVar[int] = 1
    sink_tokens: ClassVar[int] = 0

    def raw_start(self, p):
        return 0 * p

    def ring_size(self, max_len: int) -> int:
        return max_len


@dataclasses.dataclass(frozen=True)
class Sliding(AttentionPattern):
    """The last `window_size` keys (the query's own included); no slots."""

    window_size: int

    kind: ClassVar[str] = "sliding"
    group_size: ClassVar[int] = 1
    sink_tokens: ClassVar[int] = 0

    def __post_init__(self):
        _positive("window_size", self.window_size)

    def raw_start(self, p):
        return _window_start(p, self.window_size)

    def ring_size(self, max_len: int) -> int:
        return self.window_size


@dataclasses.dataclass(frozen=True)
class Streaming(AttentionPattern):
    """StreamingLLM: the sliding window plus the first `sink_tokens` tokens of the document
    as slots of one token each, for those sinks that have left the window."""

    window_size: int
    sink_tokens: int = 4

    kind: ClassVar[str] = "streaming"
    group_size: ClassVar[int] = 1
    default_sinks: ClassVar[int] = 4

    def __post_init__(self):
        _positive("window_size", self.window_size)
        _non_negative("sink_tokens", self.sink_tokens)

    def raw_start(self, p):
        return _window_start(p, self.window_size)

    def num_slots(self, p):
        return _minimum(_window_start(p, self.window_size), self.sink_tokens)

    def max_slots(self, length: int, packed: bool = False) -> int:
        w, n = self.window_size, self.sink_tokens
        if not packed:
            return max(0, min(n, length - w))
        # Only documents longer than W have sinks outside their window, at most L // (W + 1)
        # of them, and their slots add up to at most L - W.
        return max(0, min(length - w, n * (length // (w + 1))))

    def ring_size(self, max_len: int) -> int:
        return self.window_size


@dataclasses.dataclass(frozen=True)
class CCA(AttentionPattern):
    """Core Context Aware attention (SPEC section 2) with group `g`, window `s` and `N` sink
    tokens (SPEC 6; 0: the paper's CCA exactly)."""

    group_size: int
    window_size: int
    sink_tokens: int = 0

    kind: ClassVar[str] = "cca"

    def __post_init__(self):
        _positive("group_size", self.group_size)
        _positive("window_size", self.window_size)
        _non_negative("sink_tokens", self.sink_tokens)

    def _sinks_seen(self, p):
        """Sinks (SPEC 6) the query at `p` sees through their slots: those that have left the
        widest raw window of `s + g - 1` keys (all N once a core token is visible)."""
        return _minimum(_window_start(p, self.window_size + self.group_size - 1),
                        self.sink_tokens)

    def _cores(self, p):
        """n_core of SPEC 6: CCA on the positions after the N sinks."""
        return n_core(p - self.sink_tokens, self.group_size, self.window_size)

    def raw_start(self, p):
        if not self.sink_tokens:
            return raw_start(p, self.group_size, self.window_size)
        return self._sinks_seen(p) + self.group_size * self._cores(p)

    def num_slots(self, p):
        if not self.sink_tokens:
            return n_core(p, self.group_size, self.window_size)
        return self._sinks_seen(p) + self._cores(p)

    @property
    def slot_size(self) -> int:
        return self.group_size

    @property
    def lead_slots(self) -> int:
        return self.sink_tokens

    def max_slots(self, length: int, packed: bool = False) -> int:
        # Documents' groups never add up to more than one sequence's:
        # sum (l_i - s) // g <= (L - s) // g.
        g, s, n = self.group_size, self.window_size, self.sink_tokens
        if not n:
            return num_pooled_groups(length, g, s)
        if not packed:
            return int(self.num_slots(length - 1)) if length else 0
        # Sinks become slots in documents of s + g tokens or more (at most L // (s + g) of
        # them), at most l - s - g + 1 in one of l tokens; the groups after the sinks add up
        # as above.
        sinks = max(0, min(n * (length // (s + g)), length - s - g + 1))
        return sinks + max(0, (length - n - s) // g)

    def ring_size(self, max_len: int) -> int:
        # SPEC section 4's `s + g`: the local window plus the group that is still filling
        # (the widest window is `s + g - 1`, so one entry is spare).
        return self.window_size + self.group_size


# kind string -> option type: what `parse_option` and the CLIs' choices read.
ATTENTION_KINDS = types.MappingProxyType(
    {cls.kind: cls for cls in (Full, Sliding, Streaming, CCA)})


def default_sink_tokens(kind: str) -> int:
    """`sink_tokens` of option `kind` when a configuration leaves it unset: StreamingLLM's 4
    for streaming, 0 (the paper's CCA) for cca."""
    return ATTENTION_KINDS[kind].default_sinks


def parse_option(kind: str, *, group_size: int = 1, window_size: int = 1,
                 sink_tokens: int = 0) -> AttentionPattern:
    """THE parse of an attention option from a kind string and sizes (CLIs, config files):
    `Full()`, `Sliding(window_size)`, `Streaming(window_size, sink_tokens)` or
    `CCA(group_size, window_size, sink_tokens)`. Every size is validated, used or not."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {sorted(ATTENTION_KINDS)}, got {kind!r}.")
    _positive("group_size", group_size)
    _positive("window_size", window_size)
    _non_negative("sink_tokens", sink_tokens)
    if kind == "full":
        return Full()
    if kind == "sliding":
        return Sliding(window_size)
    if kind == "streaming":
        return Streaming(window_size, sink_tokens)
    return CCA(group_size, window_size, sink_tokens)


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


def _cdiv(a, b):
    return (a + b - 1) // b


# ---- Narrow edge blocks ----------------------------------------------------------------------
# When a walk's first (or last) block holds visible members only in its last (first) few
# positions, a kernel visits just those as one narrow block instead of the whole block. This
# is what keeps CCA with sinks as fast as without: N sinks move every raw window by N rows,
# so most query blocks' windows start a few keys before a key-block boundary (and most raw
# key blocks are last seen a few rows past a query-block boundary).

def _as_count(flag):
    """A bool (Python, numpy or traced) as the int 0 or 1."""
    return int(flag) if isinstance(flag, (bool, np.bool_)) else flag.astype(np.int32)


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


def completed_slot(pattern: AttentionPattern, t):
    """The slot whose last token is in-document position `t` (`slot_last(c) == t`), or -1
    when `t` completes none. The cache stores it only if it is `< C` (later slots are never
    visible within max_len)."""
    size, lead = pattern.slot_size, pattern.lead_slots
    u = t - lead if lead else t            # position among the pooled tokens
    done = (u + 1) % size == 0
    c = (u + 1) // size - 1 + lead
    if lead:                               # a lead slot (a sink) is its own token
        done = done | (u < 0)
        c = _where(u < 0, t, c)
    return _where(done, c, -1)


def completes_slot(pattern: AttentionPattern, t, num_slots: int):
    """Whether the token at position `t` completes a slot the cache stores (`0 <= c < C`):
    the decode steps that pool (numpy or jax, elementwise)."""
    c = completed_slot(pattern, t)
    return (c >= 0) & (c < num_slots)


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


def slot_ends_bound(pattern: AttentionPattern, rows: int, packed: bool = False) -> int:
    """Static bound on the slots whose last token lies in `rows` consecutive rows.

    Pooled slots end at least `slot_size` apart, across documents too (a document's first
    one ends `slot_size - 1` after its lead slots, after the previous document's last one).
    Lead slots (cca's sinks) end at a document's first N positions: one document's (its
    start) unpacked; packed, those of the documents met, which are `s + g` tokens or more
    when they have sink slots.
    """
    pooled = -(-rows // pattern.slot_size)
    lead = pattern.lead_slots
    if not lead:
        return pooled
    docs = (rows - 1) // (pattern.window_size + pattern.slot_size) + 2 if packed else 1
    return min(rows, pooled + lead * docs)


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
