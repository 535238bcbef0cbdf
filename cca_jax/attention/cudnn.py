"""`jax.nn.dot_product_attention` through cuDNN: full and sliding attention on NVIDIA GPUs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cca_jax.attention.backend import Backend
from cca_jax.blocks import Full, Sliding

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class CudnnBackend(Backend):
    """cuDNN's fused attention: causal, optionally windowed; no packed rows (segment_ids),
    bf16/fp16, head_dim a multiple of 8 up to 128."""

    def _refuses(self, option, platform, dtype, head_dim, packed, entry):
        if packed:
            return "it takes no segment_ids (packed rows); 'pallas_gpu' does"
        if dtype not in _DTYPES:
            return f"it takes bfloat16 or float16, not {dtype.name}"
        if head_dim > 128 or head_dim % 8:
            return f"it takes head_dim a multiple of 8 up to 128, not {head_dim}"
        return None

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        window = None if isinstance(pattern, Full) else (pattern.window_size - 1, 0)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                            implementation="cudnn")


CUDNN = CudnnBackend("cudnn", ("gpu",), "an NVIDIA GPU", frozenset({"attention"}),
                     options=(Full, Sliding))
