"""The key-major TPU backward kernels: dk/dv of raw keys and dck/dcv of slots.

Raw keys: grid `(batch, KV head, key block, step)`; the steps walk the G query heads of the KV
head's group one after another, each over the query blocks that see the key block
(`blocks.key_block_visits`, scalar-prefetched), so the GQA sum happens in the float32 VMEM
accumulators and no per-query-head partial is written. Slots (per query head): grid
`(batch, query head, slot block, step)` over the query blocks that see the slot block
(`blocks.slot_block_visits`). As in the forward, a step past the walk repeats the previous
block index (no copy) and is skipped; fully visible tiles skip the mask.

Tiles are computed transposed, `[keys, rows]`: the per-row log-sum-exp, delta and bounds are
then lane-dense `[1, rows]` rows, and dk, dv are plain `[keys, rows] @ [rows, D]` products.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.common import (KernelConfig, clamp_visit, compiler_params, dot_nn,
                                       dot_nt, iota, raw_visible, slot_visible, when_visited)

TABLE_FIELDS = 4   # (first, full_first, full_last, last) query blocks per key/slot block


class KeyWalk(NamedTuple):
    """Static shape of a key-side walk."""
    steps: int             # query-block steps per (query head, key block)
    groups: int            # query heads walked per key block (G for raw keys, 1 for slots)
    num_q_blocks: int
    num_key_blocks: int
    head_dim: int
    scale: float
    slots: bool            # slot mask (core_lo, core_hi) instead of the raw one (raw_lo)


def _visit(tables, b, x, j, walk: KeyWalk):
    """(query block, run, full, query head offset) of step `j` for key block `x`."""
    base = (b * walk.num_key_blocks + x) * TABLE_FIELDS
    first, full_first, full_last, last = (tables[base + f] for f in range(TABLE_FIELDS))
    head, step = (j // walk.steps, j % walk.steps) if walk.groups > 1 else (0, j)
    q_block = clamp_visit(first, last, step, walk.num_q_blocks)
    run = first + step < last
    return q_block, run, (q_block >= full_first) & (q_block < full_last), head


def _kernel(tables_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, *refs,
            walk: KeyWalk):
    bound_refs = refs[:2] if walk.slots else refs[:1]
    dk_ref, dv_ref, dk_acc, dv_acc = refs[len(bound_refs):]
    b, x, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    q_block, run, full, _ = _visit(tables_ref, b, x, j, walk)

    def body(masked):
        k, q, do = k_ref[...], q_ref[...], do_ref[...]
        p = jnp.exp(dot_nt(k, q) * walk.scale - lse_ref[...])          # [keys, rows]
        if masked:
            shape = p.shape
            key = iota(shape, 0, x * shape[0])
            if walk.slots:
                mask = slot_visible(key, bound_refs[0][...], bound_refs[1][...])
            else:
                mask = raw_visible(key, iota(shape, 1, q_block * shape[1]),
                                   bound_refs[0][...])
            p = jnp.where(mask, p, 0.0)
        dv_acc[...] += dot_nn(p.astype(do.dtype), do)
        ds = p * (dot_nt(v_ref[...], do) - delta_ref[...])
        dk_acc[...] += dot_nn(ds.astype(q.dtype), q)
    when_visited(run, full, body)

    @pl.when(j == walk.groups * walk.steps - 1)
    def _():
        dk_ref[...] = (dk_acc[...] * walk.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def key_grads(walk: KeyWalk, cfg: KernelConfig, tables, keys, values, q, do, lse, delta,
              bounds):
    """(dkeys, dvalues) shaped like `keys` `[B, N, H*D]` (head view).

    q, do: `[B, Lp, Hq*D]`; lse, delta: `[B, Hq, 1, Lp]`; bounds: `(raw_lo,)` or
    `(core_lo, core_hi)`, each `[B, 1, Lp]`. Raw keys: H = Hkv and each grid head walks its G
    query heads; slots: H = Hq.
    """
    b, n, width = keys.shape
    heads = width // walk.head_dim
    bk = cfg.block_c if walk.slots else cfg.block_k
    bq, d = cfg.block_q, walk.head_dim

    def visit(bb, x, j, t):
        return _visit(t, bb, x, j, walk)

    def q_head(h, x, bb, j, t):
        return h * walk.groups + visit(bb, x, j, t)[3]

    key_spec = pl.BlockSpec((None, bk, d), lambda bb, h, x, j, t: (bb, x, h))
    rows = pl.BlockSpec((None, bq, d), lambda bb, h, x, j, t: (
        bb, visit(bb, x, j, t)[0], q_head(h, x, bb, j, t)))
    per_head = pl.BlockSpec((None, None, 1, bq), lambda bb, h, x, j, t: (
        bb, q_head(h, x, bb, j, t), 0, visit(bb, x, j, t)[0]))
    bound = pl.BlockSpec((None, 1, bq), lambda bb, h, x, j, t: (bb, 0, visit(bb, x, j, t)[0]))
    name = "cca_tpu_dslots" if walk.slots else "cca_tpu_dkv"
    return pl.pallas_call(
        functools.partial(_kernel, walk=walk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, heads, walk.num_key_blocks, walk.groups * walk.steps),
            in_specs=[key_spec, key_spec, rows, rows, per_head, per_head,
                      *(bound for _ in bounds)],
            out_specs=[key_spec, key_spec],
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                   jax.ShapeDtypeStruct(values.shape, values.dtype)],
        compiler_params=compiler_params(cfg, ("parallel", "parallel", "parallel",
                                              "arbitrary")),
        interpret=cfg.interpret,
        name=name,
    )(tables, keys, values, q, do, lse, delta, *bounds)
