"""Tiling of the Mosaic GPU forward: one frozen, validated record.

A CTA runs `compute_wgs` consumer warpgroups of `block_q` query rows each (wgmma's 64-row
tiles) plus one producer warpgroup that TMA-copies key/value blocks of `block_kv` rows into a
ring of `stages` shared-memory buffers. Validation happens here (`check_config`, and
`check_shared_memory` once the head dim is known), so a bad setting fails with the fix named
instead of deep inside the Mosaic GPU compiler.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax

# Hopper's shared memory per CTA (sm_90: 227 KiB usable of 228).
SMEM_LIMIT_BYTES = 227 * 1024
# SMs assumed where jax names none (no GPU attached: lowering for one from a CPU host):
# an H100's or H200's.
DEFAULT_GPU_CORES = 132
# Persistent CTAs under the GPU interpreter (which has no SM count): a few, so that each
# walks several works.
INTERPRETED_CTAS = 4
BLOCK_Q_CHOICES = (64, 128)
BLOCK_KV_CHOICES = (64, 128, 256)
HEAD_DIMS = (64, 128, 256)
# Narrow head widths: multiples of wgmma's 16-deep bf16/fp16 step (the P V product's K).
NARROW_CHOICES = (0, 16, 32)
# Defaults that replace the general ones at a kernel head dim where those do not fit sm_90:
# at D = 256 a 64 x 256 float32 accumulator is 128 registers a thread and a 64-row tile is
# 32 KiB, so the forward takes 64-key steps (192 KiB of tiles at 2 stages) and the backward
# runs one consumer warpgroup (192 KiB) with dK and dV in separate kernels (one accumulator
# each). Explicit settings still override these.
WIDE_HEAD_DIM = 256
WIDE_FORWARD_DEFAULTS = {"block_kv": 64, "stages": 2}
WIDE_BACKWARD_DEFAULTS = {"compute_wgs": 1, "stages": 2, "split_keys": True}
# The fused backward's key-side kernels add dS^T tiles (two buffers) and a float32 dQ staging
# tile to their shared memory: with 3 ring stages that is 228 KiB at D = 128, so 2.
FUSED_DQ_DEFAULTS = {"stages": 2}
FUSED_DQ_HEAD_DIMS = (64, 128)


def gpu_core_count(default: int = DEFAULT_GPU_CORES) -> int:
    """Streaming multiprocessors of this process's first GPU (`default` where jax does not
    say or there is no GPU)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return default
    return int(getattr(devices[0], "core_count", 0) or default) if devices else default


def swizzle_bytes(row_bytes: int):
    """The shared-memory swizzle of tiles with rows of `row_bytes`: the widest of 128, 64
    and 32 bytes that divides a row (None if none does)."""
    return next((w for w in (128, 64, 32) if row_bytes % w == 0), None)


def fused_dq_by_columns(head_dim: int, compute_wgs: int, itemsize: int = 2) -> bool:
    """How the fused backward's consumers share a step's dQ = dS K: by columns (each half
    of D over both warpgroups' keys) when a half is whole swizzle tiles of the K tiles
    (D = 128), else each over its own keys and all of D (D = 64: twice the reduce-adds)."""
    width = head_dim // compute_wgs
    return compute_wgs > 1 and width % (swizzle_bytes(head_dim * itemsize) // itemsize) == 0


def softmax_scale(cfg, head_dim: int) -> float:
    """1 / sqrt(D) of a forward or backward config at kernel head dim `head_dim`: D is the
    real head dim when the api zero-padded it (`softmax_head_dim`)."""
    return 1.0 / math.sqrt(cfg.softmax_head_dim or head_dim)


class MosaicConfig(NamedTuple):
    """Static tiling of the Mosaic GPU forward (hashable: a custom_vjp non-diff argument).

    block_q: query rows per consumer warpgroup (a multiple of wgmma's 64).
    block_kv: keys (raw or core slots) per pipeline step; 128 measured 15-20% faster than 64
        for jax's own Mosaic flash attention on the H200.
    stages: key/value buffers in flight (>= 2: one is read while the next one lands).
    compute_wgs: consumer warpgroups per CTA (1 or 2; 2 is FA3's ping-pong: one warpgroup's
        softmax overlaps the other's matrix products).
    schedule_barrier: with 2 consumers, order their wgmma issue by a shared barrier (FA3).
    heavy_first: launch the last (heaviest: most core slots) query blocks first.
    narrow_block: keys of the narrow head (`tables.visit_tables`): a CTA whose raw window
        starts in the last `narrow_block` keys of a block visits just those, from buffers
        of their own, instead of a whole masked block (CCA with sinks off the group grid);
        0: off.
    persistent: launch one CTA per SM, each walking every SM-th (query head, row block,
        batch row) in launch order, instead of one CTA each: its ring runs on from one row
        block into the next (the next block's first keys and its Q load during the last
        block's epilogue) and O gets tiles of its own, stored while the next block runs.
        Off by default: the same bits, but slower on an H100 (128K: 20.34 ms against 18.91;
        benchmarks/results/research/h100_2026-12-07f.md).
    softmax_head_dim: set by zero-padding of the head dim (api): the real D of 1/sqrt(D).
    """
    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    compute_wgs: int = 2
    schedule_barrier: bool = True
    heavy_first: bool = True
    narrow_block: int = 16
    persistent: bool = False
    softmax_head_dim: int = 0

    @property
    def cta_rows(self) -> int:
        """Query rows per CTA (all its consumer warpgroups)."""
        return self.block_q * self.compute_wgs

    @property
    def row_multiple(self) -> int:
        """Rows (queries and keys) are zero-padded to a multiple of this."""
        return max(self.cta_rows, self.block_kv)


def _check_narrow(cfg) -> None:
    """ValueError naming the choices unless `cfg.narrow_block` is 0 or a narrow head width
    below `cfg.block_kv` (the forward's and the dq kernel's configs alike)."""
    if isinstance(cfg.narrow_block, bool) or cfg.narrow_block not in NARROW_CHOICES \
            or not cfg.narrow_block < cfg.block_kv:
        raise ValueError(f"narrow_block must be 0 (off) or one of {NARROW_CHOICES[1:]} below "
                         f"block_kv={cfg.block_kv}, got {cfg.narrow_block!r}.")


def _choice(name: str, value, choices) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def check_config(cfg: MosaicConfig) -> MosaicConfig:
    """`cfg` if every field is valid, else a ValueError naming the field and its choices."""
    _choice("block_q", cfg.block_q, BLOCK_Q_CHOICES)
    _choice("block_kv", cfg.block_kv, BLOCK_KV_CHOICES)
    _choice("compute_wgs", cfg.compute_wgs, (1, 2))
    if isinstance(cfg.stages, bool) or not isinstance(cfg.stages, int) or not 2 <= cfg.stages <= 8:
        raise ValueError(f"stages must be an int from 2 to 8, got {cfg.stages!r}.")
    _check_narrow(cfg)
    for name in ("schedule_barrier", "heavy_first", "persistent"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(cfg, name)!r}.")
    if isinstance(cfg.softmax_head_dim, bool) or not isinstance(cfg.softmax_head_dim, int) \
            or cfg.softmax_head_dim < 0:
        raise ValueError(f"softmax_head_dim must be an int >= 0, got {cfg.softmax_head_dim!r}.")
    return cfg


def shared_memory_bytes(cfg: MosaicConfig, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory the forward allocates: Q/O tiles (persistent: O tiles of their own),
    the K and V rings and narrow-head buffers, per-row bounds and log-sum-exps, barriers (8
    bytes each)."""
    wgs = cfg.compute_wgs
    own_rows = (2 if cfg.persistent else 1) * wgs * cfg.block_q
    tiles = (own_rows + 2 * cfg.stages * cfg.block_kv
             + 2 * cfg.narrow_block) * head_dim * itemsize
    rows = wgs * cfg.block_q * (3 + 1) * 4
    head_barriers = (2 + cfg.persistent) if cfg.narrow_block else 0
    barriers = (2 * wgs + 4 * cfg.stages + 1 + head_barriers) * 8
    return tiles + rows + barriers


def check_shared_memory(cfg: MosaicConfig, head_dim: int, itemsize: int = 2) -> None:
    """ValueError naming the fix when the tiles exceed sm_90's shared memory."""
    need = shared_memory_bytes(cfg, head_dim, itemsize)
    if need > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"the Mosaic GPU forward needs {need / 1024:.0f} KiB of shared memory at "
            f"head_dim={head_dim} with block_q={cfg.block_q}, block_kv={cfg.block_kv}, "
            f"stages={cfg.stages}, compute_wgs={cfg.compute_wgs}, persistent={cfg.persistent}; "
            f"sm_90 has {SMEM_LIMIT_BYTES // 1024} KiB: lower stages or block_kv"
            f"{', or pass persistent=False' if cfg.persistent else ''}.")


def mosaic_config(*, head_dim: int = 128, **fields) -> MosaicConfig:
    """A validated MosaicConfig with `fields` overriding the defaults for kernel head dim
    `head_dim` (`WIDE_FORWARD_DEFAULTS` at 256; None values ignored, so callers may pass
    optional settings through)."""
    fields = {name: value for name, value in fields.items() if value is not None}
    for name in fields:
        if name not in MosaicConfig._fields or name == "softmax_head_dim":
            settable = [f for f in MosaicConfig._fields if f != "softmax_head_dim"]
            raise ValueError(f"unknown Mosaic GPU kernel setting {name!r}; the settings are "
                             f"{settable}.")
    defaults = WIDE_FORWARD_DEFAULTS if head_dim >= WIDE_HEAD_DIM else {}
    return check_config(MosaicConfig(**{**defaults, **fields}))


# ---- the backward kernels ---------------------------------------------------------------------

# Keys (or slots) one consumer warpgroup of the dk/dv and dck/dcv kernels owns: wgmma's 64-row
# tile. Its dk and dv accumulators stay in registers for the whole walk, so 128 rows (two
# tiles, 256 float32 registers a thread at D = 128) would not fit.
KEY_ROWS = 64


class MosaicBackwardConfig(NamedTuple):
    """Static tiling of the Mosaic GPU backward (hashable: a custom_vjp non-diff argument).

    block_q: dq kernel: query rows per consumer warpgroup (a multiple of wgmma's 64).
    block_kv: dq kernel: keys or slots per pipeline step.
    key_block_q: dk/dv and dck/dcv kernels: query rows per pipeline step (each consumer
        warpgroup owns `KEY_ROWS` keys or slots and accumulates their gradients).
    stages: buffers in flight in every kernel's ring (>= 2).
    compute_wgs: consumer warpgroups per CTA in every kernel (1 or 2), sharing one ring.
    split_keys: dK and dV in two kernels, each holding one float32 accumulator (the dK one
        recomputes the scores: one more product per step) where both would not fit a
        thread's registers: D = 256.
    narrow_block: dq kernel: keys of its narrow head (the forward's `narrow_block`); 0: off.
    fused_dq: no dq kernel: the key-side kernels also compute dQ = dS K (shared by the
        consumer warpgroups as `fused_dq_by_columns` says) and add it into a float32
        accumulator by TMA reduce-adds. Five products per visited block instead of seven,
        but dq's last bits vary run to run (the adds' order). `key_block_q` 64, joint dK/dV,
        kernel head dims 64 and 128; 2 stages by default. Off by default: correct on an
        H200 but slower (128K forward+backward 123.85 ms against 91.85; NOTES.md).
    paired_scores: dq kernel: issue S = Q K^T and dP = dO V^T together before one wait,
        instead of one after the other (`pipeline.two_scores`). On by default: at 128K, Hkv 8
        on the H200, dq 30.03 ms against 30.79, the whole backward 72.37 against 74.92, in one
        round-robin run (`research/mosaic_backward_parts_h200.md`; the kernels it does not
        touch moved by up to 3 % in that run).
    persistent: every kernel one CTA per SM walking its share of the row blocks (dq) or
        key tiles (dk/dv, dck/dcv), the ring running on across them (the forward's
        `persistent`); dq stores from tiles of its own, the key side through its K and V
        tiles as before. Not with fused_dq. Off by default: the same bits, but slower on
        an H100 (128K backward 73.00 ms against 68.45; research/h100_2026-12-07f.md).
    softmax_head_dim: set by zero-padding of the head dim (api): the real D of 1/sqrt(D).
    """
    block_q: int = 64
    block_kv: int = 64
    key_block_q: int = 64
    stages: int = 3   # faster than 2 at 8K-128K: research/mosaic_gpu_cca_bwd_h200.md
    compute_wgs: int = 2
    split_keys: bool = False
    narrow_block: int = 16
    paired_scores: bool = True
    fused_dq: bool = False
    persistent: bool = False
    softmax_head_dim: int = 0

    @property
    def key_cta_rows(self) -> int:
        """Keys (slots) per CTA of the dk/dv (dck/dcv) kernel."""
        return KEY_ROWS * self.compute_wgs

    @property
    def row_multiple(self) -> int:
        """Rows (queries and keys) are zero-padded to a multiple of this."""
        return max(self.block_q * self.compute_wgs, self.block_kv, self.key_cta_rows,
                   self.key_block_q)

    @property
    def slot_multiple(self) -> int:
        """Slots are zero-padded to a multiple of this (at least one)."""
        return max(self.block_kv, self.key_cta_rows)


def check_backward_config(cfg: MosaicBackwardConfig) -> MosaicBackwardConfig:
    """`cfg` if every field is valid, else a ValueError naming the field and its choices."""
    _choice("block_q", cfg.block_q, BLOCK_Q_CHOICES)
    _choice("block_kv", cfg.block_kv, BLOCK_Q_CHOICES)
    _choice("key_block_q", cfg.key_block_q, BLOCK_Q_CHOICES)
    _choice("compute_wgs", cfg.compute_wgs, (1, 2))
    if isinstance(cfg.stages, bool) or not isinstance(cfg.stages, int) or not 2 <= cfg.stages <= 8:
        raise ValueError(f"stages must be an int from 2 to 8, got {cfg.stages!r}.")
    for name in ("split_keys", "paired_scores", "fused_dq", "persistent"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(cfg, name)!r}.")
    if cfg.fused_dq and cfg.persistent:
        raise ValueError("persistent does not run the fused_dq kernels: pass one of them.")
    if cfg.fused_dq and (cfg.split_keys or cfg.key_block_q != 64):
        raise ValueError(f"fused_dq needs key_block_q=64 and split_keys=False (its dS^T and "
                         f"dQ tiles take the shared memory and registers), got {cfg}.")
    _check_narrow(cfg)
    if isinstance(cfg.softmax_head_dim, bool) or not isinstance(cfg.softmax_head_dim, int) \
            or cfg.softmax_head_dim < 0:
        raise ValueError(f"softmax_head_dim must be an int >= 0, got {cfg.softmax_head_dim!r}.")
    return cfg


def backward_shared_memory_bytes(cfg: MosaicBackwardConfig, head_dim: int,
                                 itemsize: int = 2) -> dict:
    """Shared memory each backward kernel allocates, by name ("dq", "keys"): the tiles a
    warpgroup owns (dq: Q and dO; keys: K and V), the ring (dq: K, V; keys: Q, dO), per-row
    bounds and log2-sum-exp/delta, barriers (8 bytes each)."""
    wgs, stages = cfg.compute_wgs, cfg.stages
    barriers = (4 * wgs + 4 * stages) * 8
    own_rows = (3 if cfg.persistent else 2) * wgs * cfg.block_q     # Q, dO (and dQ)
    dq = (own_rows + 2 * stages * cfg.block_kv + 3 * cfg.narrow_block) \
        * head_dim * itemsize + wgs * cfg.block_q * (3 + 2) * 4 + barriers \
        + ((3 + cfg.persistent) * 8 if cfg.narrow_block else 0)
    keys = (2 * wgs * KEY_ROWS + 2 * stages * cfg.key_block_q) * head_dim * itemsize \
        + stages * cfg.key_block_q * (3 + 2) * 4 + barriers
    if not cfg.fused_dq:
        return {"dq": dq, "keys": keys}
    # two buffers of every warpgroup's dS^T, the float32 dQ staging tiles, one barrier
    staging = head_dim if fused_dq_by_columns(head_dim, wgs, itemsize) else wgs * head_dim
    fused = 2 * wgs * KEY_ROWS * cfg.key_block_q * itemsize + cfg.key_block_q * staging * 4
    return {"keys": keys + fused + 8}


def _check_fused_head_dim(fused_dq: bool, head_dim: int) -> None:
    if fused_dq and head_dim not in FUSED_DQ_HEAD_DIMS:
        raise ValueError(f"fused_dq runs kernel head dims {FUSED_DQ_HEAD_DIMS} (a float32 dQ "
                         f"half per thread must fit beside dK and dV), got {head_dim}: pass "
                         "fused_dq=False.")


def check_backward_shared_memory(cfg: MosaicBackwardConfig, head_dim: int,
                                 itemsize: int = 2) -> None:
    """ValueError naming the fix when a backward kernel's tiles exceed sm_90's shared
    memory."""
    _check_fused_head_dim(cfg.fused_dq, head_dim)
    for kernel, need in backward_shared_memory_bytes(cfg, head_dim, itemsize).items():
        if need > SMEM_LIMIT_BYTES:
            block = "block_kv" if kernel == "dq" else "key_block_q"
            raise ValueError(
                f"the Mosaic GPU backward's {kernel} kernel needs {need / 1024:.0f} KiB of "
                f"shared memory at head_dim={head_dim} with {cfg}; sm_90 has "
                f"{SMEM_LIMIT_BYTES // 1024} KiB: lower stages or {block}"
                f"{', or pass persistent=False' if cfg.persistent else ''}.")


def mosaic_backward_config(*, head_dim: int = 128, **fields) -> MosaicBackwardConfig:
    """A validated MosaicBackwardConfig with `fields` overriding the defaults for kernel
    head dim `head_dim` (`WIDE_BACKWARD_DEFAULTS` at 256; None values ignored)."""
    fields = {name: value for name, value in fields.items() if value is not None}
    settable = [f for f in MosaicBackwardConfig._fields if f != "softmax_head_dim"]
    for name in fields:
        if name not in settable:
            raise ValueError(f"unknown Mosaic GPU backward setting {name!r}; the settings "
                             f"are {settable} (or pass backward='triton' to tune the "
                             f"Triton backward with its kernel_config fields).")
    defaults = WIDE_BACKWARD_DEFAULTS if head_dim >= WIDE_HEAD_DIM else {}
    if fields.get("fused_dq"):
        _check_fused_head_dim(True, head_dim)
        defaults = {**defaults, **FUSED_DQ_DEFAULTS}
    return check_backward_config(MosaicBackwardConfig(**{**defaults, **fields}))
