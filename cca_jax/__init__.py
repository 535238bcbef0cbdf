"""cca-jax: Core Context Aware attention for LLaMA-family models in JAX/Flax."""

from cca_jax.attention import cca_attention
from cca_jax.config import CCAConfig, LlamaConfig, RopeScaling
from cca_jax.pretrained import from_pretrained  # noqa: E402  (convert/ checkpoints)

__all__ = ["cca_attention", "CCAConfig", "LlamaConfig", "RopeScaling"]
