"""The CCA forward as a warp-specialised Mosaic GPU kernel (sm_90: wgmma, TMA, mbarriers).

Inputs are padded (`api`): q `[B, Lp, Hq, D]`, k/v `[B, Lp, Hkv, D]`, slots ck/cv
`[B, Mp, Hq, D]` (or any number of slot rows, one per batch row picked by `slot_rows`:
a KV cache's, read in place), the per-row bounds stacked `[B, 3, Lp]` (raw_lo, core_lo,
core_hi) and the two visit tables of `tables.visit_tables` (with `cfg.narrow_block` as their
`narrow`). Outputs: out `[B, Lp, Hq, D]` and the log2-sum-exp `[B, Hq, Lp]` float32 (the
Triton forward's convention, so its backward can reuse it).

One CTA per (query head, block of `cta_rows` rows, batch row), `compute_wgs + 1` warpgroups:
  producer   (the last warpgroup) walks the CTA's steps: the narrow head if the CTA takes
             one (`cfg.narrow_block` keys into buffers of their own, copied first; the
             consumers take it last, when it has landed), the raw-window key blocks, then
             the core-slot blocks, TMA-copying each step's K
             and V block into ring slot
             `step % stages` once both consumers have released it (and at the end awaits
             the last releases, so every barrier phase is observed).
  consumers  each owns `block_q` rows: S = Q K^T on wgmma, ONE online softmax in base 2
             over all steps, O += P V on wgmma. A step is masked only where it is an edge
             block for that warpgroup's rows (split loops: masked / unmasked / masked per
             kind; the narrow head is always masked), and a step outside a warpgroup's own
             range is fully masked (no skipping: both consumers must walk the same steps of
             the shared ring).
The block ranges come from `cca_jax.blocks` via the tables: nothing is re-derived here.
Masked scores are -inf and the running max starts at a finite -1e30, so a fully masked step
changes nothing and no -inf - -inf occurs (raw blocks come first and every row sees its own
key, so l >= 1 at the end).
The same body runs under jax's GPU interpreter on a CPU (`interpret`), which checks the
barrier protocol; there the two products are plain dots (see `forward`).
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
from pallas_kernels.mosaic_gpu.config import MosaicConfig, softmax_scale
from pallas_kernels.mosaic_gpu.tables import (CORE_FIRST, CORE_FULL_FIRST, CORE_FULL_LAST,
                                              CORE_LAST, RAW_FIRST, RAW_FULL_FIRST,
                                              RAW_FULL_LAST, RAW_HEAD, RAW_LAST)

_LOG2E = math.log2(math.e)
_MAX_INIT = -1e30


def _layouts(interpreted: bool):
    """(tile, row) layout casts: a WGMMA tile's and its per-row vectors' (m, l, bounds).
    The GPU interpreter runs arrays without layouts (it has no rule for the cast): there,
    identities."""
    if interpreted:
        return (lambda x: x), (lambda x: x)
    return (functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA),
            functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA.reduce(1)))


class _Work(NamedTuple):
    """One (query head, row block, batch row, key split) of the walk: where it is and the
    steps it takes (module docstring)."""
    batch: jax.Array
    head: jax.Array
    tile: jax.Array
    split: jax.Array
    raw_first: jax.Array    # step s is raw block raw_first + s0 + s while below n_raw,
    core_first: jax.Array   # else core block core_first + s0 + s - n_raw
    n_raw: jax.Array
    s0: jax.Array           # the split's first step of the row block's walk
    n_steps: jax.Array      # the split's steps (the whole walk unsplit)
    n_head: jax.Array       # 1 where a narrow head comes first in the keys (taken last)


def _work(cta_ref, batch, head, tile, split, splits: int, narrow: int) -> _Work:
    """The walk of row block `tile` (after the launch-order mapping) of `batch`, `head`: its
    steps from the CTA table, and the share of key split `split` of `splits`."""
    raw_first = cta_ref[batch, tile, RAW_FIRST]
    core_first = cta_ref[batch, tile, CORE_FIRST]
    n_raw = cta_ref[batch, tile, RAW_LAST] - raw_first
    n_all = n_raw + cta_ref[batch, tile, CORE_LAST] - core_first
    # With key splits, the CTA walks steps [s0, s1) of the n_all (possibly none: it then
    # writes a zero output and a log2-sum-exp of about -1e30, which the merge weighs zero).
    per = lax.div(n_all + splits - 1, jnp.int32(splits))
    s0 = jnp.minimum(split * per, n_all)
    n_steps = jnp.minimum(s0 + per, n_all) - s0
    n_head = cta_ref[batch, tile, RAW_HEAD] if narrow else jnp.int32(0)
    return _Work(batch, head, tile, split, raw_first, core_first, n_raw, s0, n_steps, n_head)


def _row_block(cfg: MosaicConfig, tile, tiles: int, first_tile: int):
    """The row block of the `tile`-th of `tiles` in launch order: the heaviest (last) first
    with `heavy_first`; the row blocks `[first_tile, ...)` only."""
    return tiles + first_tile - 1 - tile if cfg.heavy_first else tile + first_tile


def _launch_order(cfg: MosaicConfig, index, hq: int, tiles: int, batch: int, first_tile: int):
    """(batch row, query head, row block, split) of the `index`-th CTA in launch order:
    heads fastest, then row blocks (`_row_block`), batch rows, splits."""
    head, tile, row, split = pipeline.unravel(index, (hq, tiles, batch))
    return row, head, _row_block(cfg, tile, tiles, first_tile), split


def _kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, bounds_ref, cta_ref, wg_ref, slot_row_ref,
            out_ref, lse_ref,
            qo_smem, k_smem, v_smem, rows_smem, lse_smem,
            q_bar, rows_bar, k_ready, v_ready, k_free, v_free, sched_bar, *extra_scratch,
            cfg: MosaicConfig, groups: int, scale: float, interpreted: bool, row_offset: int,
            splits: int, first_tile: int, ctas: int):
    bq, bk, stages, wgs = cfg.block_q, cfg.block_kv, cfg.stages, cfg.compute_wgs
    narrow = cfg.narrow_block
    # Rows of q/k/v/out: the kernel's frame (its bounds, tables and masks) starts at row_offset.
    at_row = (lambda r: r + row_offset) if row_offset else (lambda r: r)
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    hq, batch_rows = q_ref.shape[2], q_ref.shape[0]
    tiles = cta_ref.shape[1] - first_tile
    if cfg.persistent:
        o_smem, *extra_scratch = extra_scratch
        count, work_index = pipeline.persistent_works(lax.axis_index("ctas"), ctas,
                                                      hq * tiles * batch_rows * splits)

        def work_at(i):
            return _work(cta_ref, *_launch_order(cfg, work_index(i), hq, tiles, batch_rows,
                                                 first_tile), splits, narrow)
    else:
        o_smem, count = qo_smem, 1
        split = lax.axis_index("splits") if splits > 1 else jnp.int32(0)
        tile = _row_block(cfg, lax.axis_index("q_tiles"), tiles, first_tile)
        only = _work(cta_ref, lax.axis_index("batch"), lax.axis_index("heads"), tile, split,
                     splits, narrow)

        def work_at(i):
            return only
    kh_smem, vh_smem, head_bar, *head_free = extra_scratch if narrow else (None,) * 3
    head_free = head_free[0] if head_free else None
    use_sched = wgs == 2 and cfg.schedule_barrier
    as_tile, as_rows = _layouts(interpreted)

    def schedule_barrier():
        plgpu.barrier_arrive(sched_bar)
        plgpu.barrier_wait(sched_bar)

    @pipeline.consumers(wg, wgs)
    def _consumer():
        qo = qo_smem.at[wg]
        rows = rows_smem.at[wg]

        def load_rows(w: _Work):
            """Start the copies of the warpgroup's query rows and their bounds."""
            r0 = w.tile * cfg.cta_rows + wg * bq
            plgpu.copy_gmem_to_smem(q_ref.at[w.batch, pl.ds(at_row(r0), bq), w.head], qo,
                                    q_bar.at[wg])
            plgpu.copy_gmem_to_smem(bounds_ref.at[w.batch, :, pl.ds(r0, bq)], rows,
                                    rows_bar.at[wg])

        def consume(i, base):
            """Work i of this CTA, its ring steps counted from `base`; returns the next base."""
            w = work_at(i)
            r0 = w.tile * cfg.cta_rows + wg * bq
            n_steps, n_raw, s0 = w.n_steps, w.n_raw, w.s0
            raw_done = jnp.minimum(s0, n_raw)            # raw steps before this split's share
            if not cfg.persistent:
                load_rows(w)
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(rows_bar.at[wg])
            # A read followed by a layout cast: the cast is the read's layout (what
            # plgpu.load does, in a form the GPU interpreter also runs).
            raw_lo, core_lo, core_hi = (as_rows(rows.at[j][...]) for j in range(3))
            c = scale * _LOG2E

            raw_visible, core_visible = pipeline.row_masks(raw_lo, core_lo, core_hi, r0,
                                                           (bq, bk), as_tile)

            def attend(carry, k_tile, v_tile, visible, release_keys, await_values,
                       during_values, release_values):
                """One step of the softmax over the keys and values in shared-memory tiles
                `[width, D]`; `visible()` the `[bq, width]` mask (built after the scores'
                product, where it always was: fewer registers live across the wgmma), or
                None."""
                acc, m_i, l_i = carry

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, qo, k_tile.transpose((1, 0)))
                    if use_sched:
                        schedule_barrier()
                    return acc_ref[...]
                if interpreted:   # no transposed wgmma operands there: a plain product
                    sc = lax.dot_general(qo[...], k_tile[...], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
                    if use_sched:
                        schedule_barrier()
                else:
                    sc = pl.run_scoped(scores, plgpu.ACC((bq, k_tile.shape[0]), jnp.float32))
                release_keys()
                if visible is not None:
                    sc = jnp.where(visible(), sc, -jnp.inf)
                m_new = jnp.maximum(m_i, sc.max(axis=1) * c)    # c > 0: max(s)c = max(sc)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(sc * c - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                if use_sched:
                    plgpu.barrier_arrive(sched_bar)
                    await_values()
                    plgpu.barrier_wait(sched_bar)
                else:
                    await_values()

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)
                    during_values()     # while this product runs
                if interpreted:   # no run_state there: a plain product, added
                    acc = acc + jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)
                    during_values()
                else:             # the wgmma accumulates onto acc in place
                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                release_values()
                return acc, m_new, l_i

            def ring_slot(s):
                """The ring slot of this work's step s (the ring runs on across works;
                `base` is 0 for one work a CTA)."""
                return lax.rem(base + s, jnp.int32(stages))

            def step(s, block, carry, visible):
                """One pipeline step: the step's ring slot holds the block's keys and
                values."""
                slot = ring_slot(s)

                def wait_next_keys():
                    nxt = s + 1

                    @pl.when(nxt < n_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[ring_slot(nxt)])
                return attend(carry, k_smem.at[slot], v_smem.at[slot],
                              None if visible is None else lambda: visible(block),
                              lambda: plgpu.barrier_arrive(k_free.at[slot]),
                              lambda: plgpu.barrier_wait(v_ready.at[slot]), wait_next_keys,
                              lambda: plgpu.barrier_arrive(v_free.at[slot]))

            def head_step(_, carry):
                """The narrow head: its own buffers, masked; released (persistent) for the
                next work's head."""
                head_visible, _ = pipeline.row_masks(raw_lo, core_lo, core_hi, r0,
                                                     (bq, narrow), as_tile)
                head_start = w.raw_first * bk - narrow
                plgpu.barrier_wait(head_bar.at[0])
                release = (lambda: plgpu.barrier_arrive(head_free)) if cfg.persistent \
                    else (lambda: None)
                return attend(carry, kh_smem, vh_smem,
                              lambda: head_visible(head_start // narrow),
                              lambda: None, lambda: plgpu.barrier_wait(head_bar.at[1]),
                              lambda: None, release)

            def walk(first, full_first, full_last, last, offset, visible, carry):
                """Steps of blocks [first, last): masked by `visible` outside
                [full_first, full_last)."""
                def masked_step(s, block, carry, masked):
                    return step(s, block, carry, visible if masked else None)
                return pipeline.walk(first, full_first, full_last, last, offset,
                                     masked_step, carry)

            own = w.tile * wgs + wg    # this warpgroup's row in the per-warpgroup table
            carry = (as_tile(jnp.zeros((bq, q_ref.shape[-1]), jnp.float32)),
                     as_rows(jnp.full((bq,), _MAX_INIT, jnp.float32)),
                     as_rows(jnp.zeros((bq,), jnp.float32)))

            @pl.when(n_steps > 0)     # unsplit, n_steps >= 1: every row sees its own key
            def _():
                plgpu.barrier_wait(k_ready.at[ring_slot(0)])
            if use_sched:
                pl.when(wg == 1)(schedule_barrier)
            # this split's raw blocks, then its core blocks (step s0 + s: raw block
            # raw_first + s0 + s while below n_raw, else core block core_first + s0 + s -
            # n_raw)
            raw_end = jnp.minimum(s0 + n_steps, n_raw)
            carry = walk(w.raw_first + raw_done, wg_ref[w.batch, own, RAW_FULL_FIRST],
                         wg_ref[w.batch, own, RAW_FULL_LAST], w.raw_first + raw_end, 0,
                         raw_visible, carry)
            core_start = jnp.maximum(s0, n_raw) - n_raw
            carry = walk(w.core_first + core_start, wg_ref[w.batch, own, CORE_FULL_FIRST],
                         wg_ref[w.batch, own, CORE_FULL_LAST],
                         w.core_first + jnp.maximum(s0 + n_steps - n_raw, core_start),
                         raw_end - raw_done, core_visible, carry)
            if narrow:   # last, as in dq: its copies, issued first, have landed by now
                carry = lax.fori_loop(0, w.n_head, head_step, carry)
            if use_sched:
                pl.when(wg == 0)(schedule_barrier)
            if cfg.persistent:   # Q is free: the next work's rows load during this epilogue
                pipeline.load_next(i, count, load_rows, work_at)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last O is stored
            acc, m_i, l_i = carry
            l_i = jnp.maximum(l_i, 1e-30)
            o_smem.at[wg][...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
            lse_smem.at[wg][...] = m_i + jnp.log(l_i) * _LOG2E
            plgpu.commit_smem()
            out, lse = (out_ref.at[w.split], lse_ref.at[w.split]) if splits > 1 \
                else (out_ref, lse_ref)
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out.at[w.batch, pl.ds(at_row(r0), bq),
                                                          w.head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse.at[w.batch, w.head, pl.ds(r0, bq)])
            if not cfg.persistent:
                plgpu.wait_smem_to_gmem(0)
            return base + n_steps

        pipeline.consume_works(cfg.persistent, count, load_rows, work_at, consume)

    @pipeline.producer(wg, wgs)
    def _producer():
        def produce(i, carry):
            """The copies of work i's steps into the ring, whose steps are counted across
            works from `base`; returns the next (base, narrow heads copied)."""
            base, heads = carry
            w = work_at(i)
            kv_head = w.head if groups == 1 else lax.div(w.head, jnp.int32(groups))
            slot_row = slot_row_ref[w.batch]    # the ck/cv row of this batch row's slots

            def copy(s, slot, raw_ref, core_ref, smem, ready):
                s = w.s0 + s       # the walk's step
                is_raw = s < w.n_raw

                @pl.when(is_raw)
                def _():
                    rows = pl.ds(at_row((w.raw_first + s) * bk), bk)
                    plgpu.copy_gmem_to_smem(raw_ref.at[w.batch, rows, kv_head], smem.at[slot],
                                            ready.at[slot])

                @pl.when(jnp.logical_not(is_raw))
                def _():
                    rows = pl.ds((w.core_first + s - w.n_raw) * bk, bk)
                    plgpu.copy_gmem_to_smem(core_ref.at[slot_row, rows, w.head],
                                            smem.at[slot], ready.at[slot])

            def head_copies():
                rows = pl.ds(at_row(w.raw_first * bk - narrow), narrow)
                plgpu.copy_gmem_to_smem(k_ref.at[w.batch, rows, kv_head], kh_smem,
                                        head_bar.at[0])
                plgpu.copy_gmem_to_smem(v_ref.at[w.batch, rows, kv_head], vh_smem,
                                        head_bar.at[1])

            def copy_head():
                pipeline.copy_narrow_head(w.n_head, heads, head_free, head_copies)

            if not cfg.persistent:
                if narrow:
                    copy_head()
                for s in range(stages):     # fill the ring
                    @pl.when(s < w.n_steps)
                    def _():
                        copy(s, s, k_ref, ck_ref, k_smem, k_ready)
                        copy(s, s, v_ref, cv_ref, v_smem, v_ready)

                def refill(s, _):
                    slot = lax.rem(s, jnp.int32(stages))
                    plgpu.barrier_wait(k_free.at[slot])
                    copy(s, slot, k_ref, ck_ref, k_smem, k_ready)
                    plgpu.barrier_wait(v_free.at[slot])
                    copy(s, slot, v_ref, cv_ref, v_smem, v_ready)
                lax.fori_loop(jnp.int32(stages), jnp.maximum(w.n_steps, stages), refill, None)
                return base + w.n_steps, heads

            def ring_step(s, _):
                """Step s into the ring once the consumers released the slot's last step
                (a slot's first use waits for nothing)."""
                slot = lax.rem(base + s, jnp.int32(stages))
                used = base + s >= stages
                pl.when(used)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                copy(s, slot, k_ref, ck_ref, k_smem, k_ready)
                pl.when(used)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                copy(s, slot, v_ref, cv_ref, v_smem, v_ready)
            # The narrow head (taken last) after the first ring steps: its wait for the last
            # work's head does not hold up this work's first keys.
            first = jnp.minimum(w.n_steps, stages)
            lax.fori_loop(jnp.int32(0), first, ring_step, None)
            if narrow:
                copy_head()
            lax.fori_loop(first, w.n_steps, ring_step, None)
            return base + w.n_steps, heads + w.n_head

        if cfg.persistent:
            total, heads = lax.fori_loop(0, count, produce, (jnp.int32(0), jnp.int32(0)))
        else:
            total, heads = produce(0, (jnp.int32(0), jnp.int32(0)))
        pipeline.drain(total, stages, k_free, v_free)
        if narrow and cfg.persistent:
            pl.when(heads > 0)(lambda: plgpu.barrier_wait(head_free))


# A jit of its own: a program that calls the kernel once a layer with alike arguments (an
# unrolled prefill chunk) traces and lowers it once, not once a layer (the 7B 256-token chunk:
# 23.9 s of host time and 27 MB of module against 3.1 s and 3.0 MB on a 2-core CPU,
# benchmarks/results/research/lowering_probe_cpu.md).
@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "row_offset", "key_splits",
                                             "first_tile", "ctas"))
def forward(q, k, v, ck, cv, bounds, cta_visits, wg_visits, cfg: MosaicConfig,
            interpret=None, row_offset: int = 0, slot_rows=None, key_splits: int = 1,
            first_tile: int = 0, ctas: int = 0):
    """Padded inputs in (module docstring), padded out `[B, Lp, Hq, D]` and log2-sum-exp
    `[B, Hq, Lp]` out. `interpret`: None (compile for the GPU) or the GPU interpreter's
    `InterpretGPUParams` (runs on the CPU, simulating warpgroups, barriers and TMA; for
    tests of the walk, pipeline and softmax: it lacks layouts, run_state and transposed
    wgmma operands, so there the two products are plain dots on the shared-memory tiles).
    `row_offset` (`lead.py`): the kernel computes rows `[row_offset, row_offset + Lp)` of
    q/k/v/out (Lp = the bounds' length, its frame; rows of q/k/v past their end read as
    zeros on the GPU) and leaves out's first `row_offset` rows unwritten. `slot_rows` (int32
    `[B]`, default `arange(B)`): batch row b reads its slots from row `slot_rows[b]` of ck/cv,
    which may then hold other rows too (a KV cache's slots, layers and rows flattened into
    one axis, read in place: `api.blocked_attention_in_cache_mosaic_gpu`); slot blocks past
    ck/cv's end read as zeros on the GPU, where the bounds mask them. `key_splits` S > 1
    (inference: no backward takes these): each (head, row block, batch row) is S CTAs, each
    walking about 1/S of its steps, for calls with too few row blocks to fill the GPU (a
    prefill chunk of a few hundred tokens against 128K of context); out and log2-sum-exp
    then come per split, `[S, ...]`, each normalized over its own keys (`merge_key_splits`
    combines them). `first_tile`: only row blocks `[first_tile, Lp / cta_rows)` run; the
    rows of the blocks before are left unwritten (a prefill chunk's ring rows in front).
    `ctas` (`cfg.persistent` only): the CTAs launched; 0: the GPU's SMs (132 where no GPU
    is attached, 4 under the interpreter)."""
    b, _, hq, d = q.shape
    lp = bounds.shape[-1]
    if not 0 <= first_tile < lp // cfg.cta_rows:
        raise ValueError(f"first_tile must be in [0, {lp // cfg.cta_rows}), got {first_tile}.")
    if key_splits < 1 or (key_splits > 1 and cfg.narrow_block):
        raise ValueError(f"key_splits must be >= 1, and 1 with a narrow head "
                         f"(narrow_block={cfg.narrow_block}); got {key_splits}.")
    split_axis = (key_splits,) if key_splits > 1 else ()
    if slot_rows is None:
        slot_rows = jnp.arange(b, dtype=jnp.int32)
    scale = softmax_scale(cfg, d)
    wgs, stages = cfg.compute_wgs, cfg.stages
    transforms = pipeline.smem_transforms(d, jnp.dtype(q.dtype).itemsize)

    def tiles(n, rows):
        return plgpu.SMEM((n, rows, d), q.dtype, transforms=transforms)
    scratch = (
        tiles(wgs, cfg.block_q),                           # Q, then O
        tiles(stages, cfg.block_kv),                       # K ring
        tiles(stages, cfg.block_kv),                       # V ring
        plgpu.SMEM((wgs, 3, cfg.block_q), jnp.int32),      # per-row bounds
        plgpu.SMEM((wgs, cfg.block_q), jnp.float32),       # log2-sum-exp
        plgpu.Barrier(num_barriers=wgs),                   # Q landed
        plgpu.Barrier(num_barriers=wgs),                   # bounds landed
        plgpu.Barrier(num_barriers=stages),                # K landed
        plgpu.Barrier(num_barriers=stages),                # V landed
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),   # K slot released
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),   # V slot released
        plgpu.Barrier(num_arrivals=wgs),                   # consumers' wgmma schedule
    )
    if cfg.persistent:
        scratch += (tiles(wgs, cfg.block_q),)              # O, stored during the next work
    if cfg.narrow_block:
        # The head's P V product contracts over its `narrow_block` keys, and wgmma takes a
        # contraction of one swizzle width at least: the V head tile uses the narrowest
        # swizzle (32 bytes: 16 keys); the K head is the B operand of Q K^T (contracting
        # over D), so it keeps the ring's swizzle.
        narrow_swizzle = pipeline.narrow_transforms(jnp.dtype(q.dtype).itemsize)
        scratch += (plgpu.SMEM((cfg.narrow_block, d), q.dtype, transforms=transforms),  # K head
                    plgpu.SMEM((cfg.narrow_block, d), q.dtype,
                               transforms=narrow_swizzle),                         # V head
                    plgpu.Barrier(num_barriers=2))                 # K, V head landed
        if cfg.persistent:
            scratch += (plgpu.Barrier(num_arrivals=wgs),)          # the head was taken
    works = hq * (lp // cfg.cta_rows - first_tile) * b * key_splits
    if cfg.persistent:
        ctas = pipeline.persistent_ctas(works, ctas, interpret is not None)
        grid, grid_names = (ctas,), ("ctas",)
    else:
        grid = (hq, lp // cfg.cta_rows - first_tile, b, *split_axis)
        grid_names = ("heads", "q_tiles", "batch", *(("splits",) if split_axis else ()))
    kernel = functools.partial(_kernel, cfg=cfg, groups=hq // k.shape[2], scale=scale,
                               interpreted=interpret is not None, row_offset=row_offset,
                               splits=key_splits, first_tile=first_tile, ctas=ctas)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((*split_axis, *q.shape), q.dtype),
                  jax.ShapeDtypeStruct((*split_axis, b, hq, lp), jnp.float32)),
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        kernel_name="cca_forward",   # profiles tell the four kernels apart by name
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, ck, cv, bounds, cta_visits, wg_visits, slot_rows.astype(jnp.int32))


def merge_key_splits(out, lse, out_dtype):
    """The one softmax over all keys from S partial ones (`forward(key_splits=S)`): out `[S,
    B, L, Hq, D]`, each normalized over its split's keys, and log2-sum-exp `[S, B, Hq, L]`
    -> `[B, L, Hq, D]`, each split weighted by its share of the row's sum."""
    w = jnp.exp2(lse - jnp.max(lse, axis=0, keepdims=True))          # [S, B, Hq, L]
    w = jnp.moveaxis(w, -1, 2)[..., None]                            # [S, B, L, Hq, 1]
    total = jnp.sum(w * out.astype(jnp.float32), axis=0)
    return (total / jnp.sum(w, axis=0)).astype(out_dtype)
