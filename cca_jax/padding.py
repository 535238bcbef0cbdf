"""Padding to whole blocks, shared by the blocked XLA implementation and the Pallas kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(x: int, n: int) -> int:
    """The smallest multiple of `n` that is >= `x`."""
    return -(-x // n) * n


def pad_rows(x: jax.Array, total: int) -> jax.Array:
    """Zero-pad axis 1 (the sequence or slot axis) to `total`."""
    extra = total - x.shape[1]
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, extra)
    return jnp.pad(x, pad)


def pad_row_bounds(raw_lo, core_lo, core_hi, total: int):
    """Row bounds `[B, L]` padded to `total` rows.

    Padded rows see only themselves (a zero key) and the last real row's slots: every value
    they produce is finite and discarded, and the bounds stay non-decreasing along the row, as
    `cca_jax.blocks` requires.
    """
    b, length = raw_lo.shape
    extra = total - length
    if extra == 0:
        return raw_lo, core_lo, core_hi
    own = jnp.broadcast_to(jnp.arange(length, total, dtype=raw_lo.dtype), (b, extra))
    edge = lambda x: jnp.pad(x, ((0, 0), (0, extra)), mode="edge")  # noqa: E731
    return jnp.concatenate([raw_lo, own], axis=1), edge(core_lo), edge(core_hi)


def softmax_delta(dout: jax.Array, out: jax.Array) -> jax.Array:
    """`rowsum(dO * O)` of the attention backward, float32 `[B, Hq, L]`.

    A multiply-sum, not an einsum: as a dot this has one batch per row and head (millions of
    1 x D x 1 products), which XLA may hand to a batched GEMM, at TF32 on GPUs. The sums are
    kept in row order before the transpose (an optimization barrier): fused into the
    transposed stack of the backward's stats, XLA's GPU loop read dO and O a row of D per
    thread across rows 8 KB apart, 3.8 ms at 128K against 0.9 for the sums alone (H100,
    benchmarks/results/research/h100_2026-12-06.md)."""
    rows = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return jnp.swapaxes(jax.lax.optimization_barrier(rows), 1, 2)
