"""The backward's key-side kernels on Mosaic GPU (sm_90): dk/dv over raw key blocks and
dck/dcv over slot blocks, one kernel body for both.

One CTA per (KV head for raw keys / query head for slots, `KEY_ROWS * compute_wgs` keys or
slots, batch row). Each consumer warpgroup owns `KEY_ROWS` keys (K and V stay in shared
memory) and accumulates their dK and dV in registers (float32): no atomics, and with GQA
(raw keys) the G query heads of the KV head are walked one after another into the same
accumulators, so K/V are never repeated. The producer (last warpgroup) streams, per step,
one query block's Q, dO, row bounds and (log2-sum-exp, delta) into ring slot
`step % stages`: step `s` is query head `s // n` of the group and query block
`first + s % n`, the `n` blocks that see the CTA's keys (`tables.key_visit_tables`, from
`cca_jax.blocks`). A slot block no row sees (padding; m = 0) has no steps: zeros.
Per step, transposed (keys along rows): S^T = K Q^T, P^T = exp2(S^T c - lse), dV += P^T dO
and dP^T = V dO^T (issued together), dS^T = P^T (dP^T - delta), dK += dS^T Q; masked only
on edge blocks. `outputs` may ask for dK or dV alone (`MosaicBackwardConfig.split_keys`,
D = 256): that kernel holds one accumulator and skips the other's products.

Fused (`MosaicBackwardConfig.fused_dq`, no dq kernel): per step each consumer also writes its
dS^T to shared memory (two buffers, by step parity) and computes its share of dQ = dS K (A
transposed from shared memory): at D = 128 the consumers meet at a barrier and each takes
half of D's columns over both warpgroups' keys; else (`config.fused_dq_by_columns`) each
its own keys over all of D. It adds its share into a float32 accumulator in global memory
by a TMA reduce-add. jax's GPU interpreter has no reduction copies: there each warpgroup
writes its dQ partials to a slice of its own, summed over what it walked afterwards.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu import pipeline
from pallas_kernels.mosaic_gpu.config import (KEY_ROWS, MosaicBackwardConfig, fused_dq_by_columns,
                                              softmax_scale)
from pallas_kernels.mosaic_gpu.tables import Q_FIRST, Q_FULL_FIRST, Q_FULL_LAST, Q_LAST

_LOG2E = math.log2(math.e)
KINDS = ("raw", "core")
OUTPUTS = (("dk", "dv"), ("dk",), ("dv",))


class _Work(NamedTuple):
    """One (head, key tile, batch row) of the key side: where it is and its steps."""
    batch: jax.Array
    head: jax.Array         # the KV head (raw keys) or query head (slots)
    tile: jax.Array
    first: jax.Array        # the first query block that sees the tile's keys
    per_head: jax.Array     # query blocks per query head
    n_steps: jax.Array


def _kernel(q_ref, do_ref, stats_ref, bounds_ref, k_ref, v_ref, cta_ref, wg_ref, *refs,
            cfg: MosaicBackwardConfig, kind: str, outputs: tuple, groups: int, scale: float,
            interpreted: bool, row_offset: int, fused: bool, by_columns: bool, ctas: int):
    """refs: (the dQ accumulator or partials, if fused), the `outputs`, the scratch.
    `by_columns` (fused): how the consumers share dQ (`config.fused_dq_by_columns`)."""
    dq_ref, refs = (refs[0], refs[1:]) if fused else (None, refs)
    out_refs = dict(zip(outputs, refs))
    scratch = refs[len(outputs):]
    (k_smem, v_smem, q_smem, do_smem, rows_smem, stats_smem,
     k_bar, v_bar, q_ready, do_ready, rows_ready, stats_ready, free) = scratch[:13]
    ds_smem, stage_smem, sync = scratch[13:] if fused else (None, None, None)
    want_dk, want_dv = "dk" in outputs, "dv" in outputs
    bk, bq, stages, wgs = KEY_ROWS, cfg.key_block_q, cfg.stages, cfg.compute_wgs
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    as_tile, _, as_cols = pipeline.layouts(interpreted)
    # Rows of q/dO (and of raw k/v/dk/dv): the kernel's frame starts at row_offset.
    at_row = (lambda r: r + row_offset) if row_offset else (lambda r: r)
    at_key = at_row if kind == "raw" else (lambda x: x)

    def work_of(batch, head, tile) -> _Work:
        first = cta_ref[batch, tile, Q_FIRST]
        per_head = cta_ref[batch, tile, Q_LAST] - first
        return _Work(batch, head, tile, first, per_head, per_head * groups)
    if cfg.persistent:   # launch order: heads fastest, then key tiles, batch rows
        heads, tiles, batch_rows = k_ref.shape[2], cta_ref.shape[1], cta_ref.shape[0]
        count, work_index = pipeline.persistent_works(lax.axis_index("ctas"), ctas,
                                                      heads * tiles * batch_rows)

        def work_at(i):
            head, tile, batch, _ = pipeline.unravel(work_index(i), (heads, tiles, batch_rows))
            return work_of(batch, head, tile)
    else:
        count = 1
        only = work_of(lax.axis_index("batch"), lax.axis_index("heads"),
                       lax.axis_index("key_tiles"))

        def work_at(i):
            return only

    @pipeline.consumers(wg, wgs)
    def _consumer():
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]

        def load_keys(w: _Work):
            """Start the copies of the warpgroup's keys and values."""
            own_keys = pl.ds(at_key(w.tile * (bk * wgs) + wg * bk), bk)
            plgpu.copy_gmem_to_smem(k_ref.at[w.batch, own_keys, w.head], k_tile, k_bar.at[wg])
            if want_dk:   # V only enters dP^T, which only dK needs
                plgpu.copy_gmem_to_smem(v_ref.at[w.batch, own_keys, w.head], v_tile,
                                        v_bar.at[wg])

        def consume(i, base):
            """Work i of this CTA, its ring steps counted from `base`; returns the next base."""
            w = work_at(i)
            batch, head, tile, first, per_head = w.batch, w.head, w.tile, w.first, w.per_head
            x0 = tile * (bk * wgs) + wg * bk
            own_keys = pl.ds(at_key(x0), bk)
            if not cfg.persistent:
                load_keys(w)
            if want_dk:
                plgpu.barrier_wait(v_bar.at[wg])
            plgpu.barrier_wait(k_bar.at[wg])
            c = scale * _LOG2E

            def wide(x):
                return lax.broadcast_in_dim(x, (bk, bq), [1])

            def iota(dim):
                return as_tile(lax.broadcasted_iota(jnp.int32, (bk, bq), dim))

            def visible(rows, r0):
                keys = iota(0) + x0
                if kind == "raw":
                    return (keys >= wide(as_cols(rows.at[0][...]))) & (keys <= iota(1) + r0)
                return ((keys >= wide(as_cols(rows.at[1][...])))
                        & (keys < wide(as_cols(rows.at[2][...]))))

            def meet():
                """Both consumers here (fused, 2 warpgroups): each reads the other's tiles."""
                if wgs > 1:
                    plgpu.barrier_arrive(sync.at[0])
                    plgpu.barrier_wait(sync.at[0])

            def add_dq(s, block, ds_t):
                """dQ of this step's rows += dS K: this warpgroup's share (`by_columns`)."""
                buf = lax.rem(s, jnp.int32(2))
                ds_smem.at[buf, wg][...] = ds_t
                plgpu.commit_smem()
                gi = 0 if groups == 1 else lax.div(s, per_head)
                q_head = head if groups == 1 else head * groups + gi
                rows = pl.ds(at_row(block * bq), bq)

                def add(part, stage, cols):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    stage[...] = part
                    plgpu.commit_smem()
                    if interpreted:
                        plgpu.copy_smem_to_gmem(stage,
                                                dq_ref.at[tile, wg, batch, rows, q_head, cols])
                    else:
                        plgpu.copy_smem_to_gmem(stage, dq_ref.at[batch, rows, q_head, cols],
                                                reduction_op="add")
                if not by_columns:    # own keys, all columns
                    add(pipeline.transposed_products([ds_smem.at[buf, wg]], [k_tile],
                                                     interpreted), stage_smem.at[wg],
                        slice(None))
                    return
                meet()
                width = k_ref.shape[-1] // wgs
                for own_wg in range(wgs):     # static column slices of the swizzled K tiles
                    @pl.when(wg == own_wg)
                    def _():
                        cols = slice(own_wg * width, (own_wg + 1) * width)
                        add(pipeline.transposed_products(
                            [ds_smem.at[buf, x] for x in range(wgs)],
                            [k_smem.at[x, :, cols] for x in range(wgs)], interpreted),
                            stage_smem.at[own_wg], cols)

            def step(s, block, carry, masked):
                """carry: the accumulators of `outputs`, in its order."""
                grads = dict(zip(outputs, carry))
                slot = lax.rem(base + s, jnp.int32(stages))   # base 0: one work a CTA
                for ready in (q_ready, do_ready, rows_ready, stats_ready):
                    plgpu.barrier_wait(ready.at[slot])
                q_tile, do_tile, stats = q_smem.at[slot], do_smem.at[slot], stats_smem.at[slot]
                st = pipeline.scores(k_tile, q_tile, interpreted)
                if masked:
                    st = jnp.where(visible(rows_smem.at[slot], block * bq), st, -jnp.inf)
                pt = jnp.exp2(st * c - wide(as_cols(stats.at[0][...])))
                if want_dk and want_dv:
                    grads["dv"], dpt = pipeline.accumulate_and_score(
                        grads["dv"], pt.astype(dtype), do_tile, v_tile, do_tile, interpreted)
                elif want_dv:
                    grads["dv"] = pipeline.accumulate(grads["dv"], pt.astype(dtype), do_tile,
                                                      interpreted)
                else:
                    dpt = pipeline.scores(v_tile, do_tile, interpreted)
                if want_dk:
                    dst = (pt * (dpt - wide(as_cols(stats.at[1][...])))).astype(dtype)
                    grads["dk"] = pipeline.accumulate(grads["dk"], dst, q_tile, interpreted)
                plgpu.barrier_arrive(free.at[slot])
                if fused:
                    add_dq(s, block, dst)
                return tuple(grads[name] for name in outputs)

            own = tile * wgs + wg    # this warpgroup's row in the per-warpgroup table
            full_first = wg_ref[batch, own, Q_FULL_FIRST]
            full_last = wg_ref[batch, own, Q_FULL_LAST]

            def head_walk(gi, carry):
                return pipeline.walk(first, full_first, full_last, first + per_head,
                                     gi * per_head, step, carry)
            zeros = as_tile(jnp.zeros((bk, k_ref.shape[-1]), jnp.float32))
            carry = (zeros,) * len(outputs)
            carry = head_walk(0, carry) if groups == 1 else lax.fori_loop(0, groups,
                                                                          head_walk, carry)
            if by_columns:
                meet()    # the other warpgroup's last dQ product is done with this K tile
            # Written through the K (dK) and V (dV) tiles, which the walk is done reading.
            staged = {"dk": (k_tile, scale), "dv": (v_tile, 1.0)}
            for name, grad in zip(outputs, carry):
                tile_smem, factor = staged[name]
                tile_smem[...] = (grad * factor if factor != 1.0 else grad).astype(dtype)
            plgpu.commit_smem()
            for name in outputs:
                plgpu.copy_smem_to_gmem(staged[name][0],
                                        out_refs[name].at[batch, own_keys, head])
            if cfg.persistent:   # once the stores have read them, the next work's K and V
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                pipeline.load_next(i, count, load_keys, work_at)
            else:
                plgpu.wait_smem_to_gmem(0)
            return base + w.n_steps

        pipeline.consume_works(cfg.persistent, count, load_keys, work_at, consume)

    @pipeline.producer(wg, wgs)
    def _producer():
        def produce(i, base):
            """Work i's copies; returns the next ring base."""
            w = work_at(i)

            def copy(s, slot):
                gi = 0 if groups == 1 else lax.div(s, w.per_head)
                r0 = (w.first + s - gi * w.per_head) * bq
                rows, data_rows = pl.ds(r0, bq), pl.ds(at_row(r0), bq)
                q_head = w.head if groups == 1 else w.head * groups + gi
                plgpu.copy_gmem_to_smem(q_ref.at[w.batch, data_rows, q_head], q_smem.at[slot],
                                        q_ready.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[w.batch, data_rows, q_head],
                                        do_smem.at[slot], do_ready.at[slot])
                plgpu.copy_gmem_to_smem(bounds_ref.at[w.batch, :, rows], rows_smem.at[slot],
                                        rows_ready.at[slot])
                plgpu.copy_gmem_to_smem(stats_ref.at[w.batch, q_head, :, rows],
                                        stats_smem.at[slot], stats_ready.at[slot])
            if not cfg.persistent:
                pipeline.produce(w.n_steps, stages, copy, free)
                return base
            pipeline.produce_from(base, w.n_steps, stages, copy, free)
            return base + w.n_steps

        if cfg.persistent:
            pipeline.drain(lax.fori_loop(0, count, produce, jnp.int32(0)), stages, free)
        else:
            produce(0, jnp.int32(0))


def key_grads(q, do, stats, bounds, keys, values, cta_visits, wg_visits, kind: str,
              cfg: MosaicBackwardConfig, interpret=None, outputs: tuple = ("dk", "dv"),
              row_offset: int = 0, dq=None, ctas: int = 0):
    """The gradients named by `outputs` (dK, dV, in that order), shaped like `keys`,
    `values`: raw k, v `[B, Lp, Hkv, D]` (`kind="raw"`) or slots ck, cv `[B, Mp, Hq, D]`
    (`kind="core"`), from padded q, dO `[B, Lp, Hq, D]`, stats `[B, Hq, 2, Lp]` float32
    (log2-sum-exp, delta), bounds `[B, 3, Lp]` and that kind's `tables.key_visit_tables` (Lp
    and Mp multiples of `cfg.key_cta_rows` and `cfg.key_block_q`). `interpret`: None or the
    GPU interpreter's params. `row_offset` (`lead.py`): rows `[row_offset, row_offset +
    Lp)` of q/dO and, for raw keys, of k/v/dk/dv (Lp the bounds' length); the first
    `row_offset` rows of dk/dv are left unwritten.

    `dq` (fused, `cfg.fused_dq`): a float32 accumulator shaped like q; then the result ends
    with `dq` plus this kernel's sum of dS K (unscaled) over its keys.

    `cfg.persistent`: `ctas` CTAs (0: the GPU's SMs, 132 where no GPU is attached, 4 under
    the interpreter), each walking its share of the key tiles, the ring running on across
    them (the next tile's first query blocks load while this one's dK and dV are stored)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    outputs = tuple(outputs)
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}.")
    fused = dq is not None
    if fused and (outputs != ("dk", "dv") or not cfg.fused_dq):
        raise ValueError("dq is added by the joint dK/dV kernel of a fused_dq config only.")
    b, _, hq, d = q.shape
    heads = keys.shape[2]
    key_rows = bounds.shape[-1] if kind == "raw" else keys.shape[1]
    wgs, stages = cfg.compute_wgs, cfg.stages
    itemsize = jnp.dtype(q.dtype).itemsize
    transforms = pipeline.smem_transforms(d, itemsize)

    def tiles(n, rows):
        return plgpu.SMEM((n, rows, d), q.dtype, transforms=transforms)
    scratch = (
        tiles(wgs, KEY_ROWS),                                  # K, then dK
        tiles(wgs, KEY_ROWS),                                  # V, then dV
        tiles(stages, cfg.key_block_q),                        # Q ring
        tiles(stages, cfg.key_block_q),                        # dO ring
        plgpu.SMEM((stages, 3, cfg.key_block_q), jnp.int32),   # per-row bounds ring
        plgpu.SMEM((stages, 2, cfg.key_block_q), jnp.float32),  # lse, delta ring
        plgpu.Barrier(num_barriers=wgs),                       # K landed
        plgpu.Barrier(num_barriers=wgs),                       # V landed
        plgpu.Barrier(num_barriers=stages),                    # Q landed
        plgpu.Barrier(num_barriers=stages),                    # dO landed
        plgpu.Barrier(num_barriers=stages),                    # bounds landed
        plgpu.Barrier(num_barriers=stages),                    # stats landed
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),  # ring slot released
    )
    by_columns = fused and fused_dq_by_columns(d, wgs, itemsize)
    if fused:
        bq = cfg.key_block_q
        width = d // wgs if by_columns else d
        scratch += (
            plgpu.SMEM((2, wgs, KEY_ROWS, bq), q.dtype,               # dS^T, two buffers
                       transforms=pipeline.smem_transforms(bq, itemsize)),
            plgpu.SMEM((wgs, bq, width), jnp.float32,                 # dQ staging
                       transforms=pipeline.smem_transforms(width, 4)),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=1),          # consumers meet
        )
    tiles_n = key_rows // cfg.key_cta_rows
    grid, grid_names = (heads, tiles_n, b), ("heads", "key_tiles", "batch")
    if cfg.persistent:
        ctas = pipeline.persistent_ctas(heads * tiles_n * b, ctas, interpret is not None)
        grid, grid_names = (ctas,), ("ctas",)
    kernel = functools.partial(_kernel, cfg=cfg, kind=kind, outputs=outputs,
                               groups=hq // heads if kind == "raw" else 1,
                               scale=softmax_scale(cfg, d),
                               interpreted=interpret is not None, row_offset=row_offset,
                               fused=fused, by_columns=by_columns, ctas=ctas)
    like = {"dk": keys, "dv": values}
    out_type = tuple(jax.ShapeDtypeStruct(like[name].shape, like[name].dtype)
                     for name in outputs)
    launch = dict(grid=grid, grid_names=grid_names,
                  kernel_name="cca_dk_dv" if kind == "raw" else "cca_dck_dcv",
                  num_threads=wgs + 1, thread_name="wg")
    params = plgpu.CompilerParams(approx_math=True)
    operands = (q, do, stats, bounds, keys, values, cta_visits, wg_visits)
    if not fused:
        return tuple(plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch,
                                  compiler_params=params, interpret=interpret,
                                  **launch)(*operands))
    if interpret is not None:   # no reduction copies: per-CTA partials, summed here
        parts, *grads = plgpu.kernel(
            kernel, out_type=(jax.ShapeDtypeStruct((tiles_n, wgs, *dq.shape), jnp.float32),
                              *out_type),
            scratch_types=scratch, compiler_params=params, interpret=interpret,
            **launch)(*operands)
        return (*grads, dq + _visited_sum(parts, cta_visits, cfg.key_block_q, row_offset,
                                          by_columns))
    acc = jax.new_ref(dq)   # aliased in and out of the kernel
    mesh = plgpu.Mesh(**launch)

    def body(*refs):
        pl.run_scoped(functools.partial(kernel, *refs), *scratch, collective_axes="wg")
    grads = pl.kernel(body, out_type=out_type, mesh=mesh, compiler_params=params,
                      name=launch["kernel_name"])(*operands, acc)
    return (*grads, acc[...])


def _visited_sum(parts, cta_visits, block_q: int, row_offset: int, by_columns: bool):
    """The interpreted fused kernel's dQ partials `[tiles, wgs, B, rows, Hq, D]` summed,
    each counting only what was written: the query blocks its CTA walked, and (by columns)
    its warpgroup's columns."""
    tiles, wgs, _, rows, _, d = parts.shape
    first, last = cta_visits[..., Q_FIRST], cta_visits[..., Q_LAST]     # [B, tiles]
    block = (jnp.arange(rows) - row_offset) // block_q
    seen = (block >= first[..., None]) & (block < last[..., None])     # [B, tiles, rows]
    seen = jnp.swapaxes(seen, 0, 1)[:, None, :, :, None, None]
    if by_columns:   # warpgroup w wrote columns [w d / wgs, (w + 1) d / wgs)
        owner = jnp.arange(d) // (d // wgs)
        seen = seen & (owner == jnp.arange(wgs)[:, None])[None, :, None, None, None, :]
    return jnp.where(seen, parts, 0.0).sum(axis=(0, 1))
