"""Blocked, memory-linear CCA in plain XLA: the baseline every kernel must beat.

Query blocks of `block_q` rows are processed one after another. Each block attends to
  * a fixed window of `W >= block_q + s + g - 2` raw keys ending at its last row (every raw key
    any of its rows can see lies in it), and
  * the core-token blocks of `block_c` slots between the smallest `core_lo` and the largest
    `core_hi` of its rows (a run-time bound: blocks no row can see are never visited),
with one online softmax over both. Nothing larger than `[block_q, W]` scores per head exists at
a time. Raw K/V are never repeated for GQA: query heads are laid out `[Hkv, G]`.

The backward (custom VJP) recomputes probabilities from the saved log-sum-exp, as flash
attention does; the pooling in front of it is differentiated by XLA, so gradients reach q, k
and v through the core tokens.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cca_jax.attention.pooling import core_tokens_and_bounds
from cca_jax.blocks import core_blocks_for_rows

_MASKED = -1e30  # finite: a fully masked block never turns the running max into -inf


class _Blocking(NamedTuple):
    scale: float
    block_q: int
    block_c: int
    window: int       # raw keys per query block
    padded_len: int   # L rounded up to block_q
    padded_core: int  # m rounded up to block_c


def _round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def default_blocking(length: int, num_core: int, head_dim: int, group_size: int,
                     window_size: int, block_q: int | None = None,
                     block_c: int | None = None) -> _Blocking:
    block_q = block_q or min(512, _round_up(length, 16))
    block_c = block_c or min(512, _round_up(max(num_core, 1), 16))
    window = _round_up(block_q + window_size + group_size - 2, 16)
    return _Blocking(1.0 / math.sqrt(head_dim), block_q, block_c, window,
                     _round_up(length, block_q), _round_up(max(num_core, 1), block_c))


def cca_attention_xla(q, k, v, *, group_size: int, window_size: int, pooling: str = "cca",
                      segment_ids=None, block_q: int | None = None, block_c: int | None = None):
    """CCA attention, blocked; same signature and result as `cca_attention`."""
    ck, cv, *bounds = core_tokens_and_bounds(q, k, v, group_size=group_size,
                                             window_size=window_size, pooling=pooling,
                                             segment_ids=segment_ids)
    blocking = default_blocking(q.shape[1], ck.shape[1], q.shape[-1], group_size, window_size,
                                block_q, block_c)
    return blocked_attention(q, k, v, ck, cv, *bounds, blocking)


# ---- layout ------------------------------------------------------------------------------

def _pad_axis1(x, before: int, after: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (before, after)
    return jnp.pad(x, pad, constant_values=value)


def _layout(q, k, v, ck, cv, raw_lo, core_lo, core_hi, p: _Blocking):
    """Pad to whole blocks; queries and core tokens as [B, rows, Hkv, G, D]."""
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    extra = p.padded_len - length
    qp = _pad_axis1(q, 0, extra).reshape(b, p.padded_len, hkv, hq // hkv, d)
    # Left padding puts the window of query block i at padded offset i * block_q.
    kp = _pad_axis1(k, p.window - p.block_q, extra)
    vp = _pad_axis1(v, p.window - p.block_q, extra)
    m = ck.shape[1]
    ckp = _pad_axis1(ck, 0, p.padded_core - m).reshape(b, p.padded_core, hkv, hq // hkv, d)
    cvp = _pad_axis1(cv, 0, p.padded_core - m).reshape(b, p.padded_core, hkv, hq // hkv, d)
    # Padded rows see only themselves (a zero key) and the last row's core tokens: finite,
    # discarded, and the bounds stay non-decreasing along the row as blocks.py requires.
    pad_rows = jnp.broadcast_to(jnp.arange(length, p.padded_len, dtype=jnp.int32), (b, extra))
    raw_lo = jnp.concatenate([raw_lo, pad_rows], axis=1)
    core_lo = jnp.pad(core_lo, ((0, 0), (0, extra)), mode="edge")
    core_hi = jnp.pad(core_hi, ((0, 0), (0, extra)), mode="edge")
    return qp, kp, vp, ckp, cvp, raw_lo, core_lo, core_hi


def _slice(x, start, size, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _raw_block(qp, kp, vp, raw_lo, r0, p: _Blocking):
    """Query block at row r0, its raw window, scores [B,Hkv,G,bq,W] and visibility mask."""
    qb = _slice(qp, r0, p.block_q)
    kw, vw = _slice(kp, r0, p.window), _slice(vp, r0, p.window)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kw, preferred_element_type=jnp.float32)
    keys = r0 + p.block_q - p.window + jnp.arange(p.window)
    rows = r0 + jnp.arange(p.block_q)
    lo = _slice(raw_lo, r0, p.block_q)
    mask = (keys[None, None, :] >= lo[:, :, None]) & (keys[None, None, :] <= rows[None, :, None])
    return qb, kw, vw, scores * p.scale, mask[:, None, None]


def _core_block(qb, ckp, cvp, lo, hi, c, p: _Blocking):
    """Core block c against a query block: scores [B,Hkv,G,bq,bc] and visibility mask."""
    c0 = c * p.block_c
    ckb, cvb = _slice(ckp, c0, p.block_c), _slice(cvp, c0, p.block_c)
    scores = jnp.einsum("bqhgd,bchgd->bhgqc", qb, ckb, preferred_element_type=jnp.float32)
    j = c0 + jnp.arange(p.block_c)
    mask = (j[None, None, :] >= lo[:, :, None]) & (j[None, None, :] < hi[:, :, None])
    return ckb, cvb, scores * p.scale, mask[:, None, None]


def _core_block_range(lo, hi, p: _Blocking):
    """Core blocks holding any slot visible to some row of the block (any batch row)."""
    first, _, _, last = core_blocks_for_rows(
        jnp.min(lo[:, 0]), jnp.max(lo[:, -1]), jnp.min(hi[:, 0]), jnp.max(hi[:, -1]), p.block_c)
    return first, last


# ---- forward / backward ------------------------------------------------------------------

def _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, p: _Blocking):
    b, length, hq, d = q.shape
    qp, kp, vp, ckp, cvp, raw_lo, core_lo, core_hi = _layout(
        q, k, v, ck, cv, raw_lo, core_lo, core_hi, p)
    hkv, groups = qp.shape[2], qp.shape[3]

    def query_block(i, carry):
        out, lse = carry
        r0 = i * p.block_q
        qb, _, vw, s, mask = _raw_block(qp, kp, vp, raw_lo, r0, p)
        s = jnp.where(mask, s, _MASKED)
        row_max = s.max(-1)
        probs = jnp.exp(s - row_max[..., None])
        denom = probs.sum(-1)
        acc = jnp.einsum("bhgqk,bkhd->bhgqd", probs.astype(vp.dtype), vw,
                         preferred_element_type=jnp.float32)
        lo, hi = _slice(core_lo, r0, p.block_q), _slice(core_hi, r0, p.block_q)

        def core_step(c, state):
            row_max, denom, acc = state
            _, cvb, sc, cmask = _core_block(qb, ckp, cvp, lo, hi, c, p)
            sc = jnp.where(cmask, sc, _MASKED)
            new_max = jnp.maximum(row_max, sc.max(-1))
            alpha = jnp.exp(row_max - new_max)
            pc = jnp.exp(sc - new_max[..., None])
            acc = acc * alpha[..., None] + jnp.einsum(
                "bhgqc,bchgd->bhgqd", pc.astype(cvp.dtype), cvb,
                preferred_element_type=jnp.float32)
            return new_max, denom * alpha + pc.sum(-1), acc

        row_max, denom, acc = jax.lax.fori_loop(
            *_core_block_range(lo, hi, p), core_step, (row_max, denom, acc))
        block_out = (acc / denom[..., None]).transpose(0, 3, 1, 2, 4).astype(out.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, block_out, r0, 1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, row_max + jnp.log(denom), r0, 3)
        return out, lse

    out = jnp.zeros(qp.shape, q.dtype)
    lse = jnp.zeros((b, hkv, groups, p.padded_len), jnp.float32)
    out, lse = jax.lax.fori_loop(0, p.padded_len // p.block_q, query_block, (out, lse))
    return out[:, :length].reshape(b, length, hq, d), lse


def _backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout, p: _Blocking):
    b, length, hq, d = q.shape
    qp, kp, vp, ckp, cvp, raw_lo, core_lo, core_hi = _layout(
        q, k, v, ck, cv, raw_lo, core_lo, core_hi, p)
    hkv, groups = qp.shape[2], qp.shape[3]
    dop = _pad_axis1(dout, 0, p.padded_len - length).reshape(qp.shape)
    # delta = rowsum(dO * O), laid out like lse: [B, Hkv, G, Lp].
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = _pad_axis1(delta, 0, p.padded_len - length).reshape(b, p.padded_len, hkv, groups)
    delta = delta.transpose(0, 2, 3, 1)
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def query_block(i, carry):
        dq, dk, dv, dck, dcv = carry
        r0 = i * p.block_q
        qb, kw, vw, s, mask = _raw_block(qp, kp, vp, raw_lo, r0, p)
        dob = _slice(dop, r0, p.block_q)
        lse_b = _slice(lse, r0, p.block_q, 3)[..., None]
        delta_b = _slice(delta, r0, p.block_q, 3)[..., None]
        probs = jnp.where(mask, jnp.exp(s - lse_b), 0.0)
        dv_w = f32("bhgqk,bqhgd->bkhd", probs.astype(vp.dtype), dob)
        ds = probs * (f32("bqhgd,bkhd->bhgqk", dob, vw) - delta_b)
        ds = ds.astype(qp.dtype)
        dq_b = f32("bhgqk,bkhd->bqhgd", ds, kw) * p.scale
        dk_w = f32("bhgqk,bqhgd->bkhd", ds, qb) * p.scale
        dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, r0, p.window) + dk_w, r0, 1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, r0, p.window) + dv_w, r0, 1)
        lo, hi = _slice(core_lo, r0, p.block_q), _slice(core_hi, r0, p.block_q)

        def core_step(c, state):
            dq_b, dck, dcv = state
            ckb, cvb, sc, cmask = _core_block(qb, ckp, cvp, lo, hi, c, p)
            pc = jnp.where(cmask, jnp.exp(sc - lse_b), 0.0)
            dcv_b = f32("bhgqc,bqhgd->bchgd", pc.astype(cvp.dtype), dob)
            dsc = (pc * (f32("bqhgd,bchgd->bhgqc", dob, cvb) - delta_b)).astype(qp.dtype)
            dq_b = dq_b + f32("bhgqc,bchgd->bqhgd", dsc, ckb) * p.scale
            dck_b = f32("bhgqc,bqhgd->bchgd", dsc, qb) * p.scale
            c0 = c * p.block_c
            dck = jax.lax.dynamic_update_slice_in_dim(
                dck, _slice(dck, c0, p.block_c) + dck_b, c0, 1)
            dcv = jax.lax.dynamic_update_slice_in_dim(
                dcv, _slice(dcv, c0, p.block_c) + dcv_b, c0, 1)
            return dq_b, dck, dcv

        dq_b, dck, dcv = jax.lax.fori_loop(
            *_core_block_range(lo, hi, p), core_step, (dq_b, dck, dcv))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_b, r0, 1)
        return dq, dk, dv, dck, dcv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, dk, dv, dck, dcv = jax.lax.fori_loop(
        0, p.padded_len // p.block_q, query_block,
        (zeros(qp), zeros(kp), zeros(vp), zeros(ckp), zeros(cvp)))
    offset = p.window - p.block_q
    m = ck.shape[1]
    return (dq[:, :length].reshape(q.shape).astype(q.dtype),
            dk[:, offset:offset + length].astype(k.dtype),
            dv[:, offset:offset + length].astype(v.dtype),
            dck[:, :m].reshape(ck.shape).astype(ck.dtype),
            dcv[:, :m].reshape(cv.shape).astype(cv.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def blocked_attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking: _Blocking):
    """One softmax over raw keys `[raw_lo, t]` and core slots `[core_lo, core_hi)` per row."""
    return _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking)[0]


def _blocked_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking):
    out, lse = _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking)
    return out, (q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse)


def _blocked_bwd(blocking, residuals, dout):
    q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse = residuals
    grads = _backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout, blocking)
    return (*grads, None, None, None)


blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)
