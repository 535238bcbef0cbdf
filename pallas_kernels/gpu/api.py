"""Public entry of the Pallas GPU (Triton lowering) CCA kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cca_jax.attention.pooling import pool_core_tokens
from cca_jax.blocks import num_pooled_groups, row_ranges
from pallas_kernels.gpu.kernels import SUPPORTED_HEAD_DIMS, KernelConfig, cca_core_attention

_POW2 = (16, 32, 64, 128, 256)


def _check_block(name: str, value) -> None:
    if value is not None and value not in _POW2:
        raise ValueError(f"{name} must be one of {_POW2} (a power of two), got {value!r}.")


def kernel_config(group_size: int, window_size: int, head_dim: int, *, block_q=None,
                  block_k=None, num_warps=None, num_stages=None, interpret: bool = False,
                  **backward) -> KernelConfig:
    """Tiling for the four kernels; keyword overrides for any KernelConfig field."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        _check_block(name, value)
    for name, value in backward.items():
        if name not in KernelConfig._fields or name in ("group_size", "window_size"):
            raise ValueError(f"unknown kernel setting {name!r}.")
        if "block" in name:
            _check_block(name, value)
    fwd = {name: value for name, value in (("block_q", block_q), ("block_k", block_k),
                                           ("num_warps", num_warps),
                                           ("num_stages", num_stages)) if value is not None}
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
    cfg = kernel_config(group_size, window_size, d, block_q=block_q, block_k=block_k,
                        num_warps=num_warps, num_stages=num_stages,
                        interpret=bool(interpret), **backward)
    m = num_pooled_groups(length, group_size, window_size)
    ranges = row_ranges(length, group_size, window_size, segment_ids)
    ck, cv = pool_core_tokens(q, k, v, group_size=group_size, num_groups=m, pooling=pooling,
                              group_start=ranges.group_start)
    bounds = tuple(jnp.broadcast_to(x, (b, length)).astype(jnp.int32)
                   for x in (ranges.raw_lo, ranges.core_lo, ranges.core_hi))
    return cca_core_attention(q, k, v, ck, cv, *bounds, cfg)
