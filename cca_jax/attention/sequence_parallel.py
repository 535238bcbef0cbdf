"""Attention with the sequence sharded over a mesh axis: halo exchange plus all-gathered slots.

`sequence_sharded_attention(q, k, v, pattern, mesh=..., axis="sequence")` computes exactly
`run_attention(q, k, v, pattern, ...)` for the options whose raw window is bounded (cca,
sliding, streaming) with `q, k, v` sharded along the sequence over the mesh axis `axis`, and
never moves the full K/V between devices:

  * The sequence is cut into `chunks` equal chunks of `C = L / chunks` rows (below).
  * Raw window: a query at position `t` sees raw keys `raw_lo(t) .. t`, at most
    `widest = max(t - raw_start(t) + 1)` of them (s + g - 1 for cca, W for sliding and
    streaming). So a chunk needs, besides its own rows, only the last `H = widest - 1` raw k/v
    rows of the chunk before it (the *halo*, one `jax.lax.ppermute`). `H <= C` is required:
    a window reaching past the previous chunk is refused (ValueError), not walked as a ring.
  * Slots (cca's sinks and core tokens, streaming's sinks): every chunk pools the slots whose
    *last* token lies in its rows (that token's query does the pooling; the slot's other
    tokens lie within `slot_size - 1 <= H` rows before it, in the halo or the chunk). Which
    slots those are comes from `blocks.pattern_ranges` of the whole row: its `group_start` /
    `group_last` (packed documents count sinks and groups from each document's start) on the
    all-gathered segment ids, which are `L` ints. The pooled slots
    (`blocks.slot_ends_bound(pattern, C)` per chunk, at most `m` in all) are all-gathered over
    `axis` and put back into the global slot order (a gather of `m` small rows), so every
    row's visible slots are the contiguous range `[core_lo, core_hi)`. cca's sinks (SPEC 6)
    are slots of one token: they live on the shard of the document's start (the first shard
    of an unpacked row) and reach the others with the core tokens.
  * Each chunk then runs the blocked attention of `implementation` (`attention.blocked`: the
    Pallas kernels on GPU / TPU, `xla.blocked_attention` elsewhere) on the virtual sequence
    `[halo (H rows) ++ chunk (C rows)]`: query rows of the halo are zeros that see only keys
    `0 .. r` (finite, discarded; bounds stay non-decreasing as `blocks` requires), chunk row
    `H + i` is the query at position `t = c * C + i`, with `raw_lo(t) - (c * C - H)` and the
    global `core_lo(t), core_hi(t)`, all sliced from `pattern_ranges` (never re-derived here).
    Gradients come from the blocked attention's custom VJP and from JAX's transposes of
    ppermute (halo gradients go back to the previous chunk) and all_gather (reduce-scatter of
    the slots' gradients to their owners).

Layout (`zigzag`):
  * `zigzag=False`: contiguous split, `chunks = n` (the mesh axis size), shard `i` holds rows
    `[i L/n, (i+1) L/n)`. CCA's core work grows along the sequence (1.71x imbalance at 128K on
    8 shards, benchmarks/results/sequence_balance.md).
  * `zigzag=True` (default): `chunks = 2n`, shard `i` holds chunks `i` and `2n - 1 - i`
    (1.001x imbalance). Each shard runs the two chunks separately, so the early chunk never
    walks the late chunk's slots. Halos: chunk `i` gets its halo from shard `i - 1`'s first
    chunk, chunk `2n - 1 - i` from shard `i + 1`'s second chunk (shard `n - 1`: from its own
    first chunk, chunk `n - 1`).
  * `layout="natural"` (default): q, k, v, segment_ids and the output are global arrays in
    natural row order, split contiguously over `axis`; with `zigzag=True` the rows are moved
    to the zigzag assignment and back inside (two chunk-sized ppermutes per array each way).
    `layout="zigzag"`: the arrays are already in zigzag row order (`zigzag_permutation`), and
    so is the output: no rows move. A model that keeps its activations in that order (token
    ids, positions, segment ids and labels permuted once per batch; everything but attention
    is per token) pays only the halo and slot traffic.

`full` attention is refused: its raw window is unbounded (ring attention's job). Under `jit`,
`run_attention` on sequence-sharded arrays is correct for it (XLA all-gathers K/V).

`SequenceSharding(mesh, axis, layout)` is how a model asks for this: `run_attention(...,
sequence_sharding=...)` takes this path where `SequenceSharding.splits(pattern)` (the axis has
more than one device and the raw window is bounded) and the plain one otherwise (rows put
back in natural order first when the layout is zigzag).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from cca_jax.attention.pooling import pool_pattern_slots
from cca_jax.attention.backends import blocked_backend
from cca_jax.attention.checks import check_inputs, check_option
from cca_jax.attention.xla import default_blocking
from cca_jax.blocks import (AttentionPattern, pattern_ranges, search_sorted, slot_ends_bound,
                            widest_window)
from cca_jax.sharding import MESH_AXES, logical_spec

__all__ = ["sequence_sharded_attention", "zigzag_permutation", "sequence_layout",
           "SequenceLayout", "SequenceSharding", "has_bounded_window", "halo_rows"]

LAYOUTS = ("natural", "zigzag")


class SequenceLayout(NamedTuple):
    """Static sizes of one sharded call."""
    shards: int        # n: size of the mesh axis
    chunks: int        # 2n (zigzag) or n
    chunk: int         # C = L / chunks rows
    halo: int          # H raw k/v rows each chunk receives from the chunk before it
    slots: int         # m: slots of the row (pattern.max_slots)
    capacity: int      # slots pooled per chunk (static): min(m, blocks.slot_ends_bound)


def zigzag_permutation(length: int, shards: int) -> np.ndarray:
    """Row order of the zigzag layout: `x[:, perm]` puts chunks `i, 2n - 1 - i` (of `2n` equal
    chunks) on shard `i` of a contiguous split; `np.argsort(perm)` undoes it."""
    if length % (2 * shards):
        raise ValueError(f"the zigzag layout cuts L={length} into 2 x {shards} equal chunks; "
                         f"L must be a multiple of {2 * shards}.")
    c = length // (2 * shards)
    order = [ch for i in range(shards) for ch in (i, 2 * shards - 1 - i)]
    return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in order])


def has_bounded_window(pattern: AttentionPattern) -> bool:
    """Whether a query far into a document sees fewer raw keys than its whole prefix (cca,
    sliding, streaming: yes; full: no). Only these can run sequence-sharded with halos."""
    far = np.asarray([1 << 40], np.int64)
    return bool(pattern.raw_start(far)[0] > 0)


@dataclasses.dataclass(frozen=True)
class SequenceSharding:
    """Activations split along the sequence over mesh axis `axis` (hashable, static).

    layout: "natural" (rows in sequence order) or "zigzag" (rows in `zigzag_permutation(L,
    shards)` order: the caller permuted token ids, positions, segment ids and labels once, and
    attention moves no rows but halos and slots).
    """

    mesh: Mesh
    axis: str = "sequence"
    layout: str = "natural"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if self.axis not in self.mesh.shape:
            raise ValueError(f"axis {self.axis!r} is not an axis of the mesh (axes: "
                             f"{tuple(self.mesh.axis_names)}).")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}.")

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]

    def splits(self, pattern: AttentionPattern) -> bool:
        """Whether `pattern` runs sharded (halos and slots) rather than on the plain path."""
        return self.shards > 1 and has_bounded_window(pattern)

    def row_order(self, length: int) -> np.ndarray:
        """Natural position of each row of this layout (`np.arange` when natural)."""
        if self.layout == "zigzag":
            return zigzag_permutation(length, self.shards)
        return np.arange(length)


def halo_rows(pattern: AttentionPattern, length: int, *, packed: bool = False) -> int:
    """Raw k/v rows a chunk needs from the chunk before it: the widest raw window less one,
    and a slot's tokens before its last one (cca: s + g - 2 once a group is pooled)."""
    size = pattern.slot_size
    pooled = pattern.max_slots(length, packed=packed) > 0
    return max(widest_window(pattern, length) - 1, size - 1 if pooled else 0)


def sequence_layout(pattern: AttentionPattern, length: int, shards: int, *,
                    zigzag: bool = True, packed: bool = False) -> SequenceLayout:
    """Chunk, halo and slot sizes; ValueError where the sequence cannot be split this way."""
    if not has_bounded_window(pattern):
        raise ValueError(
            "sequence_sharded_attention takes options with a bounded raw window (cca, "
            "sliding, streaming); attention='full' sees the whole prefix, which needs ring "
            "attention over the full K/V. Run run_attention under jit instead (XLA then "
            "all-gathers K/V), or use cca / sliding / streaming.")
    chunks = 2 * shards if zigzag else shards
    if length % chunks:
        raise ValueError(
            f"sequence length {length} is not a multiple of the {chunks} chunks of "
            f"{'zigzag' if zigzag else 'contiguous'} sharding over {shards} shards; pad the "
            f"sequence to a multiple of {chunks}" + (" or use zigzag=False." if zigzag else "."))
    chunk = length // chunks
    size = pattern.slot_size
    m = pattern.max_slots(length, packed=packed)
    halo = halo_rows(pattern, length, packed=packed)
    if halo > chunk:
        raise ValueError(
            f"attention={pattern.kind!r} (window {pattern.window_size}"
            + (f", group {size}" if pattern.kind == "cca" else "")
            + f") needs the previous {halo} raw keys of every row, more than one chunk of "
            f"{chunk} rows (L={length} / {chunks} chunks): the halo would span several "
            f"neighbours. Use fewer sequence shards, zigzag=False, or a longer sequence.")
    capacity = min(m, slot_ends_bound(pattern, chunk, packed=packed))
    return SequenceLayout(shards, chunks, chunk, halo, m, capacity)


def _without(entry, axis: str):
    """A PartitionSpec entry with mesh axis `axis` taken out (it shards the sequence)."""
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    axes = tuple(a for a in axes if a != axis)
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


# ---- collectives -----------------------------------------------------------------------------

def _zigzag_owner(ch: int, n: int) -> int:
    return ch if ch < n else 2 * n - 1 - ch


def _natural_to_zigzag(x, i, n: int, axis: str):
    """Local rows `[chunk 2i, chunk 2i+1]` -> `[chunk i, chunk 2n-1-i]` (two ppermutes)."""
    c = x.shape[1] // 2
    even = jax.lax.ppermute(x[:, :c], axis, [(s, _zigzag_owner(2 * s, n)) for s in range(n)])
    odd = jax.lax.ppermute(x[:, c:], axis, [(s, _zigzag_owner(2 * s + 1, n)) for s in range(n)])
    # Shard j receives chunk j from the ppermute of its parity and chunk 2n-1-j from the other.
    j_even = i % 2 == 0
    return jnp.where(j_even, even, odd), jnp.where(j_even, odd, even)


def _zigzag_to_natural(first, second, i, n: int, axis: str):
    """Inverse of `_natural_to_zigzag`."""
    j_even = i % 2 == 0
    even = jax.lax.ppermute(jnp.where(j_even, first, second), axis,
                            [(_zigzag_owner(2 * s, n), s) for s in range(n)])
    odd = jax.lax.ppermute(jnp.where(j_even, second, first), axis,
                           [(_zigzag_owner(2 * s + 1, n), s) for s in range(n)])
    return jnp.concatenate([even, odd], axis=1)


def _halos(chunks_kv, i, n: int, axis: str, halo: int, zigzag: bool):
    """The last `halo` rows of (k, v) of each local chunk's natural predecessor."""
    tails = [jax.tree.map(lambda x: x[:, x.shape[1] - halo:], kv) for kv in chunks_kv]
    forward = [(s, s + 1) for s in range(n - 1)]
    first = jax.lax.ppermute(tails[0], axis, forward)    # shard 0 (chunk 0) gets zeros
    if not zigzag:
        return [first]
    backward = jax.lax.ppermute(tails[1], axis, [(s + 1, s) for s in range(n - 1)])
    last = i == n - 1     # chunk n's predecessor is chunk n - 1, this shard's own first
    second = jax.tree.map(lambda own, got: jnp.where(last, own, got), tails[0], backward)
    return [first, second]


# ---- one shard ---------------------------------------------------------------------------------

def _shard(q, k, v, seg, *, pattern: AttentionPattern, pooling: str, lay: SequenceLayout,
           axis: str, zigzag: bool, natural: bool, blocked):
    n, nc, c_len, halo, m, cap = lay
    length = nc * c_len
    i = jax.lax.axis_index(axis)
    b, _, hq, d = q.shape

    # Local chunks and their natural chunk indices.
    if zigzag and natural:
        qs, ks, vs = (_natural_to_zigzag(x, i, n, axis) for x in (q, k, v))
    else:
        qs, ks, vs = (tuple(jnp.split(x, nc // n, axis=1)) for x in (q, k, v))
    chunk_ids = [i, 2 * n - 1 - i] if zigzag else [i]

    # Bounds of the whole row (natural order), from blocks.
    seg_full = None
    if seg is not None:
        seg_full = jax.lax.all_gather(seg, axis, axis=1, tiled=True)
        if zigzag and not natural:   # gathered rows are [chunk 0, 2n-1, 1, 2n-2, ...]
            pairs = seg_full.reshape(b, n, 2, c_len)
            seg_full = jnp.concatenate([pairs[:, :, 0], pairs[:, ::-1, 1]],
                                       axis=1).reshape(b, length)
    ranges = pattern_ranges(pattern, length, seg_full)
    raw_lo, core_lo, core_hi = (jnp.broadcast_to(x, (b, length)).astype(jnp.int32)
                                for x in (ranges.raw_lo, ranges.core_lo, ranges.core_hi))

    # Virtual sequences [halo ++ chunk]; halo queries are zeros.
    if halo:
        halos = _halos(list(zip(ks, vs)), i, n, axis, halo, zigzag)
        ks = [jnp.concatenate([hk, x], axis=1) for (hk, _), x in zip(halos, ks)]
        vs = [jnp.concatenate([hv, x], axis=1) for (_, hv), x in zip(halos, vs)]
        qs = [jnp.concatenate([jnp.zeros((b, halo, hq, d), q.dtype), x], axis=1) for x in qs]
    offsets = [ch * c_len - halo for ch in chunk_ids]   # position of virtual row 0

    # Slots: each chunk pools those whose last token is in its rows; all-gather; global order.
    if m:
        slot = jnp.arange(m, dtype=jnp.int32)
        if ranges.group_start is None:
            starts = jnp.broadcast_to(pattern.slot_first(slot), (b, m))
            lasts = jnp.broadcast_to(pattern.slot_last(slot), (b, m))
        else:
            starts, lasts = (x.astype(jnp.int32) for x in (ranges.group_start, ranges.group_last))
        real = slot < core_hi[:, length - 1:]          # the last row sees every slot of its doc
        ends = jnp.where(real, lasts, length)          # non-decreasing
        chunk_starts = jnp.arange(nc, dtype=jnp.int32) * c_len
        before = jax.vmap(lambda e: search_sorted(e, chunk_starts, side="left"))(ends)
        pooled = []
        for ch, off, qx, kx, vx in zip(chunk_ids, offsets, qs, ks, vs):
            mine = jnp.take(before, ch, axis=1)[:, None] + jnp.arange(cap, dtype=jnp.int32)
            idx = jnp.minimum(mine, m - 1)
            own = (mine < m) & (jnp.take_along_axis(ends, idx, 1) < (ch + 1) * c_len)
            local = jnp.where(own, jnp.take_along_axis(starts, idx, 1) - off, 0)
            local_last = local + jnp.take_along_axis(lasts - starts, idx, 1)
            pooled.append(pool_pattern_slots(qx, kx, vx, pattern, cap, pooling=pooling,
                                             group_start=local, group_last=local_last))
        ck_loc, cv_loc = (jnp.concatenate(x, axis=1) for x in zip(*pooled))
        ck_all, cv_all = (jax.lax.all_gather(x, axis, axis=1, tiled=True)
                          for x in (ck_loc, cv_loc))
        # Gathered order: shard-major, then local chunk, then the chunk's slots.
        ch_of = jnp.minimum(ends // c_len, nc - 1)
        pos = jnp.where(ch_of < n, 2 * ch_of, 2 * (2 * n - 1 - ch_of) + 1) if zigzag else ch_of
        gather = pos * cap + slot - jnp.take_along_axis(before, ch_of, 1)
        gather = jnp.where(real, gather, 0)[:, :, None, None]
        ck = jnp.take_along_axis(ck_all, gather, axis=1)
        cv = jnp.take_along_axis(cv_all, gather, axis=1)
    else:
        ck = jnp.zeros((b, 0, hq, d), k.dtype)
        cv = jnp.zeros((b, 0, hq, d), v.dtype)

    blocking = default_blocking(halo + c_len, m, d)
    window = max(widest_window(pattern, length), halo + 1)   # halo rows see keys 0 .. r
    pad = jnp.zeros((b, halo), jnp.int32)
    outs = []
    for ch, off, qx, kx, vx in zip(chunk_ids, offsets, qs, ks, vs):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, ch * c_len, c_len, 1)  # noqa: E731
        rlo = jnp.concatenate([pad, rows(raw_lo) - off], axis=1)
        lo = jnp.concatenate([pad, rows(core_lo)], axis=1)
        hi = jnp.concatenate([pad, rows(core_hi)], axis=1)
        outs.append(blocked(qx, kx, vx, ck, cv, rlo, lo, hi, blocking, window)[:, halo:])
    if zigzag and natural:
        return _zigzag_to_natural(outs[0], outs[1], i, n, axis)
    return jnp.concatenate(outs, axis=1)


def sequence_sharded_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                               pattern: AttentionPattern, *, mesh: Mesh,
                               axis: str = "sequence", segment_ids: jax.Array | None = None,
                               pooling: str = "cca", zigzag: bool = True,
                               layout: str = "natural", implementation: str = "auto"
                               ) -> jax.Array:
    """`run_attention(q, k, v, pattern, segment_ids=..., pooling=...)` with the sequence
    sharded over mesh axis `axis` (module docstring): halos by ppermute, slots all-gathered.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]` (global arrays); segment_ids: optional
    `[B, L]` ints (packed documents). mesh: from `sharding.make_mesh`; batch and heads are
    split as `sharding.logical_spec` says for the logical axes "batch" and "heads" (where
    they divide them, else replicated), the sequence over `axis`. layout: "natural" or
    "zigzag" (rows already in `zigzag_permutation` order, output likewise; needs
    zigzag=True). implementation: what each chunk runs (`backends.blocked_backend`; "auto":
    the Pallas kernels on GPU / TPU). Returns `[B, L, Hq, D]` in q's dtype, in the rows'
    layout.
    """
    check_inputs(q, k, v, segment_ids)
    check_option(pattern, pooling)
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    missing = [a for a in MESH_AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"the mesh lacks the axes {missing}; build it with "
                         f"cca_jax.sharding.make_mesh (axes {MESH_AXES}).")
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh (axes: "
                         f"{tuple(mesh.axis_names)}).")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    if layout == "zigzag" and not zigzag:
        raise ValueError("layout='zigzag' (rows already in zigzag order) needs zigzag=True.")
    b, length, hq, _ = q.shape
    hkv = k.shape[2]
    lay = sequence_layout(pattern, length, mesh.shape[axis], zigzag=zigzag,
                          packed=segment_ids is not None)

    spec = logical_spec(("batch", None, "heads", None), (b, length, hkv, q.shape[3]), mesh)
    batch, heads = _without(spec[0], axis), _without(spec[2], axis)
    x_spec = PartitionSpec(batch, axis, heads, None)
    seg_spec = PartitionSpec(batch, axis)
    # check_vma=False: blocked_attention's loops start from unsharded zeros (an invariant
    # carry that the body makes varying); the per-shard program is the same either way.
    backend = blocked_backend(implementation, pattern, head_dim=q.shape[-1], dtype=q.dtype)
    body = functools.partial(_shard, pattern=pattern, pooling=pooling, lay=lay, axis=axis,
                             zigzag=zigzag, natural=layout == "natural",
                             blocked=backend.blocked)
    if segment_ids is None:
        fn = jax.shard_map(lambda q_, k_, v_: body(q_, k_, v_, None), mesh=mesh,
                           in_specs=(x_spec, x_spec, x_spec), out_specs=x_spec,
                           check_vma=False)
        return fn(q, k, v)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, seg_spec),
                       out_specs=x_spec, check_vma=False)
    return fn(q, k, v, segment_ids)
