"""Attention kernels for Hopper GPUs through Pallas' Mosaic GPU backend (wgmma, TMA,
warp-specialised pipelines): the forward and its backward (dq, dk/dv, dck/dcv kernels), and
the decode step; the Triton kernels' backward (`pallas_kernels.gpu`) stays selectable."""

from pallas_kernels.mosaic_gpu.api import (blocked_attention_in_cache_mosaic_gpu,
                                           blocked_attention_mosaic_gpu, mosaic_core_attention,
                                           padded_head_dim)
from pallas_kernels.mosaic_gpu.config import (HEAD_DIMS, MosaicBackwardConfig, MosaicConfig,
                                              check_config, mosaic_backward_config,
                                              mosaic_config, shared_memory_bytes)
from pallas_kernels.mosaic_gpu.decode import decode_attention_mosaic_gpu
from pallas_kernels.mosaic_gpu.tables import visit_tables

__all__ = ["blocked_attention_in_cache_mosaic_gpu", "blocked_attention_mosaic_gpu",
           "decode_attention_mosaic_gpu", "mosaic_core_attention", "padded_head_dim",
           "MosaicBackwardConfig", "MosaicConfig", "check_config", "mosaic_backward_config",
           "mosaic_config", "shared_memory_bytes", "HEAD_DIMS", "visit_tables"]
