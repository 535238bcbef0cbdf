"""Decode attention against the KV cache through Pallas' Triton lowering (split-K).

One query per row (`[B, Hq, D]`) attends to one float32 softmax over the visible entries of
the ring of raw keys/values (`[B, R, Hkv, D]`, per KV head) and the visible slots (`[B, C, Hq,
D]`, per query head), as `cca_jax.decode.cached_attention` does with dense masks. Here the
visible sets come as three integers per row (`cca_jax.blocks.decode_bounds`): ring entries
`(ring_first + i) % R` for `i < ring_count` and slots `[0, num_slots)`. Only those are read,
so at 32K of context in a 128K-sized cache a quarter of the slots is touched.

Decode is memory-bound, so the work is split for bandwidth, like flash-decoding:
  ring kernel  grid (KV head, ring split, row): the G query heads of a KV head are the rows of
               one tile (zero-padded to 16 for the 2-D dots), so each ring block is read once
               per KV head. Each split takes an equal share of the row's visible entries
               (which may wrap around the ring: at most two contiguous segments).
  slot kernel  grid (query head, slot split, row), heads fastest so that concurrently running
               programs read neighbouring heads of the same slots: each split takes an equal
               share of `[0, num_slots)` (splits follow the row's count, not the capacity, so
               no program idles on invisible slots). Per-head keys: scores by a multiply and
               a row sum (no dot with a single query row), float32 accumulation.
Each program writes an unnormalised partial (output, running max in log2 units, sum); XLA
merges the partials of all splits of both kernels exactly (`_merge_partials`).

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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cca_jax.blocks import DecodeBounds

SUPPORTED_DECODE_HEAD_DIMS = (16, 32, 64, 128, 256)
SLOT_LAYOUTS = ("bchd", "bhcd")  # slots [.., B, C, Hq, D] (KVCache) or [.., B, Hq, C, D]
_BLOCKS = (16, 32, 64, 128, 256, 512)
_LOG2E = math.log2(math.e)
_MAX_INIT = -1e30         # running max of a program that saw nothing: exp2(that - max) = 0
_MIN_ROWS = 16            # rows of a 2-D dot in the Triton lowering
# Programs per kernel the automatic split counts aim at (H200: 132 SMs, several programs
# each, so that enough loads are in flight to saturate the memory bandwidth).
_TARGET_PROGRAMS = 1024


class DecodeConfig(NamedTuple):
    """Static tiling of the two decode kernels (hashable; a field of None is chosen from the
    shapes, see `resolve_splits`).

    block_r / block_c: ring entries / slots per loop step; ring_splits / slot_splits: programs
    per (row, head) sharing the visible entries / slots; *_warps, *_stages: Triton settings.
    """
    block_r: int = 64
    ring_splits: int | None = None
    ring_warps: int = 4
    ring_stages: int = 2
    block_c: int = 64
    slot_splits: int | None = None
    slot_warps: int = 4
    slot_stages: int = 2
    slot_layout: str = "bchd"
    interpret: bool = False


def decode_config(*, interpret: bool = False, **fields) -> DecodeConfig:
    """A checked DecodeConfig with `fields` overriding its defaults (None values ignored)."""
    fields = {name: value for name, value in fields.items() if value is not None}
    for name, value in fields.items():
        if name not in DecodeConfig._fields or name == "interpret":
            raise ValueError(f"unknown decode kernel setting {name!r}; "
                             f"expected one of {DecodeConfig._fields[:-1]}.")
        if name.startswith("block_") and value not in _BLOCKS:
            raise ValueError(f"{name} must be one of {_BLOCKS}, got {value!r}.")
        if name.endswith(("_splits", "_warps", "_stages")) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
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


def _online_update(part: _Partial, s, pv):
    """Fold scores `s` (log2 units, masked ones -inf; [..., block]) into `part`;
    pv(p) -> the block's unnormalised output for probabilities p."""
    m_new = jnp.maximum(part.m, jnp.max(s, axis=-1))
    alpha = jnp.exp2(part.m - m_new)
    p = jnp.exp2(s - m_new[..., None] if s.ndim > 1 else s - m_new)
    acc = part.acc * (alpha[..., None] if s.ndim > 1 else alpha) + pv(p)
    return _Partial(acc, m_new, part.l * alpha + jnp.sum(p, axis=-1))


# ---- ring kernel ----------------------------------------------------------------------------

def _ring_kernel(layer_ref, first_ref, count_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
                 *, ring: int, block: int, splits: int, scale: float):
    layer, first = layer_ref[...], first_ref[...]
    v0, v1 = _split_range(count_ref[...], pl.program_id(1), splits, block)
    q = q_ref[...]                                     # [rows, D], rows >= 16 (zero-padded)
    c = scale * _LOG2E

    def step(start, valid, part):
        rows = (pl.ds(start, block), slice(None))
        k = plgpu.load(k_ref.at[(layer, *rows)], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[(layer, *rows)], mask=valid[:, None], other=0.0)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        s = jnp.where(valid[None, :], s * c, -jnp.inf)
        return _online_update(part, s, lambda p: lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32))

    part = _Partial(jnp.zeros(q.shape, jnp.float32),
                    jnp.full(q.shape[:1], _MAX_INIT, jnp.float32),
                    jnp.zeros(q.shape[:1], jnp.float32))
    # This split's entries, unwrapped: [x0, x1) with 0 <= x0 <= x1 < 2R; entry x % R.
    x0, x1 = first + v0, first + v1
    part = _walk(jnp.minimum(x0, ring), jnp.minimum(x1, ring), block, step, part)
    part = _walk(jnp.maximum(x0, ring) - ring, jnp.maximum(x1, ring) - ring, block, step, part)
    o_ref[...], m_ref[...], l_ref[...] = part


def _ring_partials(q, k_ring, v_ring, layer, bounds, cfg: DecodeConfig, splits: int):
    """Partials `[B, Hq, splits, D]`, `[B, Hq, splits]` x2 of the ring (stacked arrays)."""
    b, hq, d = q.shape
    ring, hkv = k_ring.shape[2], k_ring.shape[3]
    groups = hq // hkv
    rows = max(_MIN_ROWS, 1 << (groups - 1).bit_length())   # a power of two
    qg = jnp.pad(q.reshape(b, hkv, groups, d), ((0, 0), (0, 0), (0, rows - groups), (0, 0)))
    per_row = pl.BlockSpec((None,), lambda h, j, z: (z,))
    kv = pl.BlockSpec((k_ring.shape[0], None, ring, None, d), lambda h, j, z: (0, z, 0, h, 0))
    kernel = functools.partial(_ring_kernel, ring=ring, block=cfg.block_r, splits=splits,
                               scale=1.0 / math.sqrt(d))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(hkv, splits, b),
        in_specs=[per_row, per_row, per_row,
                  pl.BlockSpec((None, None, rows, d), lambda h, j, z: (z, h, 0, 0)), kv, kv],
        out_specs=[pl.BlockSpec((None, None, None, rows, d), lambda h, j, z: (z, h, j, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda h, j, z: (z, h, j, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda h, j, z: (z, h, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.ring_warps,
                                             num_stages=cfg.ring_stages),
        interpret=cfg.interpret,
        name="cca_decode_ring",
    )(layer, bounds.ring_first, bounds.ring_count, qg, k_ring, v_ring)
    # [B, Hkv, S, rows, ...] -> the real rows as query heads: [B, Hq, S, ...].
    heads = lambda x: jnp.moveaxis(x[:, :, :, :groups], 3, 2).reshape(  # noqa: E731
        b, hq, splits, *x.shape[4:])
    return heads(acc), heads(m), heads(l)


# ---- slot kernel ----------------------------------------------------------------------------

def _slot_kernel(layer_ref, count_ref, q_ref, ck_ref, cv_ref, o_ref, m_ref, l_ref,
                 *, block: int, splits: int, scale: float):
    layer = layer_ref[...]
    v0, v1 = _split_range(count_ref[...], pl.program_id(1), splits, block)
    q = q_ref[...].astype(jnp.float32) * (scale * _LOG2E)      # [D], scores in log2 units

    def step(start, valid, part):
        rows = (layer, pl.ds(start, block), slice(None))
        k = plgpu.load(ck_ref.at[rows], mask=valid[:, None], other=0.0)
        v = plgpu.load(cv_ref.at[rows], mask=valid[:, None], other=0.0)
        s = jnp.where(valid, jnp.sum(k.astype(jnp.float32) * q[None, :], axis=1), -jnp.inf)
        return _online_update(
            part, s, lambda p: jnp.sum(p[:, None] * v.astype(jnp.float32), axis=0))

    part = _Partial(jnp.zeros(q.shape, jnp.float32), jnp.float32(_MAX_INIT), jnp.float32(0.0))
    o_ref[...], m_ref[...], l_ref[...] = _walk(v0, v1, block, step, part)


def _slot_partials(q, ck, cv, layer, bounds, cfg: DecodeConfig, splits: int):
    """Partials `[B, Hq, splits, D]`, `[B, Hq, splits]` x2 of the slots (stacked arrays)."""
    b, hq, d = q.shape
    layers = ck.shape[0]
    if cfg.slot_layout == "bchd":
        slots = pl.BlockSpec((layers, None, ck.shape[2], None, d),
                             lambda h, j, z: (0, z, 0, h, 0))
    else:
        slots = pl.BlockSpec((layers, None, None, ck.shape[3], d),
                             lambda h, j, z: (0, z, h, 0, 0))
    per_row = pl.BlockSpec((None,), lambda h, j, z: (z,))
    per_split = pl.BlockSpec((None, None, None), lambda h, j, z: (z, h, j))
    kernel = functools.partial(_slot_kernel, block=cfg.block_c, splits=splits,
                               scale=1.0 / math.sqrt(d))
    return pl.pallas_call(
        kernel,
        grid=(hq, splits, b),
        in_specs=[per_row, per_row,
                  pl.BlockSpec((None, None, d), lambda h, j, z: (z, h, 0)), slots, slots],
        out_specs=[pl.BlockSpec((None, None, None, d), lambda h, j, z: (z, h, j, 0)),
                   per_split, per_split],
        out_shape=[jax.ShapeDtypeStruct((b, hq, splits, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hq, splits), jnp.float32),
                   jax.ShapeDtypeStruct((b, hq, splits), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.slot_warps,
                                             num_stages=cfg.slot_stages),
        interpret=cfg.interpret,
        name="cca_decode_slots",
    )(layer, bounds.num_slots, q, ck, cv)


# ---- merge and entry ------------------------------------------------------------------------

def _merge_partials(partials, dtype):
    """One softmax from per-split partials (acc `[B, Hq, S, D]`, m and l `[B, Hq, S]`)."""
    acc, m, l = (jnp.concatenate(x, axis=2) for x in zip(*partials))
    top = jnp.max(m, axis=2, keepdims=True)     # finite: every row sees its own key
    w = jnp.exp2(m - top)
    denom = jnp.maximum(jnp.sum(w * l, axis=2), 1e-30)
    return (jnp.sum(w[..., None] * acc, axis=2) / denom[..., None]).astype(dtype)


def resolve_splits(cfg: DecodeConfig, batch: int, q_heads: int, kv_heads: int, ring: int,
                   num_slots: int) -> tuple[int, int]:
    """(ring_splits, slot_splits): the config's, or enough programs per kernel to fill the
    GPU (`_TARGET_PROGRAMS`) without splits smaller than one block of the capacity."""
    def auto(chosen, heads, capacity, block):
        if chosen is not None:
            return chosen
        return max(1, min(-(-_TARGET_PROGRAMS // (batch * heads)), -(-capacity // block)))
    return (auto(cfg.ring_splits, kv_heads, ring, cfg.block_r),
            auto(cfg.slot_splits, q_heads, num_slots, cfg.block_c))


def _clip_bounds(bounds, ring: int, num_slots: int) -> DecodeBounds:
    """int32 bounds clipped into the cache, so that no program reads outside it."""
    first, count, slots = (jnp.asarray(x).astype(jnp.int32) for x in bounds)
    return DecodeBounds(jnp.clip(first, 0, ring - 1), jnp.clip(count, 1, ring),
                        jnp.clip(slots, 0, num_slots))


@functools.partial(jax.jit, static_argnames=("cfg", "stacked"))
def decode_attention(q, k_ring, v_ring, ck, cv, layer, bounds, cfg: DecodeConfig,
                     stacked: bool):
    """Checked inputs (cache arrays `[L, B, ...]` when `stacked`, else `[B, ...]`) ->
    float32 `[B, Hq, D]`: both kernels and the merge, in one jit."""
    if not stacked:
        k_ring, v_ring, ck, cv = (x[None] for x in (k_ring, v_ring, ck, cv))
    b, hq, _ = q.shape
    slot_axis = 2 if cfg.slot_layout == "bchd" else 3
    ring, num_slots = k_ring.shape[2], ck.shape[slot_axis]
    bounds = _clip_bounds(bounds, ring, num_slots)
    layer = jnp.broadcast_to(jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_ring.shape[0] - 1),
                             (b,))
    q = q.astype(k_ring.dtype)
    ring_splits, slot_splits = resolve_splits(cfg, b, hq, k_ring.shape[3], ring, num_slots)
    partials = [_ring_partials(q, k_ring, v_ring, layer, bounds, cfg, ring_splits)]
    if num_slots:
        partials.append(_slot_partials(q, ck, cv, layer, bounds, cfg, slot_splits))
    return _merge_partials(partials, jnp.float32)


def _check_bounds(bounds, batch: int) -> None:
    if len(bounds) != 3:
        raise ValueError("bounds must be (ring_first, ring_count, num_slots), e.g. "
                         "cca_jax.blocks.decode_bounds(pattern, positions, R, C).")
    for name, x in zip(DecodeBounds._fields, bounds):
        if np.shape(x) != (batch,) or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"bounds.{name} must be an int array [B={batch}], got "
                             f"{jnp.result_type(x)} {np.shape(x)}.")


def decode_attention_pallas_gpu(q, k_ring, v_ring, ck, cv, bounds, *, layer=None,
                                interpret=None, **tiling):
    """`cca_jax.decode.cached_attention` with per-row bounds instead of masks; float32 out.

    q: `[B, Hq, D]`. k_ring, v_ring: `[B, R, Hkv, D]` (Hq a multiple of Hkv; query head h
    uses KV head h // (Hq / Hkv)). ck, cv: `[B, C, Hq, D]` (C may be 0), or `[B, Hq, C, D]`
    with `slot_layout="bhcd"`. bounds: `cca_jax.blocks.decode_bounds(pattern, t, R, C)` of
    the rows' positions t (`DecodeBounds` or a 3-tuple of int `[B]`). layer: with it, the
    four cache arrays are the stacked `[L, B, ...]` ones of `KVCache` and layer `layer` (an
    int or int scalar, traced or not) is read in place. D a power of two in
    `SUPPORTED_DECODE_HEAD_DIMS`. tiling: `DecodeConfig` fields (block_r, ring_splits,
    block_c, slot_splits, *_warps, *_stages, slot_layout). interpret defaults to True on the
    CPU backend.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = decode_config(interpret=interpret, **tiling)
    shapes = [np.shape(x) for x in (k_ring, v_ring, ck, cv)]
    lead = () if layer is None else (None,)       # the layers axis, any size
    if np.ndim(q) != 3 or any(len(x) != 4 + len(lead) for x in shapes):
        raise ValueError(
            f"q must be [B, Hq, D] and the cache arrays [B, ...] 4-D (or [L, B, ...] 5-D with "
            f"layer=); got q {np.shape(q)}, {shapes} with layer={layer!r}.")
    b, hq, d = np.shape(q)
    if d not in SUPPORTED_DECODE_HEAD_DIMS:
        raise ValueError(f"the Pallas GPU decode kernel supports head_dim in "
                         f"{SUPPORTED_DECODE_HEAD_DIMS}, got {d}; use cached_attention (XLA).")
    k_shape, v_shape, ck_shape, cv_shape = (x[len(lead):] for x in shapes)
    ring, hkv = k_shape[1], k_shape[2]
    if (k_shape[0], k_shape[3]) != (b, d) or v_shape != k_shape or ring < 1 or hq % hkv:
        raise ValueError(f"k_ring and v_ring must be [B, R, Hkv, D] with R >= 1 and Hq a "
                         f"multiple of Hkv; got q {np.shape(q)}, {shapes[0]}, {shapes[1]}.")
    slot_axis = 1 if cfg.slot_layout == "bchd" else 2
    want = [b, ck_shape[slot_axis], ck_shape[slot_axis], d]
    want[3 - slot_axis] = hq
    if (list(ck_shape) != want or cv_shape != ck_shape
            or shapes[2][:len(lead)] != shapes[0][:len(lead)]):
        layout = "[B, C, Hq, D]" if slot_axis == 1 else "[B, Hq, C, D]"
        raise ValueError(f"ck and cv must be {layout} (slot_layout={cfg.slot_layout!r}) "
                         f"like the ring; got {shapes[2]} and {shapes[3]} for q "
                         f"{np.shape(q)}, ring {shapes[0]}.")
    _check_bounds(bounds, b)
    return decode_attention(q, k_ring, v_ring, ck, cv, 0 if layer is None else layer,
                            DecodeBounds(*bounds), cfg, layer is not None)
