"""The public attention entry points.

`run_attention(q, k, v, pattern, ...)` runs any attention option (`blocks.AttentionPattern`:
full, sliding, streaming, cca); `cca_attention(q, k, v, group_size=, window_size=, ...)` is
its CCA form. Both validate their inputs, pick a backend (`backends.resolve`: the one
registry, `BACKENDS`, and the one resolver of `implementation` strings) and return
`[B, L, Hq, D]` in the input dtype. "auto" picks, per call, the fastest backend that takes
the call; it never picks `naive`, so no L x L array is built unless asked for.

Sequence sharding: `run_attention(..., sequence_sharding=SequenceSharding(mesh, "sequence",
layout))` runs cca, sliding and streaming through `sequence_parallel` (each shard's chunks on
the blocked entry of the backend, halos by ppermute, slots all-gathered) when the axis has
more than one device. `full` stays on the plain path: under `jit` XLA then all-gathers K/V
along the sequence (no ring attention here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.attention.backends import BACKENDS, IMPLEMENTATION_CHOICES, resolve
from cca_jax.attention.checks import check_inputs, check_option
from cca_jax.attention.naive import attention_naive, cca_attention_naive
from cca_jax.attention.pooling import pool_core_tokens
from cca_jax.attention.sequence_parallel import SequenceSharding, sequence_sharded_attention
from cca_jax.attention.xla import attention_xla, cca_attention_xla
from cca_jax.blocks import CCA, AttentionPattern

__all__ = ["run_attention", "cca_attention", "attention_naive", "attention_xla",
           "cca_attention_naive", "cca_attention_xla", "pool_core_tokens",
           "resolve_implementation", "BACKENDS", "IMPLEMENTATION_CHOICES", "AttentionPattern",
           "SequenceSharding"]


def resolve_implementation(implementation: str, backend: str | None = None, *,
                           pattern: AttentionPattern | None = None, head_dim: int = 128,
                           dtype=jnp.bfloat16, packed: bool = False) -> str:
    """The name of the backend `run_attention` runs for this request on platform `backend`
    (`backends.resolve`; an explicit name that cannot run raises the reason and the fix).

    "auto": on NVIDIA GPUs, cuDNN for full and sliding attention on unpacked rows in
    bf16/fp16, else the Pallas GPU kernels (head dims up to 256); on TPUs the Pallas TPU
    kernels; `xla` elsewhere.
    """
    return resolve(implementation, pattern, platform=backend, dtype=dtype, head_dim=head_dim,
                   packed=packed).name


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
    check_inputs(q, k, v, segment_ids)
    check_option(pattern, pooling)
    if sequence_sharding is not None:
        return _run_sequence_sharded(q, k, v, pattern, pooling, implementation, segment_ids,
                                     sequence_sharding)
    backend = resolve(implementation, pattern, dtype=q.dtype, head_dim=q.shape[-1],
                      packed=segment_ids is not None)
    return backend.attention(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)


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
    pattern = CCA(group_size, window_size, sink_tokens)   # validates (Python ints)
    return run_attention(q, k, v, pattern, pooling=pooling, implementation=implementation,
                         segment_ids=segment_ids)
