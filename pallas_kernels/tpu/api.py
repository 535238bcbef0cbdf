"""Public entries of the Pallas TPU (Mosaic) kernels and their custom VJP.

`blocked_attention_pallas_tpu` runs one softmax per row over raw keys `[raw_lo, t]` and slots
`[core_lo, core_hi)` of prepared keys/values: every attention option (full, sliding,
streaming, CCA) is such a pattern, so these kernels serve all of them. The slots and bounds
are prepared by the caller (`cca_jax.attention.pallas_tpu`, which pools the core tokens).

Padding happens outside the custom VJP (autodiff slices the gradients back): rows to a
multiple of lcm(block_q, block_k) (padded rows see only their own zero key,
`padding.pad_row_bounds`), slots to a multiple of block_c, and head dims to a multiple of 128
with zeros (no dot product changes; the scale stays `1/sqrt(D)` of the caller's D).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from cca_jax import blocks
from cca_jax.padding import pad_row_bounds, pad_rows, round_up, softmax_delta
from cca_jax.remat import name_attention_residuals
from pallas_kernels.tpu import key_kernels, query_kernels
from pallas_kernels.tpu.common import LANES, KernelConfig, check_config, head_view, row_layout
from pallas_kernels.tpu.decode import check_decode_inputs, decode_attention
from pallas_kernels.tpu.key_kernels import KeyWalk
from pallas_kernels.tpu.query_kernels import QueryWalk
from pallas_kernels.shapes import check_blocked_inputs


def default_interpret():
    """The TPU interpreter on CPU (out-of-bounds reads raise, fresh memory is NaN); False on
    TPU."""
    return pltpu.InterpretParams() if jax.default_backend() == "cpu" else False


def kernel_config(*, interpret=None, **fields) -> KernelConfig:
    """KernelConfig with `fields` overriding its defaults (None values ignored);
    interpret=None: `default_interpret()`."""
    fields = {name: value for name, value in fields.items() if value is not None}
    for name in fields:
        if name not in KernelConfig._fields or name == "interpret":
            raise ValueError(f"unknown TPU kernel setting {name!r}; valid: "
                             f"{[f for f in KernelConfig._fields if f != 'interpret']}.")
    interpret = default_interpret() if interpret is None else interpret
    return check_config(KernelConfig(interpret=interpret, **fields))


class _Plan(NamedTuple):
    """Everything static about one call (a custom_vjp non-diff argument)."""
    cfg: KernelConfig
    query: QueryWalk
    raw_keys: KeyWalk
    slots: KeyWalk | None


def _plan(cfg: KernelConfig, length: int, padded_len: int, padded_slots: int, groups: int,
          head_dim: int, padded_head_dim: int, window: int) -> _Plan:
    scale = 1.0 / math.sqrt(head_dim)
    nq, nk = padded_len // cfg.block_q, padded_len // cfg.block_k
    nc = padded_slots // cfg.block_c
    width = max(1, min(window, length))     # the most raw keys any row sees
    raw_steps, _ = blocks.query_block_steps(width, padded_len, cfg.block_q, cfg.block_k, nc)
    key_steps = blocks.key_block_steps(width, padded_len, cfg.block_k, cfg.block_q)
    query = QueryWalk(raw_steps, nc, nq, nk, nc, groups, padded_head_dim, scale)
    raw_keys = KeyWalk(key_steps, groups, nq, nk, padded_head_dim, scale, slots=False)
    slots = KeyWalk(nq, 1, nq, nc, padded_head_dim, scale, slots=True) if nc else None
    return _Plan(cfg, query, raw_keys, slots)


def _query_inputs(q, k, v, ck, cv, raw_lo, core_lo, core_hi, plan: _Plan):
    inputs = dict(q=head_view(q), k=head_view(k), v=head_view(v), raw_lo=row_layout(raw_lo))
    if plan.slots is not None:
        inputs.update(ck=head_view(ck), cv=head_view(cv), core_lo=row_layout(core_lo),
                      core_hi=row_layout(core_hi))
    return inputs


def _query_tables(raw_lo, core_lo, core_hi, cfg: KernelConfig):
    return blocks.query_block_visits(raw_lo, core_lo, core_hi, cfg.block_q, cfg.block_k,
                                     cfg.block_c).reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, plan: _Plan):
    return _attention_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, plan)[0]


def _attention_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, plan: _Plan):
    tables = _query_tables(raw_lo, core_lo, core_hi, plan.cfg)
    inputs = _query_inputs(q, k, v, ck, cv, raw_lo, core_lo, core_hi, plan)
    out, lse = query_kernels.forward(plan.query, plan.cfg, tables, inputs)
    out, lse = name_attention_residuals(out.reshape(q.shape), lse)
    return out, (q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse)


def _attention_bwd(plan: _Plan, residuals, dout):
    q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse = residuals
    cfg = plan.cfg
    do = head_view(dout.astype(q.dtype))
    delta = row_layout(softmax_delta(dout, out))           # [B, Hq, 1, Lp]
    inputs = _query_inputs(q, k, v, ck, cv, raw_lo, core_lo, core_hi, plan)
    inputs.update(do=do, lse=lse, delta=delta)
    dq = query_kernels.dq(plan.query, plan.cfg, _query_tables(raw_lo, core_lo, core_hi, cfg),
                          inputs)
    key_tables = blocks.key_block_visits(raw_lo, cfg.block_k, cfg.block_q).reshape(-1)
    dk, dv = key_kernels.key_grads(plan.raw_keys, cfg, key_tables, inputs["k"], inputs["v"],
                                   inputs["q"], do, lse, delta, (inputs["raw_lo"],))
    if plan.slots is None:
        dck, dcv = jnp.zeros_like(ck), jnp.zeros_like(cv)
    else:
        slot_tables = blocks.slot_block_visits(core_lo, core_hi, ck.shape[1], cfg.block_c,
                                               cfg.block_q).reshape(-1)
        dck, dcv = key_kernels.key_grads(plan.slots, cfg, slot_tables, inputs["ck"],
                                         inputs["cv"], inputs["q"], do, lse, delta,
                                         (inputs["core_lo"], inputs["core_hi"]))
        dck, dcv = dck.reshape(ck.shape), dcv.reshape(cv.shape)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dck, dcv,
            None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad_head_dim(x, d: int):
    extra = d - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def blocked_attention_pallas_tpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi, *,
                                 window: int | None = None, interpret=None, **tiling):
    """One softmax per row over raw keys and slots, through Pallas' Mosaic (TPU) lowering.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]` (query head h uses KV head h // (Hq / Hkv));
    ck, cv: `[B, m, Hq, D]` slot keys/values per query head (m may be 0); raw_lo, core_lo,
    core_hi: int `[B, L]`, non-decreasing along t: row t sees raw keys `[raw_lo[t], t]` and
    slots `[core_lo[t], core_hi[t])`. window: the most raw keys any row sees (sizes the static
    grid; None: L, which is right for any bounds but walks every key block). interpret:
    a `pltpu.InterpretParams` or False (default: the interpreter on CPU). `tiling`:
    KernelConfig overrides (block_q=..., ...). Differentiable in q, k, v, ck and cv.
    """
    bounds = tuple(jnp.asarray(x) for x in (raw_lo, core_lo, core_hi))
    check_blocked_inputs(q, k, v, ck, cv, bounds)
    b, length, hq, d = q.shape
    if window is None:
        window = length
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (the widest raw window, e.g. "
                         f"blocks.widest_window(pattern, L)), got {window!r}.")
    cfg = kernel_config(interpret=interpret, **tiling)
    dp = round_up(d, LANES)
    lp = round_up(length, cfg.row_multiple)
    m = ck.shape[1]
    mp = round_up(m, cfg.block_c) if m else 0
    plan = _plan(cfg, length, lp, mp, hq // k.shape[2], d, dp, window)
    qp, kp, vp = (pad_rows(_pad_head_dim(x, dp), lp) for x in (q, k, v))
    ckp, cvp = (pad_rows(_pad_head_dim(x, dp), mp) for x in (ck, cv))
    rlo, clo, chi = pad_row_bounds(*(x.astype(jnp.int32) for x in bounds), lp)
    out = _attention(qp, kp, vp, ckp, cvp, rlo, clo, chi, plan)
    return out[:, :length, :, :d]


def decode_attention_pallas_tpu(q, k_ring, v_ring, ck, cv, bounds, *, layer=None,
                                interpret=None, **tiling):
    """`cca_jax.decode.cached_attention` with per-row bounds instead of masks; float32 out.

    q: `[B, Hq, D]`; k_ring, v_ring: `[B, R, Hkv, D]`; ck, cv: `[B, C, Hq, D]` (C may be 0).
    bounds: `cca_jax.blocks.decode_bounds(pattern, positions, R, C)`, positions being each
    row's query position (`KVCache.lengths` before the step; its own key already in the
    ring). layer: with it, the four cache arrays are `KVCache`'s stacked `[L, B, ...]` ones
    and layer `layer` (int, traced or not) is read in place. D a multiple of 128 on TPU.
    tiling: `decode_block_k` (ring entries per step), `decode_block_c` (slots per step).
    """
    cfg = kernel_config(interpret=interpret, **tiling)
    check_decode_inputs(q, k_ring, v_ring, ck, cv, bounds, layer is not None, cfg)
    bounds = blocks.DecodeBounds(*(jnp.asarray(x, jnp.int32) for x in bounds))
    if layer is None:
        k_ring, v_ring, ck, cv = (x[None] for x in (k_ring, v_ring, ck, cv))
        layer = 0
    return decode_attention(q, k_ring, v_ring, ck, cv, bounds, layer, cfg)
