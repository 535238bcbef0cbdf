"""Attention kernels for NVIDIA GPUs through Pallas' Triton lowering."""

from pallas_kernels.gpu.api import blocked_attention_pallas_gpu, kernel_config
from pallas_kernels.gpu.decode import (SUPPORTED_DECODE_HEAD_DIMS, DecodeConfig,
                                        decode_attention_pallas_gpu)
from pallas_kernels.gpu.kernels import (LOOP_STYLES, SUPPORTED_HEAD_DIMS, KernelConfig,
                                        cca_core_attention)

__all__ = ["blocked_attention_pallas_gpu", "kernel_config",
           "KernelConfig", "LOOP_STYLES", "cca_core_attention", "SUPPORTED_HEAD_DIMS",
           "decode_attention_pallas_gpu", "DecodeConfig", "SUPPORTED_DECODE_HEAD_DIMS"]
