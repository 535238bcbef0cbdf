"""Attention kernels for Hopper GPUs through Pallas' Mosaic GPU backend (wgmma, TMA,
warp-specialised pipelines). Forward only so far; its gradient reuses the Triton kernels'
backward (`pallas_kernels.gpu`)."""

from pallas_kernels.mosaic_gpu.api import (blocked_attention_mosaic_gpu, mosaic_core_attention,
                                           padded_head_dim)
from pallas_kernels.mosaic_gpu.config import (HEAD_DIMS, MosaicConfig, check_config,
                                              mosaic_config, shared_memory_bytes)
from pallas_kernels.mosaic_gpu.tables import visit_tables

__all__ = ["blocked_attention_mosaic_gpu", "mosaic_core_attention", "padded_head_dim",
           "MosaicConfig", "check_config", "mosaic_config", "shared_memory_bytes",
           "HEAD_DIMS", "visit_tables"]
