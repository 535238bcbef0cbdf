"""CCA attention through Pallas' Triton lowering: forward, dq, dk/dv and dck/dcv kernels.

Layout: q `[B, L, Hq, D]`, k/v `[B, L, Hkv, D]`, slots ck/cv `[B, m, Hq, D]` (prepared by the
caller: `cca_jax.attention.pallas_gpu` pools them in XLA), per-row int32 bounds
raw_lo/core_lo/core_hi `[B, L]` (`cca_jax.blocks.pattern_ranges`). Nothing is transposed;
sequences are zero-padded to whole blocks (padded rows see only their own zero key, so every
loaded value is finite; in interpret mode nothing is ever read out of bounds).

Kernels (grid dims: block, head, batch, at most 3 as the Triton lowering requires; launch order
heavy first where that is faster, see `KernelConfig.forward_heavy_first`):
  forward   per (query block, query head): ONE online softmax, base 2, over the raw-window
            key blocks first (every row sees its own key, so the running max is finite
            before any fully masked block) and then the core blocks; only edge blocks
            compute a mask (behind a uniform branch). Returns out and the log2-sum-exp.
  dq        per (query block, query head): the same walk (each loop split in three, so
            only the edge loops mask), probabilities recomputed from the log-sum-exp.
  dkv       per (raw key block, KV head): loops over the G query heads of the group and
            over the query blocks that see the key block (`blocks.row_blocks_for_interval`
            on `blocks.raw_key_rows`); GQA gradients are summed in registers, no partials.
  dcore     per (core block, query head), heads on the fastest grid axis: loops over the
            query blocks that see the slots (`blocks.core_slot_rows`).
The backward keeps dq separate from dkv and dcore: folding dq in with float32 atomics is
slower under atomic contention (benchmarks/results/pallas_gpu_h200_notes.md).
The block-visit arithmetic all comes from `cca_jax.blocks`; per-block bounds are the first
and last rows' values (bounds are monotone along rows, keys and slots).
"""

from __future__ import annotations

import functools
import math
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cca_jax import blocks
from cca_jax.padding import pad_row_bounds, pad_rows, round_up, softmax_delta
from cca_jax.remat import name_attention_residuals

# Masked scores are -inf, so exp2(score * scale - shift) is exactly 0 for them whatever the
# (finite) shift; the running max starts finite, so a fully masked block leaves it finite and
# no -inf - -inf can occur. (A finite "large negative" score would not do with the FMA: its
# rounding residual, s * c - round(s * c), is about 1e22 and exp2 of it overflows.)
_MASKED = -jnp.inf
_MAX_INIT = -1e30
_LOG2E = math.log2(math.e)
# Head dims the kernels are tiled for; others up to the largest are zero-padded to the next
# (`padded_head_dim`): zero columns change no score, and the softmax keeps 1/sqrt(real D).
KERNEL_HEAD_DIMS = (64, 128, 256)


def padded_head_dim(d: int) -> int | None:
    """The kernel head dim that `d` runs at (`d` itself or the next one up, zero-padded), or
    None when `d` is above every kernel's."""
    return next((width for width in KERNEL_HEAD_DIMS if width >= d), None)


class KernelConfig(NamedTuple):
    """Static tiling, block walks and launch orders of all four kernels (hashable: a
    custom_vjp non-diff argument; every field is read when the kernels trace, so a jit cache
    keyed on the config sees every change)."""
    # Defaults: the fastest tiling of the H200 sweep for bf16 at the paper's 128K shape
    # (benchmarks/results/pallas_gpu_h200.md); each fits sm_90's shared memory.
    block_q: int = 128          # forward
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    dq_block_q: int = 128       # dq kernel
    dq_block_k: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 3
    dkv_block_k: int = 128      # dk/dv kernel (raw key blocks)
    dkv_block_q: int = 64
    dkv_num_warps: int = 8
    dkv_num_stages: int = 3
    dc_block_k: int = 128       # dck/dcv kernel (core blocks)
    dc_block_q: int = 64
    dc_num_warps: int = 8
    dc_num_stages: int = 3
    # Raw-window edge blocks visited narrow (`blocks.narrow_head` / `narrow_tail`), per
    # kernel: a forward (dq) window that starts in the last `narrow_block` (`dq_narrow_block`)
    # keys of a key block visits only those; a dk/dv key block last seen in the first
    # `dkv_narrow_block` rows of a query block visits only those. 0: off; else a power of two
    # >= 16 (Triton's smallest dot). With sinks (N % g != 0) most windows start off the block
    # grid (benchmarks/results/research/cca_sinks_speed_h200.md).
    # On the H200 at 128K with 4 sinks the forward's head saved 1.5%, while dq's and dk/dv's
    # cost 0.4% and 1.6% more than they saved (research/sinks_narrow_h200.md): off there.
    narrow_block: int = 16
    dq_narrow_block: int = 0
    dkv_narrow_block: int = 0
    # How each kernel walks its blocks (a key of LOOP_STYLES): the faster of the two per
    # kernel on the H200 (measurements: benchmarks/results/pallas_gpu_h200_notes.md).
    # key_loop_style: the dk/dv and dck/dcv kernels.
    forward_loop_style: str = "cond"
    dq_loop_style: str = "split"
    key_loop_style: str = "split"
    # Launch order. CTAs start in grid order, and a query block's work grows along the
    # sequence while a core block's shrinks, so the last CTAs launched can be a kernel's
    # heaviest and run on alone. Heavy first: the forward and dq take query blocks last to
    # first; dck/dcv puts the heads on the fastest grid axis, so every head's heaviest core
    # blocks start together. Each default is the faster order of that kernel on the H200
    # (dq keeps the plain order; measurements: benchmarks/results/pallas_gpu_h200_notes.md).
    forward_heavy_first: bool = True
    dq_heavy_first: bool = False
    dcore_heavy_first: bool = True
    # The head dim of the softmax scale 1/sqrt(D) when the inputs are zero-padded from a
    # smaller one (`padded_head_dim`); 0: the inputs' own.
    softmax_head_dim: int = 0
    interpret: bool = False

    @property
    def row_multiple(self) -> int:
        return max(self.block_q, self.block_k, self.dq_block_q, self.dq_block_k,
                   self.dkv_block_k, self.dkv_block_q, self.dc_block_q)

    @property
    def slot_multiple(self) -> int:
        return max(self.block_k, self.dq_block_k, self.dc_block_k)


def _softmax_scale(cfg: KernelConfig, d: int) -> float:
    return 1.0 / math.sqrt(cfg.softmax_head_dim or d)


def _params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a, b, *, ta: bool = False, tb: bool = False):
    """2-D matmul with float32 accumulation; ta/tb contract a's rows / b's columns."""
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _split_loops(bounds, body, carry):
    """Run body(j, carry, masked) over [first, last), unmasked on [full_first, full_last)."""
    first, full_first, full_last, last = bounds
    carry = lax.fori_loop(first, full_first, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_first, full_last, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full_last, last, functools.partial(body, masked=True), carry)


def _cond_loops(bounds, body, carry):
    """Like `_split_loops` in one loop: body(j, carry, masked=<traced bool>)."""
    first, full_first, full_last, last = bounds

    def step(j, carry):
        return body(j, carry, masked=(j < full_first) | (j >= full_last))
    return lax.fori_loop(first, last, step, carry)


# Block walks by name (KernelConfig.*_loop_style): three loops (masked edge, unmasked middle,
# masked edge) or one loop whose edge iterations mask behind a uniform branch.
LOOP_STYLES = types.MappingProxyType({"split": _split_loops, "cond": _cond_loops})
_LOOP_STYLE_FIELDS = ("forward_loop_style", "dq_loop_style", "key_loop_style")
_HEAVY_FIRST_FIELDS = ("forward_heavy_first", "dq_heavy_first", "dcore_heavy_first")


def check_config(cfg: KernelConfig) -> KernelConfig:
    """`cfg` if its walk and launch-order fields are valid, else ValueError."""
    for name in _LOOP_STYLE_FIELDS:
        if getattr(cfg, name) not in LOOP_STYLES:
            raise ValueError(f"{name} must be one of {sorted(LOOP_STYLES)}, "
                             f"got {getattr(cfg, name)!r}.")
    for name in _HEAVY_FIRST_FIELDS:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(cfg, name)!r}.")
    return cfg


def _query_block(i, num_blocks, heavy_first: bool):
    """The query block that grid index `i` runs: the last first when `heavy_first`."""
    return num_blocks - 1 - i if heavy_first else i


def _apply_mask(masked, mask, s):
    """mask(s) when `masked`: a Python bool (split loops) or a traced one (`_cond_loops`)."""
    if isinstance(masked, bool):
        return mask(s) if masked else s
    return lax.cond(masked, mask, lambda s: s, s)


def _raw_visible(key, row, raw_lo):
    """Row `row` sees raw key `key` (operands broadcast: [rows, keys] or [keys, rows])."""
    return (key >= raw_lo) & (key <= row)


def _core_visible(slot, core_lo, core_hi):
    """A row with core range `[core_lo, core_hi)` sees core slot `slot` (broadcast)."""
    return (slot >= core_lo) & (slot < core_hi)


def _first_last(ref):
    """(smallest, largest) of a block's bound vector. Bounds are non-decreasing along rows
    (keys, slots), so these are its first and last entries: two scalar loads instead of two
    block reductions (1.5-2% of the forward at 128K on the H200: 25.9-26.0 vs 26.5 ms)."""
    return ref[0], ref[ref.shape[0] - 1]


def _kv_head_map(groups: int):
    if groups == 1:
        return lambda h: h
    return lambda h: lax.div(h, groups)


def _walk_visible_blocks(q, k_ref, v_ref, ck_ref, cv_ref, r0, rlo_ref, clo_ref, chi_ref, *,
                         block_k: int, narrow: int, step, carry, loops):
    """Fold `step(key_block, value_block, scores, carry)` over the blocks rows `[r0, r0+bq)` see.

    Raw-window blocks first (every row sees its own key, so a running max is finite before
    any fully masked block), then core blocks; only edge blocks get a mask (`loops` is
    `_split_loops` or `_cond_loops`). A window starting in the last `narrow` keys of a block
    visits only those of it (`blocks.narrow_head`).
    Scores are `q @ k.T`, unscaled (callers fold the scale into one FMA with the shift they
    subtract before `exp2`), masked entries `-inf`.
    """
    rows = r0 + jnp.arange(q.shape[0], dtype=jnp.int32)
    rlo, clo, chi = rlo_ref[...], clo_ref[...], chi_ref[...]

    def visit(keys_ref, values_ref, visible, k0, width: int, carry, masked):
        kb = keys_ref[pl.ds(k0, width), :]
        vb = values_ref[pl.ds(k0, width), :]
        s = _dot(q, kb, tb=True)

        def mask(s):
            return jnp.where(visible(k0 + jnp.arange(width, dtype=jnp.int32)), s, _MASKED)
        return step(kb, vb, _apply_mask(masked, mask, s), carry)

    def loop_body(keys_ref, values_ref, visible):
        def body(j, carry, masked):
            return visit(keys_ref, values_ref, visible, j * block_k, block_k, carry, masked)
        return body

    def raw_visible(keys):
        return _raw_visible(keys[None, :], rows[:, None], rlo[:, None])

    def core_visible(slots):
        return _core_visible(slots[None, :], clo[:, None], chi[:, None])

    r1 = r0 + q.shape[0] - 1
    rlo_first, rlo_last = _first_last(rlo_ref)
    raw = blocks.raw_blocks_for_rows(r0, r1, rlo_first, rlo_last, block_k)
    if 0 < narrow < block_k:
        head, head_start, raw = blocks.narrow_head(raw, rlo_first, block_k, narrow)
        carry = lax.fori_loop(0, head, lambda _, carry: visit(
            k_ref, v_ref, raw_visible, head_start, narrow, carry, True), carry)
    carry = loops(raw, loop_body(k_ref, v_ref, raw_visible), carry)
    return loops(blocks.core_blocks_for_rows(*_first_last(clo_ref), *_first_last(chi_ref),
                                             block_k),
                 loop_body(ck_ref, cv_ref, core_visible), carry)


class _QuerySpecs(NamedTuple):
    """Grid and BlockSpecs of a kernel over (query block, query head, batch)."""
    grid: tuple
    q: pl.BlockSpec           # [bq, D] rows of one query head (q, dO, out, dq)
    rows: pl.BlockSpec        # [bq] per-row bounds
    head_rows: pl.BlockSpec   # [bq] per-(head, row) values (lse, delta)
    kv: pl.BlockSpec          # the whole sequence of the head's KV head
    core: pl.BlockSpec        # all core slots of the head


def _query_specs(q, k, ck, block_q: int, heavy_first: bool) -> _QuerySpecs:
    b, lp, hq, d = q.shape
    kvh = _kv_head_map(hq // k.shape[2])
    nq = lp // block_q
    qb = functools.partial(_query_block, num_blocks=nq, heavy_first=heavy_first)
    return _QuerySpecs(
        grid=(nq, hq, b),
        q=pl.BlockSpec((None, block_q, None, d), lambda i, h, z: (z, qb(i), h, 0)),
        rows=pl.BlockSpec((None, block_q), lambda i, h, z: (z, qb(i))),
        head_rows=pl.BlockSpec((None, None, block_q), lambda i, h, z: (z, h, qb(i))),
        kv=pl.BlockSpec((None, lp, None, d), lambda i, h, z: (z, 0, kvh(h), 0)),
        core=pl.BlockSpec((None, ck.shape[1], None, d), lambda i, h, z: (z, 0, h, 0)))


def _query_kernel(kernel, scale: float, block_q: int, block_k: int, narrow: int,
                  loop_style: str, heavy_first: bool):
    return functools.partial(kernel, block_q=block_q, block_k=block_k, narrow=narrow,
                             scale=scale,
                             loops=LOOP_STYLES[loop_style], heavy_first=heavy_first)


# ---- forward -----------------------------------------------------------------------------

def _fwd_kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, rlo_ref, clo_ref, chi_ref,
                o_ref, lse_ref, *, block_q: int, block_k: int, narrow: int, scale: float,
                loops, heavy_first: bool):
    r0 = _query_block(pl.program_id(0), pl.num_programs(0), heavy_first) * block_q
    q = q_ref[...]
    c = scale * _LOG2E
    d = q.shape[-1]

    def step(kb, vb, s, carry):      # running max m_i in scaled (log2) units
        acc, m_i, l_i = carry
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * c)     # c > 0: max(s) * c = max(s * c)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s * c - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb)
        return acc, m_new, l_new

    carry = (jnp.zeros((block_q, d), jnp.float32),
             jnp.full((block_q,), _MAX_INIT, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = _walk_visible_blocks(q, k_ref, v_ref, ck_ref, cv_ref, r0, rlo_ref, clo_ref,
                                 chi_ref, block_k=block_k, narrow=narrow, step=step,
                                 carry=carry, loops=loops)
    acc, m_i, l_i = carry
    l_i = jnp.maximum(l_i, 1e-30)   # every row sees its own key: l >= 1; guard anyway
    o_ref[...] = (acc / l_i[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m_i + jnp.log2(l_i)


def _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg: KernelConfig):
    """Padded inputs in, padded out `[B, Lp, Hq, D]` and log2-sum-exp `[B, Hq, Lp]` out."""
    b, lp, hq, _ = q.shape
    specs = _query_specs(q, k, ck, cfg.block_q, cfg.forward_heavy_first)
    return pl.pallas_call(
        _query_kernel(_fwd_kernel, _softmax_scale(cfg, q.shape[-1]), cfg.block_q, cfg.block_k,
                      cfg.narrow_block, cfg.forward_loop_style, cfg.forward_heavy_first),
        grid=specs.grid,
        in_specs=[specs.q, specs.kv, specs.kv, specs.core, specs.core,
                  specs.rows, specs.rows, specs.rows],
        out_specs=[specs.q, specs.head_rows],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, lp), jnp.float32)],
        compiler_params=_params(cfg.num_warps, cfg.num_stages),
        interpret=cfg.interpret,
        name="cca_fwd",
    )(q, k, v, ck, cv, raw_lo, core_lo, core_hi)


# ---- backward: dq --------------------------------------------------------------------------

def _dq_kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, do_ref, lse_ref, delta_ref,
               rlo_ref, clo_ref, chi_ref, dq_ref, *, block_q: int, block_k: int, narrow: int,
               scale: float, loops, heavy_first: bool):
    r0 = _query_block(pl.program_id(0), pl.num_programs(0), heavy_first) * block_q
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    c = scale * _LOG2E

    def step(kb, vb, s, dq):
        p = jnp.exp2(s * c - lse[:, None])
        dp = _dot(do, vb, tb=True)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(kb.dtype), kb)

    dq = _walk_visible_blocks(q, k_ref, v_ref, ck_ref, cv_ref, r0, rlo_ref, clo_ref, chi_ref,
                              block_k=block_k, narrow=narrow, step=step,
                              carry=jnp.zeros(q.shape, jnp.float32), loops=loops)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dq(q, k, v, ck, cv, do, lse, delta, raw_lo, core_lo, core_hi, cfg: KernelConfig):
    specs = _query_specs(q, k, ck, cfg.dq_block_q, cfg.dq_heavy_first)
    return pl.pallas_call(
        _query_kernel(_dq_kernel, _softmax_scale(cfg, q.shape[-1]), cfg.dq_block_q,
                      cfg.dq_block_k, cfg.dq_narrow_block, cfg.dq_loop_style,
                      cfg.dq_heavy_first),
        grid=specs.grid,
        in_specs=[specs.q, specs.kv, specs.kv, specs.core, specs.core, specs.q,
                  specs.head_rows, specs.head_rows, specs.rows, specs.rows, specs.rows],
        out_specs=specs.q,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg.dq_num_warps, cfg.dq_num_stages),
        interpret=cfg.interpret,
        name="cca_bwd_dq",
    )(q, k, v, ck, cv, do, lse, delta, raw_lo, core_lo, core_hi)


# ---- backward: dk/dv over raw key blocks ----------------------------------------------------

def _key_side_call(kernel, grid, in_specs, block, like, num_warps: int, num_stages: int,
                   interpret: bool, name: str):
    """The pallas_call of a kernel over key-side blocks: two outputs (dk, dv or dck, dcv) in
    `block`s, shaped like the two arrays of `like`."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=[block, block],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in like],
        compiler_params=_params(num_warps, num_stages), interpret=interpret, name=name)


def _key_grads(vb, q, do, lse, delta, s_t, c, dk, dv):
    """One (key block, query block) tile, transposed: s_t [bk, bq] = k @ q.T (unscaled), c the
    log2 softmax scale."""
    p_t = jnp.exp2(s_t * c - lse[None, :])
    dv = dv + _dot(p_t.astype(do.dtype), do)
    dp_t = _dot(vb, do, tb=True)
    ds_t = (p_t * (dp_t - delta[None, :])).astype(q.dtype)
    dk = dk + _dot(ds_t, q)
    return dk, dv


def _dkv_kernel(q_ref, do_ref, lse_ref, delta_ref, rlo_ref, k_ref, v_ref, last_row_ref,
                dk_ref, dv_ref, *, block_q: int, block_k: int, narrow: int, groups: int,
                head_dim: int, padded_len: int, scale: float, loops):
    k0 = pl.program_id(0) * block_k
    keys = k0 + jnp.arange(block_k, dtype=jnp.int32)
    kb, vb = k_ref[...], v_ref[...]
    c = scale * _LOG2E
    last_row = _first_last(last_row_ref)
    bounds = blocks.row_blocks_for_interval(k0, k0 + block_k - 1, *last_row, block_q)
    narrow_tail = 0 < narrow < block_q   # the last query block's rows up to last_row[1] only
    if narrow_tail:
        tail, tail_start, bounds = blocks.narrow_tail(bounds, last_row[1], block_q, narrow)

    def head(gi, carry):         # query heads of this KV head, summed in registers
        def tile(r0, rows: int, carry, masked):
            dk, dv = carry
            q = q_ref[pl.ds(r0, rows), pl.ds(gi * head_dim, head_dim)]
            do = do_ref[pl.ds(r0, rows), pl.ds(gi * head_dim, head_dim)]
            lse = lse_ref[pl.ds(gi * padded_len + r0, rows)]
            delta = delta_ref[pl.ds(gi * padded_len + r0, rows)]
            s_t = _dot(kb, q, tb=True)

            def mask(s_t):
                row_ids = r0 + jnp.arange(rows, dtype=jnp.int32)
                rlo = rlo_ref[pl.ds(r0, rows)]
                return jnp.where(_raw_visible(keys[:, None], row_ids[None, :], rlo[None, :]),
                                 s_t, _MASKED)
            s_t = _apply_mask(masked, mask, s_t)
            return _key_grads(vb, q, do, lse, delta, s_t, c, dk, dv)

        carry = loops(bounds, lambda i, carry, masked: tile(i * block_q, block_q, carry,
                                                             masked), carry)
        if not narrow_tail:
            return carry
        return lax.fori_loop(0, tail, lambda _, carry: tile(tail_start, narrow, carry, True),
                             carry)

    zeros = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
    if groups == 1:
        dk, dv = head(0, zeros)
    else:   # a loop, not unrolled: one copy of the code, registers shared across heads
        dk, dv = lax.fori_loop(0, groups, head, zeros)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv(q, k, v, do, lse, delta, raw_lo, last_row, cfg: KernelConfig):
    b, lp, hq, d = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    bk, bq = cfg.dkv_block_k, cfg.dkv_block_q
    # Views (free reshapes): the G query heads of a KV head side by side.
    qg = q.reshape(b, lp, hkv, groups * d)
    dog = do.reshape(b, lp, hkv, groups * d)
    lseg = lse.reshape(b, hkv, groups * lp)
    deltag = delta.reshape(b, hkv, groups * lp)
    kernel = functools.partial(_dkv_kernel, block_q=bq, block_k=bk,
                               narrow=cfg.dkv_narrow_block,
                               groups=groups,
                               head_dim=d, padded_len=lp, scale=_softmax_scale(cfg, d),
                               loops=LOOP_STYLES[cfg.key_loop_style])
    whole_q = pl.BlockSpec((None, lp, None, groups * d), lambda i, h, z: (z, 0, h, 0))
    whole_rows = pl.BlockSpec((None, None, groups * lp), lambda i, h, z: (z, h, 0))
    k_block = pl.BlockSpec((None, bk, None, d), lambda i, h, z: (z, i, h, 0))
    in_specs = [whole_q, whole_q, whole_rows, whole_rows,
                pl.BlockSpec((None, lp), lambda i, h, z: (z, 0)),
                k_block, k_block, pl.BlockSpec((None, bk), lambda i, h, z: (z, i))]
    return _key_side_call(kernel, (lp // bk, hkv, b), in_specs, k_block, (k, v),
                          cfg.dkv_num_warps, cfg.dkv_num_stages, cfg.interpret,
                          "cca_bwd_dkv")(qg, dog, lseg, deltag, raw_lo, k, v, last_row)


# ---- backward: dck/dcv over core blocks ------------------------------------------------------

def _dcore_kernel(q_ref, do_ref, lse_ref, delta_ref, clo_ref, chi_ref, ck_ref, cv_ref,
                  first_row_ref, end_row_ref, dck_ref, dcv_ref, *, block_q: int, block_c: int,
                  scale: float, loops, heavy_first: bool):
    c0 = pl.program_id(1 if heavy_first else 0) * block_c
    slots = c0 + jnp.arange(block_c, dtype=jnp.int32)
    kb, vb = ck_ref[...], cv_ref[...]
    c = scale * _LOG2E
    bounds = blocks.row_blocks_for_interval(*_first_last(first_row_ref),
                                            *_first_last(end_row_ref), block_q)

    def body(i, carry, masked):
        dk, dv = carry
        r0 = i * block_q
        q = q_ref[pl.ds(r0, block_q), :]
        do = do_ref[pl.ds(r0, block_q), :]
        lse = lse_ref[pl.ds(r0, block_q)]
        delta = delta_ref[pl.ds(r0, block_q)]
        s_t = _dot(kb, q, tb=True)

        def mask(s_t):
            clo = clo_ref[pl.ds(r0, block_q)]
            chi = chi_ref[pl.ds(r0, block_q)]
            return jnp.where(_core_visible(slots[:, None], clo[None, :], chi[None, :]),
                             s_t, _MASKED)
        s_t = _apply_mask(masked, mask, s_t)
        return _key_grads(vb, q, do, lse, delta, s_t, c, dk, dv)

    dk, dv = loops(bounds, body, (jnp.zeros(kb.shape, jnp.float32),
                                  jnp.zeros(vb.shape, jnp.float32)))
    dck_ref[...] = (dk * scale).astype(dck_ref.dtype)
    dcv_ref[...] = dv.astype(dcv_ref.dtype)


def _dcore(q, ck, cv, do, lse, delta, core_lo, core_hi, first_row, end_row,
           cfg: KernelConfig):
    b, lp, hq, d = q.shape
    mp = ck.shape[1]
    bc, bq = cfg.dc_block_k, cfg.dc_block_q
    kernel = functools.partial(_dcore_kernel, block_q=bq, block_c=bc,
                               scale=_softmax_scale(cfg, d),
                               loops=LOOP_STYLES[cfg.key_loop_style],
                               heavy_first=cfg.dcore_heavy_first)
    # Grid (core block, head, batch), or (head, core block, batch) when heavy first; the
    # index maps see (core block, head, batch) either way.
    grid, ids = (mp // bc, hq, b), (lambda i, h, z: (i, h, z))
    if cfg.dcore_heavy_first:
        grid, ids = (hq, mp // bc, b), (lambda h, i, z: (i, h, z))

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda *g: index(*ids(*g)))
    whole_q = spec((None, lp, None, d), lambda i, h, z: (z, 0, h, 0))
    whole_rows = spec((None, None, lp), lambda i, h, z: (z, h, 0))
    bounds_row = spec((None, lp), lambda i, h, z: (z, 0))
    c_block = spec((None, bc, None, d), lambda i, h, z: (z, i, h, 0))
    slot_block = spec((None, bc), lambda i, h, z: (z, i))
    in_specs = [whole_q, whole_q, whole_rows, whole_rows, bounds_row, bounds_row,
                c_block, c_block, slot_block, slot_block]
    return _key_side_call(kernel, grid, in_specs, c_block, (ck, cv), cfg.dc_num_warps,
                          cfg.dc_num_stages, cfg.interpret, "cca_bwd_dcore")(
        q, do, lse, delta, core_lo, core_hi, ck, cv, first_row, end_row)


# ---- padding and the custom VJP ----------------------------------------------------------------

def _padded(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg: KernelConfig):
    """Zero-pad rows to whole blocks; padded rows see only themselves (bounds stay monotone)."""
    lp = round_up(q.shape[1], cfg.row_multiple)
    mp = round_up(max(ck.shape[1], 1), cfg.slot_multiple)
    return (pad_rows(q, lp), pad_rows(k, lp), pad_rows(v, lp), pad_rows(ck, mp),
            pad_rows(cv, mp), *pad_row_bounds(raw_lo, core_lo, core_hi, lp))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def cca_core_attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg: KernelConfig):
    """One softmax over raw keys `[raw_lo, t]` and core slots `[core_lo, core_hi)` per row."""
    return _cca_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg)[0]


def _cca_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg):
    check_config(cfg)
    length = q.shape[1]
    padded = _padded(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg)
    out, lse = _forward(*padded, cfg)
    out, lse = name_attention_residuals(out[:, :length], lse)
    return out, (q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse)


def _cca_bwd(cfg, residuals, dout):
    return (*cca_backward(*residuals, dout, cfg), None, None, None)


def cca_backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout,
                 cfg: KernelConfig):
    """(dq, dk, dv, dck, dcv) of `cca_core_attention` from its forward's residuals.

    Also the backward of other forwards of the same function (the Mosaic GPU kernels):
    `out` `[B, L, Hq, D]` and `lse` `[B, Hq, >= L]` float32, the log2-sum-exp of the scaled
    scores (`m + log2(l)` with scores in units of `scale * log2(e)`). Rows past L (a
    forward's own padding) are replaced by this kernel's: zeros, harmless since their dO is 0.
    """
    length, m = q.shape[1], ck.shape[1]
    qp, kp, vp, ckp, cvp, rlo, clo, chi = _padded(q, k, v, ck, cv, raw_lo, core_lo, core_hi,
                                                  cfg)
    lp, mp = qp.shape[1], ckp.shape[1]
    if lse.shape[-1] != lp:
        lse = jnp.pad(lse[..., :length], ((0, 0), (0, 0), (0, lp - length)))
    # delta = rowsum(dO * O) [B, Hq, Lp]; the scale of the log2 softmax cancels in dS.
    delta = jnp.pad(softmax_delta(dout, out), ((0, 0), (0, 0), (0, lp - length)))
    dop = pad_rows(dout.astype(q.dtype), lp)
    last_row = blocks.raw_key_rows(rlo)
    first_row, end_row = blocks.core_slot_rows(clo, chi, mp)
    dq = _dq(qp, kp, vp, ckp, cvp, dop, lse, delta, rlo, clo, chi, cfg)
    dk, dv = _dkv(qp, kp, vp, dop, lse, delta, rlo, last_row, cfg)
    dck, dcv = _dcore(qp, ckp, cvp, dop, lse, delta, clo, chi, first_row, end_row, cfg)
    return dq[:, :length], dk[:, :length], dv[:, :length], dck[:, :m], dcv[:, :m]


cca_core_attention.defvjp(_cca_fwd, _cca_bwd)
