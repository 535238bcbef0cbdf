"""The Pallas GPU (Triton lowering) backend: slots and bounds prepared here, then the
kernels of `pallas_kernels.gpu` (imported lazily: an optional accelerator).

`attention_pallas_gpu` / `cca_attention_pallas_gpu` take the kernels' tiling overrides and
`interpret` (default: True on the CPU backend) for tests and sweeps; the backend object
`PALLAS_GPU` is what `run_attention`, the prefill and the decode step call.
"""

from __future__ import annotations

import functools
import importlib.util

import jax

from cca_jax import blocks
from cca_jax.attention.backend import Backend
from cca_jax.attention.pooling import slots_and_bounds
from cca_jax.blocks import CCA, AttentionPattern


@functools.lru_cache(maxsize=None)
def triton_lowering_available() -> bool:
    """Whether this JAX still has Pallas' Triton backend (deprecated since JAX 0.11 in favour
    of Mosaic GPU, and announced for removal)."""
    return importlib.util.find_spec("jax.experimental.pallas.triton") is not None


def _check_head_dim(d: int) -> None:
    from pallas_kernels.gpu.kernels import KERNEL_HEAD_DIMS, padded_head_dim
    if padded_head_dim(d) is None:
        raise ValueError(
            f"implementation='pallas_gpu' supports head_dim up to {KERNEL_HEAD_DIMS[-1]}, got "
            f"{d}; use implementation='xla' (or 'auto', which falls back to it).")


def attention_pallas_gpu(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                         segment_ids=None, interpret=None, **tiling):
    """Attention under `pattern` through the Pallas GPU kernels; the result of
    `run_attention`. `tiling`: `pallas_kernels.gpu.kernel_config` field overrides."""
    from pallas_kernels.gpu import blocked_attention_pallas_gpu
    _check_head_dim(q.shape[-1])   # before pooling: a clear error, not a kernel failure
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, pooling=pooling,
                                       segment_ids=segment_ids)
    tiling = _narrow_where_it_pays(pattern, q, tiling)
    return blocked_attention_pallas_gpu(q, k, v, ck, cv, *bounds, interpret=interpret,
                                        **tiling)


def _narrow_where_it_pays(pattern: AttentionPattern, q, tiling: dict) -> dict:
    """`tiling` with the forward's narrow head off when no query block of one document of
    this length would take one: compiled in, the narrow path costs about 1-2% of the forward
    even when it never runs (H200, 128K), while with sinks off the group grid it saves the
    mostly-masked key block of nearly every query block
    (benchmarks/results/research/sinks_narrow_h200.md). An explicit `narrow_block` stays."""
    from pallas_kernels.gpu import kernel_config, padded_head_dim
    if tiling.get("narrow_block") is not None:
        return tiling
    cfg = kernel_config(q.dtype, head_dim=padded_head_dim(q.shape[-1]), **tiling)
    if blocks.narrow_heads(pattern, q.shape[1], cfg.block_q, cfg.block_k, cfg.narrow_block):
        return tiling
    return dict(tiling, narrow_block=0)


def cca_attention_pallas_gpu(q, k, v, *, group_size: int, window_size: int,
                             sink_tokens: int = 0, pooling: str = "cca", segment_ids=None,
                             interpret=None, **tiling):
    """CCA attention (SPEC.md; `sink_tokens`: section 6) through the Pallas GPU kernels;
    the result of `cca_attention`. D up to 256 (64, 128 and 256 native, others
    zero-padded). `tiling`: KernelConfig field overrides
    (block_q, block_k, num_warps, num_stages tile the forward kernel; dq_block_q,
    dkv_block_k, ... the backward ones)."""
    return attention_pallas_gpu(q, k, v, CCA(group_size, window_size, sink_tokens),
                                pooling=pooling, segment_ids=segment_ids, interpret=interpret,
                                **tiling)


class PallasGpuBackend(Backend):
    """Every option, packed or not, any float dtype; head_dim up to the kernels' largest
    (others than theirs zero-padded; the decode kernel reads other head dims in place,
    masked)."""

    def _refuses(self, option, platform, dtype, head_dim, packed, entry):
        if not triton_lowering_available():
            return (f"this JAX ({jax.__version__}) has no Pallas Triton backend; "
                    "'mosaic_gpu' runs on Hopper GPUs")
        if entry == "decode":
            from pallas_kernels.gpu import DECODE_WIDTHS, decode_width
            if decode_width(head_dim) is None:
                return (f"its decode kernel supports head_dim up to {DECODE_WIDTHS[-1]}, "
                        f"not {head_dim}")
            return None
        from pallas_kernels.gpu.kernels import KERNEL_HEAD_DIMS, padded_head_dim
        if padded_head_dim(head_dim) is None:
            return f"it supports head_dim up to {KERNEL_HEAD_DIMS[-1]}, not {head_dim}"
        return None

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        return attention_pallas_gpu(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)

    def _blocked(self, q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window):
        from pallas_kernels.gpu import blocked_attention_pallas_gpu
        return blocked_attention_pallas_gpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi)

    def _decode(self, q, k_all, v_all, ck, cv, layer, pattern, positions):
        from pallas_kernels.gpu import decode_attention_pallas_gpu
        bounds = blocks.decode_bounds(pattern, positions, k_all.shape[2], ck.shape[2])
        return decode_attention_pallas_gpu(q, k_all, v_all, ck, cv, bounds, layer=layer,
                                           out_dtype=q.dtype)


PALLAS_GPU = PallasGpuBackend("pallas_gpu", ("gpu",),
                              "NVIDIA GPUs (or in interpret mode on CPU)",
                              frozenset({"attention", "blocked", "decode"}),
                              interprets_on_cpu=True)
