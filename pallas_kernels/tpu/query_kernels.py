"""The query-major TPU kernels: forward (out, log-sum-exp) and dq.

Grid `(batch, query head, query block, step)`. Steps `0 .. raw_steps-1` walk the raw key blocks
of the query block's window, steps `raw_steps ..` its slot blocks (CCA's core tokens,
streaming's sinks), from the scalar-prefetched table `blocks.query_block_visits`: per query
block `(first, full_first, full_last, last)` for both walks. A step past a walk's `last` is
skipped (`pl.when`) and its index map repeats the previous block, so the pipeline copies
nothing for it; blocks inside `[full_first, full_last)` skip the mask. The raw walk comes
first: every row sees its own key, so the running max is finite before any slot block.
Query head `h` reads KV head `h // G` (GQA): raw K/V are never repeated. Accumulators (max,
denominator, output or dq) live in float32 VMEM scratch across the steps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.common import (MASKED, KernelConfig, as_column, clamp_visit,
                                       column_to_row, compiler_params, dot_nn, dot_nt, iota,
                                       online_softmax_step, raw_visible, slot_visible,
                                       when_visited)

TABLE_FIELDS = 8   # blocks.query_block_visits: raw (first, full_first, full_last, last), slots


class QueryWalk(NamedTuple):
    """Static shape of the walk: steps per query block and block counts."""
    raw_steps: int
    core_steps: int          # 0: no slots (full, sliding), the slot inputs are left out
    num_q_blocks: int
    num_k_blocks: int
    num_c_blocks: int
    groups: int              # G = Hq / Hkv
    head_dim: int            # D as the kernels see it (a multiple of 128)
    scale: float             # 1 / sqrt(the caller's D)

    @property
    def steps(self) -> int:
        return self.raw_steps + self.core_steps


class _Visit(NamedTuple):
    raw_block: jax.Array
    raw_run: jax.Array
    raw_full: jax.Array
    core_block: jax.Array
    core_run: jax.Array
    core_full: jax.Array


def _visit(tables, b, i, j, walk: QueryWalk) -> _Visit:
    """Which raw and slot block step `j` of query block `i` (row `b`) holds, and whether it
    runs and needs no mask (read from the scalar-prefetched table)."""
    base = (b * walk.num_q_blocks + i) * TABLE_FIELDS
    rf, rff, rfl, rl, cf, cff, cfl, cl = (tables[base + f] for f in range(TABLE_FIELDS))
    raw_block = clamp_visit(rf, rl, j, walk.num_k_blocks)
    raw_run = (j < walk.raw_steps) & (rf + j < rl)
    cj = jnp.maximum(j - walk.raw_steps, 0)
    core_block = clamp_visit(cf, cl, cj, max(walk.num_c_blocks, 1))
    core_run = (j >= walk.raw_steps) & (cf + cj < cl)
    return _Visit(raw_block, raw_run, (raw_block >= rff) & (raw_block < rfl),
                  core_block, core_run, (core_block >= cff) & (core_block < cfl))


def _specs(walk: QueryWalk, block_q: int, block_k: int, block_c: int, d: int):
    """BlockSpecs of the query-major kernels; index maps get (b, h, i, j, tables)."""
    def visit(b, i, j, tables):
        return _visit(tables, b, i, j, walk)

    def kv_head(h):
        return h // walk.groups if walk.groups > 1 else h

    rows = pl.BlockSpec((None, block_q, d), lambda b, h, i, j, t: (b, i, h))
    raw = pl.BlockSpec((None, block_k, d),
                       lambda b, h, i, j, t: (b, visit(b, i, j, t).raw_block, kv_head(h)))
    core = pl.BlockSpec((None, block_c, d),
                        lambda b, h, i, j, t: (b, visit(b, i, j, t).core_block, h))
    bounds = pl.BlockSpec((None, 1, block_q), lambda b, h, i, j, t: (b, 0, i))
    per_head = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j, t: (b, h, 0, i))
    return rows, raw, core, bounds, per_head


def _walk_tiles(tables_ref, refs, walk: QueryWalk, fold):
    """Call `fold(keys, values, mask_or_None)` for the raw or slot tile of this step (loads
    happen inside, so a skipped step reads nothing)."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    v = _visit(tables_ref, b, i, j, walk)
    bq = refs["q"].shape[0]
    r0 = i * bq

    def raw_body(masked):
        k = refs["k"][...]
        mask = None
        if masked:
            shape = (bq, k.shape[0])
            mask = raw_visible(iota(shape, 1, v.raw_block * k.shape[0]), iota(shape, 0, r0),
                               as_column(refs["raw_lo"]))
        fold(k, refs["v"][...], mask)
    when_visited(v.raw_run, v.raw_full, raw_body)

    if walk.core_steps:
        def core_body(masked):
            ck = refs["ck"][...]
            mask = None
            if masked:
                shape = (bq, ck.shape[0])
                mask = slot_visible(iota(shape, 1, v.core_block * ck.shape[0]),
                                    as_column(refs["core_lo"]), as_column(refs["core_hi"]))
            fold(ck, refs["cv"][...], mask)
        when_visited(v.core_run, v.core_full, core_body)


_INPUTS = ("q", "k", "v", "raw_lo")
_CORE_INPUTS = ("ck", "cv", "core_lo", "core_hi")


def _named(refs, names):
    return dict(zip(names, refs))


def _forward_kernel(tables_ref, *refs, walk: QueryWalk, names):
    named = _named(refs, names)
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[len(names):]
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def fold(keys, values, mask):
        scores = dot_nt(named["q"][...], keys) * walk.scale
        online_softmax_step(scores, mask, values, m_ref, l_ref, acc_ref)
    _walk_tiles(tables_ref, named, walk, fold)

    @pl.when(j == walk.steps - 1)
    def _():
        denom = l_ref[...]
        o_ref[...] = (acc_ref[...] / denom).astype(o_ref.dtype)
        lse_ref[...] = column_to_row(m_ref[...] + jnp.log(denom))


def _dq_kernel(tables_ref, *refs, walk: QueryWalk, names):
    named = _named(refs, names)
    dq_ref, acc_ref = refs[len(names):]
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def fold(keys, values, mask):
        p = jnp.exp(dot_nt(named["q"][...], keys) * walk.scale - as_column(named["lse"]))
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        ds = p * (dot_nt(named["do"][...], values) - as_column(named["delta"]))
        acc_ref[...] += dot_nn(ds.astype(keys.dtype), keys)
    _walk_tiles(tables_ref, named, walk, fold)

    @pl.when(j == walk.steps - 1)
    def _():
        dq_ref[...] = (acc_ref[...] * walk.scale).astype(dq_ref.dtype)


def _call(kernel, walk: QueryWalk, cfg: KernelConfig, tables, inputs: dict, extras,
          out_shape, out_kinds, scratch, name: str):
    """One pallas_call over (batch, query head, query block, step). extras: `(name, kind)` of
    inputs after the common ones; out_kinds: each output's kind ("rows" or "per_head")."""
    b = inputs["q"].shape[0]
    hq = inputs["q"].shape[2] // walk.head_dim
    rows, raw, core, bounds, per_head = _specs(walk, cfg.block_q, cfg.block_k, cfg.block_c,
                                               walk.head_dim)
    kinds = {"rows": rows, "per_head": per_head}
    names = list(_INPUTS)
    specs = [rows, raw, raw, bounds]
    if walk.core_steps:
        names += _CORE_INPUTS
        specs += [core, core, bounds, bounds]
    for extra, kind in extras:
        names.append(extra)
        specs.append(kinds[kind])
    return pl.pallas_call(
        functools.partial(kernel, walk=walk, names=tuple(names)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, hq, walk.num_q_blocks, walk.steps),
            in_specs=specs, out_specs=[kinds[kind] for kind in out_kinds],
            scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=compiler_params(cfg, ("parallel", "parallel", "parallel",
                                              "arbitrary")),
        interpret=cfg.interpret,
        name=name,
    )(tables, *(inputs[n] for n in names))


def forward(walk: QueryWalk, cfg: KernelConfig, tables, inputs: dict):
    """`(out [B, Lp, Hq*D], lse [B, Hq, 1, Lp] float32)` from head-view inputs (`common`):
    q, k, v, raw_lo, and with slots ck, cv, core_lo, core_hi."""
    q = inputs["q"]
    b, lp, width = q.shape
    bq, d = cfg.block_q, walk.head_dim
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, width // d, 1, lp), jnp.float32)]
    scratch = [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
               pltpu.VMEM((bq, d), jnp.float32)]
    return _call(_forward_kernel, walk, cfg, tables, inputs, (), out_shape,
                 ("rows", "per_head"), scratch, "cca_tpu_forward")


def dq(walk: QueryWalk, cfg: KernelConfig, tables, inputs: dict):
    """dq `[B, Lp, Hq*D]` from the forward's inputs plus `do` (rows), `lse`, `delta`."""
    q = inputs["q"]
    scratch = [pltpu.VMEM((cfg.block_q, walk.head_dim), jnp.float32)]
    return _call(_dq_kernel, walk, cfg, tables, inputs,
                 (("do", "rows"), ("lse", "per_head"), ("delta", "per_head")),
                 [jax.ShapeDtypeStruct(q.shape, q.dtype)], ("rows",), scratch,
                 "cca_tpu_dq")[0]
