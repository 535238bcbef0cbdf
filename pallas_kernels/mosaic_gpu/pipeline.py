"""Pieces the Mosaic GPU kernels share: the swizzle of shared-memory tiles, layout casts,
the two kinds of matrix product (wgmma on the GPU, plain dots under the GPU interpreter),
the producer's ring of shared-memory buffers, the split block walk of the consumers, and
the row-bounds masks of a score tile (the forward uses the masks too).

Every backward kernel is one CTA of `compute_wgs` consumer warpgroups and one producer
warpgroup (the last; `consumers` and `producer` run each its part, with FA3's register
split). The producer TMA-copies each step's operands into ring slot `step % stages` once
every consumer has released that slot; the consumers walk the same steps (they share the
ring) and mask what their own rows or keys do not see.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu.config import INTERPRETED_CTAS, gpu_core_count, swizzle_bytes

# FA3's register split when two consumers share an SM with the producer (registers per
# thread: 2 x 128 x 232 + 128 x 40 fits an SM's 64K).
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


def consumers(wg, wgs: int):
    """Decorator: runs the body on warpgroups 0..wgs-1, the consumers; two of them take the
    registers the producer gives up (FA3's split, `CONSUMER_REGISTERS`)."""
    return _warpgroup_role(wg < wgs, wgs, CONSUMER_REGISTERS, "increase")


def producer(wg, wgs: int):
    """Decorator: runs the body on warpgroup `wgs`, the producer of the copies; beside two
    consumers it keeps only `PRODUCER_REGISTERS`."""
    return _warpgroup_role(wg == wgs, wgs, PRODUCER_REGISTERS, "decrease")


def _warpgroup_role(mine, wgs: int, registers: int, action: str):
    def run(body):
        @pl.when(mine)
        def _():
            if wgs == 2:
                plgpu.set_max_registers(registers, action=action)
            body()
        return body
    return run


def smem_transforms(head_dim: int, itemsize: int = 2) -> tuple:
    """The shared-memory tiling and swizzle of `[rows, head_dim]` tiles: the widest swizzle
    (128, 64 or 32 bytes) that divides a row, in tiles of 8 rows by one swizzle width."""
    row = head_dim * itemsize
    swizzle = swizzle_bytes(row)
    if swizzle is None:
        raise ValueError(f"rows of {row} bytes (head_dim={head_dim}) are not a multiple of 32 "
                         "bytes: no shared-memory swizzle fits; use implementation='pallas_gpu' "
                         "or 'xla'.")
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def narrow_transforms(itemsize: int = 2) -> tuple:
    """The shared-memory tiling of a tile that is the B operand of a product contracting
    over its rows when those are a narrow head's 16 keys: wgmma contracts over at least one
    swizzle width, so the narrowest swizzle (32 bytes: 16 elements of 16 bits)."""
    return (plgpu.TilingTransform((8, 32 // itemsize)), plgpu.SwizzleTransform(32))


def layouts(interpreted: bool):
    """(tile, rows, cols) casts: a wgmma tile's layout, and the layouts of vectors along its
    rows (one value per row: broadcast over columns) and along its columns. The GPU
    interpreter runs arrays without layouts (it has no rule for the cast): identities."""
    if interpreted:
        return (lambda x: x), (lambda x: x), (lambda x: x)
    cast = plgpu.layout_cast
    return (functools.partial(cast, new_layout=plgpu.Layout.WGMMA),
            functools.partial(cast, new_layout=plgpu.Layout.WGMMA.reduce(1)),
            functools.partial(cast, new_layout=plgpu.Layout.WGMMA.reduce(0)))


def scores(a_smem, b_smem, interpreted: bool):
    """float32 `a @ b.T` of two shared-memory tiles `[M, D]`, `[N, D]`: wgmma with a
    transposed B operand, or (interpreter: no transposed wgmma operands there) a plain dot."""
    if interpreted:
        return lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    shape = (a_smem.shape[0], b_smem.shape[0])

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def two_scores(a_smem, b_smem, c_smem, d_smem, interpreted: bool):
    """(float32 `a @ b.T`, float32 `c @ d.T`) of shared-memory tiles: on the GPU both
    wgmmas are issued before one wait (the dq step's S = Q K^T and dP = dO V^T); under the
    interpreter two `scores`."""
    if interpreted:
        return scores(a_smem, b_smem, True), scores(c_smem, d_smem, True)

    def products(first_ref, second_ref):
        plgpu.wgmma(first_ref, a_smem, b_smem.transpose((1, 0)))
        plgpu.wgmma(second_ref, c_smem, d_smem.transpose((1, 0)))
        return first_ref[...], second_ref[...]
    return pl.run_scoped(products, plgpu.ACC((a_smem.shape[0], b_smem.shape[0]), jnp.float32),
                         plgpu.ACC((c_smem.shape[0], d_smem.shape[0]), jnp.float32))


def transposed_products(a_tiles, b_tiles, interpreted: bool):
    """float32 `sum_i a_i.T @ b_i` of shared-memory tiles `a_i` `[K, M]` and `b_i` `[K, N]`
    (the fused backward's dQ = dS K from dS^T tiles): wgmmas with the A operand transposed
    from shared memory into one accumulator, or (interpreter) plain dots."""
    if interpreted:
        return sum(lax.dot_general(a[...], b[...], (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
                   for a, b in zip(a_tiles, b_tiles))
    shape = (a_tiles[0].shape[1], b_tiles[0].shape[1])

    def product(acc_ref):
        for a, b in zip(a_tiles, b_tiles):
            plgpu.wgmma(acc_ref, a.transpose((1, 0)), b)
        return acc_ref[...]
    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def accumulate(acc, a, b_smem, interpreted: bool):
    """`acc + a @ b` with `a` in registers `[M, K]` (the operand dtype) and `b` a
    shared-memory tile `[K, N]`: wgmma accumulating in place, or (interpreter: no run_state
    there) a plain dot added."""
    if interpreted:
        return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
    return pl.run_state(product)(plgpu.ACC.init(acc))


def accumulate_and_score(acc, a, b_smem, c_smem, d_smem, interpreted: bool):
    """(`acc + a @ b`, float32 `c @ d.T`): on the GPU both wgmmas are issued before one wait
    (the dk/dv step's dV += P^T dO and dP^T = V dO^T, as jax's attention_mgpu pairs them);
    under the interpreter `accumulate` and `scores`."""
    if interpreted:
        return accumulate(acc, a, b_smem, True), scores(c_smem, d_smem, True)

    def products(refs):
        acc_ref, scores_ref = refs
        plgpu.wgmma(acc_ref, a, b_smem)
        plgpu.wgmma(scores_ref, c_smem, d_smem.transpose((1, 0)))
    zeros = plgpu.layout_cast(jnp.zeros((c_smem.shape[0], d_smem.shape[0]), jnp.float32),
                              plgpu.Layout.WGMMA)
    return pl.run_state(products)((plgpu.ACC.init(acc), plgpu.ACC.init(zeros)))


def row_masks(raw_lo, core_lo, core_hi, first_row, shape, as_tile):
    """(raw_visible(block), core_visible(block)): the entries of a `shape` = (rows, keys)
    score tile, for query rows `first_row + i` with per-row bounds (vectors along the rows),
    that see key block `block`: raw keys `[raw_lo, row]`, or slots `[core_lo, core_hi)`."""
    _, keys = shape

    def wide(x):
        return lax.broadcast_in_dim(x, shape, [0])

    def iota(dim):
        return as_tile(lax.broadcasted_iota(jnp.int32, shape, dim))

    def raw_visible(block):
        key = iota(1) + block * keys
        return (key >= wide(raw_lo)) & (key <= iota(0) + first_row)

    def core_visible(block):
        slot = iota(1) + block * keys
        return (slot >= wide(core_lo)) & (slot < wide(core_hi))
    return raw_visible, core_visible


def produce(n_steps, stages: int, copy, free) -> None:
    """The producer's loop: `copy(step, slot)` issues step's TMA copies into ring slot
    `step % stages`, after the consumers released the slot's previous step on `free`.
    Finally awaits the releases of the last steps too, so every phase of `free` is observed
    (the GPU interpreter checks that). `n_steps` may be 0."""
    for s in range(stages):     # fill the ring
        @pl.when(s < n_steps)
        def _():
            copy(jnp.int32(s), s)

    def refill(s, _):
        slot = lax.rem(s, jnp.int32(stages))
        plgpu.barrier_wait(free.at[slot])
        copy(s, slot)
    lax.fori_loop(jnp.int32(stages), jnp.maximum(n_steps, stages), refill, None)

    def drain(s, _):
        plgpu.barrier_wait(free.at[lax.rem(s, jnp.int32(stages))])
    lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, drain, None)


def produce_from(base, n_steps, stages: int, copy, free, after_first=None) -> None:
    """A persistent CTA's producer for one work: `copy(step, slot)` issues the work's step
    into ring slot `(base + step) % stages`, the ring's steps counted across works from
    `base`; a slot's first use waits for nothing, later ones for the consumers' release of
    its last step on `free`. `after_first()` runs after the first `stages` steps' copies
    (a narrow head's, which may wait for the last work's head to be taken)."""
    def ring_step(s, _):
        slot = lax.rem(base + s, jnp.int32(stages))
        pl.when(base + s >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
        copy(s, slot)
    first = jnp.minimum(n_steps, stages)
    lax.fori_loop(jnp.int32(0), first, ring_step, None)
    if after_first is not None:
        after_first()
    lax.fori_loop(first, n_steps, ring_step, None)


def copy_narrow_head(n_head, heads, head_free, copies) -> None:
    """`copies()` (a narrow head's TMA copies) where the work takes a head (`n_head` > 0),
    after the last head copied (`heads` so far) was taken, on `head_free` (persistent CTAs;
    None: one work a CTA, nothing to wait for)."""
    @pl.when(n_head > 0)
    def _():
        if head_free is not None:
            pl.when(heads > 0)(lambda: plgpu.barrier_wait(head_free))
        copies()


def drain(total, stages: int, *frees) -> None:
    """Await the consumers' release of the ring's last `stages` steps (of `total`) on each of
    `frees`: every phase of the release barriers is then observed (the GPU interpreter checks
    that)."""
    def body(s, _):
        for free in frees:
            plgpu.barrier_wait(free.at[lax.rem(s, jnp.int32(stages))])
    lax.fori_loop(jnp.maximum(total - stages, 0), total, body, None)


def unravel(index, dims: tuple):
    """(i_0, ..., i_n, rest) of a flat `index` over `dims` (the first fastest): a CTA's
    coordinates in launch order, `rest` its index over what follows `dims`."""
    out = []
    for dim in dims:
        out.append(lax.rem(index, jnp.int32(dim)))
        index = lax.div(index, jnp.int32(dim))
    return (*out, index)


def persistent_ctas(works: int, ctas: int, interpreted: bool) -> int:
    """CTAs of a persistent launch of `works` works: `ctas`, or (0) the GPU's SMs (132 where
    no GPU is attached; a few under the interpreter, so each walks several); never more
    than the works."""
    return min(works, ctas or (INTERPRETED_CTAS if interpreted else gpu_core_count()))


def persistent_works(cta, ctas: int, works: int):
    """(count, work(i)) of persistent CTA `cta` of `ctas`: works go round in waves of
    `ctas`, the CTA order reversed every other wave (a snake: the heavier end of a wave
    alternates, so no CTA takes the heavy end of every wave)."""
    waves, rest = divmod(works, ctas)
    last_wave_takes = (cta < rest) if waves % 2 == 0 else (cta >= ctas - rest)
    count = waves + jnp.where(last_wave_takes, 1, 0).astype(jnp.int32)

    def work(i):
        lane = jnp.where(lax.rem(i, 2) == 0, cta, ctas - 1 - cta)
        return i * ctas + lane
    return count, work


def consume_works(persistent: bool, count, load, work_at, consume) -> None:
    """The consumers' loop over their CTA's works: `consume(i, base)` runs work i, its ring
    steps counted from `base`, and returns the next base. Persistent: the first work's
    operands are loaded here (`load(work)`; `consume` loads each next one early), and the
    last stores awaited at the end; else the one work, which loads its own, from base 0.
    That base is a Python 0, not `jnp.int32(0)`: jax 0.11's Mosaic GPU lowering refuses a
    kernel whose ring slot adds the concrete array to a step ("Shaped arrays must be
    represented by ir.Values, got: 0"), where jax 0.10's lowers it (`.ci/newest-jax`)."""
    if not persistent:
        consume(0, 0)
        return
    pl.when(count > 0)(lambda: load(work_at(0)))
    lax.fori_loop(0, count, consume, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def load_next(i, count, load, work_at) -> None:
    """Persistent CTAs: start the copies of work i + 1's own operands (`load`), if any."""
    pl.when(i + 1 < count)(lambda: load(work_at(i + 1)))


def walk(first, full_first, full_last, last, offset, step, carry):
    """`step(s, block, carry, masked)` over blocks `[first, last)` (ring step `s = block -
    first + offset`); masked (a Python bool) outside `[full_first, full_last)`, which is
    clipped into the walk first (a warpgroup's own full range inside its CTA's walk)."""
    full_first = jnp.clip(full_first, first, last)
    full_last = jnp.clip(full_last, full_first, last)

    def body(masked):
        return lambda j, carry: step(j - first + offset, j, carry, masked)
    carry = lax.fori_loop(first, full_first, body(True), carry)
    carry = lax.fori_loop(full_first, full_last, body(False), carry)
    return lax.fori_loop(full_last, last, body(True), carry)
