"""Rotary position embeddings with HF's scaling variants (default, linear, dynamic, llama3, yarn).

Frequencies follow `transformers.modeling_rope_utils` (the reference for parity tests); the
rotation uses HF's "rotate halves" layout. Angles are computed in float32.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.config import LlamaConfig, RopeScaling


def _base_inv_freq(base, dim: int):
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return 1.0 / (base ** exponents)


def _default(cfg: LlamaConfig, sc: RopeScaling, seq_len):
    return jnp.asarray(_base_inv_freq(np.float32(cfg.rope_theta), cfg.head_dim))


def _linear(cfg: LlamaConfig, sc: RopeScaling, seq_len):
    return _default(cfg, sc, seq_len) / sc.factor


def _dynamic(cfg: LlamaConfig, sc: RopeScaling, seq_len):
    """NTK-aware: the base grows with the longest position of the batch past the trained length."""
    dim, max_pos = cfg.head_dim, cfg.max_position_embeddings
    seq_len = jnp.maximum(jnp.asarray(seq_len, jnp.float32), max_pos)
    base = cfg.rope_theta * ((sc.factor * seq_len / max_pos) - (sc.factor - 1)) ** (dim / (dim - 2))
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return 1.0 / (base ** exponents)


def _llama3(cfg: LlamaConfig, sc: RopeScaling, seq_len):
    inv_freq = _base_inv_freq(np.float32(cfg.rope_theta), cfg.head_dim)
    old_len = sc.original_max_position_embeddings
    low_wavelen = old_len / sc.low_freq_factor
    high_wavelen = old_len / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.asarray(np.where(medium, smoothed, scaled).astype(np.float32))


def _yarn(cfg: LlamaConfig, sc: RopeScaling, seq_len):
    dim, base = cfg.head_dim, cfg.rope_theta
    original = sc.original_max_position_embeddings or cfg.max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / (sc.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return jnp.asarray(inv.astype(np.float32))


# `config.ROPE_TYPES` -> inverse frequencies (a test keeps the two equal).
INV_FREQ_FNS = types.MappingProxyType({"default": _default, "linear": _linear,
                                       "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn})


def attention_scaling(sc: RopeScaling) -> float:
    """The factor YaRN applies to cos/sin (1.0 for every other type)."""
    if sc.rope_type != "yarn":
        return 1.0
    if sc.attention_factor is not None:
        return float(sc.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if sc.mscale and sc.mscale_all_dim:
        return mscale(sc.factor, sc.mscale) / mscale(sc.factor, sc.mscale_all_dim)
    return mscale(sc.factor)


def inverse_frequencies(cfg: LlamaConfig, seq_len=None) -> jax.Array:
    """`[head_dim / 2]` float32; `seq_len` (longest position + 1) matters for "dynamic" only."""
    seq_len = cfg.max_position_embeddings if seq_len is None else seq_len
    return INV_FREQ_FNS[cfg.rope_scaling.rope_type](cfg, cfg.rope_scaling, seq_len)


def rope_cos_sin(positions: jax.Array, cfg: LlamaConfig):
    """cos, sin `[B, L, head_dim]` float32 for integer `positions` `[B, L]`."""
    inv_freq = inverse_frequencies(cfg, jnp.max(positions) + 1)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = attention_scaling(cfg.rope_scaling)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `[B, L, H, D]` by position (HF's rotate-halves layout); float32 math."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)
