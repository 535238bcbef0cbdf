"""Blocked, memory-linear attention in plain XLA for every option: the portable baseline.

Query blocks of `block_q` rows are processed one after another. Each block walks
  * the raw key blocks of `block_k` keys between the smallest `raw_lo` and the last row of the
    block (`blocks.raw_blocks_for_rows`: full attention walks the whole prefix, a window only
    its width), then
  * the slot blocks of `block_c` slots between the smallest `core_lo` and the largest
    `core_hi` of its rows (`blocks.core_blocks_for_rows`),
with one online softmax over both. Bounds are run-time values, so blocks no row of the query
block can see are never visited, and nothing larger than `[block_q, max(block_k, block_c)]`
scores per head exists at a time. Raw K/V are never repeated for GQA: query heads are laid out
`[Hkv, G]`.

The backward (custom VJP) recomputes probabilities from the saved log-sum-exp, as flash
attention does; the pooling in front of it is differentiated by XLA, so gradients reach q, k
and v through the slots.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cca_jax.attention.backend import Backend
from cca_jax.attention.cached import decode_attention_xla
from cca_jax.attention.pooling import slots_and_bounds
from cca_jax.blocks import CCA, AttentionPattern, core_blocks_for_rows
from cca_jax.padding import pad_row_bounds, pad_rows, round_up, softmax_delta
from cca_jax.remat import name_attention_residuals

_MASKED = -1e30  # finite: max over a fully masked block stays finite (no inf - inf)


class Blocking(NamedTuple):
    """Static tiling of the blocked implementation."""
    scale: float
    block_q: int      # query rows per step, and raw keys per step
    block_c: int      # slots per step
    padded_len: int   # L rounded up to block_q
    padded_slots: int  # m rounded up to block_c


def default_blocking(length: int, num_slots: int, head_dim: int, block_q: int | None = None,
                     block_c: int | None = None) -> Blocking:
    block_q = block_q or min(512, round_up(length, 16))
    block_c = block_c or min(512, round_up(max(num_slots, 1), 16))
    return Blocking(1.0 / math.sqrt(head_dim), block_q, block_c, round_up(length, block_q),
                    round_up(max(num_slots, 1), block_c))


def attention_xla(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                  segment_ids=None, block_q: int | None = None, block_c: int | None = None):
    """Attention under `pattern`, blocked; same signature and result as `run_attention`."""
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, pooling=pooling,
                                       segment_ids=segment_ids)
    blocking = default_blocking(q.shape[1], ck.shape[1], q.shape[-1], block_q, block_c)
    return blocked_attention(q, k, v, ck, cv, *bounds, blocking)


def cca_attention_xla(q, k, v, *, group_size: int, window_size: int, sink_tokens: int = 0,
                      pooling: str = "cca", segment_ids=None, block_q: int | None = None,
                      block_c: int | None = None):
    """CCA attention, blocked; same signature and result as `cca_attention`."""
    return attention_xla(q, k, v, CCA(group_size, window_size, sink_tokens),
                         pooling=pooling, segment_ids=segment_ids, block_q=block_q,
                         block_c=block_c)


# ---- layout ------------------------------------------------------------------------------

def _layout(q, k, v, ck, cv, raw_lo, core_lo, core_hi, p: Blocking):
    """Pad to whole blocks; queries and slots as [B, rows, Hkv, G, D]."""
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    grouped = (b, -1, hkv, hq // hkv, d)
    qp = pad_rows(q, p.padded_len).reshape(grouped)
    ckp = pad_rows(ck, p.padded_slots).reshape(grouped)
    cvp = pad_rows(cv, p.padded_slots).reshape(grouped)
    bounds = pad_row_bounds(raw_lo, core_lo, core_hi, p.padded_len)
    return (qp, pad_rows(k, p.padded_len), pad_rows(v, p.padded_len), ckp, cvp, *bounds)


def _slice(x, start, size, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _raw_scores(qb, kp, vp, r0, j, raw_lo_b, p: Blocking):
    """Raw key block j against the query block at r0: k, v, scores [B,Hkv,G,bq,bk], mask."""
    k0 = j * p.block_q
    kb, vb = _slice(kp, k0, p.block_q), _slice(vp, k0, p.block_q)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32)
    keys = k0 + jnp.arange(p.block_q)
    rows = r0 + jnp.arange(p.block_q)
    mask = (keys[None, None, :] >= raw_lo_b[:, :, None]) & (keys[None, None, :] <= rows[None, :, None])
    return kb, vb, s * p.scale, mask[:, None, None]


def _core_scores(qb, ckp, cvp, c, lo, hi, p: Blocking):
    """Slot block c against a query block: ck, cv, scores [B,Hkv,G,bq,bc], mask."""
    c0 = c * p.block_c
    ckb, cvb = _slice(ckp, c0, p.block_c), _slice(cvp, c0, p.block_c)
    s = jnp.einsum("bqhgd,bchgd->bhgqc", qb, ckb, preferred_element_type=jnp.float32)
    j = c0 + jnp.arange(p.block_c)
    mask = (j[None, None, :] >= lo[:, :, None]) & (j[None, None, :] < hi[:, :, None])
    return ckb, cvb, s * p.scale, mask[:, None, None]


def _block_ranges(r0, raw_lo_b, lo, hi, p: Blocking):
    """Raw key blocks and slot blocks that some row of the query block (any batch row) sees."""
    raw_first = jnp.min(raw_lo_b[:, 0]) // p.block_q
    raw_last = (r0 + p.block_q - 1) // p.block_q + 1
    core_first, _, _, core_last = core_blocks_for_rows(
        jnp.min(lo[:, 0]), jnp.max(lo[:, -1]), jnp.min(hi[:, 0]), jnp.max(hi[:, -1]), p.block_c)
    return (raw_first, raw_last), (core_first, core_last)


# ---- forward / backward ------------------------------------------------------------------

def _online_step(state, s, mask, values, spec: str):
    """Fold one block of scores into the running (max, denominator, accumulator)."""
    row_max, denom, acc = state
    new_max = jnp.maximum(row_max, jnp.where(mask, s, _MASKED).max(-1))
    alpha = jnp.exp(row_max - new_max)
    probs = jnp.where(mask, jnp.exp(s - new_max[..., None]), 0.0)
    acc = acc * alpha[..., None] + jnp.einsum(spec, probs.astype(values.dtype), values,
                                              preferred_element_type=jnp.float32)
    return new_max, denom * alpha + probs.sum(-1), acc


def _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, p: Blocking):
    b, length, hq, d = q.shape
    qp, kp, vp, ckp, cvp, raw_lo, core_lo, core_hi = _layout(
        q, k, v, ck, cv, raw_lo, core_lo, core_hi, p)
    hkv, groups = qp.shape[2], qp.shape[3]

    def query_block(i, carry):
        out, lse = carry
        r0 = i * p.block_q
        qb = _slice(qp, r0, p.block_q)
        rlo = _slice(raw_lo, r0, p.block_q)
        lo, hi = _slice(core_lo, r0, p.block_q), _slice(core_hi, r0, p.block_q)
        raw_range, core_range = _block_ranges(r0, rlo, lo, hi, p)

        def raw_step(j, state):
            _, vb, s, mask = _raw_scores(qb, kp, vp, r0, j, rlo, p)
            return _online_step(state, s, mask, vb, "bhgqk,bkhd->bhgqd")

        def core_step(c, state):
            _, cvb, s, mask = _core_scores(qb, ckp, cvp, c, lo, hi, p)
            return _online_step(state, s, mask, cvb, "bhgqc,bchgd->bhgqd")

        state = (jnp.full((b, hkv, groups, p.block_q), _MASKED, jnp.float32),
                 jnp.zeros((b, hkv, groups, p.block_q), jnp.float32),
                 jnp.zeros((b, hkv, groups, p.block_q, d), jnp.float32))
        state = jax.lax.fori_loop(*raw_range, raw_step, state)
        row_max, denom, acc = jax.lax.fori_loop(*core_range, core_step, state)
        block_out = (acc / denom[..., None]).transpose(0, 3, 1, 2, 4).astype(out.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, block_out, r0, 1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, row_max + jnp.log(denom), r0, 3)
        return out, lse

    out = jnp.zeros(qp.shape, q.dtype)
    lse = jnp.zeros((b, hkv, groups, p.padded_len), jnp.float32)
    out, lse = jax.lax.fori_loop(0, p.padded_len // p.block_q, query_block, (out, lse))
    return out[:, :length].reshape(b, length, hq, d), lse


def _add_at(x, start, update):
    size = update.shape[1]
    return jax.lax.dynamic_update_slice_in_dim(x, _slice(x, start, size) + update, start, 1)


def _backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout, p: Blocking):
    b, length, hq, d = q.shape
    qp, kp, vp, ckp, cvp, raw_lo, core_lo, core_hi = _layout(
        q, k, v, ck, cv, raw_lo, core_lo, core_hi, p)
    hkv, groups = qp.shape[2], qp.shape[3]
    dop = pad_rows(dout, p.padded_len).reshape(qp.shape)
    # delta = rowsum(dO * O), laid out like lse: [B, Hkv, G, Lp].
    delta = pad_rows(softmax_delta(dout, out).transpose(0, 2, 1), p.padded_len)
    delta = delta.reshape(b, p.padded_len, hkv, groups).transpose(0, 2, 3, 1)
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def query_block(i, carry):
        dq, dk, dv, dck, dcv = carry
        r0 = i * p.block_q
        qb, dob = _slice(qp, r0, p.block_q), _slice(dop, r0, p.block_q)
        lse_b = _slice(lse, r0, p.block_q, 3)[..., None]
        delta_b = _slice(delta, r0, p.block_q, 3)[..., None]
        rlo = _slice(raw_lo, r0, p.block_q)
        lo, hi = _slice(core_lo, r0, p.block_q), _slice(core_hi, r0, p.block_q)
        raw_range, core_range = _block_ranges(r0, rlo, lo, hi, p)

        def block_step(scores, block: int, spec_kv: str):
            """Loop body over one kind of key block: adds its dq contribution and its
            (dk, dv); `scores(j)` gives the block's keys, values, scores and mask."""
            def step(j, state):
                dq_b, dk, dv = state
                keys, values, s, mask = scores(j)
                probs = jnp.where(mask, jnp.exp(s - lse_b), 0.0)
                dvb = f32(f"bhgqk,bqhgd->{spec_kv}", probs.astype(values.dtype), dob)
                ds = probs * (f32(f"bqhgd,{spec_kv}->bhgqk", dob, values) - delta_b)
                ds = ds.astype(qp.dtype)
                dq_b = dq_b + f32(f"bhgqk,{spec_kv}->bqhgd", ds, keys) * p.scale
                dkb = f32(f"bhgqk,bqhgd->{spec_kv}", ds, qb) * p.scale
                return dq_b, _add_at(dk, j * block, dkb), _add_at(dv, j * block, dvb)
            return step

        raw_step = block_step(lambda j: _raw_scores(qb, kp, vp, r0, j, rlo, p),
                              p.block_q, "bkhd")
        core_step = block_step(lambda c: _core_scores(qb, ckp, cvp, c, lo, hi, p),
                               p.block_c, "bkhgd")
        dq_b = jnp.zeros(qb.shape, jnp.float32)
        dq_b, dk, dv = jax.lax.fori_loop(*raw_range, raw_step, (dq_b, dk, dv))
        dq_b, dck, dcv = jax.lax.fori_loop(*core_range, core_step, (dq_b, dck, dcv))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_b, r0, 1)
        return dq, dk, dv, dck, dcv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, dk, dv, dck, dcv = jax.lax.fori_loop(
        0, p.padded_len // p.block_q, query_block,
        (zeros(qp), zeros(kp), zeros(vp), zeros(ckp), zeros(cvp)))
    m = ck.shape[1]
    return (dq[:, :length].reshape(q.shape).astype(q.dtype),
            dk[:, :length].astype(k.dtype),
            dv[:, :length].astype(v.dtype),
            dck[:, :m].reshape(ck.shape).astype(ck.dtype),
            dcv[:, :m].reshape(cv.shape).astype(cv.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def blocked_attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking: Blocking):
    """One softmax over raw keys `[raw_lo, t]` and slots `[core_lo, core_hi)` per row."""
    return _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking)[0]


def _blocked_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking):
    out, lse = name_attention_residuals(
        *_forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking))
    return out, (q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse)


def _blocked_bwd(blocking, residuals, dout):
    q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse = residuals
    grads = _backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout, blocking)
    return (*grads, None, None, None)


blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)


class XlaBackend(Backend):
    """Plain XLA on every platform, every option, dtype and head dim: `auto`'s last choice."""

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        return attention_xla(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)

    def _blocked(self, q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window):
        return blocked_attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking)

    def _decode(self, q, k_all, v_all, ck, cv, layer, pattern, positions):
        return decode_attention_xla(q, k_all, v_all, ck, cv, layer, pattern, positions)


XLA = XlaBackend("xla", None, "every platform", frozenset({"attention", "blocked", "decode"}))
