"""The public CCA attention and its dispatch to implementations.

`cca_attention` validates its inputs, picks an implementation and returns `[B, L, Hq, D]` in
the input dtype. Implementations:
  naive       dense L x L masks (tests, small L)
  xla         blocked, memory-linear, any backend (the baseline)
  pallas_gpu  Pallas kernels through the Triton lowering (interpret mode on CPU)
  pallas_tpu  Pallas kernels through Mosaic (interpret mode on CPU)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from cca_jax.attention.naive import cca_attention_naive
from cca_jax.attention.pooling import pool_core_tokens
from cca_jax.attention.xla import cca_attention_xla
from cca_jax.config import IMPLEMENTATIONS, POOLINGS

__all__ = ["cca_attention", "cca_attention_naive", "cca_attention_xla", "pool_core_tokens",
           "resolve_implementation"]


def _not_yet(name: str, issue_hint: str) -> Callable:
    def run(*args, **kwargs):
        raise NotImplementedError(
            f"implementation={name!r} is not available yet ({issue_hint}). "
            "Use implementation='xla' (any backend) or 'auto'.")
    return run


def _pallas_gpu(q, k, v, **kwargs):
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda", "cpu"):
        raise ValueError(
            f"implementation='pallas_gpu' runs on NVIDIA GPUs (or in interpret mode on CPU), "
            f"not on the {backend!r} backend; use implementation='auto' or 'xla'.")
    from pallas_kernels.gpu import cca_attention_pallas_gpu  # lazy: kernels import this package
    return cca_attention_pallas_gpu(q, k, v, **kwargs)


_IMPLEMENTATIONS: dict[str, Callable] = {
    "naive": cca_attention_naive,
    "xla": cca_attention_xla,
    "pallas_gpu": _pallas_gpu,
    "pallas_tpu": _not_yet("pallas_tpu", "the Pallas TPU kernels are being written"),
}

# What "auto" means on each backend: the fastest implementation that exists there.
# ("pallas_gpu" needs head_dim 64 or 128; `cca_attention` falls back to "xla" otherwise.)
_AUTO_BY_BACKEND = {"cpu": "xla", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "xla",
                    "tpu": "xla"}
_PALLAS_GPU_HEAD_DIMS = (64, 128)


def resolve_implementation(implementation: str, backend: str | None = None) -> str:
    """The implementation `cca_attention` will run for `implementation` on `backend`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    return _AUTO_BY_BACKEND.get(backend, "xla")


def _static_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive Python int, got {value!r}.")
    return value


def _check_inputs(q, k, v, segment_ids) -> None:
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
            f"q {q.shape} and k/v {k.shape} disagree on batch, seq or head_dim: CCA is "
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


def cca_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, group_size: int,
                  window_size: int, pooling: str = "cca", implementation: str = "auto",
                  segment_ids: jax.Array | None = None) -> jax.Array:
    """Core Context Aware attention (SPEC.md): one softmax over core tokens and a local window.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]`, RoPE already applied; `Hq` a multiple of `Hkv`.
    group_size (`g`) and window_size (`s`) are Python ints. segment_ids: optional `[B, L]`
    ints; each maximal run of equal ids is one document (packed rows): queries see raw and
    core tokens of their own document only, groups counted from its start.
    Returns `[B, L, Hq, D]` in the dtype of q.
    """
    _check_inputs(q, k, v, segment_ids)
    group_size = _static_int("group_size", group_size)
    window_size = _static_int("window_size", window_size)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}.")
    name = resolve_implementation(implementation)
    if name == "pallas_gpu" and implementation == "auto" and (
            q.shape[-1] not in _PALLAS_GPU_HEAD_DIMS):
        name = "xla"
    impl = _IMPLEMENTATIONS[name]
    return impl(q, k, v, group_size=group_size, window_size=window_size, pooling=pooling,
                segment_ids=segment_ids)
