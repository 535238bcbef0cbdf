"""cca-jax: Core Context Aware attention for LLaMA-family models in JAX/Flax."""

from cca_jax.attention import cca_attention
from cca_jax.config import CCAConfig, LlamaConfig, RopeScaling

__all__ = ["cca_attention", "CCAConfig", "LlamaConfig", "RopeScaling"]
