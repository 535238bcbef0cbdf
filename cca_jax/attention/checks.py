"""Input checks shared by every attention entry point (plain and sequence-sharded)."""

from __future__ import annotations

import jax.numpy as jnp

from cca_jax.attention.pooling import POOLING_FNS
from cca_jax.blocks import AttentionPattern


def check_inputs(q, k, v, segment_ids) -> None:
    """ValueError naming the expected form unless q `[B, L, Hq, D]`, k/v `[B, L, Hkv, D]`
    (Hq a multiple of Hkv, one floating dtype) and segment_ids `[B, L]` ints or None."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must be [batch, seq, heads, head_dim], got shape {getattr(x, 'shape', None)}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype, got {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}.")
    (b, length, hq, d), (bk, lk, hkv, dk) = q.shape, k.shape
    if (b, length, d) != (bk, lk, dk):
        raise ValueError(
            f"q {q.shape} and k/v {k.shape} disagree on batch, seq or head_dim: this is "
            "self-attention over one sequence, so these must match.")
    if hq % hkv:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if segment_ids is not None:
        if getattr(segment_ids, "shape", None) != (b, length):
            raise ValueError(
                f"segment_ids must be [batch, seq] = {(b, length)}, got "
                f"{getattr(segment_ids, 'shape', None)}.")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}.")


def check_option(pattern, pooling: str) -> None:
    """ValueError unless `pattern` is an `AttentionPattern` and `pooling` a pooling name."""
    if not isinstance(pattern, AttentionPattern):
        raise ValueError(f"pattern must be a blocks.AttentionPattern, got {pattern!r}.")
    if pooling not in POOLING_FNS:
        raise ValueError(f"pooling must be one of {sorted(POOLING_FNS)}, got {pooling!r}.")
