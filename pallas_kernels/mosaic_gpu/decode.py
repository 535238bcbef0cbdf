"""Decode attention against the KV cache as a Mosaic GPU kernel (sm_90: wgmma, TMA, mbarriers).

Same contract as `pallas_kernels.gpu.decode.decode_attention_pallas_gpu` (the Triton one):
one query per row (`[B, Hq, D]`) attends with one float32 softmax to the visible ring
entries `(ring_first + i) % R`, `i < ring_count` (`[.., B, R, Hkv, D]`, per KV head) and the
visible slots `[0, num_slots)` (`[.., B, C, Hq, D]`, per query head) given by
`cca_jax.blocks.decode_bounds`; the cache may be stacked over layers (`layer=`).

Built for bandwidth (decode is memory-bound), split over the context like flash-decoding:
  attention  grid (KV head, split, row). A program serves ALL G = Hq / Hkv query heads of
             its KV head: the G queries are rows of a 64-row tile (wgmma's M, rows >= G
             zero), so each ring block is read from memory once per KV head (the Triton
             kernel reads it once per query head and leans on L2). Every step brings
             `block` key rows and `block` value rows into shared memory by TMA, through a
             ring of `stages` buffers (copies for step i + stages are issued as step i ends;
             with `early_keys` its keys' as soon as step i's scores are made):
               ring step  `block` entries of the KV head (one 2-D copy each of K and V);
               slot step  `block / G'` slots of each of the G query heads (G copies each), so
                          that key row `g * block/G' + j` belongs to head g: S = Q K^T on
                          wgmma gives every head's scores in its own row, the others masked,
                          and P V sums only a head's own slots into its row. G' = `lanes(G)`
                          is G rounded up to a power of two (block / G' whole 8-row
                          tiles); lanes past G hold a copy of the last head's slots (finite
                          values: a masked score times a non-finite value would still be
                          NaN) and their rows are dropped.
             So all steps cost the same bytes and one wgmma shape serves both. The row's
             steps (ring blocks, then slot blocks) are shared equally among the splits;
             each program writes its unnormalised partial (acc, running max in log2 units,
             sum).
  merge      the exact softmax over the splits' partials, in XLA (a few small fusions: the
             partials are ~1% of the bytes the attention kernel reads).
A block never crosses the end of the ring or the slots: the last one starts earlier
(`min(j * block, N - block)`) and masks what the previous block already covered, so no copy
reads out of bounds (caches smaller than a block are zero-padded in XLA: tiny by definition).
Invisible entries inside a visited block are read and masked by score (p = 0), so they must
be finite, as a `KVCache`'s are (zero-initialised, then written); the Triton kernel masks
its loads instead. Notes, limits and measurements to make: DECODE-NOTES.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from cca_jax.blocks import DecodeBounds
from pallas_kernels.mosaic_gpu.decode_config import (DTYPES, HEAD_DIMS, MosaicDecodeConfig,
                                                    check_shapes, decode_config, gpu_slots,
                                                    lanes, query_rows, resolve_splits)
from pallas_kernels.mosaic_gpu.interpret import interpret_params
from pallas_kernels.mosaic_gpu.pipeline import smem_transforms
from pallas_kernels.shapes import check_decode_inputs

_LOG2E = math.log2(math.e)
_MAX_INIT = -1e30                 # running max of a program that saw nothing


def _layouts(interpreted: bool, transposed: bool = False):
    """(tile, vector) layout casts of WGMMA tiles and their per-query vectors (per row, or
    per column when `transposed`); identities in the GPU interpreter (it runs arrays without
    layouts)."""
    if interpreted:
        return (lambda x: x), (lambda x: x)
    return (functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA),
            functools.partial(plgpu.layout_cast,
                              new_layout=plgpu.Layout.WGMMA.reduce(0 if transposed else 1)))


def _kernel(layer_ref, first_ref, count_ref, slots_ref, q_ref, k_ref, v_ref, ck_ref, cv_ref,
            acc_ref, ml_ref, q_smem, q_bar, ring_bar, slot_bar, *, ring: int, num_slots_cap: int,
            ring_rows: int, slot_rows: int, groups: int, splits: int,
            cfg: MosaicDecodeConfig, scale: float, interpreted: bool):
    """One (KV head, split, row): the split's share of the row's steps (module docstring).
    The K/V buffers and the float32 output tile are scoped one after the other, so that
    they share shared memory."""
    d = q_ref.shape[-1]
    transforms = smem_transforms(d, jnp.dtype(k_ref.dtype).itemsize)
    buffers = [plgpu.SMEM((cfg.stages, cfg.block, d), k_ref.dtype, transforms=transforms)] * 2
    rows = query_rows(cfg)
    if cfg.keys_along_rows:   # V^T and P as one wgmma's operands: their swizzles must match
        narrow = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
        buffers = [buffers[0],
                   plgpu.SMEM((cfg.stages, cfg.block, d), k_ref.dtype, transforms=narrow),
                   plgpu.SMEM((cfg.block, rows), k_ref.dtype, transforms=narrow)]
    attend = functools.partial(
        _attend, layer_ref, first_ref, count_ref, slots_ref, q_ref, k_ref, v_ref, ck_ref,
        cv_ref, q_smem, q_bar, ring_bar, slot_bar, ring=ring, num_slots_cap=num_slots_cap,
        ring_rows=ring_rows, slot_rows=slot_rows, groups=groups, splits=splits, cfg=cfg,
        scale=scale, interpreted=interpreted)
    acc, m_i, l_i = pl.run_scoped(attend, *buffers)
    batch, kvh, split = (lax.axis_index(n) for n in ("batch", "kv_heads", "splits"))

    def write(o_smem, ml_smem):
        o_smem[...] = acc
        ml_smem.at[0][...] = m_i
        ml_smem.at[1][...] = l_i
        plgpu.commit_smem()
        out = o_smem if cfg.keys_along_rows else o_smem.at[pl.ds(0, groups)]
        plgpu.copy_smem_to_gmem(out, acc_ref.at[batch, kvh, split])
        plgpu.copy_smem_to_gmem(ml_smem, ml_ref.at[batch, kvh, split])
        plgpu.wait_smem_to_gmem(0)
    tile = (d, rows) if cfg.keys_along_rows else (rows, d)
    pl.run_scoped(write, plgpu.SMEM(tile, jnp.float32), plgpu.SMEM((2, rows), jnp.float32))


def _attend(layer_ref, first_ref, count_ref, slots_ref, q_ref, k_ref, v_ref, ck_ref, cv_ref,
            q_smem, q_bar, ring_bar, slot_bar, k_smem, v_smem, p_smem=None, *, ring: int,
            num_slots_cap: int, ring_rows: int, slot_rows: int, groups: int, splits: int,
            cfg: MosaicDecodeConfig, scale: float, interpreted: bool):
    """The pipelined walk over the split's steps: its (acc, max, sum), per query row (acc
    `[64, D]`), or with keys_along_rows per column (acc `[D, 16]`; `p_smem` P's tile)."""
    bk, stages = cfg.block, cfg.stages
    per_head = bk // lanes(groups)                           # slots of one head per step
    batch, kvh, split = (lax.axis_index(n) for n in ("batch", "kv_heads", "splits"))
    transposed = cfg.keys_along_rows
    as_tile, as_rows = _layouts(interpreted, transposed)
    queries = query_rows(cfg)
    # A score tile: [query rows, keys], or transposed [keys, query columns].
    shape, key_dim = ((bk, queries), 0) if transposed else ((queries, bk), 1)
    query_dim = 1 - key_dim
    # The row's bounds and the layer, clipped into the cache: no copy reads outside it.
    first = jnp.clip(first_ref[batch], 0, ring - 1)
    count = jnp.clip(count_ref[batch], 1, ring)
    num_slots = jnp.clip(slots_ref[batch], 0, num_slots_cap)
    layer = jnp.clip(layer_ref[0], 0, k_ref.shape[0] - 1)

    # The row's steps: ring blocks rb0 .. rb0 + n_ring (all of them when the visible entries
    # wrap past the ring's end), then slot blocks 0 .. n_slot.
    ring_blocks = -(-ring_rows // bk)
    wraps = first + count > ring
    rb0 = jnp.where(wraps, 0, lax.div(first, jnp.int32(bk)))
    n_ring = jnp.where(wraps, ring_blocks, lax.div(first + count - 1, jnp.int32(bk)) + 1 - rb0)
    n_slot = lax.div(num_slots + per_head - 1, jnp.int32(per_head))
    n_all = n_ring + n_slot
    per = lax.div(n_all + splits - 1, jnp.int32(splits))
    s0 = jnp.minimum(split * per, n_all)
    s1 = jnp.minimum(s0 + per, n_all)

    def copy(step, buf, parts=("k", "v")):
        """Issue the copies of the row's step `step` into buffer `buf`: its keys ("k"), its
        values ("v") or both (each arrives on the step's barrier, whenever issued)."""
        @pl.when(step < n_ring)
        def _():
            start = jnp.minimum((rb0 + step) * bk, ring_rows - bk)
            rows = (layer, batch, pl.ds(start, bk), kvh)
            for part, src, dst in (("k", k_ref, k_smem), ("v", v_ref, v_smem)):
                if part in parts:
                    plgpu.copy_gmem_to_smem(src.at[rows], dst.at[buf], ring_bar.at[buf])

        @pl.when(step >= n_ring)
        def _():
            start = jnp.minimum((step - n_ring) * per_head, slot_rows - per_head)
            for g in range(lanes(groups)):
                head = kvh * groups + min(g, groups - 1)   # spare lanes: the last head again
                if cfg.slot_layout == "bchd":
                    rows = (layer, batch, pl.ds(start, per_head), head)
                else:
                    rows = (layer, batch, head, pl.ds(start, per_head))
                dst = (buf, pl.ds(g * per_head, per_head))
                for part, src, smem in (("k", ck_ref, k_smem), ("v", cv_ref, v_smem)):
                    if part in parts:
                        plgpu.copy_gmem_to_smem(src.at[rows], smem.at[dst], slot_bar.at[buf])

    plgpu.copy_gmem_to_smem(q_ref.at[batch, kvh], q_smem, q_bar)
    for i in range(stages):                                   # fill the pipeline
        @pl.when(s0 + i < s1)
        def _():
            copy(s0 + i, i)

    c = scale * _LOG2E
    dtype = k_smem.dtype

    def iota(dim):
        return as_tile(lax.broadcasted_iota(jnp.int32, shape, dim))

    def ring_visible(j):
        nominal = (rb0 + j) * bk
        entry = iota(key_dim) + jnp.minimum(nominal, ring_rows - bk)
        offset = entry - first
        offset = jnp.where(offset < 0, offset + ring, offset)
        return (entry >= nominal) & (entry < ring) & (offset < count)

    def ring_whole(j):
        """Whether every entry of ring step j's block is visible (scalar)."""
        nominal = (rb0 + j) * bk
        offset = nominal - first
        offset = jnp.where(offset < 0, offset + ring, offset)
        return ((nominal <= ring_rows - bk) & (nominal + bk <= ring)
                & ((count >= ring) | (offset + bk <= count)))

    def lanes_visible():
        """Each query's own lane of a slot step (the tile's keys of its query head)."""
        row0 = iota(query_dim) * per_head
        return (iota(key_dim) >= row0) & (iota(key_dim) < row0 + per_head)

    def slot_visible(j):
        nominal = j * per_head
        row0 = iota(query_dim) * per_head           # the query's head's first key row
        col = iota(key_dim)
        slot = col - row0 + jnp.minimum(nominal, slot_rows - per_head)
        return (col >= row0) & (col < row0 + per_head) & (slot >= nominal) & (slot < num_slots)

    def slot_whole(j):
        """Whether slot step j's block holds only visible slots in each lane (scalar)."""
        nominal = j * per_head
        return (nominal <= slot_rows - per_head) & (nominal + per_head <= num_slots)

    def masked(sc, visible, whole, lane_mask):
        """The scores with invisible keys at -inf: by the tile `visible()`, or with
        `edge_masks_only`, where the scalar `whole()` holds, by the tile `lane_mask()` (None:
        no mask) instead."""
        edge = lambda s: jnp.where(visible(), s, -jnp.inf)
        if not cfg.edge_masks_only:
            return edge(sc)
        inner = (lambda s: s) if lane_mask is None else (
            lambda s: jnp.where(lane_mask(), s, -jnp.inf))
        return lax.cond(whole(), inner, edge, sc)

    def step(i, carry, bar, visible, whole, lane_mask=None):
        """Step i of the row (buffer (i - s0) % stages), then the copies of step i + stages;
        its scores `masked(sc, visible, whole, lane_mask)`."""
        acc, m_i, l_i = carry
        buf = lax.rem(i - s0, jnp.int32(stages))
        plgpu.barrier_wait(bar.at[buf])
        a, b = (k_smem.at[buf], q_smem) if transposed else (q_smem, k_smem.at[buf])
        if interpreted:   # no transposed wgmma operand there: a plain product
            sc = lax.dot_general(a[...], b[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        else:
            def scores(acc_ref):
                plgpu.wgmma(acc_ref, a, b.transpose((1, 0)))
                return acc_ref[...]
            sc = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
        if cfg.early_keys:   # the scores have read this buffer's keys
            @pl.when(i + stages < s1)
            def _():
                copy(i + stages, buf, ("k",))
        sc = masked(sc, visible, whole, lane_mask)
        m_new = jnp.maximum(m_i, sc.max(axis=key_dim) * c)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(sc * c - lax.broadcast_in_dim(m_new, shape, [query_dim]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1 if transposed else 0])
        l_i = l_i * alpha + p.sum(axis=key_dim)
        p16 = p.astype(dtype)
        if transposed:    # O^T += V^T P: P through shared memory (wgmma's B)
            p_smem[...] = p16
            plgpu.commit_smem()
            if interpreted:
                acc = acc + lax.dot_general(v_smem.at[buf][...], p_smem[...],
                                            (((0,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
            else:
                def values_t(acc_ref):
                    plgpu.wgmma(acc_ref, v_smem.at[buf].transpose((1, 0)), p_smem)
                acc = pl.run_state(values_t)(plgpu.ACC.init(acc))   # the buffers are free
        elif interpreted:
            acc = acc + jnp.dot(p16, v_smem.at[buf][...], preferred_element_type=jnp.float32)
        else:
            def values(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[buf])
            acc = pl.run_state(values)(plgpu.ACC.init(acc))   # waits: the buffer is free

        @pl.when(i + stages < s1)
        def _():
            copy(i + stages, buf, ("v",) if cfg.early_keys else ("k", "v"))
        return acc, m_new, l_i

    d = q_ref.shape[-1]
    carry = (as_tile(jnp.zeros((d, queries) if transposed else (queries, d), jnp.float32)),
             as_rows(jnp.full((queries,), _MAX_INIT, jnp.float32)),
             as_rows(jnp.zeros((queries,), jnp.float32)))
    plgpu.barrier_wait(q_bar)
    ring_end = jnp.minimum(s1, n_ring)
    carry = lax.fori_loop(s0, ring_end, lambda i, cr: step(
        i, cr, ring_bar, lambda: ring_visible(i), lambda: ring_whole(i)), carry)
    carry = lax.fori_loop(jnp.maximum(s0, n_ring), s1, lambda i, cr: step(
        i, cr, slot_bar, lambda: slot_visible(i - n_ring), lambda: slot_whole(i - n_ring),
        None if lanes(groups) == 1 else lanes_visible), carry)
    return carry


def _partials(layer, bounds, q_rows, k_ring, v_ring, ck, cv, *, ring: int, num_slots: int,
              groups: int, splits: int, cfg: MosaicDecodeConfig, interpret):
    """Partials: acc `[B, Hkv, splits, G, D]`, (max, sum) `[B, Hkv, splits, 2, 64]` f32;
    with keys_along_rows acc `[B, Hkv, splits, D, 16]`, (max, sum) `[.., 2, 16]`.
    layer: int32 `[1]`; bounds: three int32 `[B]` (clipped in the kernel)."""
    b, hkv, rows, d = q_rows.shape
    slot_axis = 2 if cfg.slot_layout == "bchd" else 3
    transforms = smem_transforms(d, k_ring.dtype.itemsize)
    scratch = (
        plgpu.SMEM((rows, d), k_ring.dtype, transforms=transforms),        # queries
        plgpu.Barrier(),                                                    # queries landed
        plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),             # ring K, V landed
        plgpu.Barrier(num_arrivals=2 * lanes(groups), num_barriers=cfg.stages),  # slots
    )
    kernel = functools.partial(
        _kernel, ring=ring, num_slots_cap=num_slots, ring_rows=k_ring.shape[2],
        slot_rows=ck.shape[slot_axis],
        groups=groups, splits=splits, cfg=cfg, scale=1.0 / math.sqrt(d),
        interpreted=interpret is not None)
    acc = (d, rows) if cfg.keys_along_rows else (groups, d)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((b, hkv, splits, *acc), jnp.float32),
                  jax.ShapeDtypeStruct((b, hkv, splits, 2, rows), jnp.float32)),
        scratch_types=scratch,
        grid=(hkv, splits, b),
        grid_names=("kv_heads", "splits", "batch"),
        kernel_name="cca_decode",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(layer, *bounds, q_rows, k_ring, v_ring, ck, cv)


def _merge(acc, ml, out_dtype, groups: int, transposed: bool = False):
    """`[B, Hq, D]`: the softmax over the splits (every row sees its own key: the largest
    running max is finite). `transposed`: keys_along_rows' partials `[.., D, 16]`."""
    if transposed:
        acc = jnp.swapaxes(acc, -1, -2)[..., :groups, :]
    b, hkv, _, _, d = acc.shape
    m, l = ml[:, :, :, 0, :groups], ml[:, :, :, 1, :groups]          # [B, Hkv, S, G]
    w = jnp.exp2(m - jnp.max(m, axis=2, keepdims=True))
    out = jnp.sum(w[..., None] * acc, axis=2) / jnp.maximum(jnp.sum(w * l, axis=2), 1e-30)[
        ..., None]
    return out.reshape(b, hkv * groups, d).astype(out_dtype)


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] >= size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _tile_rows(size: int, block: int) -> int:
    """Rows a cache axis of `size` entries is padded to: at least one block of `block`,
    whole 8-row tiles (the TMA copies' tiling)."""
    return max(block, -(-size // 8) * 8)


def decode_partials(q, k_ring, v_ring, ck, cv, layer, bounds, cfg: MosaicDecodeConfig,
                    stacked: bool, interpret=None):
    """Checked inputs (cache arrays `[L, B, ...]` when `stacked`, else `[B, ...]`) -> the
    attention kernel's partials (`_partials`), before the merge (benchmarks time both)."""
    if not stacked:
        k_ring, v_ring, ck, cv = (x[None] for x in (k_ring, v_ring, ck, cv))
    b, hq, d = q.shape
    ring, hkv = k_ring.shape[2], k_ring.shape[3]
    groups = hq // hkv
    slot_axis = 2 if cfg.slot_layout == "bchd" else 3
    num_slots = ck.shape[slot_axis]
    # Zero-padded (never visible): caches smaller than one block (a few KiB), and a ring or
    # slot count that is not whole 8-row TMA tiles (a copy of the stacked cache each step, 2.9
    # ms of 9.3 at 7B 128K on an H100: a `KVCache` allocates its slots in whole tiles,
    # `kv_cache.slot_capacity`; its ring is s + g).
    k_ring, v_ring = (_pad_axis(x, 2, _tile_rows(ring, cfg.block)) for x in (k_ring, v_ring))
    ck, cv = (_pad_axis(x, slot_axis, _tile_rows(num_slots, cfg.block // lanes(groups)))
              for x in (ck, cv))
    bounds = [jnp.asarray(x).astype(jnp.int32) for x in bounds]   # no-ops on int32
    layer = jnp.asarray(layer).astype(jnp.int32).reshape(1)
    q_rows = _pad_axis(q.astype(k_ring.dtype).reshape(b, hkv, groups, d), 2, query_rows(cfg))
    splits = resolve_splits(cfg, b, hkv, ring, num_slots, groups,
                            gpu_slots(cfg, d, k_ring.dtype.itemsize))
    return _partials(layer, bounds, q_rows, k_ring, v_ring, ck, cv, ring=ring,
                     num_slots=num_slots, groups=groups, splits=splits, cfg=cfg,
                     interpret=interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "stacked", "out_dtype", "interpret"))
def decode_attention(q, k_ring, v_ring, ck, cv, layer, bounds, cfg: MosaicDecodeConfig,
                     stacked: bool, out_dtype=jnp.float32, interpret=None):
    """Checked inputs -> `[B, Hq, D]` in `out_dtype`: the attention kernel and the merge,
    in one jit."""
    acc, ml = decode_partials(q, k_ring, v_ring, ck, cv, layer, bounds, cfg, stacked,
                              interpret)
    return _merge(acc, ml, out_dtype, q.shape[1] // k_ring.shape[-2], cfg.keys_along_rows)


def decode_attention_mosaic_gpu(q, k_ring, v_ring, ck, cv, bounds, *, layer=None,
                                out_dtype=jnp.float32, interpret=None, **tiling):
    """`decode_attention_pallas_gpu`'s contract through the Mosaic GPU kernel (sm_90).

    q: `[B, Hq, D]`. k_ring, v_ring: `[B, R, Hkv, D]` (query head h uses KV head
    h // (Hq / Hkv)). ck, cv: `[B, C, Hq, D]` (C may be 0), or `[B, Hq, C, D]` with
    `slot_layout="bhcd"`. bounds: `cca_jax.blocks.decode_bounds(pattern, t, R, C)`
    (`DecodeBounds` or a 3-tuple of int `[B]`). layer: with it, the four cache arrays are
    the stacked `[L, B, ...]` ones of `KVCache`, read in place at layer `layer` (int or int
    scalar, traced or not). bfloat16 or float16, one dtype; D in `HEAD_DIMS` (the cache is
    stored at the model's D: others go to implementation='pallas_gpu' or 'xla').
    Invisible ring entries and slots must be finite (module docstring).
    tiling: `MosaicDecodeConfig` fields (block, stages, splits, slot_layout) over the
    defaults for D and G (`decode_config`). interpret:
    None/False compiles for the GPU (lowers for "cuda" anywhere); True (or an
    `InterpretGPUParams`) runs jax's GPU interpreter on the CPU (tiny shapes only).
    """
    d = q.shape[-1]
    cfg = decode_config(head_dim=d, groups=q.shape[1] // max(k_ring.shape[-2], 1), **tiling)
    b, hq, d, hkv = check_decode_inputs(q, k_ring, v_ring, ck, cv, bounds,
                                        stacked=layer is not None, slot_layout=cfg.slot_layout)
    if d not in HEAD_DIMS:
        raise ValueError(f"the Mosaic GPU decode kernel supports head_dim in {HEAD_DIMS}, got "
                         f"{d}; use implementation='pallas_gpu' or 'xla'.")
    dtypes = {jnp.dtype(jnp.result_type(x)) for x in (k_ring, v_ring, ck, cv)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise ValueError(f"the Mosaic GPU decode kernel takes a bfloat16 or float16 cache of "
                         f"one dtype, got {sorted(str(x) for x in dtypes)}; use "
                         f"implementation='pallas_gpu' (any float dtype) or 'xla'.")
    check_shapes(cfg, hq // hkv, d, next(iter(dtypes)).itemsize)
    return decode_attention(q, k_ring, v_ring, ck, cv, 0 if layer is None else layer,
                            DecodeBounds(*bounds), cfg, layer is not None,
                            jnp.dtype(out_dtype), interpret_params(interpret))
