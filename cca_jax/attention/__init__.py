"""The public attention entry points and their dispatch to implementations.

`run_attention(q, k, v, pattern, ...)` runs any attention option (`blocks.AttentionPattern`:
full, sliding, streaming, cca); `cca_attention(q, k, v, group_size=, window_size=, ...)` is
its CCA form. Both validate their inputs, pick an implementation and return `[B, L, Hq, D]`
in the input dtype. Implementations (`IMPLEMENTATIONS`, the one registry of their names):
  naive       dense L x L masks (tests, small L), every option
  xla         blocked, memory-linear, any backend, every option
  pallas_gpu  Pallas kernels through the Triton lowering (interpret mode on CPU), every option
  cudnn       `jax.nn.dot_product_attention` through cuDNN: full and sliding, unpacked rows
  pallas_tpu  Pallas kernels through Mosaic (the TPU interpreter on CPU), every option
"auto" picks, per call, the fastest one that takes the call (`resolve_implementation`); it
never picks `naive`, so no L x L array is built unless asked for.

Sequence sharding: `run_attention(..., sequence_sharding=SequenceSharding(mesh, "sequence",
layout))` runs cca, sliding and streaming through `sequence_parallel` (each shard's chunks on
xla's blocked attention, halos by ppermute, slots all-gathered; the implementation argument
is not used there) when the axis has more than one device. `full` stays on the plain path:
under `jit` XLA then all-gathers K/V along the sequence (no ring attention here).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.attention.naive import attention_naive, cca_attention_naive
from cca_jax.attention.pooling import POOLING_FNS, pool_core_tokens, slots_and_bounds
from cca_jax.attention.sequence_parallel import SequenceSharding, sequence_sharded_attention
from cca_jax.attention.xla import attention_xla, cca_attention_xla
from cca_jax.blocks import ATTENTION_KINDS, AttentionPattern, cca_pattern

__all__ = ["run_attention", "cca_attention", "attention_naive", "attention_xla",
           "cca_attention_naive", "cca_attention_xla", "pool_core_tokens",
           "resolve_implementation", "IMPLEMENTATIONS", "AttentionPattern", "SequenceSharding"]

_log = logging.getLogger(__name__)

# The dense path refuses lengths where its L x L float32 masks and logits would not fit.
NAIVE_MAX_LEN = 16384


def _naive(q, k, v, pattern, *, pooling, segment_ids):
    if q.shape[1] > NAIVE_MAX_LEN:
        raise ValueError(
            f"implementation='naive' builds L x L arrays; L={q.shape[1]} is over its limit of "
            f"{NAIVE_MAX_LEN}. Use implementation='xla' or 'auto' (memory-linear).")
    return attention_naive(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)


def _xla(q, k, v, pattern, *, pooling, segment_ids):
    return attention_xla(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)


def _pallas_gpu(q, k, v, pattern, *, pooling, segment_ids):
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda", "cpu"):
        raise ValueError(
            f"implementation='pallas_gpu' runs on NVIDIA GPUs (or in interpret mode on CPU), "
            f"not on the {backend!r} backend; use implementation='auto' or 'xla'.")
    from pallas_kernels.gpu import blocked_attention_pallas_gpu  # lazy: kernels import us
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, pooling=pooling,
                                       segment_ids=segment_ids)
    return blocked_attention_pallas_gpu(q, k, v, ck, cv, *bounds)


def _cudnn(q, k, v, pattern, *, pooling, segment_ids):
    if jax.default_backend() not in ("gpu", "cuda"):
        raise ValueError(
            f"implementation='cudnn' needs an NVIDIA GPU, not the {jax.default_backend()!r} "
            "backend; use implementation='auto' or 'xla'.")
    if segment_ids is not None:
        raise ValueError(
            "implementation='cudnn' takes no segment_ids (packed rows); use 'pallas_gpu' or "
            "'auto', which routes packed rows to the Pallas kernels.")
    window = None if pattern.kind == "full" else (pattern.window_size - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                        implementation="cudnn")


def _pallas_tpu(q, k, v, pattern, *, pooling, segment_ids):
    backend = jax.default_backend()
    if backend not in ("tpu", "cpu"):
        raise ValueError(
            f"implementation='pallas_tpu' runs on TPUs (or in the TPU interpreter on CPU), not "
            f"on the {backend!r} backend; use implementation='auto' or 'xla'.")
    from pallas_kernels.tpu import attention_pallas_tpu  # lazy: kernels import us
    return attention_pallas_tpu(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)


class Implementation(NamedTuple):
    run: Callable
    kinds: frozenset[str]   # attention options it computes


_ALL_KINDS = frozenset(ATTENTION_KINDS)
IMPLEMENTATIONS: dict[str, Implementation] = {
    "naive": Implementation(_naive, _ALL_KINDS),
    "xla": Implementation(_xla, _ALL_KINDS),
    "pallas_gpu": Implementation(_pallas_gpu, _ALL_KINDS),
    "cudnn": Implementation(_cudnn, frozenset({"full", "sliding"})),
    "pallas_tpu": Implementation(_pallas_tpu, _ALL_KINDS),
}
IMPLEMENTATION_CHOICES = ("auto", *IMPLEMENTATIONS)

_PALLAS_GPU_HEAD_DIMS = (64, 128)
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


@functools.lru_cache(maxsize=None)
def _log_choice_once(kind: str, backend: str, packed: bool, name: str) -> None:
    """Log what 'auto' picked, once per (option, backend, packing, choice)."""
    _log.info("attention=%s on %s%s: implementation 'auto' -> %r", kind, backend,
              " (packed rows)" if packed else "", name)


def resolve_implementation(implementation: str, backend: str | None = None, *,
                           pattern: AttentionPattern | None = None, head_dim: int = 128,
                           dtype=jnp.bfloat16, packed: bool = False) -> str:
    """The implementation `run_attention` runs for this request on `backend`.

    "auto": on NVIDIA GPUs, cuDNN for full and sliding attention on unpacked rows in
    bf16/fp16, else the Pallas kernels where the head dim is 64 or 128; on TPUs the Pallas TPU
    kernels; `xla` elsewhere.
    """
    if implementation not in IMPLEMENTATION_CHOICES:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATION_CHOICES}, got {implementation!r}.")
    kind = "cca" if pattern is None else pattern.kind
    if implementation != "auto":
        if kind not in IMPLEMENTATIONS[implementation].kinds:
            raise ValueError(
                f"implementation={implementation!r} does not compute attention={kind!r}; it "
                f"takes {sorted(IMPLEMENTATIONS[implementation].kinds)}. Use 'auto' or 'xla'.")
        return implementation
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda"):
        if (kind in IMPLEMENTATIONS["cudnn"].kinds and not packed and head_dim <= 128
                and head_dim % 8 == 0 and jnp.dtype(dtype) in _CUDNN_DTYPES):
            return "cudnn"
        if head_dim in _PALLAS_GPU_HEAD_DIMS:
            return "pallas_gpu"
    if backend == "tpu":
        return "pallas_tpu"   # every option, dtype and head dim (padded to 128 lanes)
    return "xla"


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


def run_attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: AttentionPattern, *,
                  pooling: str = "cca", implementation: str = "auto",
                  segment_ids: jax.Array | None = None,
                  sequence_sharding: SequenceSharding | None = None) -> jax.Array:
    """Causal attention under `pattern` (full, sliding, streaming or cca; see `blocks`).

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]`, RoPE already applied; `Hq` a multiple of
    `Hkv`. segment_ids: optional `[B, L]` ints; each maximal run of equal ids is one document
    (packed rows): queries see only their own document, and windows, sinks and groups count
    from its start. pooling (cca only): "cca", "mean" or "max". sequence_sharding: the rows
    are split over a mesh axis (module docstring); with its layout "zigzag", q, k, v,
    segment_ids and the output are in that row order. Returns `[B, L, Hq, D]` in the dtype
    of q.
    """
    _check_inputs(q, k, v, segment_ids)
    if not isinstance(pattern, AttentionPattern):
        raise ValueError(f"pattern must be a blocks.AttentionPattern, got {pattern!r}.")
    if pooling not in POOLING_FNS:
        raise ValueError(f"pooling must be one of {sorted(POOLING_FNS)}, got {pooling!r}.")
    if sequence_sharding is not None:
        return _run_sequence_sharded(q, k, v, pattern, pooling, implementation, segment_ids,
                                     sequence_sharding)
    name = resolve_implementation(implementation, pattern=pattern, head_dim=q.shape[-1],
                                  dtype=q.dtype, packed=segment_ids is not None)
    if implementation == "auto":
        _log_choice_once(pattern.kind, jax.default_backend(), segment_ids is not None, name)
    return IMPLEMENTATIONS[name].run(q, k, v, pattern, pooling=pooling,
                                     segment_ids=segment_ids)


def _run_sequence_sharded(q, k, v, pattern, pooling, implementation, segment_ids,
                          sharding: SequenceSharding):
    """Halos and slots where the pattern allows; else the plain path in natural row order."""
    if sharding.splits(pattern):
        return sequence_sharded_attention(q, k, v, pattern, mesh=sharding.mesh,
                                          axis=sharding.axis, segment_ids=segment_ids,
                                          pooling=pooling, zigzag=True, layout=sharding.layout,
                                          implementation=implementation)
    plain = functools.partial(run_attention, pattern=pattern, pooling=pooling,
                              implementation=implementation)
    if sharding.layout == "natural" or sharding.shards == 1:   # rows already in natural order
        return plain(q, k, v, segment_ids=segment_ids)
    order = sharding.row_order(q.shape[1])
    natural = jnp.asarray(np.argsort(order))
    q, k, v = (x[:, natural] for x in (q, k, v))
    segment_ids = None if segment_ids is None else segment_ids[:, natural]
    return plain(q, k, v, segment_ids=segment_ids)[:, jnp.asarray(order)]


def cca_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, group_size: int,
                  window_size: int, sink_tokens: int = 0, pooling: str = "cca",
                  implementation: str = "auto",
                  segment_ids: jax.Array | None = None) -> jax.Array:
    """Core Context Aware attention (SPEC.md): one softmax over core tokens and a local window.

    q: `[B, L, Hq, D]`; k, v: `[B, L, Hkv, D]`, RoPE already applied; `Hq` a multiple of `Hkv`.
    group_size (`g`) and window_size (`s`) are Python ints. sink_tokens (`N`, SPEC 6): the
    first N positions of each document are seen raw by every later query and the groups start
    after them; 0 (the default) is the paper's CCA exactly. segment_ids: optional `[B, L]`
    ints; each maximal run of equal ids is one document (packed rows): queries see raw and
    core tokens of their own document only, sinks and groups counted from its start.
    Returns `[B, L, Hq, D]` in the dtype of q.
    """
    pattern = cca_pattern(group_size, window_size, sink_tokens)   # validates (Python ints)
    return run_attention(q, k, v, pattern, pooling=pooling, implementation=implementation,
                         segment_ids=segment_ids)
