"""Decode attention against the KV cache on TPU: one query per row, ring and slots.

Same result as `cca_jax.decode.cached_attention` (float32 out), with the visible sets given as
per-row bounds (`cca_jax.blocks.decode_bounds` of the rows' positions: ring entries
`(ring_first + i) % R` for `i < ring_count`, slots `[0, num_slots)`) instead of masks.

Grid `(batch, KV head, step)`: the G query heads of a KV head are the rows of one tile, so each
ring block is read once per KV head. Steps `0 .. ring_steps-1` walk the ring blocks holding
visible entries, then the slot blocks holding visible slots (a slot tile is `[block_c, G*D]`:
the G heads' slots side by side, one `[1, D] x [D, block_c]` product per head), from the
scalar-prefetched table `blocks.decode_block_visits`; steps past a row's walk repeat the last
block index (no copy) and are skipped. A block overhanging the ring's or the slots' end reads
entries no row sees: they are masked and their values zeroed (the overhang may hold NaN).

The cache may be passed stacked over layers (`[L, B, ...]`, `KVCache`) with a `layer` index:
it is scalar-prefetched and selects the layer in the index maps, so nothing is sliced or
copied out of the stacked cache.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cca_jax import blocks
from cca_jax.blocks import DecodeBounds
from pallas_kernels.shapes import check_decode_inputs as check_decode_contract
from pallas_kernels.tpu.common import (LANES, MASKED, KernelConfig, clamp_visit,
                                       compiler_params, dot_nt, iota, online_softmax_step)

TABLE_FIELDS = 6   # blocks.decode_block_visits


class DecodeWalk(NamedTuple):
    ring: int
    num_slots: int
    block_r: int
    block_c: int
    ring_steps: int
    slot_steps: int        # 0: no slots (full, sliding), slot inputs left out
    groups: int
    head_dim: int
    scale: float


def _fields(tables, b):
    base = 1 + b * TABLE_FIELDS
    return tuple(tables[base + f] for f in range(TABLE_FIELDS))


def _kernel(tables_ref, q_ref, k_ref, v_ref, *refs, walk: DecodeWalk):
    if walk.slot_steps:
        ck_ref, cv_ref, *refs = refs
    o_ref, m_ref, l_ref, acc_ref = refs
    b, j = pl.program_id(0), pl.program_id(2)
    first, count, num_slots, ring_block_first, ring_blocks, slot_blocks = _fields(tables_ref, b)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...]
    g, br, bc, d = walk.groups, walk.block_r, walk.block_c, walk.head_dim

    @pl.when(j < ring_blocks)
    def _():
        e0 = (ring_block_first + j) * br
        visible = blocks.ring_entry_visible(iota((g, br), 1, e0), first, count, walk.ring)
        kept = blocks.ring_entry_visible(iota((br, 1), 0, e0), first, count, walk.ring)
        values = jnp.where(kept, v_ref[...], 0).astype(v_ref.dtype)
        online_softmax_step(dot_nt(q, k_ref[...]) * walk.scale, visible, values,
                            m_ref, l_ref, acc_ref)

    if walk.slot_steps:
        step = j - walk.ring_steps

        @pl.when((step >= 0) & (step < slot_blocks))
        def _():
            c0 = step * bc
            visible = iota((1, bc), 1, c0) < num_slots
            keys = ck_ref[...]
            values = jnp.where(iota((bc, 1), 0, c0) < num_slots, cv_ref[...], 0)
            values = values.astype(cv_ref.dtype)
            for head in range(g):
                cols = slice(head * d, (head + 1) * d)
                scores = dot_nt(q[head:head + 1], keys[:, cols]) * walk.scale
                online_softmax_step(scores, visible, values[:, cols], m_ref, l_ref, acc_ref,
                                    rows=slice(head, head + 1))

    @pl.when(j == walk.ring_steps + walk.slot_steps - 1)
    def _():
        o_ref[...] = acc_ref[...] / l_ref[...]


def _decode(walk: DecodeWalk, cfg: KernelConfig, tables, q, k_ring, v_ring, ck, cv):
    """q `[B, Hkv, G, D]`; ring `[L, B, R, Hkv*D]`; slots `[L, B, C, Hq*D]` -> `[B, Hkv, G, D]`."""
    b, hkv, g, d = q.shape
    nr = -(-walk.ring // walk.block_r)
    nc = max(-(-walk.num_slots // walk.block_c), 1)

    def ring_block(bb, j, t):
        first, _, _, block_first, ring_blocks, _ = _fields(t, bb)
        return clamp_visit(block_first, block_first + ring_blocks, j, nr)

    def slot_block(bb, j, t):
        slot_blocks = _fields(t, bb)[5]
        return clamp_visit(0, slot_blocks, jnp.maximum(j - walk.ring_steps, 0), nc)

    rows = pl.BlockSpec((None, None, g, d), lambda bb, h, j, t: (bb, h, 0, 0))
    ring = pl.BlockSpec((None, None, walk.block_r, d),
                        lambda bb, h, j, t: (t[0], bb, ring_block(bb, j, t), h))
    in_specs, inputs = [rows, ring, ring], [q, k_ring, v_ring]
    if walk.slot_steps:
        slot = pl.BlockSpec((None, None, walk.block_c, g * d),
                            lambda bb, h, j, t: (t[0], bb, slot_block(bb, j, t), h))
        in_specs += [slot, slot]
        inputs += [ck, cv]
    return pl.pallas_call(
        functools.partial(_kernel, walk=walk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, hkv, walk.ring_steps + walk.slot_steps),
            in_specs=in_specs, out_specs=rows,
            scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                            pltpu.VMEM((g, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        compiler_params=compiler_params(cfg, ("parallel", "parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="cca_tpu_decode",
    )(tables, *inputs)


def _block(size: int, preferred: int) -> int:
    """The whole axis when it fits one block (a full dim needs no (8, 128) alignment), else
    `preferred` (a multiple of 128; the last block may overhang)."""
    return size if size <= preferred else preferred


def decode_attention(q, k_ring, v_ring, ck, cv, bounds: DecodeBounds, layer, cfg: KernelConfig):
    """The kernel on checked inputs: ring `[L, B, R, Hkv, D]`, slots `[L, B, C, Hq, D]`."""
    b, hq, d = q.shape
    _, _, ring, hkv, _ = k_ring.shape
    num_slots = ck.shape[2]
    block_r = _block(ring, cfg.decode_block_k)
    block_c = _block(max(num_slots, 1), cfg.decode_block_c)
    walk = DecodeWalk(ring, num_slots, block_r, block_c, -(-ring // block_r),
                      -(-num_slots // block_c) if num_slots else 0, hq // hkv, d,
                      1.0 / math.sqrt(d))
    table = blocks.decode_block_visits(bounds, ring, block_r, block_c)
    tables = jnp.concatenate([jnp.asarray(layer, jnp.int32).reshape(1), table.reshape(-1)])
    def flat(x):   # [L, B, N, H, D] -> [L, B, N, H*D]; slots may be absent (C = 0)
        return x.reshape(*x.shape[:3], x.shape[3] * x.shape[4]) if x.shape[2] else None
    out = _decode(walk, cfg, tables, q.reshape(b, hkv, hq // hkv, d), flat(k_ring),
                  flat(v_ring), flat(ck), flat(cv))
    return out.reshape(b, hq, d)


def check_decode_inputs(q, k_ring, v_ring, ck, cv, bounds, stacked: bool, cfg: KernelConfig):
    """ValueError naming the fix unless the shapes fit (`decode_attention_pallas_tpu`): the
    decode contract (`pallas_kernels.shapes`, slots `[B, C, Hq, D]`), then the lanes."""
    _, _, d, _ = check_decode_contract(q, k_ring, v_ring, ck, cv, bounds, stacked=stacked)
    if d % LANES and cfg.interpret is False:
        raise ValueError(f"the TPU decode kernel needs head_dim a multiple of {LANES} (got "
                         f"{d}): padding would copy the cache every step; use "
                         "cca_jax.decode.cached_attention (XLA).")
