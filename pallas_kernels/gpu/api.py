"""Public entry of the Pallas GPU (Triton lowering) CCA kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cca_jax.attention.pooling import core_tokens_and_bounds
from pallas_kernels.gpu.kernels import SUPPORTED_HEAD_DIMS, KernelConfig, cca_core_attention

_POW2 = (16, 32, 64, 128, 256)
_MAX_ELEMS = 2**31 - 1


def _check_block(name: str, value) -> None:
    if value is not None and value not in _POW2:
        raise ValueError(f"{name} must be one of {_POW2} (a power of two), got {value!r}.")


# float32 inputs: the bf16 tiles would need up to 260 KiB of shared memory on sm_90 (limit
# 227 KiB); these fit (offline ptxas check), at some register spilling in dk/dv and dck/dcv.
_FLOAT32_TILING = dict(block_q=64, block_k=32, num_warps=8, num_stages=2,
                       dq_block_q=64, dq_block_k=32, dq_num_warps=8, dq_num_stages=2,
                       dkv_block_k=64, dkv_block_q=32, dkv_num_warps=8, dkv_num_stages=2,
                       dc_block_k=64, dc_block_q=32, dc_num_warps=8, dc_num_stages=2)


def kernel_config(group_size: int, window_size: int, head_dim: int, *, dtype=None,
                  block_q=None, block_k=None, num_warps=None, num_stages=None,
                  interpret: bool = False, **backward) -> KernelConfig:
    """Tiling for the four kernels; keyword overrides for any KernelConfig field.

    Defaults (KernelConfig) are for 2-byte inputs; float32 inputs get smaller tiles.
    """
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        _check_block(name, value)
    for name, value in backward.items():
        if name not in KernelConfig._fields or name in ("group_size", "window_size"):
            raise ValueError(f"unknown kernel setting {name!r}.")
        if "block" in name:
            _check_block(name, value)
    fwd = dict(_FLOAT32_TILING) if dtype is not None and jnp.dtype(dtype).itemsize > 2 else {}
    fwd.update({name: value for name, value in (("block_q", block_q), ("block_k", block_k),
                                                ("num_warps", num_warps),
                                                ("num_stages", num_stages))
                if value is not None})
    fwd.update(backward)
    return KernelConfig(group_size, window_size, interpret=interpret, **fwd)


def cca_attention_pallas_gpu(q, k, v, *, group_size: int, window_size: int,
                             pooling: str = "cca", segment_ids=None, block_q=None, block_k=None,
                             num_warps=None, num_stages=None, interpret=None, **backward):
    """CCA attention (SPEC.md) through Pallas' Triton lowering; result as `cca_attention_xla`.

    q: `[B, L, Hq, D]`, k, v: `[B, L, Hkv, D]` with D in (64, 128). block_q/block_k,
    num_warps/num_stages tile the forward kernel; `backward` takes the other KernelConfig
    fields (dq_block_q, dkv_block_k, ...). interpret defaults to True on the CPU backend.
    """
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"implementation='pallas_gpu' supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}; "
            "use implementation='xla' (or 'auto', which falls back to it).")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    b, length = q.shape[:2]
    cfg = kernel_config(group_size, window_size, d, dtype=q.dtype, block_q=block_q,
                        block_k=block_k,
                        num_warps=num_warps, num_stages=num_stages,
                        interpret=bool(interpret), **backward)
    ck, cv, *bounds = core_tokens_and_bounds(q, k, v, group_size=group_size,
                                             window_size=window_size, pooling=pooling,
                                             segment_ids=segment_ids)
    # The Triton lowering computes element offsets in int32: keep every array a kernel sees
    # (padded rows included) under 2**31 elements by running batch rows in chunks.
    row_elems = (length + cfg.row_multiple) * q.shape[2] * d
    if row_elems >= _MAX_ELEMS:
        raise ValueError(
            f"implementation='pallas_gpu' needs L * Hq * head_dim < 2**31 per batch row (int32 "
            f"offsets), got L={length}, Hq={q.shape[2]}, D={d}; use implementation='xla'.")
    chunk = max(1, _MAX_ELEMS // row_elems)
    if b <= chunk:
        return cca_core_attention(q, k, v, ck, cv, *bounds, cfg)
    outs = [cca_core_attention(*(x[i:i + chunk] for x in (q, k, v, ck, cv, *bounds)), cfg)
            for i in range(0, b, chunk)]
    return jnp.concatenate(outs, axis=0)
