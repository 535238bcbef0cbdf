"""The Mosaic GPU kernels (`pallas_kernels.mosaic_gpu`) on the CPU, without running them:
cross-lowering for "cuda" (builds the Mosaic GPU modules: catches API, shape, layout and
wgmma/TMA constraint errors; not ptxas, shared memory at run time or numerics), the config
and input validation, and what the backend compiles in for each case (narrow heads, lead
rows, whole slot blocks).
The kernels run in `tests/test_mosaic_gpu_interpreted.py` (CPU, slow) and
`tests/test_mosaic_gpu.py` (GPU)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.padding import pad_row_bounds
from pallas_kernels.mosaic_gpu import (MosaicBackwardConfig, MosaicConfig,
                                       blocked_attention_in_cache_mosaic_gpu,
                                       blocked_attention_mosaic_gpu, mosaic_backward_config,
                                       mosaic_config, shared_memory_bytes, visit_tables)
from pallas_kernels.mosaic_gpu.config import SMEM_LIMIT_BYTES, backward_shared_memory_bytes
from pallas_kernels.mosaic_gpu.tables import walk_steps
from tests.mosaic_gpu_cases import (dense_reference, in_cache_inputs, lowered_text,
                                    random_inputs, random_segments)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype,d,hq,hkv,tiling", [
    ("bfloat16", 128, 8, 2, {}),                                  # the default tiling, GQA
    ("float16", 64, 4, 4, dict(compute_wgs=1, stages=3)),         # one consumer warpgroup
])
def test_forward_lowers_for_cuda(dtype, d, hq, hkv, tiling):
    """L = 1000 (not a multiple of any block), m = 45 slots (not a multiple of block_kv):
    one Mosaic GPU kernel, no Triton one."""
    text = lowered_text(dtype, d, hq, hkv, 1000, 45, **tiling)
    assert text.count("mosaic_gpu_v2(") == 1
    assert "xla.gpu.triton" not in text


@pytest.mark.parametrize("remat,kernels", [("full", 5), ("save_attention", 4)])
def test_save_attention_remat_runs_the_forward_kernel_once(remat, kernels):
    """Under `full` remat the gradient runs the forward kernel again (forward, its rerun,
    dq, dk/dv, dck/dcv); `save_attention` keeps the kernel's output and log-sum-exp, so the
    backward starts from them (four kernels)."""
    text = lowered_text("bfloat16", 128, 8, 2, 1000, 45, grad=True, remat=remat)
    assert text.count("mosaic_gpu_v2(") == kernels


@pytest.mark.parametrize("backward,m,kernels", [
    ("mosaic", 30, dict(mosaic=4, triton=0)),   # forward, dq, dk/dv, dck/dcv
    ("mosaic", 0, dict(mosaic=3, triton=0)),    # no slots: no dck/dcv kernel
    ("triton", 30, dict(mosaic=1, triton=3)),   # the Triton backward: dq, dk/dv, dck/dcv
])
def test_gradient_lowers_for_cuda(backward, m, kernels):
    """jax.grad through it, D = 96 zero-padded to 128, GQA, L = 700: the Mosaic backward
    is Mosaic GPU kernels only (no Triton one); the Triton one stays selectable. Around
    the kernels, no while loop (a few launches per iteration on a GPU: the tables' binary
    searches are unrolled) and no dot (delta and pooling are multiply-sums)."""
    text = lowered_text("bfloat16", 96, 8, 2, 700, m, grad=True, backward=backward)
    assert text.count("mosaic_gpu_v2(") == kernels["mosaic"]
    assert text.count("xla.gpu.triton") == kernels["triton"]
    around = [line for line in text.splitlines() if "custom_call" not in line]  # not in IR
    assert not [line for line in around if "stablehlo.while" in line or "dot_general" in line]


@pytest.mark.parametrize("d,m,kernels", [
    (256, 30, 6),    # forward, dq, dk, dv, dck, dcv: the key side split at D = 256
    (160, 0, 4),     # zero-padded to 256; no slots: no dck/dcv kernels
])
def test_wide_head_dims_lower_for_cuda(d, m, kernels):
    """D = 256 (native) and 160 (padded to 256), GQA, L = 700, at the head-dim defaults:
    Mosaic GPU kernels only, one per kernel the wide backward runs."""
    assert lowered_text("bfloat16", d, 8, 2, 700, m).count("mosaic_gpu_v2(") == 1
    text = lowered_text("bfloat16", d, 8, 2, 700, m, grad=True, backward="mosaic")
    assert text.count("mosaic_gpu_v2(") == kernels and "xla.gpu.triton" not in text


def test_gradient_lowers_for_cuda_at_every_backward_tiling():
    """float16, D = 64, no GQA, L = 1000: one consumer warpgroup, a deeper ring, wide steps
    and wide dq rows, S and dP issued one after the other (every backward setting off its
    default) still lower."""
    tilings = [dict(compute_wgs=1, stages=3, block_kv=128, key_block_q=128),
               dict(block_q=128, stages=4, paired_scores=False)]
    for tiling in tilings:
        text = lowered_text("float16", 64, 4, 4, 1000, 45, grad=True, backward="mosaic",
                             backward_tiling=tiling)
        assert text.count("mosaic_gpu_v2(") == 4 and "xla.gpu.triton" not in text, tiling


def test_config_defaults_fit_shared_memory():
    cfg = mosaic_config()
    assert cfg == MosaicConfig() and cfg.cta_rows == 128 and cfg.row_multiple == 128
    for d in (64, 128):
        assert shared_memory_bytes(cfg, d) <= SMEM_LIMIT_BYTES
    assert mosaic_config(block_kv=None) == MosaicConfig()   # None: the default


@pytest.mark.parametrize("fields,match", [
    (dict(block_q=32), "block_q must be one of"),
    (dict(block_kv=96), "block_kv must be one of"),
    (dict(stages=1), "stages must be an int from 2 to 8"),
    (dict(stages=True), "stages must be an int"),
    (dict(compute_wgs=3), "compute_wgs must be one of"),
    (dict(schedule_barrier=1), "schedule_barrier must be a bool"),
    (dict(heavy_first="yes"), "heavy_first must be a bool"),
    (dict(narrow_block=8), "narrow_block must be 0 .off. or one of"),
    (dict(narrow_block=True), "narrow_block must be 0"),
    (dict(narrow_block=32, block_kv=64), None),
    (dict(narrow_block=64, block_kv=64), "below block_kv=64"),
    (dict(block_qq=64), "unknown Mosaic GPU kernel setting 'block_qq'"),
    (dict(softmax_head_dim=80), "unknown Mosaic GPU kernel setting"),   # set by the padding
])
def test_config_errors(fields, match):
    if match is None:   # a valid setting, beside the invalid ones
        assert mosaic_config(**fields)._asdict().items() >= fields.items()
        return
    with pytest.raises(ValueError, match=match):
        mosaic_config(**fields)


def _small_inputs(dtype=jnp.bfloat16, d=128, length=40, m=3):
    q = jnp.zeros((1, length, 2, d), dtype)
    kv = jnp.zeros((1, length, 1, d), dtype)
    c = jnp.zeros((1, m, 2, d), dtype)
    zeros = jnp.zeros((1, length), jnp.int32)
    return q, kv, kv, c, c, zeros, zeros, zeros


def test_dense_reference_is_the_kernels_contract():
    """(The GPU tests' reference, checked on the interpreted-kernel-free path: xla's
    blocked attention on the same bounds.)"""
    from cca_jax.attention.xla import blocked_attention, default_blocking
    q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(layers=1, rows=2, m=40, b=2,
                                                           length=24, d=16,
                                                           dtype=jnp.float32)
    ck, cv = ck_cache[0], cv_cache[0]
    got = blocked_attention(q, k, v, ck, cv, *bounds, default_blocking(24, 40, 16))
    np.testing.assert_allclose(np.asarray(got), dense_reference(q, k, v, ck, cv, bounds),
                               atol=1e-5)


def test_in_cache_forward_lowers_for_cuda_reading_the_stacked_slots_in_place():
    """The slots stay the cache's stacked arrays up to the kernel: one layer's slots are
    neither sliced out nor padded to whole blocks (no op of a layer's slot size before the
    custom call), and the layer may be traced (a scan over layers)."""
    q, k, v, ck_cache, cv_cache, bounds = (
        S(x.shape, x.dtype) if hasattr(x, "shape") else tuple(S(y.shape, y.dtype) for y in x)
        for x in in_cache_inputs(layers=3, rows=4, m=200))

    def fwd(q, k, v, ck_cache, cv_cache, layer, rows, *b, **kw):
        return blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache, cv_cache, layer, rows,
                                                     *b, compute_wgs=1, **kw)
    text = jax.jit(fwd).trace(q, k, v, ck_cache, cv_cache, S((), jnp.int32),
                              S((2,), jnp.int32), *bounds).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "cca_forward" in text
    # the stacked arrays, then layers x rows as one axis (a reshape): nothing of one layer
    # (2x200x...), and no slot axis padded to whole blocks of 64 (x256x...)
    assert set(re.findall(r"tensor<([\dx]*)x200x2x64xbf16>", text)) == {"3x4", "12"}
    assert "x256x2x64" not in text
    split = jax.jit(functools.partial(fwd, key_splits=2, first_row=40)).trace(
        q, k, v, ck_cache, cv_cache, S((), jnp.int32), S((2,), jnp.int32), *bounds).lower(
        lowering_platforms=("cuda",)).as_text()   # a grid of 4 axes, partial outputs
    assert "cca_forward" in split and "tensor<2x2x128x2x64xbf16>" in split


def test_the_backend_reads_in_place_only_the_caches_the_kernel_takes():
    """bfloat16/float16, native head dims, whole tiles of 8 slots: else prefill slices."""
    from cca_jax.attention.pallas_mosaic_gpu import MOSAIC_GPU
    takes = MOSAIC_GPU.reads_slots_in_cache
    assert takes(jnp.bfloat16, 128, 8128) and takes(jnp.float16, 64, 8)
    assert not takes(jnp.float32, 128, 8128)      # the kernels' dtypes only
    assert not takes(jnp.bfloat16, 80, 8128)      # would need the slots padded to 128
    assert not takes(jnp.bfloat16, 128, 8132)     # not whole shared-memory tiles
    assert not takes(jnp.bfloat16, 128, 0)        # no slots (full, sliding)


def test_in_cache_forward_input_errors():
    q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(layers=2, rows=3, m=40)
    rows = jnp.array([0, 2])
    with pytest.raises(ValueError, match="multiple of 8.*C = 36"):
        blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache[:, :, :36], cv_cache[:, :, :36],
                                              0, rows, *bounds)
    with pytest.raises(ValueError, match=r"stacked slots \[layers, rows, C >= 1, Hq, D\]"):
        blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache[0], cv_cache[0], 0, rows,
                                              *bounds)
    with pytest.raises(ValueError, match=r"ck and cv must be \[B, m, Hq, D\]"):
        blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache[..., :1, :], cv_cache[..., :1, :],
                                              0, rows, *bounds)
    with pytest.raises(ValueError, match=r"cache_rows must be an int array \[B=2\]"):
        blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache, cv_cache, 0, rows[:1], *bounds)
    with pytest.raises(ValueError, match="layer must be an int scalar"):
        blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache, cv_cache, rows, rows, *bounds)
    with pytest.raises(ValueError, match="slice the layer's slots"):
        q80, k80, v80, c80, cv80, b80 = in_cache_inputs(layers=1, rows=2, m=8, d=80, length=16)
        blocked_attention_in_cache_mosaic_gpu(q80, k80, v80, c80, cv80, 0, rows, *b80)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache.astype(jnp.float32),
                                              cv_cache.astype(jnp.float32), 0, rows, *bounds)


def test_input_errors():
    args = _small_inputs()
    with pytest.raises(ValueError, match="shared memory.*lower stages or block_kv"):
        blocked_attention_mosaic_gpu(*args, stages=4)     # 4 x 2 x 32 KiB K/V + Q > 227 KiB
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        blocked_attention_mosaic_gpu(*_small_inputs(jnp.float32))
    with pytest.raises(ValueError, match="head_dim up to 256"):
        blocked_attention_mosaic_gpu(*_small_inputs(d=320))
    q, k, v, ck, cv, *b = args
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        blocked_attention_mosaic_gpu(q, k, v, ck, cv, b[0][:, :5], b[1], b[2])
    with pytest.raises(ValueError, match=r"lead_rows must be in \[0, L\)"):
        blocked_attention_mosaic_gpu(q, k, v, ck, cv, *b, lead_rows=q.shape[1])
    with pytest.raises(ValueError, match="multiple of 8.*lead_rows=0"):
        blocked_attention_mosaic_gpu(q, k, v, ck, cv, *b, lead_rows=4)


def test_backward_config_defaults_fit_shared_memory():
    cfg = mosaic_backward_config()
    assert cfg == MosaicBackwardConfig() and cfg.row_multiple == 128
    assert cfg.slot_multiple == 128 and cfg.key_cta_rows == 128
    for d in (64, 128):
        assert max(backward_shared_memory_bytes(cfg, d).values()) <= SMEM_LIMIT_BYTES


def test_wide_head_dim_defaults_fit_shared_memory():
    """At D = 256 the general defaults overflow sm_90's shared memory (the forward's 128-key
    steps, the backward's two warpgroups and 3 stages); the head-dim defaults fit, split
    dK from dV, and explicit settings still win."""
    assert shared_memory_bytes(MosaicConfig(), 256) > SMEM_LIMIT_BYTES
    assert max(backward_shared_memory_bytes(MosaicBackwardConfig(), 256).values()) \
        > SMEM_LIMIT_BYTES
    fwd, bwd = mosaic_config(head_dim=256), mosaic_backward_config(head_dim=256)
    assert (fwd.block_kv, fwd.stages, fwd.compute_wgs) == (64, 2, 2)
    assert (bwd.compute_wgs, bwd.stages, bwd.split_keys) == (1, 2, True)
    assert shared_memory_bytes(fwd, 256) <= SMEM_LIMIT_BYTES
    assert max(backward_shared_memory_bytes(bwd, 256).values()) <= SMEM_LIMIT_BYTES
    assert mosaic_config(head_dim=256, stages=3).stages == 3
    assert mosaic_backward_config(head_dim=256, split_keys=False).split_keys is False
    assert mosaic_config(head_dim=128) == MosaicConfig()
    with pytest.raises(ValueError, match="split_keys must be a bool"):
        mosaic_backward_config(split_keys=1)


@pytest.mark.parametrize("fields,match", [
    (dict(block_q=32), "block_q must be one of"),
    (dict(block_kv=256), "block_kv must be one of"),
    (dict(key_block_q=16), "key_block_q must be one of"),
    (dict(stages=9), "stages must be an int from 2 to 8"),
    (dict(compute_wgs=0), "compute_wgs must be one of"),
    (dict(dq_block_q=64), "unknown Mosaic GPU backward setting 'dq_block_q'.*backward='triton'"),
    (dict(softmax_head_dim=80), "unknown Mosaic GPU backward setting"),   # set by the padding
])
def test_backward_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        mosaic_backward_config(**fields)


def test_backward_input_errors():
    """A bad `backward`, a backward tiling over sm_90's shared memory, and Triton settings
    given to the Mosaic backward each fail with the fix named, before anything runs."""
    args = _small_inputs()
    with pytest.raises(ValueError, match=r"backward must be one of \('mosaic', 'triton'\)"):
        blocked_attention_mosaic_gpu(*args, backward="cuda")
    with pytest.raises(ValueError, match="keys kernel needs .* lower stages or key_block_q"):
        blocked_attention_mosaic_gpu(*args, backward="mosaic",
                                     backward_tiling=dict(stages=4, key_block_q=128))
    with pytest.raises(ValueError, match="dq kernel needs .* lower stages or block_kv"):
        blocked_attention_mosaic_gpu(*args, backward="mosaic",
                                     backward_tiling=dict(stages=4, block_kv=128))
    with pytest.raises(ValueError, match="unknown Mosaic GPU backward setting 'dkv_block_k'"):
        blocked_attention_mosaic_gpu(*args, backward="mosaic",
                                     backward_tiling=dict(dkv_block_k=64))


def test_backend_compiles_the_narrow_head_in_only_where_a_cta_takes_one():
    """The Mosaic backend keeps the narrow heads (16 keys) of the forward and of the dq
    kernel for CCA with 4 sinks at 128K, where 1015 of 1024 forward CTAs take one, and
    drops them (no head path compiled) for the options and shapes where none would; explicit
    settings and a Triton backward's settings stay."""
    from cca_jax.attention.pallas_mosaic_gpu import _narrow_where_it_pays
    q = S((1, 131072, 32, 128), jnp.bfloat16)
    sinks = blocks.CCA(16, 1024, 4)
    assert blocks.narrow_heads(sinks, 131072, 128, 128, 16) == 1015
    assert blocks.narrow_heads(sinks, 131072, 128, 64, 16) > 1000      # the dq kernel's
    assert _narrow_where_it_pays(sinks, q, {}) == {}
    off = {"narrow_block": 0, "backward_tiling": {"narrow_block": 0}}
    for pattern in (blocks.CCA(16, 1024), blocks.CCA(16, 1024, 16), blocks.Full(),
                    blocks.Sliding(1024), blocks.Streaming(1024, 4)):
        assert _narrow_where_it_pays(pattern, q, {"stages": 3}) == {"stages": 3, **off}
    assert _narrow_where_it_pays(blocks.CCA(16, 1024), q, {"narrow_block": 32}) == {
        "narrow_block": 32, "backward_tiling": {"narrow_block": 0}}
    triton = {"backward": "triton", "backward_tiling": {"block_q": 64}}
    assert _narrow_where_it_pays(blocks.CCA(16, 1024), q, triton) == {**triton,
                                                                       "narrow_block": 0}
    # Unpacked rows run after their lead rows (8 sinks): no CTA takes a head there.
    assert _narrow_where_it_pays(blocks.CCA(16, 1024, 8), q, {}, lead=8) == off


def test_backend_runs_unpacked_sinks_after_their_lead_rows(monkeypatch):
    """The Mosaic backend passes `lead_rows` = N with the sinks moved into the slots
    (`blocks.sinks_as_slots`) for unpacked rows whose N sinks are all pooled and N is a
    multiple of 8, and the plain bounds with no lead rows for 4 sinks (TMA row tiles of 8:
    the narrow heads serve them), for packed rows, for rows too short to pool every sink,
    and for CCA without sinks."""
    import pallas_kernels.mosaic_gpu as mosaic
    from cca_jax.attention.pallas_mosaic_gpu import attention_mosaic_gpu
    calls = []

    def record(q, k, v, ck, cv, *bounds, lead_rows=0, **kw):
        calls.append((lead_rows, [np.asarray(b) for b in bounds]))
        return q
    monkeypatch.setattr(mosaic, "blocked_attention_mosaic_gpu", record)
    sinks = blocks.CCA(16, 64, 8)
    for length, pattern, seg, lead in ((300, sinks, None, 8), (300, blocks.CCA(16, 64, 4), None, 0),
                                       (300, sinks, "packed", 0), (80, sinks, None, 0),
                                       (300, blocks.CCA(16, 64), None, 0)):
        q, k, v, _ = random_inputs(1, length, 2, 1, 64, jnp.bfloat16, seed=0)
        seg = jnp.asarray(random_segments(1, length, 2)) if seg else None
        attention_mosaic_gpu(q, k, v, pattern, segment_ids=seg)
        got_lead, bounds = calls.pop()
        plain = [np.asarray(b) for b in blocks.pattern_ranges(pattern, length, seg)[:3]]
        want = blocks.sinks_as_slots(pattern, *plain) if lead else plain
        assert got_lead == lead, (length, pattern, seg is not None)
        for got, w in zip(bounds, want):
            np.testing.assert_array_equal(got, np.broadcast_to(w, got.shape))


def test_backend_pools_whole_slot_blocks_so_no_kernel_pads_them(monkeypatch):
    """Unpacked rows pool their 192 slots (L = 4096, g = 16, s = 1024) up to 256, whole
    blocks of the forward and of the backward: the program lowered for "cuda" (forward and
    gradient) pads no slot tensor, and its slots are the 256 pooled ones."""
    import re
    from cca_jax.attention import pallas_mosaic_gpu
    monkeypatch.setattr(pallas_mosaic_gpu, "gpu_capability", lambda: 9.0)
    monkeypatch.setattr(pallas_mosaic_gpu, "_interpret_default", lambda interpret: False)
    q, kv = S((1, 4096, 8, 128), jnp.bfloat16), S((1, 4096, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        out = pallas_mosaic_gpu.attention_mosaic_gpu(q, k, v, blocks.CCA(16, 1024))
        return jnp.sum(out.astype(jnp.float32))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    slot_pads = [line for line in text.splitlines()
                 if "stablehlo.pad" in line and re.search(r"-> tensor<1x256x8x128x", line)]
    assert not slot_pads, slot_pads
    assert "tensor<1x256x8x128xbf16>" in text
    assert pallas_mosaic_gpu.MOSAIC_GPU.slots_to_pool(192, 128) == 256
    assert pallas_mosaic_gpu._whole_slot_blocks(192, 128, {"block_kv": 64,
                                                           "backward": "triton"}) == 192


def _frame_counts(pattern, length: int, lead: int, narrow: int):
    """(ring steps, narrow heads, masked warpgroup-steps) of the forward's walk at the
    default tiling over rows `[lead, length)` of `blocks.pattern_ranges` (the sinks moved
    into the slots first when `lead`)."""
    cfg = mosaic_config(head_dim=128)
    bounds = [np.asarray(x) for x in blocks.pattern_ranges(pattern, length)[:3]]
    if lead:
        bounds = blocks.sinks_as_slots(pattern, *bounds)
        bounds = [bounds[0][:, lead:] - lead, bounds[1][:, lead:], bounds[2][:, lead:]]
    lp = -(-(length - lead) // cfg.row_multiple) * cfg.row_multiple
    tables = visit_tables(*pad_row_bounds(*bounds, lp), block_q=cfg.block_q,
                          compute_wgs=cfg.compute_wgs, block_kv=cfg.block_kv, narrow=narrow)
    wgs = cfg.compute_wgs
    steps = [walk_steps(tables.cta[0, c], tables.wg[0, wgs * c: wgs * (c + 1)], cfg.block_kv,
                        narrow) for c in range(tables.cta.shape[1])]
    flat = [step for cta in steps for step in cta]
    return (sum(width == cfg.block_kv for _, _, width, _ in flat),
            sum(width == narrow for _, _, width, _ in flat),
            sum(sum(masked) for *_, masked in flat))


def test_the_frame_after_the_sinks_walks_the_steps_of_cca_without_them():
    """8 sinks shift every CCA window 8 keys off the 128-key grid: in the row's own frame
    each CTA takes one more masked step (or a narrow head). In the frame after the sinks
    (`lead_rows`) the walk is CCA's without sinks but for the 8 slots more, at 16K (counted:
    1643 steps against 1628, 759 masked warpgroup-steps against 743; the narrow heads: 1635
    + 119 heads, 981 masked). (4 sinks count the same, but TMA cannot start at row 4.)"""
    length, sinks = 16384, blocks.CCA(16, 1024, 8)
    plain = _frame_counts(blocks.CCA(16, 1024), length - 8, 0, 0)
    frame = _frame_counts(sinks, length, 8, 0)
    heads = _frame_counts(sinks, length, 0, 16)
    assert frame[1] == 0 and heads[1] > 100
    assert plain[0] <= frame[0] <= 1.01 * plain[0], (frame, plain)
    assert plain[2] <= frame[2] <= 1.05 * plain[2], (frame, plain)
    assert frame[2] < 0.8 * heads[2], (frame, heads)


def test_lead_rows_lower_for_cuda():
    """With `lead_rows` the forward is one Mosaic kernel plus the lead rows' dense block in
    XLA written over the output's first rows, and the gradient four Mosaic kernels; no
    Triton kernel (D = 128 and the split-key D = 256). The output reaches that update
    through an optimization barrier: straight from the kernel it failed XLA's dynamic-slice
    fusion at 128K (H100, 2026-12-06)."""
    for d, kernels in ((128, 4), (256, 6)):
        text = lowered_text("bfloat16", d, 8, 2, 1000, 70, lead_rows=8)
        assert text.count("mosaic_gpu_v2(") == 1 and "dynamic_update_slice" in text
        assert "optimization_barrier" in text
        text = lowered_text("bfloat16", d, 8, 2, 1000, 70, grad=True, lead_rows=8)
        assert text.count("mosaic_gpu_v2(") == kernels and "xla.gpu.triton" not in text


def test_kernels_carry_their_names_into_profiles():
    """Each kernel is named (a profile otherwise lists all four as
    `anonymous_mosaic_gpu_kernel`, and a sinks or tiling change cannot be pinned on one)."""
    import re
    text = lowered_text("bfloat16", 128, 8, 2, 1000, 70, grad=True)
    names = set(re.findall(r"(cca_\w+)_mosaic_gpu", text))
    assert names == {"cca_forward", "cca_dq", "cca_dk_dv", "cca_dck_dcv"}, names


@pytest.mark.parametrize("wgs", [2, 1])
def test_two_consumer_warpgroups_take_the_producers_registers(wgs):
    """FA3's split (`pipeline.consumers` / `producer`): beside two consumer warpgroups the
    producer gives up registers (40 left) and the consumers take them (232), once each, in
    every kernel; a single consumer keeps the even split. Read from the modules as lowered."""
    from jax.experimental.mosaic.gpu import core

    from benchmarks.research.mosaic_modules import capture_modules, module_name
    if not hasattr(core, "_run_serde_pass"):
        pytest.skip("this jax's Mosaic GPU has no hook to read modules at (0.10, 0.11 have)")
    tiling = dict(compute_wgs=wgs, backward_tiling=dict(compute_wgs=wgs))
    texts = capture_modules(lambda: lowered_text("bfloat16", 128, 8, 2, 1000, 45, grad=True,
                                                 **tiling))
    # jax 0.10 writes `nvvm.setmaxregister increase 232`, jax 0.11 the PTX `setmaxnreg.inc...`
    split = re.compile(r"setmaxregister (inc|dec)rease (\d+)|"
                       r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)")
    splits = {module_name(t): ["".join(m) for m in split.findall(t)] for t in texts}
    expected = ["inc232", "dec40"] if wgs == 2 else []
    assert splits == {name: expected for name in ("cca_forward", "cca_dq", "cca_dk_dv",
                                                  "cca_dck_dcv")}, splits


def test_persistent_works_cover_every_work_once_in_balanced_shares():
    """A persistent launch's CTAs take every (head, row block, batch row, split) exactly
    once, in waves of `ctas` with the order reversed every other wave; counts differ by at
    most one; the launch order maps works onto row blocks heaviest first, from first_tile."""
    from pallas_kernels.mosaic_gpu.forward import _launch_order
    from pallas_kernels.mosaic_gpu.pipeline import persistent_works
    for works, ctas in ((12, 4), (9, 4), (10, 4), (3, 5), (132 * 7 + 5, 132)):
        taken = []
        for cta in range(ctas):
            count, work = persistent_works(jnp.int32(cta), ctas, works)
            mine = [int(work(jnp.int32(i))) for i in range(int(count))]
            assert all(0 <= w < works for w in mine)
            taken += mine
            if mine:
                assert mine[0] == cta
            if len(mine) > 1:
                assert mine[1] == 2 * ctas - 1 - cta      # the second wave runs backwards
        assert sorted(taken) == list(range(works)), (works, ctas)
    cfg = mosaic_config()
    order = [tuple(int(x) for x in _launch_order(cfg, jnp.int32(i), 2, 3, 2, 1))
             for i in range(12)]
    # (batch, head, tile, split): heads fastest, then tiles 3, 2, 1 (heaviest first)
    assert order[:4] == [(0, 0, 3, 0), (0, 1, 3, 0), (0, 0, 2, 0), (0, 1, 2, 0)]
    assert order[6] == (1, 0, 3, 0) and order[-1] == (1, 1, 1, 0)
    plain = mosaic_config(heavy_first=False)
    assert [int(_launch_order(plain, jnp.int32(i), 2, 3, 1, 1)[2]) for i in (0, 2, 4)] \
        == [1, 2, 3]


def test_persistent_config_and_its_shared_memory():
    """persistent adds O tiles of its own (and a head-release barrier): it fits at the
    default tiling up to D = 128 and is refused, naming the fix, at D = 256."""
    cfg = mosaic_config(persistent=True)
    extra = shared_memory_bytes(cfg, 128) - shared_memory_bytes(MosaicConfig(), 128)
    assert extra == 2 * 64 * 128 * 2 + 8
    assert shared_memory_bytes(cfg, 128) <= SMEM_LIMIT_BYTES
    with pytest.raises(ValueError, match="persistent must be a bool"):
        mosaic_config(persistent=1)
    q, k, v, ck, cv, *bounds = _small_inputs(d=256)
    with pytest.raises(ValueError, match="or pass persistent=False"):
        blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, persistent=True)


def test_persistent_forward_lowers_for_cuda():
    """The persistent launch lowers for cuda from a CPU host (132 CTAs assumed there): one
    Mosaic GPU kernel."""
    text = lowered_text("bfloat16", 128, 8, 2, 1000, 45, persistent=True)
    assert text.count("mosaic_gpu_v2(") == 1


def test_persistent_backward_config_and_its_shared_memory():
    """The backward's persistent launch adds dQ tiles of its own to the dq kernel (the key
    side stores through its K and V tiles, as before): it fits at the default backward
    tiling up to D = 128 and is refused, naming the fix, at D = 256, and with fused_dq; the
    three kernels lower for cuda from a CPU host."""
    cfg = mosaic_backward_config(persistent=True)
    dq_bytes = backward_shared_memory_bytes(cfg, 128)["dq"]
    assert backward_shared_memory_bytes(cfg, 128)["keys"] == backward_shared_memory_bytes(
        MosaicBackwardConfig(), 128)["keys"]
    assert dq_bytes - backward_shared_memory_bytes(MosaicBackwardConfig(), 128)["dq"] \
        == 2 * 64 * 128 * 2 + 8
    assert dq_bytes <= SMEM_LIMIT_BYTES
    with pytest.raises(ValueError, match="persistent must be a bool"):
        mosaic_backward_config(persistent="yes")
    with pytest.raises(ValueError, match="persistent does not run the fused_dq kernels"):
        mosaic_backward_config(persistent=True, fused_dq=True)
    q, k, v, ck, cv, *bounds = _small_inputs(d=256)
    with pytest.raises(ValueError, match="dq kernel .* or pass persistent=False"):
        jax.grad(lambda q: jnp.sum(blocked_attention_mosaic_gpu(
            q, k, v, ck, cv, *bounds, backward_tiling=dict(persistent=True)).astype(
                jnp.float32)))(q)
    text = lowered_text("bfloat16", 128, 8, 2, 1000, 45, grad=True,
                        backward_tiling=dict(persistent=True))
    assert text.count("mosaic_gpu_v2(") == 4
