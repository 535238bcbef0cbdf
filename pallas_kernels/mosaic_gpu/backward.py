"""The gradient of `mosaic_core_attention` on Mosaic GPU: dq (`dq`), dk/dv and dck/dcv
(`keys`), from the forward's residuals.

Host side (XLA) this pads rows and slots to whole CTAs (padded rows see only themselves
and have dO = 0, so they add nothing), computes delta = rowsum(dO * O), stacks it with the
forward's log2-sum-exp, and builds the block-visit tables from `cca_jax.blocks` (the one
place that arithmetic lives): the forward's tables for dq, `key_visit_tables` for the
key-side kernels. Three kernels, no atomics: dq per query block, dk/dv per raw key block
(GQA summed in registers), dck/dcv per slot block (the key-side ones as a dK and a dV kernel
each with `cfg.split_keys`).
"""

from __future__ import annotations

import jax.numpy as jnp

from cca_jax.padding import pad_row_bounds, pad_rows, round_up, softmax_delta
from pallas_kernels.mosaic_gpu.config import KEY_ROWS, MosaicBackwardConfig
from pallas_kernels.mosaic_gpu.dq import dq as dq_kernel
from pallas_kernels.mosaic_gpu.keys import key_grads
from pallas_kernels.mosaic_gpu.tables import key_visit_tables, visit_tables


def mosaic_backward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout,
                    cfg: MosaicBackwardConfig, interpret=None):
    """(dq, dk, dv, dck, dcv) of `mosaic_core_attention` (unpadded rows and slots; head dim
    as given, zero-padded columns stay zero). `out` `[B, L, Hq, D]`, `lse` `[B, Hq, >= L]`
    float32: the forward's log2-sum-exp of the scaled scores (values past L are ignored).
    `interpret`: None, or the GPU interpreter's params (runs the kernels on the CPU)."""
    length, m = q.shape[1], ck.shape[1]
    lp = round_up(length, cfg.row_multiple)
    mp = round_up(max(m, 1), cfg.slot_multiple)
    rlo, clo, chi = pad_row_bounds(raw_lo, core_lo, core_hi, lp)
    rows = ((0, 0), (0, 0), (0, lp - length))
    stats = jnp.stack([jnp.pad(lse[..., :length].astype(jnp.float32), rows),
                       jnp.pad(softmax_delta(dout, out), rows)], axis=2)   # [B, Hq, 2, Lp]
    bounds = jnp.stack([rlo, clo, chi], axis=1)                              # [B, 3, Lp]
    qp, kp, vp = (pad_rows(x, lp) for x in (q, k, v))
    dop = pad_rows(dout.astype(q.dtype), lp)
    ckp, cvp = pad_rows(ck, mp), pad_rows(cv, mp)
    fwd = visit_tables(rlo, clo, chi, block_q=cfg.block_q, compute_wgs=cfg.compute_wgs,
                       block_kv=cfg.block_kv, narrow=cfg.narrow_block)
    raw, slots = key_visit_tables(rlo, clo, chi, mp, key_rows=KEY_ROWS,
                                  compute_wgs=cfg.compute_wgs, block_q=cfg.key_block_q)
    dq = dq_kernel(qp, kp, vp, ckp, cvp, dop, stats, bounds, fwd.cta, fwd.wg, cfg,
                   interpret=interpret)

    def keys_and_values(keys, values, tables, kind):
        args = (qp, dop, stats, bounds, keys, values, tables.cta, tables.wg, kind, cfg)
        if not cfg.split_keys:
            return key_grads(*args, interpret=interpret)
        return (key_grads(*args, interpret=interpret, outputs=("dk",))[0],
                key_grads(*args, interpret=interpret, outputs=("dv",))[0])
    dk, dv = keys_and_values(kp, vp, raw, "raw")
    if m == 0:
        dck, dcv = jnp.zeros_like(ck), jnp.zeros_like(cv)
    else:
        dck, dcv = keys_and_values(ckp, cvp, slots, "core")
    return (dq[:, :length], dk[:, :length], dv[:, :length], dck[:, :m], dcv[:, :m])
