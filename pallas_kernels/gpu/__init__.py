"""CCA attention kernels for NVIDIA GPUs through Pallas' Triton lowering."""

from pallas_kernels.gpu.api import cca_attention_pallas_gpu, kernel_config
from pallas_kernels.gpu.kernels import SUPPORTED_HEAD_DIMS, KernelConfig, cca_core_attention

__all__ = ["cca_attention_pallas_gpu", "kernel_config", "KernelConfig", "cca_core_attention",
           "SUPPORTED_HEAD_DIMS"]
