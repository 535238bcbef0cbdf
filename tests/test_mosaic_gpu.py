"""The Mosaic GPU kernels (`pallas_kernels.mosaic_gpu`): the forward and the backward.

On the CPU (default suite): cross-lowering for "cuda" (builds the Mosaic GPU modules:
catches API, shape, layout and wgmma/TMA constraint errors; not ptxas, shared memory at run
time or numerics), the config validation, and the block walks the kernels take (forward and
key-side backward), checked against dense visibility in Python (`tables.walk_steps`,
`tables.key_walk_steps` mirror the kernels' loop bounds).
On the CPU, slow (`slow` marker, 40-130 s each): the kernels themselves in jax's GPU
interpreter (`jax._src.pallas.mosaic_gpu.interpret`, jax 0.10.2), which simulates the
warpgroups, barriers and TMA copies; it has no layout_cast, run_state or transposed wgmma
operand, so there every matrix product is a plain dot on the shared-memory tiles
(`pipeline.scores` / `pipeline.accumulate`), and the wgmma path is checked by lowering only.
On a Hopper GPU (`gpu` marker): outputs and gradients against the float64 references, row
by row, and against the Triton kernels.
"""

from __future__ import annotations

import functools
import math
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
from pallas_kernels.mosaic_gpu.tables import key_visit_tables, key_walk_steps, walk_steps

S = jax.ShapeDtypeStruct


# ---- CPU: cross-lowering ------------------------------------------------------------------

def _lowered_text(dtype, d, hq, hkv, length, m, grad=False, remat=None, **tiling):
    q, kv, c = (S((2, length, h, d), jnp.dtype(dtype)) for h in (hq, hkv, hkv))
    c = S((2, m, hq, d), jnp.dtype(dtype))
    bounds = S((2, length), jnp.int32)

    def fwd(q, k, v, ck, cv, *b):
        return blocked_attention_mosaic_gpu(q, k, v, ck, cv, *b, **tiling)
    if remat is not None:     # a rematerialized layer: the policy of that name
        from cca_jax.config import REMAT_POLICIES
        fwd = jax.checkpoint(lambda *a, f=fwd: jnp.tanh(f(*a)), policy=REMAT_POLICIES[remat])
    fn = fwd
    if grad:   # with remat, the loss too: else the first forward is dead code
        fn = (jax.grad if remat is None else jax.value_and_grad)(
            lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    return jax.jit(fn).trace(q, kv, kv, c, c, bounds, bounds, bounds).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,d,hq,hkv,tiling", [
    ("bfloat16", 128, 8, 2, {}),                                  # the default tiling, GQA
    ("float16", 64, 4, 4, dict(compute_wgs=1, stages=3)),         # one consumer warpgroup
])
def test_forward_lowers_for_cuda(dtype, d, hq, hkv, tiling):
    """L = 1000 (not a multiple of any block), m = 45 slots (not a multiple of block_kv):
    one Mosaic GPU kernel, no Triton one."""
    text = _lowered_text(dtype, d, hq, hkv, 1000, 45, **tiling)
    assert text.count("mosaic_gpu_v2(") == 1
    assert "xla.gpu.triton" not in text


@pytest.mark.parametrize("remat,kernels", [("full", 5), ("save_attention", 4)])
def test_save_attention_remat_runs_the_forward_kernel_once(remat, kernels):
    """Under `full` remat the gradient runs the forward kernel again (forward, its rerun,
    dq, dk/dv, dck/dcv); `save_attention` keeps the kernel's output and log-sum-exp, so the
    backward starts from them (four kernels)."""
    text = _lowered_text("bfloat16", 128, 8, 2, 1000, 45, grad=True, remat=remat)
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
    text = _lowered_text("bfloat16", 96, 8, 2, 700, m, grad=True, backward=backward)
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
    assert _lowered_text("bfloat16", d, 8, 2, 700, m).count("mosaic_gpu_v2(") == 1
    text = _lowered_text("bfloat16", d, 8, 2, 700, m, grad=True, backward="mosaic")
    assert text.count("mosaic_gpu_v2(") == kernels and "xla.gpu.triton" not in text


def test_gradient_lowers_for_cuda_at_every_backward_tiling():
    """float16, D = 64, no GQA, L = 1000: one consumer warpgroup, a deeper ring, wide steps
    and wide dq rows, S and dP issued one after the other (every backward setting off its
    default) still lower."""
    tilings = [dict(compute_wgs=1, stages=3, block_kv=128, key_block_q=128),
               dict(block_q=128, stages=4, paired_scores=False)]
    for tiling in tilings:
        text = _lowered_text("float16", 64, 4, 4, 1000, 45, grad=True, backward="mosaic",
                             backward_tiling=tiling)
        assert text.count("mosaic_gpu_v2(") == 4 and "xla.gpu.triton" not in text, tiling


# ---- CPU: configuration ---------------------------------------------------------------------

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


def _in_cache_inputs(layers=3, rows=4, m=104, b=2, length=48, d=64, seed=0,
                     dtype=jnp.bfloat16):
    """q/k/v rows of a prefill chunk and a KV cache's stacked slots `[layers, rows, m, Hq, D]`
    (Hq 2, Hkv 1) with the bounds of CCA at a chunk offset: rows see raw keys of their
    window and every slot up to their own."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (b, length, 2, d), dtype)
    k, v = (jax.random.normal(x, (b, length, 1, d), dtype) for x in keys[1:3])
    ck_cache, cv_cache = (jax.random.normal(x, (layers, rows, m, 2, d), dtype)
                          for x in keys[3:5])
    t = jnp.arange(length)
    raw_lo = jnp.broadcast_to(jnp.maximum(t - 20, 0), (b, length)).astype(jnp.int32)
    core_lo = jnp.zeros((b, length), jnp.int32)
    core_hi = jnp.broadcast_to(jnp.minimum(m - 30 + t, m), (b, length)).astype(jnp.int32)
    return q, k, v, ck_cache, cv_cache, (raw_lo, core_lo, core_hi)


def _dense_reference(q, k, v, ck, cv, bounds):
    """The blocked contract in float64: row t sees raw keys [raw_lo[t], t] and slots
    [core_lo[t], core_hi[t]) in one softmax; `[B, L, Hq, D]`."""
    q, k, v, ck, cv = (np.asarray(x, np.float64) for x in (q, k, v, ck, cv))
    raw_lo, core_lo, core_hi = (np.asarray(x) for x in bounds)
    b, length, hq, d = q.shape
    groups = hq // k.shape[2]
    t, u, c = np.arange(length), np.arange(length), np.arange(ck.shape[1])
    out = np.zeros(q.shape)
    for row in range(b):
        raw = (u[None] >= raw_lo[row][:, None]) & (u[None] <= t[:, None])
        core = (c[None] >= core_lo[row][:, None]) & (c[None] < core_hi[row][:, None])
        for h in range(hq):
            keys = np.concatenate([k[row, :, h // groups], ck[row, :, h]])
            values = np.concatenate([v[row, :, h // groups], cv[row, :, h]])
            scores = q[row, :, h] @ keys.T / math.sqrt(d)
            scores = np.where(np.concatenate([raw, core], axis=1), scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[row, :, h] = (p / p.sum(axis=1, keepdims=True)) @ values
    return out


def test_dense_reference_is_the_kernels_contract():
    """(The GPU tests' reference, checked on the interpreted-kernel-free path: xla's
    blocked attention on the same bounds.)"""
    from cca_jax.attention.xla import blocked_attention, default_blocking
    q, k, v, ck_cache, cv_cache, bounds = _in_cache_inputs(layers=1, rows=2, m=40, b=2,
                                                           length=24, d=16,
                                                           dtype=jnp.float32)
    ck, cv = ck_cache[0], cv_cache[0]
    got = blocked_attention(q, k, v, ck, cv, *bounds, default_blocking(24, 40, 16))
    np.testing.assert_allclose(np.asarray(got), _dense_reference(q, k, v, ck, cv, bounds),
                               atol=1e-5)


def test_in_cache_forward_lowers_for_cuda_reading_the_stacked_slots_in_place():
    """The slots stay the cache's stacked arrays up to the kernel: one layer's slots are
    neither sliced out nor padded to whole blocks (no op of a layer's slot size before the
    custom call), and the layer may be traced (a scan over layers)."""
    q, k, v, ck_cache, cv_cache, bounds = (
        S(x.shape, x.dtype) if hasattr(x, "shape") else tuple(S(y.shape, y.dtype) for y in x)
        for x in _in_cache_inputs(layers=3, rows=4, m=200))

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
    q, k, v, ck_cache, cv_cache, bounds = _in_cache_inputs(layers=2, rows=3, m=40)
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
        q80, k80, v80, c80, cv80, b80 = _in_cache_inputs(layers=1, rows=2, m=8, d=80, length=16)
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
        q, k, v, _ = _inputs(1, length, 2, 1, 64, jnp.bfloat16, seed=0)
        seg = jnp.asarray(_segments(1, length, 2)) if seg else None
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
        text = _lowered_text("bfloat16", d, 8, 2, 1000, 70, lead_rows=8)
        assert text.count("mosaic_gpu_v2(") == 1 and "dynamic_update_slice" in text
        assert "optimization_barrier" in text
        text = _lowered_text("bfloat16", d, 8, 2, 1000, 70, grad=True, lead_rows=8)
        assert text.count("mosaic_gpu_v2(") == kernels and "xla.gpu.triton" not in text


def test_kernels_carry_their_names_into_profiles():
    """Each kernel is named (a profile otherwise lists all four as
    `anonymous_mosaic_gpu_kernel`, and a sinks or tiling change cannot be pinned on one)."""
    import re
    text = _lowered_text("bfloat16", 128, 8, 2, 1000, 70, grad=True)
    names = set(re.findall(r"(cca_\w+)_mosaic_gpu", text))
    assert names == {"cca_forward", "cca_dq", "cca_dk_dv", "cca_dck_dcv"}, names


# ---- CPU: the block walk against dense visibility -------------------------------------------

def _segments(b, length, seed):
    rng = np.random.default_rng(seed)
    cuts = [np.sort(rng.choice(np.arange(1, length), 2, replace=False)) for _ in range(b)]
    return np.stack([np.searchsorted(c, np.arange(length), side="right")
                     for c in cuts]).astype(np.int32)


PATTERNS = {
    "full": blocks.Full(),
    "sliding": blocks.Sliding(37),
    "streaming": blocks.Streaming(37, 4),
    "cca": blocks.CCA(4, 37),
    "cca_sinks": blocks.CCA(5, 41, 3),
}


@functools.lru_cache(maxsize=None)
def _row_bounds(name: str, packed: bool, b: int, length: int):
    """numpy `[B, L]` raw_lo, core_lo, core_hi of a pattern (three documents a row if packed)."""
    seg = _segments(b, length, 5) if packed else None
    ranges = jax.jit(blocks.pattern_ranges, static_argnums=(0, 1))(PATTERNS[name], length, seg)
    return [np.broadcast_to(np.asarray(x), (b, length)) for x in
            (ranges.raw_lo, ranges.core_lo, ranges.core_hi)]


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block_q,wgs,block_kv,narrow", [(8, 2, 16, 0), (16, 1, 8, 0),
                                                        (8, 2, 16, 4), (16, 1, 8, 4)])
def test_walk_covers_every_visible_key_and_masks_every_partial_block(name, packed, block_q,
                                                                     wgs, block_kv, narrow):
    """For every CTA and warpgroup, the steps the kernel takes (`walk_steps`, from the
    tables, narrow head included): every (row, key) or (row, slot) pair a row sees lies in
    a visited step, and a step left unmasked for a warpgroup is seen whole by each of its
    rows. Small blocks stand in for the kernel's (the arithmetic is the same at any size)."""
    b, length = 2, 150
    bounds = _row_bounds(name, packed, b, length)
    cfg_rows = block_q * wgs
    lp = -(-length // max(cfg_rows, block_kv)) * max(cfg_rows, block_kv)
    rlo, clo, chi = (np.asarray(x) for x in pad_row_bounds(*bounds, lp))
    tables = visit_tables(rlo, clo, chi, block_q=block_q, compute_wgs=wgs, block_kv=block_kv,
                          narrow=narrow)
    assert tables.cta.shape == (b, lp // cfg_rows, 9) and tables.wg.shape == (b, lp // block_q, 8)
    slots = int(chi.max()) + block_kv
    for z in range(b):
        for tile in range(lp // cfg_rows):
            steps = walk_steps(tables.cta[z, tile], tables.wg[z, tile * wgs:(tile + 1) * wgs],
                               block_kv, narrow)
            assert len(steps) >= 1
            for w in range(wgs):
                rows = tile * cfg_rows + w * block_q + np.arange(block_q)
                keys = np.arange(lp)
                raw = (keys[None] >= rlo[z, rows, None]) & (keys[None] <= rows[:, None])
                slot_ids = np.arange(slots)
                core = ((slot_ids[None] >= clo[z, rows, None])
                        & (slot_ids[None] < chi[z, rows, None]))
                covered = {"raw": np.zeros_like(raw), "core": np.zeros_like(core)}
                for kind, first, width, masked in steps:
                    cols = slice(first, first + width)
                    covered[kind][:, cols] = True
                    if not masked[w]:
                        seen = raw if kind == "raw" else core
                        assert seen[:, cols].all(), (z, tile, w, kind, first)
                assert not (raw & ~covered["raw"]).any(), (z, tile, w)
                assert not (core & ~covered["core"]).any(), (z, tile, w)
            kinds = [kind for kind, *_ in steps]
            assert kinds == sorted(kinds, key=["raw", "core"].index)   # raw blocks first


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("key_rows,wgs,block_q", [(8, 2, 16), (16, 1, 8)])
def test_key_walk_covers_every_row_that_sees_a_key_and_masks_every_partial_block(
        name, packed, key_rows, wgs, block_q):
    """The backward's key-side kernels (dk/dv over raw keys, dck/dcv over slots): for every
    CTA and warpgroup, the steps taken (`key_walk_steps`, from `key_visit_tables`) visit,
    for each query head of the group, every query block holding a row that sees one of the
    warpgroup's keys (slots), and a step left unmasked is seen whole by every row of it.
    Small blocks stand in for the kernel's (`KEY_ROWS` = 64)."""
    b, length, groups = 2, 150, 2
    bounds = _row_bounds(name, packed, b, length)
    cta = key_rows * wgs
    lp = -(-length // max(cta, block_q)) * max(cta, block_q)
    rlo, clo, chi = (np.asarray(x) for x in pad_row_bounds(*bounds, lp))
    mp = -(-max(int(chi.max()), 1) // cta) * cta
    tables = key_visit_tables(rlo, clo, chi, mp, key_rows=key_rows, compute_wgs=wgs,
                              block_q=block_q)
    t, keys, slots = np.arange(lp), np.arange(lp), np.arange(mp)
    seen = {"raw": (keys[None, None] >= rlo[..., None]) & (keys[None, None] <= t[None, :, None]),
            "core": (slots[None, None] >= clo[..., None]) & (slots[None, None] < chi[..., None])}
    for kind, table in zip(("raw", "core"), tables):
        cta_table, wg_table = np.asarray(table.cta), np.asarray(table.wg)
        n = (lp if kind == "raw" else mp) // cta
        assert cta_table.shape == (b, n, 4) and wg_table.shape == (b, n * wgs, 4)
        for z in range(b):
            for tile in range(n):
                steps = key_walk_steps(cta_table[z, tile],
                                       wg_table[z, tile * wgs:(tile + 1) * wgs], groups)
                assert [h for h, _, _ in steps] == sorted(h for h, _, _ in steps)
                for w in range(wgs):
                    own = tile * cta + w * key_rows + np.arange(key_rows)
                    rows_seeing = seen[kind][z][:, own]                # [Lp rows, keys]
                    for gi in range(groups):
                        covered = np.zeros(lp, bool)
                        for h, block, masked in steps:
                            if h != gi:
                                continue
                            rows = slice(block * block_q, (block + 1) * block_q)
                            covered[rows] = True
                            if not masked[w]:
                                assert rows_seeing[rows].all(), (kind, z, tile, w, block)
                        assert not (rows_seeing.any(axis=1) & ~covered).any(), (kind, z, tile)


@pytest.mark.slow   # about 40 s: three Triton kernels in interpret mode
def test_triton_backward_takes_this_forwards_log2_sum_exp():
    """The gradient path: `cca_backward` fed with an output and a log2-sum-exp made outside
    the Triton forward (here in XLA, with the Mosaic forward's convention and its own row
    padding, garbage past L) equals the Triton kernels' own VJP (interpret mode, small
    tiles). This is the contract the Mosaic forward's custom_vjp relies on."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.gpu import cca_core_attention, kernel_config
    from pallas_kernels.gpu.kernels import cca_backward
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    b, length, hq, hkv, d = 1, 40, 2, 1, 64
    q = jax.random.normal(ks[0], (b, length, hq, d))
    k, v = (jax.random.normal(x, (b, length, hkv, d)) for x in ks[1:3])
    dout = jax.random.normal(ks[3], q.shape)
    ck, cv, rlo, clo, chi = slots_and_bounds(q, k, v, blocks.CCA(4, 9))
    cfg = kernel_config(interpret=True, block_q=16, block_k=16, dq_block_q=16, dq_block_k=16,
                        dkv_block_k=16, dkv_block_q=16, dc_block_k=16, dc_block_q=16)
    # Dense forward with the Mosaic kernel's lse convention: log2 sum exp2(s * scale * log2 e).
    t = jnp.arange(length)
    kk, vv = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
    keys = jnp.concatenate([ck, kk], axis=1)
    vals = jnp.concatenate([cv, vv], axis=1)
    slot = jnp.arange(ck.shape[1])
    core = (slot[None, None] >= clo[..., None]) & (slot[None, None] < chi[..., None])
    raw = (t[None, None] >= rlo[..., None]) & (t[None, None] <= t[None, :, None])
    seen = jnp.concatenate([core, raw], axis=-1)                             # [B, L, m + L]
    s = jnp.einsum("bthd,buhd->bhtu", q, keys) / np.sqrt(d)
    s = jnp.where(seen[:, None], s, -jnp.inf)
    out = jnp.einsum("bhtu,buhd->bthd", jax.nn.softmax(s, axis=-1), vals)
    lse = jax.nn.logsumexp(s, axis=-1) / np.log(2.0)                         # [B, Hq, L]
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, 88)), constant_values=1e30)    # another padding
    got = cca_backward(q, k, v, ck, cv, rlo, clo, chi, out, lse, dout, cfg)
    _, vjp = jax.vjp(lambda *x: cca_core_attention(*x, rlo, clo, chi, cfg), q, k, v, ck, cv)
    for name, g, w in zip(("dq", "dk", "dv", "dck", "dcv"), got, vjp(dout)):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=name)


# ---- on a Hopper GPU ----------------------------------------------------------------------

def _hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return float(cc) >= 9.0


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")

# Largest per-row error (`tests/row_errors.py`) against float64: bf16 as the Triton kernels'
# GPU test (tests/test_pallas_gpu.py GPU_ROW_TOL); float16 has 3 more mantissa bits, x1/3
# margin kept. Not yet measured for this kernel: the first GPU run prints the errors.
ROW_TOL = {"bfloat16": dict(out=6e-3, grad=2.5e-2), "float16": dict(out=3e-3, grad=1.2e-2)}


def _inputs(b, length, hq, hkv, d, dtype, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, length, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, length, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, length, hkv, d), jnp.float32).astype(dtype)
    ct = jax.random.normal(ks[3], q.shape, jnp.float32)
    return q, k, v, ct


def _option_reference(q, k, v, name, pattern, seg):
    from tests.reference import cca_reference
    from tests.test_options import option_reference
    seg = None if seg is None else np.asarray(seg)
    if name == "cca":
        return cca_reference(q, k, v, pattern.group_size, pattern.window_size,
                             segment_ids=seg)
    return option_reference(*(np.asarray(x, np.float32) for x in (q, k, v)), name, seg,
                            w=pattern.window_size, n=pattern.sink_tokens)


@functools.lru_cache(maxsize=None)
def _run(pattern, impl: str, tiling: tuple = (), grad: bool = False):
    """jit of (q, k, v, ct, seg) -> out, or (out, q/k/v gradients of sum(out * ct)) when
    `grad`, through `slots_and_bounds` and the Mosaic ("mosaic") or Triton ("triton")
    kernels."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.gpu import blocked_attention_pallas_gpu
    entry = {"mosaic": blocked_attention_mosaic_gpu, "triton": blocked_attention_pallas_gpu}[impl]

    def attention(q, k, v, seg):
        ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
        return entry(q, k, v, ck, cv, *bounds, **dict(tiling))

    def run(q, k, v, ct, seg):
        if not grad:
            return attention(q, k, v, seg)

        def loss(q, k, v):
            out = attention(q, k, v, seg)
            return jnp.sum(out.astype(jnp.float32) * ct), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads
    return jax.jit(run)


GPU_OPTIONS = {
    "full": blocks.Full(),
    "sliding": blocks.Sliding(300),
    "streaming": blocks.Streaming(300, 4),
    "cca": blocks.CCA(16, 100),       # s not a multiple of g
}
# (dtype, D, Hq, Hkv): bf16 GQA at the model's D; float16 at D = 64 with G = 4.
GPU_SHAPES = [("bfloat16", 128, 4, 2), ("float16", 64, 4, 1)]
# D = 96 (zero-padded to 128) and D = 256 (the wide kernels: 64-key forward steps, split
# dK/dV backward), CCA only.
WIDE_GPU_SHAPES = [("bfloat16", 96, 2, 2), ("bfloat16", 256, 4, 2)]


def _gpu_case(dtype, d, hq, hkv, name, packed):
    b, length = 2, 1000     # ragged: no multiple of any block
    q, k, v, ct = _inputs(b, length, hq, hkv, d, jnp.dtype(dtype), seed=len(name) + d)
    seg = jnp.asarray(_segments(b, length, 7)) if packed else None
    return q, k, v, ct, seg


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,hq,hkv", GPU_SHAPES + WIDE_GPU_SHAPES)
@pytest.mark.parametrize("name", sorted(GPU_OPTIONS))
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_forward_matches_float64_and_triton(dtype, d, hq, hkv, name, packed):
    """Every option through `slots_and_bounds`, ragged L = 1000, GQA, packed rows (D = 96
    zero-padded to 128, and D = 256 at its head-dim defaults, CCA only): the output against
    float64 row by row, and against the Triton kernels' output."""
    if d in (96, 256) and name != "cca":
        pytest.skip(f"D = {d} is checked on CCA only")
    from tests.row_errors import row_max_error
    pattern = GPU_OPTIONS[name]
    q, k, v, ct, seg = _gpu_case(dtype, d, hq, hkv, name, packed)
    out = _run(pattern, "mosaic")(q, k, v, ct, seg)
    assert out.dtype == q.dtype and np.all(np.isfinite(np.asarray(out, np.float32)))
    tol = ROW_TOL[dtype]
    err = row_max_error(out, _option_reference(q, k, v, name, pattern, seg))
    vs_triton = row_max_error(out, _run(pattern, "triton")(q, k, v, ct, seg))
    print(f"{name} {dtype} D={d} packed={packed}: row error vs float64 {err:.2e}, "
          f"vs Triton {vs_triton:.2e}")
    assert err < tol["out"], err
    assert vs_triton < tol["out"], vs_triton


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,m,key_splits,first_row", [
    ("bfloat16", 128, 1000, 1, 0), ("float16", 64, 8128, 1, 0),
    ("bfloat16", 128, 8128, 2, 128), ("bfloat16", 128, 1000, 4, 200)])
def test_gpu_in_cache_forward_equals_the_sliced_slots(dtype, d, m, key_splits, first_row):
    """On the GPU the slot axis read in place is not padded: its last, partial key block
    reads past the slots' end (TMA gives zeros there; the bounds mask them). Unsplit, the
    output equals the kernel's on the slots sliced out and padded, bit for bit; with the
    keys split over CTAs (and the row blocks before `first_row`'s skipped), it is within
    bfloat16 rounding of it. Both against the float64 reference too."""
    from tests.row_errors import row_max_error
    length = 300
    q, k, v, ck_cache, cv_cache, bounds = _in_cache_inputs(
        layers=3, rows=4, m=m, b=2, length=length, d=d, seed=5, dtype=jnp.dtype(dtype))
    rows, layer = jnp.array([2, 0]), jnp.int32(1)
    got = jax.jit(functools.partial(blocked_attention_in_cache_mosaic_gpu, first_row=first_row,
                                    key_splits=key_splits))(q, k, v, ck_cache, cv_cache,
                                                            layer, rows, *bounds)
    ck, cv = ck_cache[1, rows], cv_cache[1, rows]
    want = jax.jit(functools.partial(blocked_attention_mosaic_gpu, narrow_block=0))(
        q, k, v, ck, cv, *bounds)[:, first_row:]   # no narrow head, as the in-cache entry
    assert got.shape == want.shape
    if key_splits == 1:
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(want, np.float32))
    else:
        vs_unsplit = row_max_error(got, np.asarray(want, np.float64))
        print(f"key_splits={key_splits}: row error vs unsplit {vs_unsplit:.2e}")
        assert vs_unsplit < ROW_TOL[dtype]["out"], vs_unsplit
    ref = _dense_reference(q, k, v, ck, cv, bounds)[:, first_row:]
    err = row_max_error(got, ref)
    print(f"{dtype} D={d} C={m} splits={key_splits}: row error vs float64 {err:.2e}")
    assert err < ROW_TOL[dtype]["out"], err


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d", [("bfloat16", 128), ("float16", 64), ("bfloat16", 256)])
def test_gpu_narrow_head_with_sinks_matches_float64_and_triton(dtype, d):
    """CCA with 4 sinks (g = 16, s = 256) at L = 1000: 5 of 8 CTAs take the 16-key narrow
    head (wgmma N = 16 scores, a 32-byte-swizzled V tile for the K = 16 P V product). The
    output against SPEC 6 in float64 row by row and against the Triton kernels; gradients
    (the Mosaic backward, fed with this forward's log2-sum-exp) against Triton's."""
    from tests.row_errors import row_max_error
    from tests.test_cca_sinks import sinks_reference
    pattern = blocks.CCA(16, 256, 4)
    q, k, v, ct = _inputs(2, 1000, 4, 2, d, jnp.dtype(dtype), seed=11)
    assert blocks.narrow_heads(pattern, 1000, 128, 64 if d == 256 else 128, 16) == 5
    out, grads = _run(pattern, "mosaic", grad=True)(q, k, v, ct, None)
    want, want_grads = _run(pattern, "triton", grad=True)(q, k, v, ct, None)
    with jax.enable_x64():
        ref = sinks_reference(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)),
                              16, 256, 4)
    tol = ROW_TOL[dtype]
    errs = [row_max_error(out, np.asarray(ref)), row_max_error(out, want)]
    errs += [row_max_error(g, w) for g, w in zip(grads, want_grads)]
    print(f"sinks narrow head {dtype} D={d}: out vs float64 {errs[0]:.2e}, vs Triton "
          f"{errs[1]:.2e}; dq/dk/dv vs Triton {errs[2]:.2e} {errs[3]:.2e} {errs[4]:.2e}")
    assert errs[0] < tol["out"] and errs[1] < tol["out"], errs
    assert max(errs[2:]) < tol["grad"], errs


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,length,sinks", [
    ("bfloat16", 128, 1000, 8), ("float16", 64, 1032, 8), ("bfloat16", 256, 1000, 16)])
def test_gpu_sinks_after_the_lead_rows_match_float64(dtype, d, length, sinks):
    """CCA with 8 or 16 sinks (g = 16, s = 256) on unpacked rows through the Mosaic backend:
    the kernels run rows [N, L) with a row offset in their TMA coordinates, reading q/k/v/dO
    unpadded (L = 1000: TMA zero-fills the rows past the end and clips the stores; L = 1032:
    whole CTAs). Output and q/k/v gradients against SPEC 6 in float64, row by row. (4 sinks
    as lead rows failed to compile: TMA rows start on 8-row tiles; they take the narrow
    heads, `test_gpu_narrow_head_with_sinks_matches_float64_and_triton`.)"""
    from cca_jax.attention.pallas_mosaic_gpu import kernel_lead_rows
    from tests.row_errors import row_max_error
    pattern = blocks.CCA(16, 256, sinks)
    assert kernel_lead_rows(pattern, length, False) == sinks
    q, k, v, ct = _inputs(2, length, 4, 2, d, jnp.dtype(dtype), seed=13)
    out, grads = jax.jit(functools.partial(_sinks_through_the_backend, pattern=pattern))(
        q, k, v, ct)
    want, want_grads = _sinks_reference64(q, k, v, ct, pattern)
    errs = [row_max_error(out, want)] + [row_max_error(g, w) for g, w in zip(grads, want_grads)]
    print(f"sinks after the lead rows {dtype} D={d} L={length}: out, dq, dk, dv row errors "
          "vs float64: " + " ".join(f"{e:.2e}" for e in errs))
    tol = ROW_TOL[dtype]
    assert errs[0] < tol["out"] and max(errs[1:]) < tol["grad"], errs


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,hq,hkv,name,packed", [
    ("bfloat16", 128, 4, 2, "cca", True), ("float16", 64, 4, 1, "streaming", False),
    ("bfloat16", 96, 2, 2, "sliding", True)])
def test_gpu_gradients_match_triton(dtype, d, hq, hkv, name, packed):
    """q/k/v gradients (the Mosaic backward, the default) against the Triton kernels'
    forward + backward, row by row."""
    from tests.row_errors import row_max_error
    pattern = GPU_OPTIONS[name]
    q, k, v, ct, seg = _gpu_case(dtype, d, hq, hkv, name, packed)
    _, grads = _run(pattern, "mosaic", grad=True)(q, k, v, ct, seg)
    _, want = _run(pattern, "triton", grad=True)(q, k, v, ct, seg)
    for dname, got, ref in zip("qkv", grads, want):
        assert np.all(np.isfinite(np.asarray(got, np.float32))), dname
        err = row_max_error(got, ref)
        print(f"{name} {dtype} D={d}: d{dname} row error vs the Triton kernels' {err:.2e}")
        assert err < ROW_TOL[dtype]["grad"], (dname, err)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tiling", [
    dict(compute_wgs=1), dict(schedule_barrier=False, heavy_first=False),
    dict(block_kv=64, stages=4), dict(stages=3, block_kv=64, compute_wgs=1)])
def test_gpu_every_tiling_matches_float64(tiling):
    """The config's other settings (one consumer warpgroup, no schedule barrier, plain
    launch order, narrow key blocks with a deeper ring) on packed CCA."""
    from tests.reference import cca_reference
    from tests.row_errors import row_max_error
    pattern = blocks.CCA(16, 100)
    q, k, v, ct = _inputs(1, 777, 4, 2, 128, jnp.bfloat16, seed=3)
    seg = jnp.asarray(_segments(1, 777, 11))
    out = _run(pattern, "mosaic", tuple(sorted(tiling.items())))(q, k, v, ct, seg)
    err = row_max_error(out, cca_reference(q, k, v, 16, 100, segment_ids=np.asarray(seg)))
    print(f"{tiling}: out row error vs float64 {err:.2e}")
    assert err < ROW_TOL["bfloat16"]["out"], err



GPU_BACKWARD_OPTIONS = dict(GPU_OPTIONS, cca_sinks=blocks.CCA(16, 100, 4))


def _naive_grads64(q, k, v, ct, pattern, seg):
    """float64 q/k/v gradients of sum(out * ct) through the naive implementation (x64):
    pooling and attention by dense masks, from cca_jax.attention.naive."""
    from cca_jax.attention.naive import attention_naive
    with jax.enable_x64(True):
        q, k, v, ct = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, ct))
        seg = None if seg is None else jnp.asarray(np.asarray(seg))
        grads = jax.grad(lambda q, k, v: jnp.sum(attention_naive(
            q, k, v, pattern, segment_ids=seg) * ct), argnums=(0, 1, 2))(q, k, v)
        return [np.asarray(g) for g in grads]


def _entry_grads(pattern, q, k, v, ct, seg, **entry_kw):
    """q/k/v gradients of sum(out * ct) through `slots_and_bounds` and the Mosaic entry."""
    from cca_jax.attention.pooling import slots_and_bounds

    def loss(q, k, v):
        ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
        out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, **entry_kw)
        return jnp.sum(out.astype(jnp.float32) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,hq,hkv", GPU_SHAPES + WIDE_GPU_SHAPES)
@pytest.mark.parametrize("name", ["cca", "cca_sinks", "full", "streaming"])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_backward_matches_float64_and_triton(dtype, d, hq, hkv, name, packed):
    """The Mosaic backward on ragged L = 1000, GQA, packed rows, sinks, no slots
    (full), D = 96 zero-padded to 128 and D = 256 (CCA only): q/k/v gradients against
    float64 (naive, x64) and against the Triton backward fed with the same forward, row by
    row."""
    if d in (96, 256) and name != "cca":
        pytest.skip(f"D = {d} is checked on CCA only")
    from tests.row_errors import row_max_error
    pattern = GPU_BACKWARD_OPTIONS[name]
    q, k, v, ct, seg = _gpu_case(dtype, d, hq, hkv, name, packed)
    got = _entry_grads(pattern, q, k, v, ct, seg, backward="mosaic")
    triton = _entry_grads(pattern, q, k, v, ct, seg, backward="triton")
    want = _naive_grads64(q, k, v, ct, pattern, seg)
    for dname, g, t, w in zip("qkv", got, triton, want):
        assert g.dtype == q.dtype and np.all(np.isfinite(np.asarray(g, np.float32))), dname
        err, vs_triton = row_max_error(g, w), row_max_error(g, t)
        print(f"{name} {dtype} D={d} packed={packed}: d{dname} row error vs float64 "
              f"{err:.2e}, vs the Triton backward {vs_triton:.2e} (Triton vs float64 "
              f"{row_max_error(t, w):.2e})")
        assert err < ROW_TOL[dtype]["grad"], (dname, err)
        assert vs_triton < ROW_TOL[dtype]["grad"], (dname, vs_triton)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("backward_tiling", [
    dict(compute_wgs=1), dict(stages=2), dict(block_kv=128, key_block_q=128, stages=2),
    dict(block_q=128, stages=3, compute_wgs=1), dict(paired_scores=False)])
def test_gpu_every_backward_tiling_matches_float64(backward_tiling):
    """The backward config's other settings (one consumer warpgroup, a shallower ring, wide
    steps, wide dq rows, S and dP issued one after the other) on packed CCA, bf16, D = 128,
    GQA."""
    from tests.row_errors import row_max_error
    pattern = blocks.CCA(16, 100)
    q, k, v, ct = _inputs(1, 777, 4, 2, 128, jnp.bfloat16, seed=3)
    seg = jnp.asarray(_segments(1, 777, 11))
    got = _entry_grads(pattern, q, k, v, ct, seg, backward="mosaic",
                       backward_tiling=backward_tiling)
    want = _naive_grads64(q, k, v, ct, pattern, seg)
    for dname, g, w in zip("qkv", got, want):
        err = row_max_error(g, w)
        print(f"{backward_tiling}: d{dname} row error vs float64 {err:.2e}")
        assert err < ROW_TOL["bfloat16"]["grad"], (dname, err)

# ---- CPU, slow: the kernel itself under jax's GPU interpreter --------------------------------

@pytest.mark.slow   # 40-60 s each: the interpreter simulates every warpgroup, barrier and copy
@pytest.mark.parametrize("tiling,packed,d", [
    (dict(compute_wgs=1), False, 64),
    (dict(compute_wgs=2, block_kv=64), True, 64),   # FA3 ping-pong, more steps than stages
    ({}, True, 256),                                # D = 256 at its head-dim defaults
])
def test_interpreted_kernel_matches_float64(tiling, packed, d):
    """The whole kernel (tables, TMA ring, barriers, warpgroup walk, edge masks, one online
    softmax) in the GPU interpreter, against float64, GQA, ragged L. Its two matrix products
    are plain dots there (no transposed wgmma operand, no run_state in the interpreter)."""
    from cca_jax.attention.pooling import slots_and_bounds
    from tests.reference import cca_reference
    from tests.row_errors import row_max_error
    length = 150
    q, k, v, _ = _inputs(1, length, 2, 1, d, jnp.bfloat16, seed=1)
    seg = jnp.asarray(_segments(1, length, 2)) if packed else None
    ck, cv, *bounds = slots_and_bounds(q, k, v, blocks.CCA(4, 37), segment_ids=seg)
    out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, interpret=True, **tiling)
    ref = cca_reference(q, k, v, 4, 37, segment_ids=None if seg is None else np.asarray(seg))
    err = row_max_error(out, ref)
    assert err < ROW_TOL["bfloat16"]["out"], err     # measured 1.3e-3 and 1.5e-3


@pytest.mark.slow   # about 20 s: the interpreter at 48 rows
def test_interpreted_in_cache_forward_equals_the_sliced_slots():
    """Reading the slots of `cache_rows` at `layer` from the stacked cache (rows and layers
    flattened, a row index per batch row, the slot axis unpadded: 104 slots in blocks of 64)
    gives the very output of slicing those slots out first, bit for bit, in the GPU
    interpreter."""
    q, k, v, ck_cache, cv_cache, bounds = _in_cache_inputs(layers=3, rows=4, m=104)
    rows = jnp.array([3, 1])
    tiling = dict(compute_wgs=1, block_kv=64, narrow_block=0)   # (the in-cache default)
    got = blocked_attention_in_cache_mosaic_gpu(q, k, v, ck_cache, cv_cache, jnp.int32(2),
                                                rows, *bounds, interpret=True, **tiling)
    want = blocked_attention_mosaic_gpu(q, k, v, ck_cache[2, rows], cv_cache[2, rows],
                                        *bounds, interpret=True, **tiling)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    other = blocked_attention_mosaic_gpu(q, k, v, ck_cache[1, rows], cv_cache[1, rows],
                                         *bounds, interpret=True, **tiling)
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(other, np.float32))


@pytest.mark.slow   # 35-70 s each: the interpreter at 48 rows, twice
@pytest.mark.parametrize("key_splits", [2, 5])
def test_interpreted_key_splits_merge_to_the_unsplit_softmax(key_splits):
    """Each row block's walk split over CTAs (2: both take steps; 5: more CTAs than a row
    block's at most 4 steps,
    some walk none and must weigh nothing), their partial softmaxes merged: the output of
    the unsplit walk within bfloat16 rounding of the partial outputs, in the GPU
    interpreter."""
    from tests.row_errors import row_max_error
    q, k, v, ck_cache, cv_cache, bounds = _in_cache_inputs(layers=2, rows=3, m=104)
    rows, tiling = jnp.array([2, 0]), dict(compute_wgs=1, block_kv=64)
    args = (q, k, v, ck_cache, cv_cache, jnp.int32(1), rows, *bounds)
    got = blocked_attention_in_cache_mosaic_gpu(*args, key_splits=key_splits, interpret=True,
                                                **tiling)
    want = blocked_attention_in_cache_mosaic_gpu(*args, interpret=True, **tiling)
    err = row_max_error(got, np.asarray(want, np.float64))
    ref = _dense_reference(q, k, v, ck_cache[1, rows], cv_cache[1, rows], bounds)
    err64, unsplit64 = row_max_error(got, ref), row_max_error(want, ref)
    print(f"key_splits={key_splits}: row error vs unsplit {err:.2e}, vs float64 {err64:.2e} "
          f"(unsplit {unsplit64:.2e})")
    assert got.dtype == q.dtype and 0 < err < ROW_TOL["bfloat16"]["out"], err
    assert err64 < ROW_TOL["bfloat16"]["out"], err64


@pytest.mark.slow   # about 60 s: the interpreter at 300 rows
@pytest.mark.parametrize("narrow", [16, 0])
def test_interpreted_narrow_head_with_sinks_matches_float64(narrow):
    """CCA with 4 sinks (g = 16, s = 64) shifts the windows off the 64-key grid: 2 of the 3
    CTAs of 128 rows take a narrow head (`narrow_block` 16 keys, their own buffers and
    barriers, a 32-byte swizzle for the P V product). The whole kernel in the GPU
    interpreter equals SPEC 6 built densely (float64), with and without the head."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.mosaic_gpu.tables import RAW_HEAD
    from tests.row_errors import row_max_error
    from tests.test_cca_sinks import sinks_reference
    length, pattern, tiling = 300, blocks.CCA(16, 64, 4), dict(compute_wgs=2, block_kv=64)
    q, k, v, _ = _inputs(1, length, 2, 1, 64, jnp.bfloat16, seed=3)
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern)
    cfg = mosaic_config(head_dim=64, narrow_block=narrow, **tiling)
    lp = -(-length // cfg.row_multiple) * cfg.row_multiple
    tables = visit_tables(*(np.asarray(x) for x in pad_row_bounds(*bounds, lp)),
                          block_q=cfg.block_q, compute_wgs=cfg.compute_wgs,
                          block_kv=cfg.block_kv, narrow=narrow)
    assert int(tables.cta[..., RAW_HEAD].sum()) == (2 if narrow else 0)
    out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, interpret=True,
                                       narrow_block=narrow, **tiling)
    with jax.enable_x64():
        ref = sinks_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), 16, 64, 4)
    err = row_max_error(out, np.asarray(ref))
    assert err < ROW_TOL["bfloat16"]["out"], err


def _sinks_through_the_backend(q, k, v, ct, pattern):
    """Output and q/k/v gradients of sum(out * ct) through the Mosaic backend
    (`run_attention`: on the CPU its kernels run in the GPU interpreter): unpacked rows with
    sinks run in the frame after them (`lead_rows`)."""
    from cca_jax.attention import run_attention

    def loss(q, k, v):
        out = run_attention(q, k, v, pattern, implementation="mosaic_gpu")
        return jnp.sum(out.astype(jnp.float32) * ct), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _sinks_reference64(q, k, v, ct, pattern):
    """SPEC 6 (tests/test_cca_sinks.py) in float64: output and q/k/v gradients."""
    from tests.test_cca_sinks import sinks_reference
    args = (pattern.group_size, pattern.window_size, pattern.sink_tokens)
    with jax.enable_x64():
        x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, ct)]
        out, vjp = jax.vjp(lambda q, k, v: sinks_reference(q, k, v, *args), *x64[:3])
        return np.asarray(out), [np.asarray(g) for g in vjp(x64[3])]


@pytest.mark.slow   # about 15 s each: the interpreter at 260-300 rows
@pytest.mark.parametrize("length", [264, 300])
def test_interpreted_forward_after_the_lead_rows_matches_float64(length):
    """CCA with 8 sinks (g = 16, s = 64) through the kernel in the frame after the sinks
    (`blocks.sinks_as_slots`, `lead_rows` 8: a row offset in the TMA coordinates, the 8 x 8
    lead block dense), in the GPU interpreter, against SPEC 6 in float64: L - N a whole
    number of CTAs (264: q/k/v read unpadded, as on the GPU) and ragged (300: padded)."""
    from cca_jax.attention.pooling import slots_and_bounds
    from tests.row_errors import row_max_error
    pattern = blocks.CCA(16, 64, 8)
    q, k, v, ct = _inputs(1, length, 2, 1, 64, jnp.bfloat16, seed=3)
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern)
    assert blocks.lead_rows(pattern, length) == 8
    out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *blocks.sinks_as_slots(pattern, *bounds),
                                       interpret=True, lead_rows=8, compute_wgs=2, block_kv=64)
    want, _ = _sinks_reference64(q, k, v, ct, pattern)
    err = row_max_error(out, want)
    print(f"L={length}: row error vs float64 {err:.2e}")
    assert err < ROW_TOL["bfloat16"]["out"], err     # measured 1.7e-3 at both


@pytest.mark.slow   # about 70 s: the interpreted forward and backward
def test_interpreted_sinks_through_the_backend_match_float64():
    """The Mosaic backend with CCA + 8 sinks on unpacked rows (ragged L, GQA): forward and
    the three backward kernels in the frame after the sinks, the lead rows' block and its
    gradient dense, the sinks' gradients through their slots; output and q/k/v gradients
    against SPEC 6 in float64, row by row."""
    from tests.row_errors import row_max_error
    pattern = blocks.CCA(16, 64, 8)
    q, k, v, ct = _inputs(1, 300, 4, 2, 64, jnp.bfloat16, seed=5)
    out, grads = _sinks_through_the_backend(q, k, v, ct, pattern)
    want, want_grads = _sinks_reference64(q, k, v, ct, pattern)
    errs = [row_max_error(out, want)] + [row_max_error(g, w) for g, w in zip(grads, want_grads)]
    print("out, dq, dk, dv row errors vs float64:", " ".join(f"{e:.2e}" for e in errs))
    assert errs[0] < ROW_TOL["bfloat16"]["out"], errs
    assert max(errs[1:]) < 1e-2, errs     # as the interpreted backward's: bf16 rounding


@pytest.mark.slow   # about 2 minutes: the interpreted forward, then Triton's interpreted backward
def test_interpreted_gradients_match_the_triton_kernels():
    """jax.grad through `blocked_attention_mosaic_gpu` with backward="triton" (interpreted
    forward, the Triton backward fed with its output and log2-sum-exp) against the Triton
    kernels' own forward
    and backward: q/k/v gradients agree row by row within bf16 rounding (measured dq 1.9e-3,
    dk 1.7e-3, dv 0)."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.gpu import blocked_attention_pallas_gpu
    from tests.row_errors import row_max_error
    q, k, v, ct = _inputs(1, 100, 2, 1, 64, jnp.bfloat16, seed=0)
    small = dict(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkv_block_k=16,
                 dkv_block_q=16, dc_block_k=16, dc_block_q=16)

    def grads(entry, **kw):
        def loss(q, k, v):
            ck, cv, *bounds = slots_and_bounds(q, k, v, blocks.CCA(4, 21))
            return jnp.sum(entry(q, k, v, ck, cv, *bounds, **kw).astype(jnp.float32) * ct)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    got = grads(blocked_attention_mosaic_gpu, interpret=True, compute_wgs=1,
                backward="triton", backward_tiling=small)
    want = grads(blocked_attention_pallas_gpu, interpret=True, **small)
    for name, g, w in zip("qkv", got, want):
        assert row_max_error(g, w) < ROW_TOL["bfloat16"]["grad"], (name, row_max_error(g, w))


# ---- CPU, slow: the backward kernels under jax's GPU interpreter -----------------------------

def _core_reference64(q, k, v, ck, cv, raw_lo, core_lo, core_hi, dout):
    """float64 (x64) output, log2-sum-exp `[B, Hq, L]` and (dq, dk, dv, dck, dcv) of the
    function the kernels compute, by dense masks: one softmax per row over raw keys
    `[raw_lo, t]` and slots `[core_lo, core_hi)` (K/V repeated over the GQA group here)."""
    with jax.enable_x64(True):
        x = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, ck, cv)]
        rlo, clo, chi = (jnp.asarray(np.asarray(a)) for a in (raw_lo, core_lo, core_hi))
        length, d = q.shape[1], q.shape[-1]
        t, slot = jnp.arange(length), jnp.arange(ck.shape[1])
        core = (slot[None, None] >= clo[..., None]) & (slot[None, None] < chi[..., None])
        raw = (t[None, None] >= rlo[..., None]) & (t[None, None] <= t[None, :, None])
        seen = jnp.concatenate([core, raw], axis=-1)[:, None]          # [B, 1, L, m + L]

        def scores(q, k, ck):
            keys = jnp.concatenate([ck, jnp.repeat(k, q.shape[2] // k.shape[2], 2)], axis=1)
            s = jnp.einsum("bthd,buhd->bhtu", q, keys) / np.sqrt(d)
            return jnp.where(seen, s, -jnp.inf)

        def attend(q, k, v, ck, cv):
            vals = jnp.concatenate([cv, jnp.repeat(v, q.shape[2] // v.shape[2], 2)], axis=1)
            return jnp.einsum("bhtu,buhd->bthd", jax.nn.softmax(scores(q, k, ck), -1), vals)
        out, vjp = jax.vjp(attend, *x)
        lse = jax.nn.logsumexp(scores(x[0], x[1], x[3]), axis=-1) / np.log(2.0)
        grads = vjp(jnp.asarray(np.asarray(dout, np.float64)))
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


# (pattern, L, Hq, Hkv, packed, backward tiling, D): ragged L everywhere (no multiple of 64).
INTERPRETED_BACKWARD = {
    "cca_gqa_packed": (blocks.CCA(4, 37), 200, 2, 1, True, dict(compute_wgs=1), 64),
    "cca_sinks": (blocks.CCA(5, 41, 3), 150, 2, 1, False, dict(compute_wgs=2, stages=3), 64),
    # 4 sinks off the 64-key grid: 2 of the dq kernel's 3 CTAs take the 16-key narrow head
    "cca_sinks_narrow_head": (blocks.CCA(16, 64, 4), 300, 2, 1, False, dict(compute_wgs=2), 64),
    "full_no_slots": (blocks.CCA(4, 400), 150, 2, 2, False, dict(compute_wgs=1), 64),  # m = 0
    # D = 256 at its head-dim defaults: one warpgroup, dK and dV in separate kernels.
    "cca_d256_split_keys": (blocks.CCA(4, 37), 150, 2, 1, False, {}, 256),
}


@pytest.mark.slow   # 40-110 s each on 2 cores: the interpreter simulates every warpgroup
@pytest.mark.parametrize("case", sorted(INTERPRETED_BACKWARD))
def test_interpreted_backward_matches_float64(case):
    """The three backward kernels (dq; dk/dv with the GQA group summed in registers;
    dck/dcv, absent when m = 0) in the GPU interpreter, fed with a float64 forward's output
    (in bf16) and log2-sum-exp, against float64 gradients of the same function, row by row:
    CCA with packed rows (segment ids), with sinks, and full attention (no slots). The
    interpreter runs plain dots where the GPU runs wgmma (module docstring)."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.mosaic_gpu.interpret import interpret_params
    from pallas_kernels.mosaic_gpu.backward import mosaic_backward
    from tests.row_errors import row_max_error
    pattern, length, hq, hkv, packed, tiling, d = INTERPRETED_BACKWARD[case]
    q, k, v, ct = _inputs(1, length, hq, hkv, d, jnp.bfloat16, seed=len(case))
    seg = jnp.asarray(_segments(1, length, 2)) if packed else None
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
    assert (ck.shape[1] == 0) == (case == "full_no_slots")
    if case == "cca_sinks_narrow_head":
        assert blocks.narrow_heads(pattern, length, 128, 64, 16) == 2
    dout = ct.astype(q.dtype)
    out, lse, want = _core_reference64(q, k, v, ck, cv, *bounds, dout)
    got = mosaic_backward(q, k, v, ck, cv, *bounds, jnp.asarray(out, q.dtype),
                          jnp.asarray(lse, jnp.float32), dout,
                          mosaic_backward_config(head_dim=d, **tiling),
                          interpret=interpret_params(True))
    for name, g, w in zip(("dq", "dk", "dv", "dck", "dcv"), got, want):
        assert g.shape == w.shape and g.dtype == q.dtype, name
        if w.size == 0:
            continue
        err = row_max_error(g, w)
        print(f"{case} {name}: row error vs float64 {err:.2e}")
        assert err < 1e-2, (name, err)     # bf16 rounding: measured 1.3e-3 to 2.9e-3


@pytest.mark.slow   # about 35 s: two interpreted backwards
def test_split_key_kernels_equal_the_joint_one():
    """`split_keys` (a dK kernel and a dV kernel, each with one accumulator) gives the joint
    kernel's dk, dv, dck and dcv bit for bit, in the GPU interpreter: the same products in
    the same order, only spread over two kernels (D = 64 here; D = 256 uses it)."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.mosaic_gpu.backward import mosaic_backward
    from pallas_kernels.mosaic_gpu.interpret import interpret_params
    q, k, v, ct = _inputs(1, 70, 2, 1, 64, jnp.bfloat16, seed=5)
    ck, cv, *bounds = slots_and_bounds(q, k, v, blocks.CCA(4, 17))
    dout = ct.astype(q.dtype)
    out, lse, _ = _core_reference64(q, k, v, ck, cv, *bounds, dout)
    args = (q, k, v, ck, cv, *bounds, jnp.asarray(out, q.dtype), jnp.asarray(lse), dout)
    joint, split = (mosaic_backward(*args, mosaic_backward_config(compute_wgs=1, split_keys=x),
                                    interpret=interpret_params(True)) for x in (False, True))
    for name, a, b in zip(("dq", "dk", "dv", "dck", "dcv"), joint, split):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    assert float(jnp.abs(split[1].astype(jnp.float32)).max()) > 0     # not all zeros


@pytest.mark.slow   # about 2 minutes: the interpreted forward, then the interpreted backward
def test_interpreted_gradients_through_the_entry_match_float64():   # measured 1.9-2.4e-3
    """jax.grad through `blocked_attention_mosaic_gpu` (backward="mosaic") and
    the pooling, in the GPU interpreter, against the naive implementation's q/k/v gradients
    in float64: the custom_vjp wiring, residuals and padding end to end."""
    from cca_jax.attention.naive import cca_attention_naive
    from cca_jax.attention.pooling import slots_and_bounds
    from tests.row_errors import row_max_error
    q, k, v, ct = _inputs(1, 100, 2, 1, 64, jnp.bfloat16, seed=0)

    def loss(q, k, v):
        ck, cv, *bounds = slots_and_bounds(q, k, v, blocks.CCA(4, 21))
        out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, interpret=True,
                                           compute_wgs=1, backward="mosaic")
        return jnp.sum(out.astype(jnp.float32) * ct)
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, ct)]
        want = jax.grad(lambda q, k, v: jnp.sum(cca_attention_naive(
            q, k, v, group_size=4, window_size=21) * x64[3]), argnums=(0, 1, 2))(*x64[:3])
    for name, g, w in zip("qkv", got, want):
        err = row_max_error(g, np.asarray(w))
        print(f"d{name}: row error vs float64 {err:.2e}")
        assert err < 1e-2, (name, err)


def _triton_warnings(run) -> list[str]:
    """jax's warnings for the deprecated Pallas Triton backend (raised when a Triton kernel
    lowers) while `run()` runs."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "Triton backend is deprecated" in str(w.message)]


def _default_bf16_model():
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, dtype="bfloat16", param_dtype="bfloat16",
                      attention=dict(kind="cca", group_size=16, window_size=256))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 1024)), jnp.int32)
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), ids


@pytest.mark.gpu
@needs_hopper
def test_gpu_defaults_train_and_prefill_print_no_triton_deprecation():
    """A bf16 model with the default implementation on a Hopper GPU trains (forward and
    backward) and prefills a cache through Mosaic GPU kernels only: no Triton kernel lowers."""
    from flax import nnx

    from cca_jax.kv_cache import init_cache
    from cca_jax.prefill import prefill
    model, ids = _default_bf16_model()

    def run():
        grads = nnx.grad(lambda m: m(ids).astype(jnp.float32).mean())(model)
        jax.block_until_ready(jax.tree.leaves(grads))
        _, logits = prefill(model, init_cache(model.config, 1, 1024), ids[:, :700],
                            chunk_size=512)
        jax.block_until_ready(logits)
    triton = _triton_warnings(run)
    assert not triton, triton[0]


@pytest.mark.gpu
@needs_hopper
def test_gpu_default_decode_prints_no_triton_deprecation():
    """Decoding with the defaults on a Hopper GPU (D = 64, G = 2): no Triton kernel lowers,
    the Mosaic decode kernel serves the steps."""
    from cca_jax.generate import generate
    model, ids = _default_bf16_model()
    triton = _triton_warnings(lambda: generate(model, [ids[0, :700].tolist()],
                                               max_new_tokens=4, chunk_size=512))
    assert not triton, triton[0]
