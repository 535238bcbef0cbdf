"""Decode attention against the KV cache through Pallas' Triton lowering (split-K).

One query per row (`[B, Hq, D]`) attends to one float32 softmax over the visible entries of
the ring of raw keys/values (`[B, R, Hkv, D]`, per KV head) and the visible slots (`[B, C, Hq,
D]`, per query head), as `cca_jax.decode.cached_attention` does with dense masks. Here the
visible sets come as three integers per row (`cca_jax.blocks.decode_bounds`): ring entries
`(ring_first + i) % R` for `i < ring_count` and slots `[0, num_slots)`. Only those are read,
so at 32K of context in a 128K-sized cache a quarter of the slots is touched.

Decode is memory-bound, so the work is split for bandwidth, like flash-decoding, in two
kernels:
  attention  grid (query head, split, row), heads fastest so that concurrently running
             programs read neighbouring heads of the same entries (the G query heads of one
             KV head share its ring blocks through L2). A row's visible entries form one
             sequence, the ring's (which may wrap: at most two contiguous segments) then the
             slots', and each split takes an equal share of it, so ring and slots are read by
             the same launch and no program idles on invisible slots. Scores and outputs are
             MMA dots of the query repeated on 16 rows (the smallest tile; streaming the 128K
             ring of full attention this was 10% faster than a multiply and row sum on the
             CUDA cores, `dots=False`), float32 accumulation; each program writes an
             unnormalised partial (output, running max in log2 units, sum).
  merge      grid (query head, row): the exact softmax over the splits' partials.
One launch for ring and slots matters at decode: the ring's share alone is too small to use
the GPU (a separate ring kernel took 9 us per layer of the 7B shape, latency-bound), and the
merge in XLA was five small fusions.

The cache's arrays may be passed stacked over layers (`[L, B, ...]`) with a `layer` index, so
that a `lax.scan` over layers hands the kernels the whole cache without slicing (a dynamic
slice feeding a custom call is a copy of the layer). Arrays over 4 GiB use 64-bit offsets in
the Triton lowering, so the stacked cache needs no batch chunking.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cca_jax.blocks import DecodeBounds
from pallas_kernels.shapes import check_decode_inputs

# Head dims the kernel runs at; a cache of another D up to the largest is read at the next
# one up, its loads masked past D (no copy of the cache: the rows are read in place).
DECODE_WIDTHS = (16, 32, 64, 128, 256)
SLOT_LAYOUTS = ("bchd", "bhcd")  # slots [.., B, C, Hq, D] (KVCache) or [.., B, Hq, C, D]
_BLOCKS = (16, 32, 64, 128, 256, 512)
_LOG2E = math.log2(math.e)
_MAX_INIT = -1e30         # running max of a program that saw nothing: exp2(that - max) = 0
# Programs per kernel the automatic split counts aim at (H200: 132 SMs, several programs
# each, so that enough loads are in flight to saturate the memory bandwidth).
_TARGET_PROGRAMS = 1024
_DOT_ROWS = 16            # rows of the smallest 2-D dot of the Triton lowering


class DecodeConfig(NamedTuple):
    """Static tiling of the decode kernel (hashable; `splits=None` is chosen from the shapes,
    see `resolve_splits`).

    block: ring entries / slots per loop step; splits: programs per (row, query head) sharing
    the row's visible entries (a power of two: the merge kernel reads them as one block);
    warps, stages: Triton settings of the main kernel. dots: scores and outputs as MMA dots
    of the query repeated on 16 rows (tensor cores), else as multiply-and-sum on the CUDA
    cores.
    """
    block: int = 64
    splits: int | None = None
    warps: int = 4
    stages: int = 2
    dots: bool = True
    slot_layout: str = "bchd"
    interpret: bool = False


def decode_config(*, interpret: bool = False, **fields) -> DecodeConfig:
    """A checked DecodeConfig with `fields` overriding its defaults (None values ignored)."""
    fields = {name: value for name, value in fields.items() if value is not None}
    for name, value in fields.items():
        if name not in DecodeConfig._fields or name == "interpret":
            raise ValueError(f"unknown decode kernel setting {name!r}; "
                             f"expected one of {DecodeConfig._fields[:-1]}.")
        if name == "block" and value not in _BLOCKS:
            raise ValueError(f"block must be one of {_BLOCKS}, got {value!r}.")
        if name == "dots" and not isinstance(value, bool):
            raise ValueError(f"dots must be a bool, got {value!r}.")
        if name in ("splits", "warps", "stages") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    splits = fields.get("splits", 1)
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two (the merge kernel reads the splits "
                         f"as one block), got {splits}.")
    if fields.get("slot_layout", "bchd") not in SLOT_LAYOUTS:
        raise ValueError(f"slot_layout must be one of {SLOT_LAYOUTS}, "
                         f"got {fields['slot_layout']!r}.")
    return DecodeConfig(interpret=bool(interpret), **fields)


def _cdiv(a, b):
    """Ceiling division of non-negative int32 scalars (lax.div: C semantics, as Triton)."""
    return lax.div(a + b - 1, b)


def _split_range(count, split, splits: int, block: int):
    """`[v0, v1)`: split `split`'s share of `[0, count)`, whole blocks except the last."""
    per = _cdiv(_cdiv(count, splits), block) * block
    v0 = jnp.minimum(split * per, count)
    return v0, jnp.minimum(v0 + per, count)


class _Partial(NamedTuple):
    """A program's running softmax: acc (unnormalised output), m (max, log2 units), l (sum)."""
    acc: jax.Array
    m: jax.Array
    l: jax.Array


def _walk(start, end, block: int, step, carry):
    """Run step(first_index, valid [block], carry) over blocks starting at `start` until
    `end` (exclusive); only the last block can be ragged, and no block is empty."""
    def body(i, carry):
        first = start + i * block
        return step(first, first + jnp.arange(block, dtype=jnp.int32) < end, carry)
    return lax.fori_loop(0, _cdiv(jnp.maximum(end - start, 0), block), body, carry)


def _online_update(part: _Partial, s, v, dots: bool):
    """Fold scores `s` (log2 units, masked ones -inf; `[block]`, or `[16, block]` of 16
    equal rows with `dots`) and values `v` (`[block, D]`) into `part`."""
    m_new = jnp.maximum(part.m, jnp.max(s, axis=-1))
    alpha = jnp.exp2(part.m - m_new)
    if dots:
        p = jnp.exp2(s - m_new[:, None])
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return _Partial(part.acc * alpha[:, None] + pv, m_new,
                        part.l * alpha + jnp.sum(p, axis=-1))
    p = jnp.exp2(s - m_new)
    acc = part.acc * alpha + jnp.sum(p[:, None] * v.astype(jnp.float32), axis=0)
    return _Partial(acc, m_new, part.l * alpha + jnp.sum(p))


# ---- the attention kernel: partials of ring and slots ------------------------------------

def decode_width(d: int) -> int | None:
    """The kernel width a cache of head dim `d` is read at, or None above every width."""
    return next((w for w in DECODE_WIDTHS if w >= d), None)


def _decode_kernel(layer_ref, first_ref, count_ref, slots_ref, q_ref, k_ref, v_ref, ck_ref,
                   cv_ref, o_ref, m_ref, l_ref, *, ring: int, block: int, splits: int,
                   scale: float, dots: bool, head_dim: int):
    """One (query head, split, row): its share of the row's visible ring entries followed by
    its visible slots, as one sequence `[0, ring_count + num_slots)`. With `dots`, the query
    is 16 equal rows (the smallest MMA tile) and every row carries the same softmax. The
    query and outputs are `width` wide (zero-padded past the cache's `head_dim`), and so
    are the key/value loads, masked past `head_dim`."""
    layer, first, count = layer_ref[...], first_ref[...], count_ref[...]
    v0, v1 = _split_range(count + slots_ref[...], pl.program_id(1), splits, block)
    c = scale * _LOG2E                                           # scores in log2 units
    q = q_ref[...]                                                # [D]
    if dots:   # the 16 equal rows are made here, not by XLA: a launch per layer less
        q = jnp.broadcast_to(q[None], (_DOT_ROWS, q.shape[0]))
    else:
        q = q.astype(jnp.float32) * c

    width = q.shape[-1]
    if width == head_dim:
        columns, in_dim = slice(None), None
    else:
        columns = pl.ds(0, width)
        in_dim = jnp.arange(width, dtype=jnp.int32) < head_dim

    def stepper(key_ref, value_ref):
        def step(start, valid, part):
            rows = (layer, pl.ds(start, block), columns)
            mask = valid[:, None] if in_dim is None else valid[:, None] & in_dim[None, :]
            k = plgpu.load(key_ref.at[rows], mask=mask, other=0.0)
            v = plgpu.load(value_ref.at[rows], mask=mask, other=0.0)
            if dots:
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
                s = jnp.where(valid[None, :], s * c, -jnp.inf)
            else:
                s = jnp.where(valid, jnp.sum(k.astype(jnp.float32) * q[None, :], axis=1),
                              -jnp.inf)
            return _online_update(part, s, v, dots)
        return step

    lead = q.shape[:1] if dots else ()
    part = _Partial(jnp.zeros(q.shape, jnp.float32), jnp.full(lead, _MAX_INIT, jnp.float32),
                    jnp.zeros(lead, jnp.float32))
    # Ring entries of this share, unwrapped: [x0, x1) with 0 <= x0 <= x1 < 2R; entry x % R.
    x0, x1 = first + jnp.minimum(v0, count), first + jnp.minimum(v1, count)
    ring_step = stepper(k_ref, v_ref)
    part = _walk(jnp.minimum(x0, ring), jnp.minimum(x1, ring), block, ring_step, part)
    part = _walk(jnp.maximum(x0, ring) - ring, jnp.maximum(x1, ring) - ring, block, ring_step,
                 part)
    part = _walk(jnp.maximum(v0, count) - count, jnp.maximum(v1, count) - count, block,
                 stepper(ck_ref, cv_ref), part)
    if dots:   # the rows are equal: any of them, exactly (max of equal values)
        part = _Partial(jnp.max(part.acc, axis=0), jnp.max(part.m), jnp.max(part.l))
    o_ref[...], m_ref[...], l_ref[...] = part


def _partials(q, k_ring, v_ring, ck, cv, layer, bounds, cfg: DecodeConfig, splits: int):
    """Partials `[B, Hq, splits, W]`, `[B, Hq, splits]` x2 (stacked cache arrays of head dim
    D; q `[B, Hq, W]`, W the kernel width, zero-padded past D)."""
    b, hq, width = q.shape
    layers, ring, hkv, d = k_ring.shape[0], k_ring.shape[2], k_ring.shape[3], k_ring.shape[4]
    groups = hq // hkv
    raw = pl.BlockSpec((layers, None, ring, None, d), lambda h, j, z: (0, z, 0, h // groups, 0))
    if cfg.slot_layout == "bchd":
        slots = pl.BlockSpec((layers, None, ck.shape[2], None, d),
                             lambda h, j, z: (0, z, 0, h, 0))
    else:
        slots = pl.BlockSpec((layers, None, None, ck.shape[3], d),
                             lambda h, j, z: (0, z, h, 0, 0))
    per_row = pl.BlockSpec((None,), lambda h, j, z: (z,))
    per_split = pl.BlockSpec((None, None, None), lambda h, j, z: (z, h, j))
    kernel = functools.partial(_decode_kernel, ring=ring, block=cfg.block, splits=splits,
                               scale=1.0 / math.sqrt(d), dots=cfg.dots, head_dim=d)
    q_spec = pl.BlockSpec((None, None, width), lambda h, j, z: (z, h, 0))
    return pl.pallas_call(
        kernel,
        grid=(hq, splits, b),
        in_specs=[per_row] * 4 + [q_spec, raw, raw, slots, slots],
        out_specs=[pl.BlockSpec((None, None, None, width), lambda h, j, z: (z, h, j, 0)),
                   per_split, per_split],
        out_shape=[jax.ShapeDtypeStruct((b, hq, splits, width), jnp.float32),
                   jax.ShapeDtypeStruct((b, hq, splits), jnp.float32),
                   jax.ShapeDtypeStruct((b, hq, splits), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
        interpret=cfg.interpret,
        name="cca_decode",
    )(layer, bounds.ring_first, bounds.ring_count, bounds.num_slots, q, k_ring, v_ring, ck, cv)


# ---- merge ----------------------------------------------------------------------------------

def _merge_kernel(acc_ref, m_ref, l_ref, o_ref):
    """One (query head, row): the softmax over all splits (every row sees its own key, so
    the largest running max is finite)."""
    m = m_ref[...]
    w = jnp.exp2(m - jnp.max(m))
    out = jnp.sum(w[:, None] * acc_ref[...], axis=0) / jnp.maximum(jnp.sum(w * l_ref[...]),
                                                                   1e-30)
    o_ref[...] = out.astype(o_ref.dtype)


def _merge(acc, m, l, dtype, cfg: DecodeConfig):
    b, hq, splits, d = acc.shape
    per_head = lambda *tail: pl.BlockSpec((None, None, *tail),  # noqa: E731
                                          lambda h, z: (z, h) + (0,) * len(tail))
    return pl.pallas_call(
        _merge_kernel,
        grid=(hq, b),
        in_specs=[per_head(splits, d), per_head(splits), per_head(splits)],
        out_specs=per_head(d),
        out_shape=jax.ShapeDtypeStruct((b, hq, d), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=cfg.interpret,
        name="cca_decode_merge",
    )(acc, m, l)


def resolve_splits(cfg: DecodeConfig, batch: int, q_heads: int, ring: int,
                   num_slots: int) -> int:
    """The config's splits, or the power of two that gives enough programs to fill the GPU
    (`_TARGET_PROGRAMS`) without splits smaller than one block of the capacity."""
    if cfg.splits is not None:
        return cfg.splits
    want = min(-(-_TARGET_PROGRAMS // (batch * q_heads)), -(-(ring + num_slots) // cfg.block))
    return 1 << (max(want, 1) - 1).bit_length()


def _clip_bounds(bounds, ring: int, num_slots: int) -> DecodeBounds:
    """int32 bounds clipped into the cache, so that no program reads outside it."""
    first, count, slots = (jnp.asarray(x).astype(jnp.int32) for x in bounds)
    return DecodeBounds(jnp.clip(first, 0, ring - 1), jnp.clip(count, 1, ring),
                        jnp.clip(slots, 0, num_slots))


@functools.partial(jax.jit, static_argnames=("cfg", "stacked", "out_dtype"))
def decode_attention(q, k_ring, v_ring, ck, cv, layer, bounds, cfg: DecodeConfig,
                     stacked: bool, out_dtype=jnp.float32):
    """Checked inputs (cache arrays `[L, B, ...]` when `stacked`, else `[B, ...]`) ->
    `[B, Hq, D]` in `out_dtype`: the attention kernel and the merge, in one jit."""
    if not stacked:
        k_ring, v_ring, ck, cv = (x[None] for x in (k_ring, v_ring, ck, cv))
    b, hq, d = q.shape
    slot_axis = 2 if cfg.slot_layout == "bchd" else 3
    ring, num_slots = k_ring.shape[2], ck.shape[slot_axis]
    if not num_slots:     # no slots (sliding, full): one zero slot that no row sees
        shape = [1, b, 1, hq, d] if slot_axis == 2 else [1, b, hq, 1, d]
        ck = cv = jnp.zeros(shape, k_ring.dtype)
    bounds = _clip_bounds(bounds, ring, num_slots)
    layer = jnp.broadcast_to(jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_ring.shape[0] - 1),
                             (b,))
    width = decode_width(d)
    q = q.astype(k_ring.dtype)
    if width != d:   # the query only: the cache is read in place, masked past d
        q = jnp.pad(q, ((0, 0), (0, 0), (0, width - d)))
    splits = resolve_splits(cfg, b, hq, ring, num_slots)
    acc, m, l = _partials(q, k_ring, v_ring, ck, cv, layer, bounds, cfg, splits)
    out = _merge(acc, m, l, out_dtype, cfg)
    return out if width == d else out[..., :d]


def decode_attention_pallas_gpu(q, k_ring, v_ring, ck, cv, bounds, *, layer=None,
                                out_dtype=jnp.float32, interpret=None, **tiling):
    """`cca_jax.decode.cached_attention` with per-row bounds instead of masks; `out_dtype`
    out (float32 by default; the model's dtype saves a conversion after the merge).

    q: `[B, Hq, D]`. k_ring, v_ring: `[B, R, Hkv, D]` (Hq a multiple of Hkv; query head h
    uses KV head h // (Hq / Hkv)). ck, cv: `[B, C, Hq, D]` (C may be 0), or `[B, Hq, C, D]`
    with `slot_layout="bhcd"`. bounds: `cca_jax.blocks.decode_bounds(pattern, t, R, C)` of
    the rows' positions t (`DecodeBounds` or a 3-tuple of int `[B]`). layer: with it, the
    four cache arrays are the stacked `[L, B, ...]` ones of `KVCache` and layer `layer` (an
    int or int scalar, traced or not) is read in place. D up to the largest of
    `DECODE_WIDTHS` (others than those read at the next one up, masked). tiling:
    `DecodeConfig` fields (block, splits, warps, stages, slot_layout). interpret defaults to
    True on the CPU backend.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = decode_config(interpret=interpret, **tiling)
    b, hq, d, hkv = check_decode_inputs(q, k_ring, v_ring, ck, cv, bounds,
                                        stacked=layer is not None, slot_layout=cfg.slot_layout)
    if decode_width(d) is None:
        raise ValueError(f"the Pallas GPU decode kernel supports head_dim up to "
                         f"{DECODE_WIDTHS[-1]}, got {d}; use implementation='xla'.")
    return decode_attention(q, k_ring, v_ring, ck, cv, 0 if layer is None else layer,
                            DecodeBounds(*bounds), cfg, layer is not None,
                            jnp.dtype(out_dtype))
