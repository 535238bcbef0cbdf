"""Public entries of the Pallas GPU (Triton lowering) kernels.

`blocked_attention_pallas_gpu` runs one softmax per row over raw keys `[raw_lo, t]` and slots
`[core_lo, core_hi)` of prepared keys/values: every attention option of the model (full,
sliding, streaming, CCA) is such a pattern. The slots and bounds are prepared by the caller
(`cca_jax.attention.pallas_gpu`, which pools the core tokens).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from pallas_kernels.shapes import check_blocked_inputs
from pallas_kernels.gpu.kernels import (KERNEL_HEAD_DIMS, KernelConfig, cca_core_attention,
                                        check_config, padded_head_dim)

_POW2 = (16, 32, 64, 128, 256)
_MAX_ELEMS = 2**31 - 1


def _check_block(name: str, value) -> None:
    if value not in _POW2:
        raise ValueError(f"{name} must be one of {_POW2} (a power of two), got {value!r}.")


def _check_narrow(name: str, value, interpret: bool) -> None:
    smallest = 1 if interpret else 16     # Triton's smallest dot operand
    power_of_two = isinstance(value, int) and value > 0 and value & (value - 1) == 0
    if value != 0 and not (power_of_two and value >= smallest):
        raise ValueError(f"{name} must be 0 (off) or a power of two >= {smallest}, "
                         f"got {value!r}.")


# Rows of 512 bytes (float32 at D = 128, 2-byte inputs at D = 256): the default tiles would
# need up to 260 KiB of shared memory on sm_90 (limit 227 KiB); these fit (offline ptxas
# check at float32 D = 128, the same bytes), at some register spilling in dk/dv and dck/dcv.
_WIDE_ROW_TILING = types.MappingProxyType(dict(
    block_q=64, block_k=32, num_warps=8, num_stages=2,
    dq_block_q=64, dq_block_k=32, dq_num_warps=8, dq_num_stages=2,
    dkv_block_k=64, dkv_block_q=32, dkv_num_warps=8, dkv_num_stages=2,
    dc_block_k=64, dc_block_q=32, dc_num_warps=8, dc_num_stages=2))
# Rows of 1 KiB (float32 at D = 256): the 512-byte tiles with their 64-row blocks halved, so
# each tile keeps its bytes.
_WIDEST_ROW_TILING = types.MappingProxyType(dict(
    _WIDE_ROW_TILING, block_q=32, dq_block_q=32, dkv_block_k=32, dc_block_k=32))


def _tiling_for_rows(row_bytes: int) -> dict:
    """The default tiling's overrides for rows of `row_bytes` (head dim x itemsize)."""
    if row_bytes <= 256:
        return {}
    return dict(_WIDE_ROW_TILING if row_bytes <= 512 else _WIDEST_ROW_TILING)


def kernel_config(dtype=None, *, head_dim: int = 128, interpret: bool = False,
                  **fields) -> KernelConfig:
    """The KernelConfig for inputs of `dtype` at kernel head dim `head_dim`, with `fields`
    overriding any of its fields.

    Defaults (KernelConfig) are for rows of up to 256 bytes (2-byte inputs, D <= 128); wider
    rows (float32, or D = 256) get smaller tiles. None values are ignored (callers may pass
    optional settings through).
    """
    fields = {name: value for name, value in fields.items() if value is not None}
    for name, value in fields.items():
        if name not in KernelConfig._fields or name in ("interpret", "softmax_head_dim"):
            raise ValueError(f"unknown kernel setting {name!r}.")
        if name.endswith("narrow_block"):
            _check_narrow(name, value, interpret)
        elif "block" in name:
            _check_block(name, value)
    itemsize = 2 if dtype is None else jnp.dtype(dtype).itemsize
    tiling = _tiling_for_rows(head_dim * itemsize)
    tiling.update(fields)
    return check_config(KernelConfig(interpret=bool(interpret), **tiling))


def _check_head_dim(d: int) -> int:
    """The kernel head dim `d` runs at, or a ValueError naming the fix."""
    width = padded_head_dim(d)
    if width is None:
        raise ValueError(
            f"implementation='pallas_gpu' supports head_dim up to {KERNEL_HEAD_DIMS[-1]}, got "
            f"{d}; use implementation='xla' (or 'auto', which falls back to it).")
    return width


def _pad_head_dim(x, width: int):
    return x if x.shape[-1] == width else jnp.pad(
        x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def blocked_attention_pallas_gpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi, *, interpret=None,
                                 **tiling):
    """One softmax per row over raw keys and slots, through Pallas' Triton lowering.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]` (Hq a multiple of Hkv; query head h uses KV
    head h // (Hq / Hkv)); ck, cv: `[B, m, Hq, D]` prepared slot keys/values per query head
    (CCA's core tokens, streaming's sinks; m may be 0); raw_lo, core_lo, core_hi: int `[B, L]`.
    Row t sees raw keys `[raw_lo[t], t]` (raw_lo[t] <= t) and slots `[core_lo[t], core_hi[t])`;
    all three must be non-decreasing along t. D up to 256: other than 64, 128 and 256 it
    runs zero-padded to the next of them (an extra copy of the inputs). `tiling`:
    KernelConfig field overrides (block_q=..., dq_block_k=..., forward_loop_style=...; see
    `kernel_config`).
    interpret defaults to True on the CPU backend. Differentiable in q, k, v, ck and cv.
    """
    bounds = tuple(jnp.asarray(x) for x in (raw_lo, core_lo, core_hi))
    check_blocked_inputs(q, k, v, ck, cv, bounds)
    b, length, hq, d = q.shape
    width = _check_head_dim(d)
    bounds = tuple(x.astype(jnp.int32) for x in bounds)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = kernel_config(q.dtype, head_dim=width, interpret=interpret, **tiling)
    if width != d:
        cfg = cfg._replace(softmax_head_dim=d)
        q, k, v, ck, cv = (_pad_head_dim(x, width) for x in (q, k, v, ck, cv))
        d = width
    # The Triton lowering computes element offsets in int32: keep every array a kernel sees
    # (padded rows included) under 2**31 elements by running batch rows in chunks.
    row_elems = (length + cfg.row_multiple) * hq * d
    if row_elems >= _MAX_ELEMS:
        raise ValueError(
            f"implementation='pallas_gpu' needs L * Hq * head_dim < 2**31 per batch row (int32 "
            f"offsets), got L={length}, Hq={hq}, D={d}; use implementation='xla'.")
    chunk = max(1, _MAX_ELEMS // row_elems)
    args = (q, k, v, ck, cv, *bounds)
    if b <= chunk:
        out = cca_core_attention(*args, cfg)
    else:
        out = jnp.concatenate([cca_core_attention(*(x[i:i + chunk] for x in args), cfg)
                               for i in range(0, b, chunk)], axis=0)
    return out[..., :cfg.softmax_head_dim] if cfg.softmax_head_dim else out
