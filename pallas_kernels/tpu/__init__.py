"""Attention kernels for TPUs through Pallas' Mosaic lowering (forward, backward, decode)."""

from pallas_kernels.tpu.api import (blocked_attention_pallas_tpu, decode_attention_pallas_tpu,
                                    default_interpret, kernel_config)
from pallas_kernels.tpu.common import KernelConfig

__all__ = ["blocked_attention_pallas_tpu", "decode_attention_pallas_tpu", "default_interpret", "kernel_config", "KernelConfig"]
