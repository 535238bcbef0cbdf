"""RoPE variants against transformers' own rotary embedding (LLaMA)."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from transformers import LlamaConfig as HFLlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding, apply_rotary_pos_emb)

from cca_jax.config import LlamaConfig  # noqa: E402
from cca_jax.rope import apply_rope, rope_cos_sin  # noqa: E402

ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_legacy_type_key": {"type": "yarn", "factor": 2.0, "beta_fast": 16.0,
                             "original_max_position_embeddings": 512},
}


def hf_config(scaling, theta=50000.0):
    return HFLlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, rope_theta=theta, rope_scaling=scaling,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=32)


@pytest.mark.parametrize("name", ROPE_SCALINGS)
@pytest.mark.parametrize("max_pos", [700, 3000])  # 3000 > max_position_embeddings: dynamic kicks in
def test_cos_sin_and_rotation_match_transformers(name, max_pos):
    hf = hf_config(ROPE_SCALINGS[name])
    ours = LlamaConfig.from_hf_dict(hf.to_dict())
    assert ours.rope_scaling.rope_type == name.split("_")[0]
    positions = np.sort(np.random.default_rng(0).choice(max_pos, size=(2, 64)), axis=1)
    rotary = LlamaRotaryEmbedding(hf)
    x = torch.randn(2, 64, 2, 64)
    cos_t, sin_t = rotary(x, torch.tensor(positions))
    cos, sin = rope_cos_sin(jnp.asarray(positions), ours)
    # "dynamic" raises a data-dependent base to a power in float32 (as HF does); XLA's and
    # torch's float32 pow differ in the last bits, which shows at positions in the thousands.
    atol = 1e-3 if name == "dynamic" else 2e-4
    np.testing.assert_allclose(cos, cos_t.numpy(), atol=atol)
    np.testing.assert_allclose(sin, sin_t.numpy(), atol=atol)
    # Rotation of q and k: HF rotates [B, H, L, D] tensors.
    q, k = torch.randn(2, 2, 64, 64), torch.randn(2, 1, 64, 64)
    q_t, k_t = apply_rotary_pos_emb(q, k, cos_t, sin_t)
    q_j = apply_rope(jnp.asarray(q.numpy().transpose(0, 2, 1, 3)), cos, sin)
    k_j = apply_rope(jnp.asarray(k.numpy().transpose(0, 2, 1, 3)), cos, sin)
    np.testing.assert_allclose(q_j, q_t.numpy().transpose(0, 2, 1, 3), atol=1e-3)
    np.testing.assert_allclose(k_j, k_t.numpy().transpose(0, 2, 1, 3), atol=1e-3)


def test_rope_theta_is_not_dropped():
    a = LlamaConfig.from_hf_dict(hf_config(None, theta=10000.0).to_dict())
    b = LlamaConfig.from_hf_dict(hf_config(None, theta=500000.0).to_dict())
    assert b.rope_theta == 500000.0
    pos = jnp.arange(100)[None]
    assert not np.allclose(rope_cos_sin(pos, a)[0], rope_cos_sin(pos, b)[0])


def test_every_rope_type_the_config_accepts_is_implemented():
    """config.py names the RoPE variants without importing rope.py (no import circle);
    rope.py implements exactly those."""
    from cca_jax.config import ROPE_TYPES
    from cca_jax.rope import INV_FREQ_FNS
    assert tuple(INV_FREQ_FNS) == ROPE_TYPES
