"""The Mosaic GPU decode kernel's tiling (`MosaicDecodeConfig`), its checks, and the split
count and shared memory it implies: what `decode.py` runs, and what the backend asks before
it chooses the kernel (`decode_refusal`)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from pallas_kernels.mosaic_gpu.config import SMEM_LIMIT_BYTES, gpu_core_count

# The cache is read in place at the model's D, so each D needs its own shared-memory tiles:
# rows of 128 bytes or a multiple (64, 128, 256 in 16-bit) take the 128-byte swizzle, 96 the
# 64-byte one and 80 the 32-byte one (`pipeline.smem_transforms`).
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCKS = (64, 128, 256)    # the value product's K: a multiple of 64 (128-byte swizzle)
# At D = 256 the default 128-key steps' K/V buffers alone are 256 KiB: 64-key steps there.
WIDE_HEAD_DIM, WIDE_BLOCK = 256, 64
# Query heads per KV head (G, from 2 to 4, D <= 128) that default to 64-key steps in 4 stages:
# on the H200 at G = 4 that was 1.02x the Triton kernel, the 128-key default 0.95x; at G = 1
# the default was 1.05x (benchmarks/results/research/mosaic_gpu_decode_sweep_h200.md).
GROUPED_BLOCK, GROUPED_STAGES, GROUPED_MAX = 64, 4, 4
SLOT_LAYOUTS = ("bchd", "bhcd")   # slots [.., B, C, Hq, D] (KVCache) or [.., B, Hq, C, D]
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ROWS = 64                        # wgmma's M: the query heads of a KV head, zero-padded
_COLS = 16                        # keys_along_rows: wgmma's N, the query heads zero-padded


class MosaicDecodeConfig(NamedTuple):
    """Static tiling of the Mosaic GPU decode kernel (hashable).

    block: key rows per pipeline step (the wgmma N and K): ring entries, or `block / G'`
        slots of each of a KV head's G query heads, G' = G rounded up to a power of two (so
        `block / G'` must be a multiple of 8: G up to 8, 16 and 32 at blocks 64, 128, 256).
    stages: shared-memory buffers of K and V in flight (>= 2).
    splits: programs per (row, KV head) sharing the row's steps; None: whole waves of
        programs that fill the GPU (`resolve_splits`).
    slot_layout: "bchd" (KVCache: `[.., B, C, Hq, D]`) or "bhcd" (`[.., B, Hq, C, D]`).
    early_keys: issue step i + stages's key copy as soon as step i's scores have read the
        keys, its value copy after the value product (False: both after it). Half a step
        more of key bytes in flight, for a kernel that waits on memory latency.
    edge_masks_only: mask the scores by position only on the blocks that need it (the ring's
        edge blocks, a clipped last block, the last slot block); a block every row sees
        whole takes no mask (a slot block keeps its lanes' mask when G > 1). The masks are
        a dozen integer operations a score on the 64-row tile, more issue slots than exp2.
    keys_along_rows: compute each step transposed, keys along wgmma's M and the query heads
        along its N (16, G zero-padded: G <= 16; D a multiple of 64, O^T's M): S^T = K Q^T,
        the softmax down the columns,
        O^T += V^T P with P through shared memory and V in 32-byte-swizzled tiles. The
        elementwise work of a step is then that of a 16-column tile, not a 64-row one.
    """
    block: int = 128
    stages: int = 2
    splits: int | None = None
    slot_layout: str = "bchd"
    early_keys: bool = False
    edge_masks_only: bool = False
    keys_along_rows: bool = False


def query_rows(cfg: MosaicDecodeConfig) -> int:
    """Rows of a program's query tile: wgmma's M (64), or its N (16) with keys_along_rows."""
    return _COLS if cfg.keys_along_rows else _ROWS


def shared_memory_bytes(cfg: MosaicDecodeConfig, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of one program: the query tile, barriers, and the K/V buffers (with
    keys_along_rows, P's tile) or (after them, in the same space) the float32 output tile
    with max and sum."""
    rows = query_rows(cfg)
    buffers = 2 * cfg.stages * cfg.block * head_dim * itemsize
    if cfg.keys_along_rows:
        buffers += cfg.block * rows * itemsize
    out = rows * head_dim * 4 + 2 * rows * 4
    return rows * head_dim * itemsize + (2 * cfg.stages + 1) * 8 + max(buffers, out)


def decode_config(*, head_dim: int = 128, groups: int = 1, **fields) -> MosaicDecodeConfig:
    """A checked MosaicDecodeConfig with `fields` overriding its defaults for head dim
    `head_dim` and G = `groups` query heads per KV head (block `WIDE_BLOCK` at D = 256;
    `GROUPED_BLOCK` in `GROUPED_STAGES` stages at G in 2..`GROUPED_MAX` unless either is
    given; None ignored)."""
    fields = {name: value for name, value in fields.items() if value is not None}
    if head_dim >= WIDE_HEAD_DIM:
        fields = {"block": WIDE_BLOCK, **fields}
    elif 2 <= groups <= GROUPED_MAX and not {"block", "stages"} & fields.keys():
        fields = {"block": GROUPED_BLOCK, "stages": GROUPED_STAGES, **fields}   # as a pair
    for name, value in fields.items():
        if name not in MosaicDecodeConfig._fields:
            raise ValueError(f"unknown Mosaic GPU decode setting {name!r}; the settings are "
                             f"{MosaicDecodeConfig._fields}.")
        if name == "block" and (isinstance(value, bool) or value not in BLOCKS):
            raise ValueError(f"block must be one of {BLOCKS}, got {value!r}.")
        if name in ("stages", "splits") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if name == "stages" and not 2 <= value <= 8:
            raise ValueError(f"stages must be from 2 to 8 (one buffer is read while the "
                             f"next lands), got {value!r}.")
        if name == "slot_layout" and value not in SLOT_LAYOUTS:
            raise ValueError(f"slot_layout must be one of {SLOT_LAYOUTS}, got {value!r}.")
        if name in ("early_keys", "edge_masks_only", "keys_along_rows") and \
                not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}.")
    return MosaicDecodeConfig(**fields)


def lanes(groups: int) -> int:
    """Query-head lanes of a program serving G query heads: G rounded up to a power of two,
    so that a step's `block` key rows split into whole 8-row tiles per lane."""
    return 1 << (groups - 1).bit_length()


def check_shapes(cfg: MosaicDecodeConfig, groups: int, head_dim: int, itemsize: int) -> None:
    """ValueError naming the fix when `cfg` cannot serve G query heads per KV head at D."""
    if cfg.keys_along_rows and lanes(groups) > _COLS:
        raise ValueError(f"keys_along_rows serves at most {_COLS} query heads per KV head, "
                         f"got {groups}; leave it off.")
    if cfg.keys_along_rows and head_dim % _ROWS:
        raise ValueError(f"keys_along_rows puts head_dim along wgmma's M (a multiple of "
                         f"{_ROWS}), got {head_dim}; leave it off.")
    if cfg.block < 8 * lanes(groups):
        ok = [b for b in BLOCKS if b >= 8 * lanes(groups)]
        raise ValueError(
            f"block={cfg.block} cannot hold the slots of {groups} query heads per KV head "
            f"(block / G must be a multiple of 8, G rounded up to {lanes(groups)}); use "
            f"block in {ok}"
            + ("" if ok else " (none fits: use implementation='pallas_gpu')") + ".")
    need = shared_memory_bytes(cfg, head_dim, itemsize)
    if need > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"the Mosaic GPU decode kernel needs {need / 1024:.0f} KiB of shared memory at "
            f"head_dim={head_dim}, block={cfg.block}, stages={cfg.stages}; sm_90 has "
            f"{SMEM_LIMIT_BYTES // 1024} KiB: lower stages or block.")


def gpu_slots(cfg: MosaicDecodeConfig, head_dim: int, itemsize: int = 2) -> int:
    """Programs the GPU runs at once: SMs (this process's first GPU, else an H200's 132)
    times the CTAs of this shared-memory size an SM holds (228 KiB, 1 KiB reserved each)."""
    sms = gpu_core_count()
    per_sm = max(1, (228 * 1024) // (shared_memory_bytes(cfg, head_dim, itemsize) + 1024))
    return sms * per_sm


def decode_refusal(dtype, head_dim: int, q_heads: int, kv_heads: int, **tiling) -> str | None:
    """None if the kernel takes this cache (at `tiling`), else why not: for a backend that
    falls back to the Triton decode kernel (`implementation='pallas_gpu'`) instead."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"it takes a bfloat16 or float16 cache, not {jnp.dtype(dtype).name}"
    if head_dim not in HEAD_DIMS:
        return f"it supports head_dim in {HEAD_DIMS}, not {head_dim}"
    if kv_heads < 1 or q_heads % kv_heads:
        return f"Hq = {q_heads} is not a multiple of Hkv = {kv_heads}"
    try:
        groups = q_heads // kv_heads
        check_shapes(decode_config(head_dim=head_dim, groups=groups, **tiling), groups,
                     head_dim, jnp.dtype(dtype).itemsize)
    except ValueError as e:
        return str(e)
    return None


def resolve_splits(cfg: MosaicDecodeConfig, batch: int, kv_heads: int, ring: int,
                   num_slots: int, groups: int, slots_at_once: int) -> int:
    """The config's splits, or the smallest count whose waves of equal programs fill the
    GPU within 5% of the best (`slots_at_once` programs run together; a program per
    (row, KV head) is `batch * kv_heads`), at most the steps of a full row; at least 2
    where a row has 2 steps (2 never take more waves than 1): a batch with idle rows (a
    server's decode step) then runs each busy row over twice the SMs (H100, 7B, 8 rows x
    128K: one busy row 0.123 ms a layer with 1 split, 0.087 with 2; all 8 busy 0.414
    either way; benchmarks/results/research/mosaic_gpu_decode_idle_rows_h100_b60e6cb.md)."""
    if cfg.splits is not None:
        return cfg.splits
    steps = -(-ring // cfg.block) + 1 + -(-num_slots // (cfg.block // lanes(groups)))
    programs = batch * kv_heads
    top = max(1, min(steps, -(-8 * slots_at_once // programs)))
    cost = {s: -(-programs * s // slots_at_once) / s for s in range(1, top + 1)}
    best = min(cost.values())
    return max(min(s for s, c in cost.items() if c <= 1.05 * best), min(2, top))
