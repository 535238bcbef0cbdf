"""The Mosaic GPU kernels themselves under jax's GPU interpreter (CPU, `slow` marker, 40-130 s
each): `jax._src.pallas.mosaic_gpu.interpret` (jax 0.10.2) simulates the warpgroups,
barriers and TMA copies; it has no layout_cast, run_state or transposed wgmma operand, so
there every matrix product is a plain dot on the shared-memory tiles (`pipeline.scores` /
`pipeline.accumulate`), and the wgmma path is checked by lowering only
(`tests/test_mosaic_gpu_lowering.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.padding import pad_row_bounds
from pallas_kernels.mosaic_gpu import (blocked_attention_in_cache_mosaic_gpu,
                                       blocked_attention_mosaic_gpu, mosaic_backward_config,
                                       mosaic_config, visit_tables)
from tests.mosaic_gpu_cases import (ROW_TOL, core_reference64, dense_reference,
                                    in_cache_inputs, random_inputs, random_segments,
                                    sinks_reference64, sinks_through_the_backend)


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
    q, k, v, _ = random_inputs(1, length, 2, 1, d, jnp.bfloat16, seed=1)
    seg = jnp.asarray(random_segments(1, length, 2)) if packed else None
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
    q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(layers=3, rows=4, m=104)
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
    q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(layers=2, rows=3, m=104)
    rows, tiling = jnp.array([2, 0]), dict(compute_wgs=1, block_kv=64)
    args = (q, k, v, ck_cache, cv_cache, jnp.int32(1), rows, *bounds)
    got = blocked_attention_in_cache_mosaic_gpu(*args, key_splits=key_splits, interpret=True,
                                                **tiling)
    want = blocked_attention_in_cache_mosaic_gpu(*args, interpret=True, **tiling)
    err = row_max_error(got, np.asarray(want, np.float64))
    ref = dense_reference(q, k, v, ck_cache[1, rows], cv_cache[1, rows], bounds)
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
    from tests.cca_sinks_cases import sinks_reference
    length, pattern, tiling = 300, blocks.CCA(16, 64, 4), dict(compute_wgs=2, block_kv=64)
    q, k, v, _ = random_inputs(1, length, 2, 1, 64, jnp.bfloat16, seed=3)
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
    q, k, v, ct = random_inputs(1, length, 2, 1, 64, jnp.bfloat16, seed=3)
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern)
    assert blocks.lead_rows(pattern, length) == 8
    out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *blocks.sinks_as_slots(pattern, *bounds),
                                       interpret=True, lead_rows=8, compute_wgs=2, block_kv=64)
    want, _ = sinks_reference64(q, k, v, ct, pattern)
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
    q, k, v, ct = random_inputs(1, 300, 4, 2, 64, jnp.bfloat16, seed=5)
    out, grads = sinks_through_the_backend(q, k, v, ct, pattern)
    want, want_grads = sinks_reference64(q, k, v, ct, pattern)
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
    q, k, v, ct = random_inputs(1, 100, 2, 1, 64, jnp.bfloat16, seed=0)
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
    q, k, v, ct = random_inputs(1, length, hq, hkv, d, jnp.bfloat16, seed=len(case))
    seg = jnp.asarray(random_segments(1, length, 2)) if packed else None
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
    assert (ck.shape[1] == 0) == (case == "full_no_slots")
    if case == "cca_sinks_narrow_head":
        assert blocks.narrow_heads(pattern, length, 128, 64, 16) == 2
    dout = ct.astype(q.dtype)
    out, lse, want = core_reference64(q, k, v, ck, cv, *bounds, dout)
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
    q, k, v, ct = random_inputs(1, 70, 2, 1, 64, jnp.bfloat16, seed=5)
    ck, cv, *bounds = slots_and_bounds(q, k, v, blocks.CCA(4, 17))
    dout = ct.astype(q.dtype)
    out, lse, _ = core_reference64(q, k, v, ck, cv, *bounds, dout)
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
    q, k, v, ct = random_inputs(1, 100, 2, 1, 64, jnp.bfloat16, seed=0)

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


@pytest.mark.slow   # 15-40 s each: the interpreter, twice
@pytest.mark.parametrize("case", ["packed", "sinks_narrow_head", "in_cache_splits"])
def test_interpreted_persistent_forward_equals_the_grid_launch(case):
    """Four CTAs walking 9-12 works each in turn (the ring's slots and barrier phases
    running on from one work into the next, Q loading during the last work's epilogue):
    the very output of one CTA per work, bit for bit, in the GPU interpreter, which checks
    the barrier protocol. Packed CCA, CCA with 4 sinks (narrow heads, their own release
    barrier), and the in-cache entry with its keys split over 2 CTAs."""
    from cca_jax.attention.pooling import slots_and_bounds
    if case == "in_cache_splits":
        q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(layers=2, rows=3, m=104)
        args = (q, k, v, ck_cache, cv_cache, jnp.int32(1), jnp.array([2, 0]), *bounds)
        got, want = (blocked_attention_in_cache_mosaic_gpu(
            *args, key_splits=2, interpret=True, compute_wgs=1, block_kv=64,
            persistent=persistent) for persistent in (True, False))
    else:
        sinks = case == "sinks_narrow_head"
        pattern = blocks.CCA(16, 64, 4) if sinks else blocks.CCA(4, 37)
        q, k, v, _ = random_inputs(1, 300, 3, 1, 64, jnp.bfloat16, seed=3)
        seg = None if sinks else jnp.asarray(random_segments(1, 300, 2))
        ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
        got, want = (blocked_attention_mosaic_gpu(
            q, k, v, ck, cv, *bounds, interpret=True, compute_wgs=2, block_kv=64,
            narrow_block=16 if sinks else 0, persistent=persistent)
            for persistent in (True, False))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.slow   # about 50 s each: two interpreted backwards
@pytest.mark.parametrize("case", ["packed", "sinks_narrow_head"])
def test_interpreted_persistent_backward_equals_the_grid_launch(case):
    """The backward kernels with four CTAs each (`persistent`): dq's walking 12 (head, row
    block) works in turn, the ring and the narrow head's release barrier running on across
    them, the next block's Q, dO, bounds and stats loading during the last one's epilogue;
    dk/dv's 6 (KV head, key tile) works, the next tile's K and V loading once this one's
    gradients are stored; dck/dcv's 4 (query head, slot tile), one a CTA here. Every gradient is the
    very one of one CTA per work, bit for bit, in the GPU interpreter."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.mosaic_gpu.backward import mosaic_backward
    from pallas_kernels.mosaic_gpu.interpret import interpret_params
    sinks = case == "sinks_narrow_head"
    pattern = blocks.CCA(16, 64, 4) if sinks else blocks.CCA(4, 37)
    q, k, v, ct = random_inputs(1, 300, 4, 2, 64, jnp.bfloat16, seed=4)
    seg = None if sinks else jnp.asarray(random_segments(1, 300, 2))
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
    if sinks:
        assert blocks.narrow_heads(pattern, 300, 128, 64, 16) == 2
    dout = ct.astype(q.dtype)
    out, lse, _ = core_reference64(q, k, v, ck, cv, *bounds, dout)
    got, want = (mosaic_backward(q, k, v, ck, cv, *bounds, jnp.asarray(out, q.dtype),
                                 jnp.asarray(lse, jnp.float32), dout,
                                 mosaic_backward_config(head_dim=64, persistent=persistent),
                                 interpret=interpret_params(True))
                 for persistent in (True, False))
    for name, g, w in zip(("dq", "dk", "dv", "dck", "dcv"), got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=name)
