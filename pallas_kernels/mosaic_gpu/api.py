"""Public entry of the Mosaic GPU kernels: `blocked_attention_mosaic_gpu`.

Same prepared tensors as `pallas_kernels.gpu.blocked_attention_pallas_gpu` (the slots and
bounds come from the caller, e.g. `cca_jax.attention.pooling.slots_and_bounds`). The forward
is the Mosaic GPU kernel (`forward`). The backward is the Mosaic GPU one (`backward`: dq,
dk/dv, dck/dcv kernels) by default, or, with `backward="triton"`, the Triton-lowered kernels'
(`pallas_kernels.gpu.kernels.cca_backward`, imported only when differentiating); both are
fed with this forward's output and log2-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cca_jax.padding import pad_row_bounds, pad_rows, round_up
from cca_jax.remat import name_attention_residuals
from pallas_kernels.mosaic_gpu.config import (HEAD_DIMS, MosaicBackwardConfig, MosaicConfig,
                                              check_backward_shared_memory,
                                              check_shared_memory, mosaic_backward_config,
                                              mosaic_config, softmax_scale)
from pallas_kernels.mosaic_gpu.interpret import interpret_params
from pallas_kernels.mosaic_gpu.lead import check_lead_rows
from pallas_kernels.shapes import check_blocked_inputs

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The TMA copies tile shared memory in 8-row tiles (`pipeline.smem_transforms`), and a slot
# axis read in place (not padded to whole blocks) must come in whole tiles.
IN_CACHE_SLOT_MULTIPLE = 8
BACKWARDS = ("mosaic", "triton")


def padded_head_dim(d: int) -> int | None:
    """The kernel head dim `d` runs at (itself, or the next one up, zero-padded), or None."""
    return next((width for width in HEAD_DIMS if width >= d), None)


def _pad_head_dim(x, width: int):
    return x if x.shape[-1] == width else jnp.pad(
        x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def prepare_rows(q, k, v, raw_lo, core_lo, core_hi, cfg: MosaicConfig, lead: int = 0,
                 interpreted: bool = False):
    """The kernel's row operands: q/k/v rows zero-padded to `cfg.row_multiple` (padded rows
    see only themselves), bounds stacked `[B, 3, Lp]`, and the visit tables. With `lead`
    rows (`lead.py`) the bounds and tables are those of rows `[lead, L)` in their own frame,
    and q/k/v rows stay unpadded on the GPU."""
    from pallas_kernels.mosaic_gpu.lead import frame_bounds, kernel_rows
    from pallas_kernels.mosaic_gpu.tables import visit_tables
    lp = round_up(q.shape[1] - lead, cfg.row_multiple)
    rlo, clo, chi = pad_row_bounds(*frame_bounds(raw_lo, core_lo, core_hi, lead), lp)
    tables = visit_tables(rlo, clo, chi, block_q=cfg.block_q, compute_wgs=cfg.compute_wgs,
                          block_kv=cfg.block_kv, narrow=cfg.narrow_block)
    return (*(kernel_rows(x, lead, lp, interpreted) for x in (q, k, v)),
            jnp.stack([rlo, clo, chi], axis=1), tables.cta, tables.wg)


def prepare(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg: MosaicConfig, lead: int = 0,
            interpreted: bool = False):
    """The forward's operands: `prepare_rows`' with the slots zero-padded to whole key blocks
    (at least one) between v and the bounds."""
    q, k, v, bounds, cta, wg = prepare_rows(q, k, v, raw_lo, core_lo, core_hi, cfg, lead,
                                            interpreted)
    mp = round_up(max(ck.shape[1], 1), cfg.block_kv)
    return q, k, v, pad_rows(ck, mp), pad_rows(cv, mp), bounds, cta, wg


def _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg: MosaicConfig, interpret,
             lead: int = 0):
    from pallas_kernels.mosaic_gpu.forward import forward
    from pallas_kernels.mosaic_gpu.lead import lead_attention, with_lead_rows
    out, lse = forward(*prepare(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg, lead,
                                interpret is not None), cfg,
                       interpret=interpret, row_offset=lead)
    if lead:
        lead_out, lead_lse = lead_attention(q[:, :lead], k[:, :lead], v[:, :lead],
                                            raw_lo[:, :lead], softmax_scale(cfg, q.shape[-1]))
        out = with_lead_rows(out, lead_out)
        lse = jnp.concatenate([lead_lse, lse], axis=-1)
    return out[:, :q.shape[1]], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def mosaic_core_attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg: MosaicConfig,
                          backward_cfg, interpret=None, lead: int = 0):
    """One softmax over raw keys `[raw_lo, t]` and slots `[core_lo, core_hi)` per row.
    `backward_cfg`: a MosaicBackwardConfig (the Mosaic GPU backward) or the Triton kernels'
    KernelConfig (their backward); `interpret`: None, or the GPU interpreter's params
    (`forward.forward`; the Mosaic backward runs in it too); `lead`: the lead rows
    (`blocked_attention_mosaic_gpu`'s `lead_rows`)."""
    return _forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg, interpret, lead)[0]


def _vjp_fwd(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg, backward_cfg, interpret, lead):
    out, lse = name_attention_residuals(
        *_forward(q, k, v, ck, cv, raw_lo, core_lo, core_hi, cfg, interpret, lead))
    return out, (q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse)


def _vjp_bwd(cfg, backward_cfg, interpret, lead, residuals, dout):
    if isinstance(backward_cfg, MosaicBackwardConfig):
        from pallas_kernels.mosaic_gpu.backward import mosaic_backward
        grads = mosaic_backward(*residuals, dout, backward_cfg, interpret=interpret,
                                lead=lead)
    else:   # out and lse hold every row: the Triton backward needs no lead rows
        from pallas_kernels.gpu.kernels import cca_backward
        grads = cca_backward(*residuals, dout, backward_cfg)
    return (*grads, None, None, None)


mosaic_core_attention.defvjp(_vjp_fwd, _vjp_bwd)


def _backward_config(backward: str, dtype, width: int, softmax_head_dim: int, backward_tiling,
                     interpret: bool):
    """The backward's config: a MosaicBackwardConfig ("mosaic", checked against shared
    memory at the kernel head dim `width`) or the Triton kernels' KernelConfig ("triton");
    `backward_tiling` overrides its fields."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}.")
    if backward == "mosaic":
        cfg = mosaic_backward_config(head_dim=width, **(backward_tiling or {}))
        check_backward_shared_memory(cfg, width, jnp.dtype(dtype).itemsize)
    else:
        from pallas_kernels.gpu.api import kernel_config
        cfg = kernel_config(dtype, head_dim=width, interpret=interpret,
                            **(backward_tiling or {}))
    return cfg._replace(softmax_head_dim=softmax_head_dim)


def blocked_attention_mosaic_gpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi, *,
                                 backward="mosaic", backward_tiling=None, interpret=None,
                                 lead_rows: int = 0, **tiling):
    """One softmax per row over raw keys and slots, through the Mosaic GPU forward (sm_90).

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]` (query head h uses KV head h // (Hq / Hkv),
    K/V never repeated); ck, cv: `[B, m, Hq, D]` slot keys/values per query head (m may be
    0); raw_lo, core_lo, core_hi: int `[B, L]`, each non-decreasing along t. Row t sees raw
    keys `[raw_lo[t], t]` and slots `[core_lo[t], core_hi[t])`. bfloat16 or float16; D up
    to 256 (64, 128 and 256 native, others zero-padded to the next). `tiling`: MosaicConfig
    fields (block_q, block_kv, stages, compute_wgs, schedule_barrier, heavy_first,
    narrow_block) over
    the defaults for the kernel head dim (`config.WIDE_FORWARD_DEFAULTS` at 256).
    Differentiable in q, k, v, ck, cv: `backward="mosaic"` (default: measured faster on the
    H200) runs the Mosaic GPU backward kernels (`backward_tiling`: MosaicBackwardConfig
    overrides), `"triton"` the Triton-lowered ones (`backward_tiling`: their `kernel_config`
    overrides). Needs a Hopper GPU to run; lowers for "cuda" anywhere. `interpret=True` (or
    an `InterpretGPUParams`) runs it on the CPU in jax's GPU interpreter (slow: tiny shapes
    only; a Triton backward then in Triton's interpret mode).
    `lead_rows` N > 0 (`lead.py`; from `cca_jax.blocks.sinks_as_slots`): no row t >= N sees a
    raw key below N and rows t < N see no slot; the kernels then run rows [N, L) in their
    own frame and rows [0, N) are a dense N x N product. N is a multiple of 8
    (`lead.LEAD_ROW_MULTIPLE`). Bounds breaking that give wrong results: it is the
    caller's promise, as the bounds' monotonicity is.
    """
    bounds = tuple(jnp.asarray(x) for x in (raw_lo, core_lo, core_hi))
    check_blocked_inputs(q, k, v, ck, cv, bounds)
    check_lead_rows(lead_rows, q.shape[1])
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v, ck, cv)}
    if len(dtypes) != 1 or dtypes.pop() not in _DTYPES:
        raise ValueError(f"the Mosaic GPU kernels take bfloat16 or float16 q, k, v, ck, cv "
                         f"of one dtype, got {[str(x.dtype) for x in (q, k, v, ck, cv)]}; "
                         f"cast them, or use blocked_attention_pallas_gpu for float32.")
    d = q.shape[-1]
    width = padded_head_dim(d)
    if width is None:
        raise ValueError(f"the Mosaic GPU kernels take head_dim up to {HEAD_DIMS[-1]}, got "
                         f"{d}; use implementation='xla'.")
    cfg = mosaic_config(head_dim=width, **tiling)
    check_shared_memory(cfg, width, q.dtype.itemsize)
    if width != d:
        cfg = cfg._replace(softmax_head_dim=d)
        q, k, v, ck, cv = (_pad_head_dim(x, width) for x in (q, k, v, ck, cv))
    interpret = interpret_params(interpret)
    backward_cfg = _backward_config(backward, q.dtype, width, cfg.softmax_head_dim,
                                    backward_tiling, interpret is not None)
    out = mosaic_core_attention(q, k, v, ck, cv, *(x.astype(jnp.int32) for x in bounds), cfg,
                                backward_cfg, interpret, lead_rows)
    return out[..., :d]


def reads_slots_in_cache(dtype, head_dim: int, slots: int) -> bool:
    """Whether `blocked_attention_in_cache_mosaic_gpu` takes a cache of this slot dtype,
    head dim and slot count (where not, it says why)."""
    return (jnp.dtype(dtype) in _DTYPES and padded_head_dim(head_dim) == head_dim
            and slots >= 1 and slots % IN_CACHE_SLOT_MULTIPLE == 0)


def blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache, cv_cache, layer, cache_rows, raw_lo,
                                          core_lo, core_hi, *, first_row: int = 0,
                                          key_splits: int = 1, interpret=None, **tiling):
    """`blocked_attention_mosaic_gpu`'s forward with the slots read in place from a KV cache:
    ck_cache, cv_cache `[layers, rows, C, Hq, D]` (C a positive multiple of 8), and q's row b
    sees the slots `ck_cache[layer, cache_rows[b]]` (layer: int scalar, traced or not;
    cache_rows: int `[B]`). Slicing a layer's slots out of the stacked cache and padding them
    to whole key blocks, which the other entry needs, copies both slot arrays: 0.1 ms a layer
    in the serving chunk of the 7B shape at 128K (H100). Inference only (no gradient); head
    dims 64, 128 and 256 (the others would need the slots padded: slice them and use
    `blocked_attention_mosaic_gpu`). Returns rows `[first_row, L)` only, `[B, L - first_row,
    Hq, D]` (a prefill chunk's rows after the ring's; the row blocks before first_row's are
    not run). `key_splits` S: each row block's keys walked by S CTAs and their partial
    softmaxes merged (`forward.merge_key_splits`), for a chunk of a few hundred rows, whose
    row blocks alone leave most of the GPU idle. Other arguments as there, without lead
    rows."""
    if isinstance(key_splits, bool) or not isinstance(key_splits, int) or key_splits < 1:
        raise ValueError(f"key_splits must be a positive int, got {key_splits!r}.")
    if not 0 <= first_row < q.shape[1]:
        raise ValueError(f"first_row must be in [0, L={q.shape[1]}), got {first_row}.")
    bounds = tuple(jnp.asarray(x) for x in (raw_lo, core_lo, core_hi))
    if ck_cache.ndim != 5 or cv_cache.shape != ck_cache.shape or ck_cache.shape[2] < 1:
        raise ValueError(f"ck_cache and cv_cache must be a KV cache's stacked slots "
                         f"[layers, rows, C >= 1, Hq, D]; got {ck_cache.shape} and "
                         f"{cv_cache.shape}.")
    if ck_cache.shape[2] % IN_CACHE_SLOT_MULTIPLE:
        raise ValueError(f"the slot axis read in place must be a multiple of "
                         f"{IN_CACHE_SLOT_MULTIPLE} (the kernel's shared-memory tiles), got "
                         f"C = {ck_cache.shape[2]}; slice the layer's slots and use "
                         f"blocked_attention_mosaic_gpu, which pads them.")
    n_layers, n_rows, m = ck_cache.shape[:3]
    b = q.shape[0]
    one_row = jax.ShapeDtypeStruct((b, m, *ck_cache.shape[3:]), ck_cache.dtype)
    check_blocked_inputs(q, k, v, one_row, one_row, bounds)
    if jnp.shape(cache_rows) != (b,) or not jnp.issubdtype(jnp.result_type(cache_rows),
                                                           jnp.integer):
        raise ValueError(f"cache_rows must be an int array [B={b}], got "
                         f"{jnp.result_type(cache_rows)} {jnp.shape(cache_rows)}.")
    if jnp.shape(layer) != ():
        raise ValueError(f"layer must be an int scalar, got shape {jnp.shape(layer)}.")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v, ck_cache, cv_cache)}
    if len(dtypes) != 1 or dtypes.pop() not in _DTYPES:
        raise ValueError(f"the Mosaic GPU kernels take bfloat16 or float16 q, k, v and slots "
                         f"of one dtype, got {[str(x.dtype) for x in (q, k, v, ck_cache)]}.")
    d = q.shape[-1]
    if padded_head_dim(d) != d:
        raise ValueError(f"blocked_attention_in_cache_mosaic_gpu takes head_dim "
                         f"{HEAD_DIMS[0]}, 128 or {HEAD_DIMS[-1]}, got {d}; slice the layer's "
                         f"slots and use blocked_attention_mosaic_gpu, which pads them.")
    # no narrow head by default: whether a CTA takes one depends on where the chunk starts
    cfg = mosaic_config(head_dim=d, **{"narrow_block": 0, **tiling})
    check_shared_memory(cfg, d, q.dtype.itemsize)
    interpret = interpret_params(interpret)
    # layers x rows as one axis (a free reshape of the stacked arrays): one row index each
    slot_rows = (jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1) * n_rows
                 + jnp.clip(jnp.asarray(cache_rows, jnp.int32), 0, n_rows - 1))
    ck, cv = (x.reshape(n_layers * n_rows, *x.shape[2:]) for x in (ck_cache, cv_cache))
    if interpret is not None:   # the interpreter reads no zeros past an array's end
        ck, cv = (pad_rows(x, round_up(m, cfg.block_kv)) for x in (ck, cv))
    from pallas_kernels.mosaic_gpu.forward import forward, merge_key_splits
    q_rows, k_rows, v_rows, stacked, cta, wg = prepare_rows(
        q, k, v, *(x.astype(jnp.int32) for x in bounds), cfg, 0, interpret is not None)
    # the row blocks from first_row's on: a chunk's ring rows in front cost no CTA
    out, lse = forward(q_rows, k_rows, v_rows, ck, cv, stacked, cta, wg, cfg,
                       interpret=interpret, slot_rows=slot_rows, key_splits=key_splits,
                       first_tile=first_row // cfg.cta_rows)
    if key_splits > 1:   # merged where wanted only
        return merge_key_splits(out[:, :, first_row:q.shape[1]],
                                lse[..., first_row:q.shape[1]], q.dtype)
    return out[:, first_row:q.shape[1]]
