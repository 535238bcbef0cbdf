"""The gradient of `mosaic_core_attention` on Mosaic GPU: dq (`dq`), dk/dv and dck/dcv
(`keys`), from the forward's residuals.

Host side (XLA) this pads rows and slots to whole CTAs (padded rows see only themselves
and have dO = 0, so they add nothing), computes delta = rowsum(dO * O), stacks it with the
forward's log2-sum-exp, and builds the block-visit tables from `cca_jax.blocks` (the one
place that arithmetic lives): the forward's tables for dq, `key_visit_tables` for the
key-side kernels. Three kernels, no atomics: dq per query block, dk/dv per raw key block
(GQA summed in registers), dck/dcv per slot block (the key-side ones as a dK and a dV kernel
each with `cfg.split_keys`). With `cfg.fused_dq` two: the key-side kernels also add dQ into
one float32 accumulator (reduce-adds: its last bits vary run to run).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from cca_jax.padding import pad_row_bounds, pad_rows, round_up, softmax_delta
from pallas_kernels.mosaic_gpu.config import KEY_ROWS, MosaicBackwardConfig, softmax_scale
from pallas_kernels.mosaic_gpu.dq import dq as dq_kernel
from pallas_kernels.mosaic_gpu.keys import key_grads
from pallas_kernels.mosaic_gpu.lead import (frame_bounds, kernel_rows, lead_gradients, shifted,
                                            with_lead_rows)
from pallas_kernels.mosaic_gpu.tables import VisitTables, key_visit_tables, visit_tables


class BackwardOperands(NamedTuple):
    """The three kernels' inputs: rows and slots padded, stats `[B, Hq, 2, Lp]` float32
    (log2-sum-exp, delta), bounds `[B, 3, Lp]`, the forward's visit tables (dq's) and the
    key side's for raw keys and for slots."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    ck: jax.Array
    cv: jax.Array
    dout: jax.Array
    stats: jax.Array
    bounds: jax.Array
    query_tables: VisitTables
    raw_tables: VisitTables
    slot_tables: VisitTables


def backward_operands(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout,
                      cfg: MosaicBackwardConfig, lead: int = 0,
                      interpreted: bool = False) -> BackwardOperands:
    """The host side of `mosaic_backward` (XLA): padding, delta, tables. With `lead` rows
    (`lead.py`): stats, bounds and tables of rows `[lead, L)` in their own frame, and q/k/v/dO
    rows unpadded on the GPU."""
    length, m = q.shape[1], ck.shape[1]
    lp = round_up(length - lead, cfg.row_multiple)
    mp = round_up(max(m, 1), cfg.slot_multiple)
    rlo, clo, chi = pad_row_bounds(*frame_bounds(raw_lo, core_lo, core_hi, lead), lp)
    rows = ((0, 0), (0, 0), (0, lp - length + lead))
    stats = jnp.stack([jnp.pad(lse[..., lead:length].astype(jnp.float32), rows),
                       jnp.pad(shifted(softmax_delta(dout, out), lead), rows)],
                      axis=2)   # [B, Hq, 2, Lp]
    raw, slots = key_visit_tables(rlo, clo, chi, mp, key_rows=KEY_ROWS,
                                  compute_wgs=cfg.compute_wgs, block_q=cfg.key_block_q)
    return BackwardOperands(
        *(kernel_rows(x, lead, lp, interpreted) for x in (q, k, v)), pad_rows(ck, mp),
        pad_rows(cv, mp), kernel_rows(dout.astype(q.dtype), lead, lp, interpreted), stats,
        jnp.stack([rlo, clo, chi], axis=1),
        visit_tables(rlo, clo, chi, block_q=cfg.block_q, compute_wgs=cfg.compute_wgs,
                     block_kv=cfg.block_kv, narrow=cfg.narrow_block), raw, slots)


def query_grads(ops: BackwardOperands, cfg: MosaicBackwardConfig, interpret=None,
                lead: int = 0):
    """dq `[B, Lp, Hq, D]` (the dq kernel; its first `lead` rows unwritten)."""
    return dq_kernel(ops.q, ops.k, ops.v, ops.ck, ops.cv, ops.dout, ops.stats, ops.bounds,
                     ops.query_tables.cta, ops.query_tables.wg, cfg, interpret=interpret,
                     row_offset=lead)


def _key_kernel_args(ops: BackwardOperands, kind: str, cfg: MosaicBackwardConfig) -> tuple:
    """`key_grads`' positional arguments for the raw keys (`kind="raw"`) or the slots."""
    keys, values, tables = ((ops.k, ops.v, ops.raw_tables) if kind == "raw"
                            else (ops.ck, ops.cv, ops.slot_tables))
    return (ops.q, ops.dout, ops.stats, ops.bounds, keys, values, tables.cta, tables.wg,
            kind, cfg)


def keys_and_values(ops: BackwardOperands, kind: str, cfg: MosaicBackwardConfig,
                    interpret=None, lead: int = 0):
    """(dK, dV) of the raw keys (`kind="raw"`, `[B, Lp, Hkv, D]`, the first `lead` rows
    unwritten) or of the slots (`"core"`, `[B, Mp, Hq, D]`): one kernel, or one each with
    `cfg.split_keys`."""
    args = _key_kernel_args(ops, kind, cfg)
    if not cfg.split_keys:
        return key_grads(*args, interpret=interpret, row_offset=lead)
    return (key_grads(*args, interpret=interpret, outputs=("dk",), row_offset=lead)[0],
            key_grads(*args, interpret=interpret, outputs=("dv",), row_offset=lead)[0])


def keys_values_and_dq(ops: BackwardOperands, kind: str, acc, cfg: MosaicBackwardConfig,
                       interpret=None, lead: int = 0):
    """(dK, dV, acc + dS K) of the raw keys or the slots (as `keys_and_values`) by the fused
    key-side kernel (`cfg.fused_dq`): `acc` a float32 dq accumulator shaped like `ops.q`."""
    return key_grads(*_key_kernel_args(ops, kind, cfg), interpret=interpret, row_offset=lead,
                     dq=acc)


def fused_gradients(ops: BackwardOperands, cfg: MosaicBackwardConfig, interpret=None,
                    lead: int = 0, slots: bool = True):
    """(dq `[B, Lp, Hq, D]`, dK, dV, dck, dcv) by the key-side kernels alone: dq summed in
    float32 by both (the raw keys' kernel, then the slots' unless `slots` is False: m = 0),
    scaled and cast once."""
    acc = jnp.zeros(ops.q.shape, jnp.float32)
    dk, dv, acc = keys_values_and_dq(ops, "raw", acc, cfg, interpret, lead)
    if slots:
        dck, dcv, acc = keys_values_and_dq(ops, "core", acc, cfg, interpret, lead)
    else:
        dck, dcv = jnp.zeros_like(ops.ck), jnp.zeros_like(ops.cv)
    dq = (acc * softmax_scale(cfg, ops.q.shape[-1])).astype(ops.q.dtype)
    return dq, dk, dv, dck, dcv


def mosaic_backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout,
                    cfg: MosaicBackwardConfig, interpret=None, lead: int = 0):
    """(dq, dk, dv, dck, dcv) of `mosaic_core_attention` (unpadded rows and slots; head dim
    as given, zero-padded columns stay zero). `out` `[B, L, Hq, D]`, `lse` `[B, Hq, >= L]`
    float32: the forward's log2-sum-exp of the scaled scores (values past L are ignored).
    `interpret`: None, or the GPU interpreter's params (runs the kernels on the CPU).
    `lead`: the forward's lead rows (`lead.py`): the kernels run rows `[lead, L)` in their
    own frame, the lead rows' block is differentiated densely."""
    length, m = q.shape[1], ck.shape[1]
    ops = backward_operands(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout, cfg,
                            lead, interpret is not None)
    if cfg.fused_dq:
        dq, dk, dv, dck, dcv = fused_gradients(ops, cfg, interpret, lead, slots=m > 0)
    else:
        dq = query_grads(ops, cfg, interpret, lead)
        dk, dv = keys_and_values(ops, "raw", cfg, interpret, lead)
        if m == 0:
            dck, dcv = jnp.zeros_like(ck), jnp.zeros_like(cv)
        else:
            dck, dcv = keys_and_values(ops, "core", cfg, interpret, lead)
    if lead:
        lead_grads = lead_gradients(q[:, :lead], k[:, :lead], v[:, :lead], raw_lo[:, :lead],
                                    dout[:, :lead], softmax_scale(cfg, q.shape[-1]))
        dq, dk, dv = (with_lead_rows(x, g) for x, g in zip((dq, dk, dv), lead_grads))
    return (dq[:, :length], dk[:, :length], dv[:, :length], dck[:, :m], dcv[:, :m])
