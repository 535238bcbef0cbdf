"""cca-jax: Core Context Aware attention for LLaMA-family models in JAX/Flax."""

from cca_jax.attention import cca_attention, run_attention
from cca_jax.blocks import CCA, AttentionPattern, Full, Sliding, Streaming, parse_option
from cca_jax.config import AttentionConfig, LlamaConfig, RopeScaling
from cca_jax.pretrained import from_pretrained

__all__ = ["cca_attention", "run_attention", "AttentionPattern", "Full", "Sliding", "Streaming",
           "CCA", "parse_option", "AttentionConfig",
           "LlamaConfig", "RopeScaling", "from_pretrained"]
