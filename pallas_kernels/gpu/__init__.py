"""Attention kernels for NVIDIA GPUs through Pallas' Triton lowering."""

from pallas_kernels.gpu.api import blocked_attention_pallas_gpu, kernel_config
from pallas_kernels.gpu.decode import (DECODE_WIDTHS, DecodeConfig, decode_width,
                                        decode_attention_pallas_gpu)
from pallas_kernels.gpu.kernels import (KERNEL_HEAD_DIMS, LOOP_STYLES, KernelConfig,
                                        cca_core_attention, padded_head_dim)

__all__ = ["blocked_attention_pallas_gpu", "kernel_config",
           "KernelConfig", "LOOP_STYLES", "cca_core_attention", "KERNEL_HEAD_DIMS",
           "padded_head_dim",
           "decode_attention_pallas_gpu", "DecodeConfig", "DECODE_WIDTHS", "decode_width"]
