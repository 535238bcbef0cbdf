"""The backward's dq kernel on Mosaic GPU (sm_90): per block of query rows, the forward's walk.

One CTA per (query head, `block_q * compute_wgs` rows, batch row). The producer (last
warpgroup) streams the raw-window key blocks and then the slot blocks the CTA's rows see
(the forward's tables, `tables.visit_tables`), K and V of each into ring slot
`step % stages`. Each consumer warpgroup owns `block_q` rows: per step it recomputes
P = exp2(S * c - lse) from the forward's log2-sum-exp, dP = dO V^T, dS = P (dP - delta),
and accumulates dQ += dS K in registers (float32), masking only the steps that are edge
blocks for its own rows. dq is written once, scaled, in the inputs' dtype.
With `cfg.narrow_block`, a CTA whose raw window starts in the last `narrow_block` keys of a
block takes those as one masked narrow step (the forward's narrow head, from buffers of
their own: K twice, once with the 32-byte swizzle that dQ += dS K's 16-deep contraction
over the keys needs). It comes after the ring's steps: its copies are issued first, so by
then they have landed, where taken first their latency stood before every CTA's walk.
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
from pallas_kernels.mosaic_gpu.config import MosaicBackwardConfig, softmax_scale
from pallas_kernels.mosaic_gpu.tables import (CORE_FIRST, CORE_FULL_FIRST, CORE_FULL_LAST,
                                              CORE_LAST, RAW_FIRST, RAW_FULL_FIRST,
                                              RAW_FULL_LAST, RAW_HEAD, RAW_LAST)

_LOG2E = math.log2(math.e)


class _Work(NamedTuple):
    """One (query head, row block, batch row) of the walk: where it is and its steps."""
    batch: jax.Array
    head: jax.Array
    tile: jax.Array
    raw_first: jax.Array    # step s: raw block raw_first + s while below n_raw,
    core_first: jax.Array   # else core block core_first + s - n_raw
    n_raw: jax.Array
    n_steps: jax.Array
    n_head: jax.Array       # 1 where a narrow head comes first in the keys (taken last)


def _work(cta_ref, batch, head, tile, narrow: int) -> _Work:
    raw_first = cta_ref[batch, tile, RAW_FIRST]
    core_first = cta_ref[batch, tile, CORE_FIRST]
    n_raw = cta_ref[batch, tile, RAW_LAST] - raw_first
    n_steps = n_raw + cta_ref[batch, tile, CORE_LAST] - core_first
    n_head = cta_ref[batch, tile, RAW_HEAD] if narrow else jnp.int32(0)
    return _Work(batch, head, tile, raw_first, core_first, n_raw, n_steps, n_head)


def _kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, do_ref, stats_ref, bounds_ref, cta_ref,
            wg_ref, dq_ref,
            q_smem, do_smem, k_smem, v_smem, rows_smem, stats_smem,
            q_bar, do_bar, rows_bar, stats_bar, k_ready, v_ready, free, *extra_scratch,
            cfg: MosaicBackwardConfig, groups: int, scale: float, interpreted: bool,
            row_offset: int, ctas: int):
    bq, bk, stages, wgs = cfg.block_q, cfg.block_kv, cfg.stages, cfg.compute_wgs
    narrow = cfg.narrow_block
    # Rows of q/k/v/dO/dq: the kernel's frame (bounds, stats, tables) starts at row_offset.
    at_row = (lambda r: r + row_offset) if row_offset else (lambda r: r)
    wg = lax.axis_index("wg")
    hq, batch_rows, tiles = q_ref.shape[2], q_ref.shape[0], cta_ref.shape[1]
    if cfg.persistent:   # the heaviest row blocks first (the forward's launch order)
        dq_smem, *extra_scratch = extra_scratch
        count, work_index = pipeline.persistent_works(lax.axis_index("ctas"), ctas,
                                                      hq * tiles * batch_rows)

        def work_at(i):
            head, tile, batch, _ = pipeline.unravel(work_index(i), (hq, tiles, batch_rows))
            return _work(cta_ref, batch, head, tiles - 1 - tile, narrow)
    else:
        dq_smem, count = q_smem, 1
        only = _work(cta_ref, lax.axis_index("batch"), lax.axis_index("heads"),
                     lax.axis_index("q_tiles"), narrow)

        def work_at(i):
            return only
    kh_smem, kh32_smem, vh_smem, head_bar, *head_free = (extra_scratch if narrow
                                                          else (None,) * 4)
    head_free = head_free[0] if head_free else None
    as_tile, as_rows, _ = pipeline.layouts(interpreted)

    @pipeline.consumers(wg, wgs)
    def _consumer():
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]

        def load_rows(w: _Work):
            """Start the copies of the warpgroup's Q, dO, bounds and stats rows."""
            r0 = w.tile * (bq * wgs) + wg * bq
            rows, data_rows = pl.ds(r0, bq), pl.ds(at_row(r0), bq)
            plgpu.copy_gmem_to_smem(q_ref.at[w.batch, data_rows, w.head], q_tile, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[w.batch, data_rows, w.head], do_tile,
                                    do_bar.at[wg])
            plgpu.copy_gmem_to_smem(bounds_ref.at[w.batch, :, rows], rows_smem.at[wg],
                                    rows_bar.at[wg])
            plgpu.copy_gmem_to_smem(stats_ref.at[w.batch, w.head, :, rows], stats_smem.at[wg],
                                    stats_bar.at[wg])

        def consume(i, base):
            """Work i of this CTA, its ring steps counted from `base`; returns the next base."""
            w = work_at(i)
            r0 = w.tile * (bq * wgs) + wg * bq
            if not cfg.persistent:
                load_rows(w)
            for bar in (q_bar, do_bar, rows_bar, stats_bar):
                plgpu.barrier_wait(bar.at[wg])
            raw_lo, core_lo, core_hi = (as_rows(rows_smem.at[wg].at[j][...]) for j in range(3))
            lse, delta = (as_rows(stats_smem.at[wg].at[j][...]) for j in range(2))
            c = scale * _LOG2E

            raw_visible, core_visible = pipeline.row_masks(raw_lo, core_lo, core_hi, r0,
                                                           (bq, bk), as_tile)

            def gradient(dq, k_tile, v_tile, k_rows, visible):
                """dQ += dS K over the keys of one step's tiles (`k_rows`: K laid out for
                the dS K product); `visible()` the mask of the step's scores (built after
                their product, as before the head existed), or None."""
                if cfg.paired_scores:
                    sc, dp = pipeline.two_scores(q_tile, k_tile, do_tile, v_tile, interpreted)
                else:
                    sc = pipeline.scores(q_tile, k_tile, interpreted)
                if visible is not None:
                    sc = jnp.where(visible(), sc, -jnp.inf)
                p = jnp.exp2(sc * c - lax.broadcast_in_dim(lse, sc.shape, [0]))
                if not cfg.paired_scores:
                    dp = pipeline.scores(do_tile, v_tile, interpreted)
                ds = p * (dp - lax.broadcast_in_dim(delta, sc.shape, [0]))
                return pipeline.accumulate(dq, ds.astype(q_ref.dtype), k_rows, interpreted)

            def step(s, block, dq, masked, visible):
                slot = lax.rem(base + s, jnp.int32(stages))   # base 0: one work a CTA
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                dq = gradient(dq, k_smem.at[slot], v_smem.at[slot], k_smem.at[slot],
                              (lambda: visible(block)) if masked else None)
                plgpu.barrier_arrive(free.at[slot])
                return dq

            def head_step(_, dq):
                """The narrow head: its own buffers, masked; released (persistent) for the
                next work's head."""
                head_visible, _ = pipeline.row_masks(raw_lo, core_lo, core_hi, r0,
                                                     (bq, narrow), as_tile)
                for j in range(3):
                    plgpu.barrier_wait(head_bar.at[j])
                dq = gradient(dq, kh_smem, vh_smem, kh32_smem,
                              lambda: head_visible((w.raw_first * bk - narrow) // narrow))
                if cfg.persistent:
                    plgpu.barrier_arrive(head_free)
                return dq

            own = w.tile * wgs + wg    # this warpgroup's row in the per-warpgroup table
            dq = as_tile(jnp.zeros((bq, q_ref.shape[-1]), jnp.float32))
            dq = pipeline.walk(w.raw_first, wg_ref[w.batch, own, RAW_FULL_FIRST],
                               wg_ref[w.batch, own, RAW_FULL_LAST], w.raw_first + w.n_raw, 0,
                               functools.partial(step, visible=raw_visible), dq)
            dq = pipeline.walk(w.core_first, wg_ref[w.batch, own, CORE_FULL_FIRST],
                               wg_ref[w.batch, own, CORE_FULL_LAST],
                               w.core_first + w.n_steps - w.n_raw, w.n_raw,
                               functools.partial(step, visible=core_visible), dq)
            if narrow:   # last: its copies, issued first, have landed by now (dQ is a sum)
                dq = lax.fori_loop(0, w.n_head, head_step, dq)
            if cfg.persistent:   # Q and dO are free: the next work's load during this epilogue
                pipeline.load_next(i, count, load_rows, work_at)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last dQ is stored
            dq_smem.at[wg][...] = (dq * scale).astype(q_ref.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_smem.at[wg],
                                    dq_ref.at[w.batch, pl.ds(at_row(r0), bq), w.head])
            if not cfg.persistent:
                plgpu.wait_smem_to_gmem(0)
            return base + w.n_steps

        pipeline.consume_works(cfg.persistent, count, load_rows, work_at, consume)

    @pipeline.producer(wg, wgs)
    def _producer():
        def produce(i, carry):
            """Work i's copies; returns the next (ring base, narrow heads copied)."""
            base, heads = carry
            w = work_at(i)
            kv_head = w.head if groups == 1 else lax.div(w.head, jnp.int32(groups))

            def head_copies():
                keys = pl.ds(at_row(w.raw_first * bk - narrow), narrow)
                for j, (ref, smem) in enumerate(((k_ref, kh_smem), (k_ref, kh32_smem),
                                                 (v_ref, vh_smem))):
                    plgpu.copy_gmem_to_smem(ref.at[w.batch, keys, kv_head], smem,
                                            head_bar.at[j])

            def copy_head():
                pipeline.copy_narrow_head(w.n_head, heads, head_free, head_copies)

            def copy(s, slot):
                @pl.when(s < w.n_raw)
                def _():
                    keys = pl.ds(at_row((w.raw_first + s) * bk), bk)
                    plgpu.copy_gmem_to_smem(k_ref.at[w.batch, keys, kv_head], k_smem.at[slot],
                                            k_ready.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[w.batch, keys, kv_head], v_smem.at[slot],
                                            v_ready.at[slot])

                @pl.when(s >= w.n_raw)
                def _():
                    slots = pl.ds((w.core_first + s - w.n_raw) * bk, bk)
                    plgpu.copy_gmem_to_smem(ck_ref.at[w.batch, slots, w.head], k_smem.at[slot],
                                            k_ready.at[slot])
                    plgpu.copy_gmem_to_smem(cv_ref.at[w.batch, slots, w.head], v_smem.at[slot],
                                            v_ready.at[slot])
            if not cfg.persistent:
                if narrow:
                    copy_head()
                pipeline.produce(w.n_steps, stages, copy, free)
                return base, heads
            pipeline.produce_from(base, w.n_steps, stages, copy, free,
                                  copy_head if narrow else None)
            return base + w.n_steps, heads + w.n_head

        if cfg.persistent:
            total, heads = lax.fori_loop(0, count, produce, (jnp.int32(0), jnp.int32(0)))
            pipeline.drain(total, stages, free)
            if narrow:
                pl.when(heads > 0)(lambda: plgpu.barrier_wait(head_free))
        else:
            produce(0, (jnp.int32(0), jnp.int32(0)))


def dq(q, k, v, ck, cv, do, stats, bounds, cta_visits, wg_visits, cfg: MosaicBackwardConfig,
       interpret=None, row_offset: int = 0, ctas: int = 0):
    """dq `[B, Lp, Hq, D]` (q's dtype) from padded inputs: q, dO `[B, Lp, Hq, D]`, k, v
    `[B, Lp, Hkv, D]`, slots `[B, Mp, Hq, D]`, stats `[B, Hq, 2, Lp]` float32 (the forward's
    log2-sum-exp, then delta = rowsum(dO * O)), bounds `[B, 3, Lp]`, and the forward's visit
    tables at (`block_q`, `compute_wgs`, `block_kv`). `interpret`: None or the GPU
    interpreter's params (products there are plain dots, `pipeline`). `row_offset`
    (`lead.py`): rows `[row_offset, row_offset + Lp)` of q/k/v/dO/dq, Lp the bounds'
    length; dq's first `row_offset` rows are left unwritten. `ctas` (`cfg.persistent`
    only): the CTAs launched; 0: the GPU's SMs (132 where no GPU is attached, 4 under the
    interpreter)."""
    b, _, hq, d = q.shape
    lp = bounds.shape[-1]
    wgs, stages = cfg.compute_wgs, cfg.stages
    transforms = pipeline.smem_transforms(d, jnp.dtype(q.dtype).itemsize)

    def tiles(n, rows):
        return plgpu.SMEM((n, rows, d), q.dtype, transforms=transforms)
    scratch = (
        tiles(wgs, cfg.block_q),                           # Q, then dQ
        tiles(wgs, cfg.block_q),                           # dO
        tiles(stages, cfg.block_kv),                       # K ring
        tiles(stages, cfg.block_kv),                       # V ring
        plgpu.SMEM((wgs, 3, cfg.block_q), jnp.int32),      # per-row bounds
        plgpu.SMEM((wgs, 2, cfg.block_q), jnp.float32),    # log2-sum-exp, delta
        plgpu.Barrier(num_barriers=wgs),                   # Q landed
        plgpu.Barrier(num_barriers=wgs),                   # dO landed
        plgpu.Barrier(num_barriers=wgs),                   # bounds landed
        plgpu.Barrier(num_barriers=wgs),                   # stats landed
        plgpu.Barrier(num_barriers=stages),                # K landed
        plgpu.Barrier(num_barriers=stages),                # V landed
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),   # ring slot released
    )
    if cfg.persistent:
        scratch += (tiles(wgs, cfg.block_q),)              # dQ, stored during the next work
    if cfg.narrow_block:
        n = cfg.narrow_block
        narrow_swizzle = pipeline.narrow_transforms(jnp.dtype(q.dtype).itemsize)
        scratch += (plgpu.SMEM((n, d), q.dtype, transforms=transforms),      # K head (for S)
                    plgpu.SMEM((n, d), q.dtype, transforms=narrow_swizzle),  # K head (dS K)
                    plgpu.SMEM((n, d), q.dtype, transforms=transforms),      # V head
                    plgpu.Barrier(num_barriers=3))                           # each landed
        if cfg.persistent:
            scratch += (plgpu.Barrier(num_arrivals=wgs),)            # the head was taken
    works = hq * (lp // (cfg.block_q * wgs)) * b
    if cfg.persistent:
        ctas = pipeline.persistent_ctas(works, ctas, interpret is not None)
        grid, grid_names = (ctas,), ("ctas",)
    else:
        grid, grid_names = (hq, lp // (cfg.block_q * wgs), b), ("heads", "q_tiles", "batch")
    kernel = functools.partial(_kernel, cfg=cfg, groups=hq // k.shape[2],
                               scale=softmax_scale(cfg, d),
                               interpreted=interpret is not None, row_offset=row_offset,
                               ctas=ctas)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        kernel_name="cca_dq",
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, ck, cv, do, stats, bounds, cta_visits, wg_visits)
