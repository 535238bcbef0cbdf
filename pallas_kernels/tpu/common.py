"""What the Pallas TPU (Mosaic) kernels share: tiling, layouts, masks, matmuls, the softmax step.

Layout. Callers' arrays are `[B, N, H, D]` (N: rows, keys or slots). The kernels see the free
reshape `[B, N, H * D]` (`head_view`): a block of `rows` rows of head `h` is the 2-D tile
`[rows, D]` at block index `(b, row_block, h)`, so nothing is transposed in HBM; D is a
multiple of 128 (the wrapper zero-pads smaller head dims, which changes no dot product).
Per-row values (the bounds `raw_lo, core_lo, core_hi`; `lse`, `delta` per head) are lane-dense
rows `[B, (H,) 1, N]`, read as `[1, rows]` tiles: key-major kernels use them as rows, the
query-major ones as a column (`as_column`, an in-kernel relayout of one vector).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
# Finite: a row whose scores in a block are all masked keeps a finite running max, and
# probabilities are zeroed with `where`, so no inf - inf or 0 * inf arises.
MASKED = -1e30


class KernelConfig(NamedTuple):
    """Static tiling of the TPU kernels (hashable: a custom_vjp non-diff argument).

    block_q: query rows per tile (every kernel); block_k: raw keys per tile; block_c: slots per
    tile. All multiples of 128 (scores are `[block_q, block_k]` tiles, bounds lane-dense).
    Sequences are padded to a multiple of lcm(block_q, block_k), slots to block_c.
    decode_block_k / decode_block_c: ring entries / slots per step of the decode kernel.
    vmem_limit_bytes: Mosaic's scoped VMEM limit (None: the compiler's default).
    interpret: False on TPU; on CPU a `pltpu.InterpretParams` (the TPU interpreter).
    """
    block_q: int = 512
    block_k: int = 512
    block_c: int = 512
    decode_block_k: int = 512
    decode_block_c: int = 512
    vmem_limit_bytes: int | None = None
    interpret: Any = False

    @property
    def row_multiple(self) -> int:
        return math.lcm(self.block_q, self.block_k)


def check_config(cfg: KernelConfig) -> KernelConfig:
    """`cfg` if its block sizes are valid, else a ValueError naming the fix."""
    for name in ("block_q", "block_k", "block_c", "decode_block_k", "decode_block_c"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % LANES:
            raise ValueError(f"{name} must be a positive multiple of {LANES} (TPU lanes), "
                             f"got {value!r}.")
    if cfg.interpret is not False and not isinstance(cfg.interpret, pltpu.InterpretParams):
        raise ValueError("interpret must be False or a pltpu.InterpretParams, got "
                         f"{cfg.interpret!r}.")
    return cfg


def head_view(x: jax.Array) -> jax.Array:
    """`[B, N, H, D]` -> `[B, N, H * D]` (free): head h's rows are columns `h*D:(h+1)*D`."""
    b, n, h, d = x.shape
    return x.reshape(b, n, h * d)


def row_layout(x: jax.Array) -> jax.Array:
    """`[B, N]` -> `[B, 1, N]`; `[B, H, N]` -> `[B, H, 1, N]` (lane-dense per-row values)."""
    return jnp.expand_dims(x, -2)


def as_column(row_ref) -> jax.Array:
    """A `[1, n]` tile of per-row values as an `[n, 1]` column."""
    return jnp.expand_dims(row_ref[0], -1)


def column_to_row(col: jax.Array) -> jax.Array:
    """`[n, 1]` -> `[1, n]` (through a lane-broadcast transpose, which Mosaic lowers)."""
    return jnp.transpose(jnp.broadcast_to(col, (col.shape[0], LANES)))[:1]


def dot_nt(a, b):
    """`a @ b.T` with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """`a @ b` with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def raw_visible(key, row, raw_lo):
    """Row `row` sees raw key `key` (all broadcast): `raw_lo <= key <= row`."""
    return (key >= raw_lo) & (key <= row)


def slot_visible(slot, core_lo, core_hi):
    """A row with slots `[core_lo, core_hi)` sees `slot` (broadcast)."""
    return (slot >= core_lo) & (slot < core_hi)


def iota(shape, dim: int, start):
    return start + lax.broadcasted_iota(jnp.int32, shape, dim)


def online_softmax_step(scores, mask, values, m_ref, l_ref, acc_ref, rows=slice(None)):
    """Fold one tile of float32 scores `[rows, keys]` (scaled) into the running max `m_ref`,
    denominator `l_ref` (`[rows, 1]`) and accumulator `acc_ref` (`[rows, D]`), or into their
    `rows` slice. mask: bool tile or None (every entry visible)."""
    if mask is not None:
        scores = jnp.where(mask, scores, MASKED)
    m_prev = m_ref[rows]
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(scores - m_new)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    l_ref[rows] = alpha * l_ref[rows] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[rows] = alpha * acc_ref[rows] + dot_nn(p.astype(values.dtype), values)
    m_ref[rows] = m_new


def compiler_params(cfg: KernelConfig, semantics: tuple[str, ...]):
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=cfg.vmem_limit_bytes)


def when_visited(run, full, body):
    """Run `body(masked)` at a visited step: unmasked when the tile is fully visible."""
    @pl.when(run & full)
    def _():
        body(False)

    @pl.when(run & jnp.logical_not(full))
    def _():
        body(True)


def clamp_visit(first, last, step, limit: int):
    """The block a walk over `[first, last)` holds at `step`: `first + step`, staying on the
    last visited block past the end (no new copy), within `[0, limit)` (an empty walk holds
    `first`, the block the next walk of the same head starts at)."""
    return jnp.minimum(jnp.minimum(first + step, jnp.maximum(last - 1, first)), limit - 1)
