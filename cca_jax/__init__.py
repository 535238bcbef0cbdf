"""cca-jax: Core Context Aware attention for LLaMA-family models in JAX/Flax."""

from cca_jax.attention import cca_attention
from cca_jax.config import CCAConfig, LlamaConfig, RopeScaling
from cca_jax.pretrained import from_pretrained

__all__ = ["cca_attention", "CCAConfig", "LlamaConfig", "RopeScaling", "from_pretrained"]
