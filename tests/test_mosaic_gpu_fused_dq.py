"""The fused Mosaic GPU backward (`MosaicBackwardConfig.fused_dq`): no dq kernel, the
key-side kernels add dQ = dS K into a float32 accumulator by TMA reduce-adds.

On the CPU: its settings and their errors, its cross-lowering for "cuda" (the accumulator
aliased through both key-side kernels), and (slow) the kernels in jax's GPU interpreter,
where a CTA's dQ partials go to a slice of its own instead (no reduction copies there). On
a Hopper GPU (`gpu`): against float64 and the three-kernel backward, and how much dq varies
between two runs (the adds' order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu
from pallas_kernels.mosaic_gpu.config import (SMEM_LIMIT_BYTES, backward_shared_memory_bytes,
                                              check_backward_shared_memory,
                                              fused_dq_by_columns, mosaic_backward_config)
from tests.mosaic_gpu_cases import (ROW_TOL, core_reference64, lowered_text, naive_grads64,
                                    needs_hopper, random_inputs, random_segments)

FUSED = {"fused_dq": True}


# ---- CPU: settings ------------------------------------------------------------------------

def test_fused_defaults_fit_shared_memory_at_two_stages():
    """The fused kernel's extra tiles (two dS^T buffers per warpgroup, the float32 dQ
    staging) fit sm_90 at 2 ring stages, its default, and not at the unfused default of 3
    (D = 128, 2 warpgroups); how the warpgroups share dQ follows the swizzle."""
    cfg = mosaic_backward_config(fused_dq=True)
    assert cfg.stages == 2 and cfg.fused_dq and "dq" not in backward_shared_memory_bytes(cfg, 128)
    for d in (64, 128):
        for wgs in (1, 2):
            fits = mosaic_backward_config(fused_dq=True, compute_wgs=wgs)
            assert backward_shared_memory_bytes(fits, d)["keys"] <= SMEM_LIMIT_BYTES
    deep = mosaic_backward_config(fused_dq=True, stages=3)
    with pytest.raises(ValueError, match="keys kernel needs 228 KiB"):
        check_backward_shared_memory(deep, 128)
    assert fused_dq_by_columns(128, 2) and not fused_dq_by_columns(64, 2)
    assert not fused_dq_by_columns(128, 1)


@pytest.mark.parametrize("head_dim,fields,match", [
    (128, dict(fused_dq=1), "fused_dq must be a bool"),
    (128, dict(fused_dq=True, key_block_q=128), "fused_dq needs key_block_q=64"),
    (128, dict(fused_dq=True, split_keys=True), "split_keys=False"),
    (256, dict(fused_dq=True), r"fused_dq runs kernel head dims \(64, 128\).*fused_dq=False"),
])
def test_fused_setting_errors(head_dim, fields, match):
    with pytest.raises(ValueError, match=match):
        mosaic_backward_config(head_dim=head_dim, **fields)


@pytest.mark.parametrize("by_columns", [True, False])
def test_interpreted_partials_sum_only_what_each_warpgroup_wrote(by_columns):
    """The interpreter's dQ partials (`[tiles, wgs, B, rows, Hq, D]`, unwritten entries
    NaN here) summed over the query blocks each CTA walked, rows after the lead rows, and
    (by columns) each warpgroup's own columns: 2 tiles, 2 warpgroups, 2-row blocks, 2 lead
    rows; tile 0 walks frame blocks [0, 2), tile 1 blocks [1, 3)."""
    from pallas_kernels.mosaic_gpu.keys import _visited_sum
    from pallas_kernels.mosaic_gpu.tables import Q_FIRST, Q_LAST
    visits = np.zeros((1, 2, max(Q_FIRST, Q_LAST) + 1), np.int32)
    visits[0, :, Q_FIRST], visits[0, :, Q_LAST] = (0, 1), (2, 3)
    parts = np.full((2, 2, 1, 8, 1, 4), np.nan, np.float32)
    for tile, (first, last) in enumerate([(0, 2), (1, 3)]):
        rows = slice(2 + 2 * first, 2 + 2 * last)
        for wg in range(2):
            cols = slice(2 * wg, 2 * wg + 2) if by_columns else slice(None)
            parts[tile, wg, 0, rows, 0, cols] = 1.0 if by_columns else 0.5
    got = _visited_sum(jnp.asarray(parts), jnp.asarray(visits), 2, 2, by_columns)
    want = np.array([0, 0, 1, 1, 2, 2, 1, 1], np.float32)[:, None] * np.ones(4)
    np.testing.assert_array_equal(np.asarray(got)[0, :, 0], want)


# ---- CPU: cross-lowering ------------------------------------------------------------------

@pytest.mark.parametrize("dtype,d,hq,hkv,m,wgs,kernels", [
    ("bfloat16", 128, 8, 2, 45, 2, 3),  # forward, dk/dv+dq, dck/dcv+dq; dQ by column halves
    ("float16", 64, 4, 4, 45, 2, 3),    # D = 64: each warpgroup its own keys' dQ
    ("bfloat16", 96, 8, 2, 0, 1, 2),    # padded to 128, one warpgroup; no slots: no dck/dcv
])
def test_fused_gradient_lowers_for_cuda(dtype, d, hq, hkv, m, wgs, kernels):
    """jax.grad through the entry with `fused_dq`: no dq kernel, and the float32 dQ
    accumulator is aliased in and out of every key-side kernel (the reduce-adds' target)."""
    text = lowered_text(dtype, d, hq, hkv, 700, m, grad=True, backward="mosaic",
                         backward_tiling=dict(FUSED, compute_wgs=wgs))
    calls = [line for line in text.splitlines() if "mosaic_gpu_v2(" in line]
    assert len(calls) == kernels and "xla.gpu.triton" not in text
    assert sum("output_operand_alias" in line for line in calls) == kernels - 1


# ---- CPU, slow: the kernels in jax's GPU interpreter ----------------------------------------

# (pattern, L, Hq, Hkv, packed, backward tiling, D): ragged L everywhere.
INTERPRETED = {
    "gqa_packed_own_keys": (blocks.CCA(4, 37), 200, 2, 1, True, {}, 64),
    "d128_by_columns": (blocks.CCA(4, 37), 150, 2, 1, False, {}, 128),
    "one_warpgroup_sinks": (blocks.CCA(5, 41, 3), 150, 2, 1, False, dict(compute_wgs=1), 64),
    "no_slots": (blocks.CCA(4, 400), 150, 2, 2, False, {}, 64),
}


@pytest.mark.slow   # 20-60 s each on 2 cores: two interpreted backwards
@pytest.mark.parametrize("case", sorted(INTERPRETED))
def test_interpreted_fused_backward_matches_float64_and_the_dq_kernel(case):
    """The fused backward in the GPU interpreter against float64 gradients, row by row, and
    against the three-kernel backward at the same ring depth: dk, dv, dck, dcv bit for bit
    (the same products in the same order), dq to float32 rounding (summed in another
    order). Covers dQ shared by columns (D = 128) and by keys (D = 64), one warpgroup,
    GQA, packed rows, sinks and no slots."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.mosaic_gpu.backward import mosaic_backward
    from pallas_kernels.mosaic_gpu.interpret import interpret_params
    from tests.row_errors import row_max_error
    pattern, length, hq, hkv, packed, tiling, d = INTERPRETED[case]
    q, k, v, ct = random_inputs(1, length, hq, hkv, d, jnp.bfloat16, seed=len(case))
    seg = jnp.asarray(random_segments(1, length, 2)) if packed else None
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=seg)
    dout = ct.astype(q.dtype)
    out, lse, want = core_reference64(q, k, v, ck, cv, *bounds, dout)
    args = (q, k, v, ck, cv, *bounds, jnp.asarray(out, q.dtype), jnp.asarray(lse), dout)
    fused, plain = (mosaic_backward(*args, mosaic_backward_config(head_dim=d, stages=2,
                                                                   fused_dq=f, **tiling),
                                    interpret=interpret_params(True)) for f in (True, False))
    for name, g, p, w in zip(("dq", "dk", "dv", "dck", "dcv"), fused, plain, want):
        assert g.shape == w.shape and g.dtype == q.dtype, name
        if w.size == 0:
            continue
        err = row_max_error(g, w)
        print(f"{case} {name}: row error vs float64 {err:.2e}")
        assert err < 1e-2, (name, err)     # bf16 rounding, as the three kernels'
        if name == "dq":
            assert row_max_error(g, p) < 2e-3, row_max_error(g, p)
        else:
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(p, np.float32),
                                          err_msg=name)


@pytest.mark.slow   # about 2 minutes: the interpreted forward, then the fused backward
def test_interpreted_fused_gradients_after_lead_rows_match_float64():
    """jax.grad through the entry with 8 sinks run as lead rows (the kernels in the frame
    after them: the dQ rows' offset) and the fused backward, against float64."""
    from cca_jax.attention.pooling import slots_and_bounds
    from tests.row_errors import row_max_error
    pattern = blocks.CCA(4, 21, 8)
    q, k, v, ct = random_inputs(1, 100, 2, 1, 64, jnp.bfloat16, seed=0)

    def loss(q, k, v):
        ck, cv, *bounds = slots_and_bounds(q, k, v, pattern)
        bounds = blocks.sinks_as_slots(pattern, *bounds)
        out = blocked_attention_mosaic_gpu(q, k, v, ck, cv, *bounds, lead_rows=8,
                                           interpret=True, compute_wgs=1,
                                           backward="mosaic", backward_tiling=FUSED)
        return jnp.sum(out.astype(jnp.float32) * ct)
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = naive_grads64(q, k, v, ct, pattern, None)
    for name, g, w in zip("qkv", got, want):
        err = row_max_error(g, w)
        print(f"d{name}: row error vs float64 {err:.2e}")
        assert err < 1e-2, (name, err)


# ---- GPU (Hopper) ---------------------------------------------------------------------------

@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,hq,hkv,pattern,packed", [
    ("bfloat16", 128, 4, 2, blocks.CCA(16, 100), True),      # dQ by column halves, GQA
    ("float16", 64, 4, 1, blocks.CCA(16, 100), False),       # dQ by each warpgroup's keys
    ("bfloat16", 128, 4, 2, blocks.CCA(16, 100, 8), False),  # sinks as lead rows
    ("bfloat16", 96, 2, 2, blocks.CCA(16, 100), False),      # padded to 128
])
def test_gpu_fused_backward_matches_float64_and_the_dq_kernel(dtype, d, hq, hkv, pattern,
                                                             packed):
    """q/k/v gradients through the backend with `fused_dq`, ragged L = 1000, against
    float64 and against the three-kernel backward, row by row; and dq of two runs, which
    may differ in the last bits (the reduce-adds' order): printed, bounded by the rounding
    of one bf16/fp16 value."""
    from cca_jax.attention.pallas_mosaic_gpu import attention_mosaic_gpu
    from tests.row_errors import row_max_error
    q, k, v, ct = random_inputs(2, 1000, hq, hkv, d, jnp.dtype(dtype), seed=d + hq)
    seg = jnp.asarray(random_segments(2, 1000, 7)) if packed else None

    def grads(tiling):
        def loss(q, k, v):
            out = attention_mosaic_gpu(q, k, v, pattern, segment_ids=seg,
                                       backward_tiling=tiling)
            return jnp.sum(out.astype(jnp.float32) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    fused, again, plain = grads(FUSED), grads(FUSED), grads({})
    want = naive_grads64(q, k, v, ct, pattern, seg)
    for name, g, p, w in zip("qkv", fused, plain, want):
        err, vs_plain = row_max_error(g, w), row_max_error(g, p)
        print(f"{dtype} D={d} {pattern}: d{name} row error vs float64 {err:.2e}, vs the "
              f"three kernels {vs_plain:.2e} (they vs float64 {row_max_error(p, w):.2e})")
        assert err < ROW_TOL[dtype]["grad"], (name, err)
    runs = row_max_error(fused[0], again[0])
    print(f"dq between two fused runs: row error {runs:.2e}")
    assert runs < ROW_TOL[dtype]["out"], runs
