"""The Mosaic GPU backend (Hopper): slots and bounds prepared here, then the warp-specialised
forward of `pallas_kernels.mosaic_gpu` (imported lazily: an optional accelerator).

Its gradient is the Mosaic GPU backward (`backward="triton"` selects the Triton-lowered
one). Its decode step is the Mosaic GPU decode kernel for every cache it takes
(bfloat16/float16, D 64, 80, 96, 128 or 256, up to 16 query heads per KV head at D <= 128, 8 at
D = 256; speed against the Triton kernel: pallas_kernels/mosaic_gpu/DECODE-NOTES.md). A cache
it refuses goes to the Triton decode kernel (`pallas_gpu`) while JAX has it: the same
function in a float32 softmax, so the choice changes speed, not results (logged once).
Forward timings: benchmarks/results/research/mosaic_gpu_cca_h200.md. `auto` picks it before `pallas_gpu` on
sm_90+ GPUs for bfloat16 and float16 up to head dim 128; float32 and older GPUs go to
`pallas_gpu` or `xla`, and so do head dims 129-256 while JAX has the Triton lowering (the
256-wide Mosaic kernels run when asked for by name, or when the Triton lowering is gone).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp

from cca_jax import blocks
from cca_jax.attention.backend import Backend
from cca_jax.attention.pallas_gpu import PALLAS_GPU
from cca_jax.attention.pooling import slots_and_bounds
from cca_jax.blocks import AttentionPattern

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MIN_CAPABILITY = 9.0   # wgmma and TMA: sm_90 (Hopper) and later
# Head dims its forward and backward have run at on the H200. The 256-wide kernels are
# tested in the GPU interpreter and by cross-lowering only, so while JAX has the Triton
# lowering, `auto` sends those head dims to the Triton kernels.
_MEASURED_HEAD_DIM = 128
_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _log_borrowed_decode_once(reason: str) -> None:
    _log.info("mosaic_gpu decode: the Triton decode kernel serves this cache (the Mosaic GPU "
              "one refuses: %s)", reason)


def gpu_capability() -> float | None:
    """The compute capability of this process's first GPU (e.g. 9.0), or None without one."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    capability = getattr(devices[0], "compute_capability", None) if devices else None
    return float(capability) if capability else None


# A prefill chunk's rows split their keys over at most this many CTAs each
# (`prefill_key_splits`).
MAX_PREFILL_KEY_SPLITS = 4


def prefill_key_splits(live_rows: int, cta_rows: int, heads: int, batch: int,
                       cores: int) -> int:
    """How many CTAs walk the keys of each block of a chunk's rows: enough that the chunk's
    (head, row block, batch row) CTAs fill the GPU's `cores` once (at most
    `MAX_PREFILL_KEY_SPLITS`). 256 rows of 32 heads in blocks of 128 are 64 CTAs, each
    walking ~80 key blocks of a 128K context while half of an H100's 132 SMs idle: 2 splits;
    a chunk of 2048 rows fills the GPU alone: 1."""
    ctas = -(-live_rows // cta_rows) * heads * batch
    return max(1, min(MAX_PREFILL_KEY_SPLITS, cores // max(ctas, 1)))


def _interpret_default(interpret):
    return jax.default_backend() == "cpu" if interpret is None else interpret


def attention_mosaic_gpu(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                         segment_ids=None, interpret=None, **tiling):
    """Attention under `pattern` through the Mosaic GPU forward; the result of
    `run_attention`. `tiling`: `pallas_kernels.mosaic_gpu.mosaic_config` field overrides
    (plus `backward=` "mosaic" or "triton" and `backward_tiling=`, that backward's
    settings). interpret defaults to True on the CPU
    backend (jax's GPU interpreter: tiny shapes only)."""
    from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu
    ck, cv, *bounds = slots_and_bounds(
        q, k, v, pattern, pooling=pooling, segment_ids=segment_ids,
        min_slots=0 if segment_ids is not None else _whole_slot_blocks(
            pattern.max_slots(q.shape[1]), q.shape[-1], tiling))
    lead = kernel_lead_rows(pattern, q.shape[1], segment_ids is not None)
    if lead:
        bounds = blocks.sinks_as_slots(pattern, *bounds)
    tiling = _narrow_where_it_pays(pattern, q, tiling, lead)
    return blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, lead_rows=lead,
                                        interpret=_interpret_default(interpret), **tiling)


def _kernel_configs(head_dim: int, tiling: dict):
    """(the forward's MosaicConfig, the Mosaic backward's MosaicBackwardConfig or None for
    the Triton backward) at `tiling` (`attention_mosaic_gpu`'s keyword arguments), at the
    kernel head dim of `head_dim`."""
    from pallas_kernels.mosaic_gpu import (mosaic_backward_config, mosaic_config,
                                           padded_head_dim)
    width = padded_head_dim(head_dim) or head_dim
    fields = {k: v for k, v in tiling.items() if k not in ("backward", "backward_tiling")}
    backward = None
    if tiling.get("backward", "mosaic") == "mosaic":
        backward = mosaic_backward_config(head_dim=width, **(tiling.get("backward_tiling") or {}))
    return mosaic_config(head_dim=width, **fields), backward


def _whole_slot_blocks(slots: int, head_dim: int, tiling: dict) -> int:
    """`slots` rounded up to whole slot blocks of the forward and of the Mosaic backward at
    `tiling`: what unpacked rows pool (`slots_and_bounds` stops where groups end). The
    kernels read only each row's visible slots, so the extra ones change nothing, while
    the kernels' own zero-padding of the slot axis, a copy of both slot tensors (0.29 ms of
    the forward at 128K on an H100), goes away."""
    forward, backward = _kernel_configs(head_dim, tiling)
    multiple = forward.block_kv
    if backward is not None:
        multiple = math.lcm(multiple, backward.slot_multiple)
    return -(-slots // multiple) * multiple


def kernel_lead_rows(pattern: AttentionPattern, length: int, packed: bool) -> int:
    """The rows the kernels run after (`lead.py`): CCA's N sinks in unpacked rows where N
    is a whole number of TMA row tiles (8, 16, ...), else 0, and sinks off the group grid
    take the narrow heads in the rows' own frame (`_narrow_where_it_pays`): 4 sinks as lead
    rows do not compile (H100, 2026-12-06)."""
    from pallas_kernels.mosaic_gpu.lead import lead_rows_fit
    lead = 0 if packed else blocks.lead_rows(pattern, length)
    return lead if lead_rows_fit(lead) else 0


def _narrow_where_it_pays(pattern: AttentionPattern, q, tiling: dict, lead: int = 0) -> dict:
    """`tiling` with the narrow heads of the forward and of the Mosaic backward's dq kernel
    off where no CTA of one document of this length would take one (CCA without sinks,
    full, sliding, streaming at their usual shapes): those programs then hold no head path
    at all. With sinks off the group grid (N % g != 0) in packed rows nearly every CTA's
    window starts just past a key block's edge, and the head visits 16 keys instead of a
    whole masked block (`tables.visit_tables`). Unpacked rows with `lead` rows (the sinks
    moved into the slots, `blocks.sinks_as_slots`) run in the frame after the sinks, where
    the windows are CCA's without sinks. Explicit `narrow_block` settings stay."""
    length = q.shape[1] - lead
    frame = dataclasses.replace(pattern, sink_tokens=0) if lead else pattern

    def pays(rows: int, block_kv: int, narrow: int) -> bool:
        return bool(blocks.narrow_heads(frame, length, rows, block_kv, narrow))
    forward, backward = _kernel_configs(q.shape[-1], tiling)
    tiling = dict(tiling)
    if tiling.get("narrow_block") is None and \
            not pays(forward.cta_rows, forward.block_kv, forward.narrow_block):
        tiling["narrow_block"] = 0
    backward_tiling = dict(tiling.get("backward_tiling") or {})
    if backward is not None and backward_tiling.get("narrow_block") is None and \
            not pays(backward.block_q * backward.compute_wgs, backward.block_kv,
                     backward.narrow_block):
        tiling["backward_tiling"] = dict(backward_tiling, narrow_block=0)
    return tiling


class MosaicGpuBackend(Backend):
    """Every option, packed or not; bfloat16 and float16; head_dim up to 256 (64, 128 and
    256 native, others zero-padded); an sm_90+ GPU when compiled. `auto` passes it over for
    head dims above 128 while the Triton kernels can serve them (`defers_in_auto`)."""

    def _refuses(self, option, platform, dtype, head_dim, packed, entry):
        if entry == "decode":   # its own decode kernel, else the Triton one's: their union
            borrowed = PALLAS_GPU.supports(option, platform, dtype, head_dim, packed, entry)
            if borrowed is None:
                return None
            from pallas_kernels.mosaic_gpu.decode_config import decode_refusal
            own = decode_refusal(dtype, head_dim, 1, 1)   # G is checked per call
            return None if own is None else f"{own}, and the Triton decode kernel: {borrowed}"
        if dtype not in _DTYPES:
            return f"it takes bfloat16 or float16, not {dtype.name}; 'pallas_gpu' takes it"
        from pallas_kernels.mosaic_gpu import HEAD_DIMS, padded_head_dim
        if padded_head_dim(head_dim) is None:
            return f"it supports head_dim up to {HEAD_DIMS[-1]}, not {head_dim}"
        if platform == "gpu":
            capability = gpu_capability()
            if capability is None:
                return "it needs a Hopper (sm_90+) GPU and this process has no GPU"
            if capability < _MIN_CAPABILITY:
                return (f"it needs a Hopper (sm_90+) GPU, this one is sm_{capability:g}; "
                        "'pallas_gpu' runs there")
        return None

    def defers_in_auto(self, option, platform, dtype, head_dim, packed, entry="attention"):
        """Head dims above 128 (the 256-wide kernels) go to the Triton kernels while JAX has
        them: those are measured on the H200, these are not yet."""
        if head_dim > _MEASURED_HEAD_DIM and PALLAS_GPU.supports(
                option, platform, dtype, head_dim, packed, entry) is None:
            return (f"its kernels at head_dim {head_dim} are not yet measured on the H200; "
                    "'pallas_gpu' serves it")
        return None

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        return attention_mosaic_gpu(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)

    def slots_to_pool(self, slots: int, head_dim: int) -> int:
        return _whole_slot_blocks(slots, head_dim, {})

    def _blocked(self, q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window):
        from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu
        # No narrow heads here (prefill chunks, sequence shards): whether a CTA takes one
        # depends on where the chunk or shard starts, and a head path compiled in but not
        # taken is not free (the Triton forward's cost 1-2 %); kept off until measured.
        return blocked_attention_mosaic_gpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi,
                                            interpret=_interpret_default(None), narrow_block=0,
                                            backward_tiling={"narrow_block": 0})

    def reads_slots_in_cache(self, dtype, head_dim: int, slots: int) -> bool:
        from pallas_kernels.mosaic_gpu.api import reads_slots_in_cache
        return reads_slots_in_cache(dtype, head_dim, slots)

    def _blocked_in_cache(self, q, k, v, ck_cache, cv_cache, layer, cache_rows, raw_lo,
                          core_lo, core_hi, blocking, window, first_row):
        from pallas_kernels.mosaic_gpu import blocked_attention_in_cache_mosaic_gpu, mosaic_config
        from pallas_kernels.mosaic_gpu.config import gpu_core_count
        cta_rows = mosaic_config(head_dim=q.shape[-1]).cta_rows
        splits = prefill_key_splits(q.shape[1] - first_row, cta_rows, q.shape[2], q.shape[0],
                                    gpu_core_count())
        return blocked_attention_in_cache_mosaic_gpu(
            q, k, v, ck_cache, cv_cache, layer, cache_rows, raw_lo, core_lo, core_hi,
            first_row=first_row, key_splits=splits, interpret=_interpret_default(None))

    def _decode(self, q, k_all, v_all, ck, cv, layer, pattern, positions):
        from pallas_kernels.mosaic_gpu.decode_config import decode_refusal
        d = q.shape[-1]
        reason = decode_refusal(k_all.dtype, d, q.shape[1], k_all.shape[-2])
        if reason is not None:
            borrowed = PALLAS_GPU.supports(pattern, jax.default_backend(), k_all.dtype, d,
                                           False, "decode")
            if borrowed is not None:
                raise ValueError(
                    f"implementation='mosaic_gpu' cannot decode this cache: its decode kernel "
                    f"refuses it ({reason}) and so does the Triton one it borrows ({borrowed}); "
                    "use implementation='xla'.")
            _log_borrowed_decode_once(reason)
            return PALLAS_GPU._decode(q, k_all, v_all, ck, cv, layer, pattern, positions)
        return self._own_decode(q, k_all, v_all, ck, cv, layer, pattern, positions)

    def _own_decode(self, q, k_all, v_all, ck, cv, layer, pattern, positions):
        from pallas_kernels.mosaic_gpu.decode import decode_attention_mosaic_gpu
        bounds = blocks.decode_bounds(pattern, positions, k_all.shape[2], ck.shape[2])
        return decode_attention_mosaic_gpu(q, k_all, v_all, ck, cv, bounds, layer=layer,
                                           out_dtype=q.dtype,
                                           interpret=_interpret_default(None))


MOSAIC_GPU = MosaicGpuBackend("mosaic_gpu", ("gpu",),
                              "Hopper GPUs (or jax's GPU interpreter on CPU)",
                              frozenset({"attention", "blocked", "decode"}),
                              interprets_on_cpu=True)
