"""The Mosaic GPU kernels (`pallas_kernels.mosaic_gpu`) on a Hopper GPU (`gpu` marker): outputs
and gradients against the float64 references, row by row, and against the Triton kernels,
for all four attention options, packed rows, GQA and head dims 64-256; the in-cache
forward; sinks; and no Triton deprecation warning from the defaults.
On the CPU: `tests/test_mosaic_gpu_lowering.py` (cross-lowering, validation),
`tests/test_mosaic_gpu_walks.py` (the block walks) and `tests/test_mosaic_gpu_interpreted.py`
(the kernels in jax's GPU interpreter)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from pallas_kernels.mosaic_gpu import (blocked_attention_in_cache_mosaic_gpu,
                                       blocked_attention_mosaic_gpu)
from tests.mosaic_gpu_cases import (ROW_TOL, dense_reference, in_cache_inputs, naive_grads64,
                                    needs_hopper, random_inputs, random_segments,
                                    sinks_reference64, sinks_through_the_backend)


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
    q, k, v, ct = random_inputs(b, length, hq, hkv, d, jnp.dtype(dtype), seed=len(name) + d)
    seg = jnp.asarray(random_segments(b, length, 7)) if packed else None
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
    q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(
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
    ref = dense_reference(q, k, v, ck, cv, bounds)[:, first_row:]
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
    from tests.cca_sinks_cases import sinks_reference
    pattern = blocks.CCA(16, 256, 4)
    q, k, v, ct = random_inputs(2, 1000, 4, 2, d, jnp.dtype(dtype), seed=11)
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
    q, k, v, ct = random_inputs(2, length, 4, 2, d, jnp.dtype(dtype), seed=13)
    out, grads = jax.jit(functools.partial(sinks_through_the_backend, pattern=pattern))(
        q, k, v, ct)
    want, want_grads = sinks_reference64(q, k, v, ct, pattern)
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
    q, k, v, ct = random_inputs(1, 777, 4, 2, 128, jnp.bfloat16, seed=3)
    seg = jnp.asarray(random_segments(1, 777, 11))
    out = _run(pattern, "mosaic", tuple(sorted(tiling.items())))(q, k, v, ct, seg)
    err = row_max_error(out, cca_reference(q, k, v, 16, 100, segment_ids=np.asarray(seg)))
    print(f"{tiling}: out row error vs float64 {err:.2e}")
    assert err < ROW_TOL["bfloat16"]["out"], err


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["packed", "sinks_narrow_head", "in_cache_splits"])
def test_gpu_persistent_forward_equals_the_grid_launch(case):
    """One CTA per SM walking several works (512 works, or the in-cache chunk's few with
    its keys split), the ring running on across them: the very output of one CTA per work,
    bit for bit, on packed CCA, CCA with 4 sinks (narrow heads) and the in-cache entry."""
    if case == "in_cache_splits":
        q, k, v, ck_cache, cv_cache, bounds = in_cache_inputs(
            layers=3, rows=4, m=8128, b=2, length=300, d=128, seed=5)
        args = (q, k, v, ck_cache, cv_cache, jnp.int32(1), jnp.array([2, 0]), *bounds)
        got, want = (jax.jit(functools.partial(
            blocked_attention_in_cache_mosaic_gpu, first_row=128, key_splits=2,
            persistent=persistent))(*args) for persistent in (True, False))
    else:
        pattern = blocks.CCA(16, 256, 4 if case == "sinks_narrow_head" else 0)
        q, k, v, ct = random_inputs(2, 4000, 8, 2, 128, jnp.bfloat16, seed=13)
        seg = jnp.asarray(random_segments(2, 4000, 3)) if case == "packed" else None
        got, want = (_run(pattern, "mosaic", (("persistent", persistent),))(q, k, v, ct, seg)
                     for persistent in (True, False))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("sinks", [0, 3])
def test_gpu_persistent_backward_equals_the_grid_launch(sinks):
    """The backward kernels with one CTA per SM each (`persistent`), walking 512 (dq), 256
    (dk/dv) and 256 (dck/dcv) works in turn: q/k/v gradients bit for bit those of one CTA
    per work, on packed CCA and on CCA with 3 sinks (narrow heads in dq)."""
    pattern = blocks.CCA(4, 256, sinks)
    q, k, v, ct = random_inputs(2, 8192, 8, 2, 128, jnp.bfloat16, seed=17)
    seg = None if sinks else jnp.asarray(random_segments(2, 8192, 5))
    if sinks:
        assert blocks.narrow_heads(pattern, 8192, 128, 64, 16) > 0
    got, want = (_entry_grads(pattern, q, k, v, ct, seg,
                              backward_tiling=dict(persistent=persistent))
                 for persistent in (True, False))
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=name)


GPU_BACKWARD_OPTIONS = dict(GPU_OPTIONS, cca_sinks=blocks.CCA(16, 100, 4))


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
    want = naive_grads64(q, k, v, ct, pattern, seg)
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
    q, k, v, ct = random_inputs(1, 777, 4, 2, 128, jnp.bfloat16, seed=3)
    seg = jnp.asarray(random_segments(1, 777, 11))
    got = _entry_grads(pattern, q, k, v, ct, seg, backward="mosaic",
                       backward_tiling=backward_tiling)
    want = naive_grads64(q, k, v, ct, pattern, seg)
    for dname, g, w in zip("qkv", got, want):
        err = row_max_error(g, w)
        print(f"{backward_tiling}: d{dname} row error vs float64 {err:.2e}")
        assert err < ROW_TOL["bfloat16"]["grad"], (dname, err)


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
