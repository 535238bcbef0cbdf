"""The kernels with attention sinks (SPEC section 6) against the SPEC's dense reference
(`tests/cca_sinks_cases.py`): the Pallas GPU kernels in interpret mode and the TPU kernels in
the TPU interpreter at small shapes, the decode kernels reading a cache whose first slots are
the sinks; `gpu`: the kernels compiled on a GPU, and property 6 through them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.blocks import CCA
from cca_jax.config import LlamaConfig
from tests.cca_sinks_cases import (
    GRAD_TOL,
    OUT_TOL,
    TINY,
    in_float64,
    make_inputs,
    make_segments,
    max_err,
    out_and_grads,
    sinks_case,
    sinks_reference,
    tiny_model)


# ---- the kernels ---------------------------------------------------------------------------

def test_pallas_gpu_kernels_interpret():
    """The Triton-lowered kernels (forward, dq, dk/dv, dcore) in interpret mode on a packed
    case with N > s: outputs and gradients against the float64 reference."""
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    (q, k, v, ct, seg), kw = sinks_case("n_above_s_packed", d=64)
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    ref, ref_grads = in_float64(out_and_grads(
        lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg)), q, k, v, ct)
    small = dict(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkv_block_k=16,
                 dkv_block_q=16, dc_block_k=16, dc_block_q=16)
    attend = functools.partial(cca_attention_pallas_gpu, segment_ids=seg, interpret=True,
                               **kw, **small)
    out, grads = jax.jit(out_and_grads(attend))(q, k, v, ct)
    assert max_err(out, ref) < OUT_TOL
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert max_err(got, want) < 4 * GRAD_TOL, (dname, max_err(got, want))


@pytest.mark.slow   # ~30 s interpreted; the sinks kernels path stays in the default run
def test_pallas_gpu_narrow_edge_blocks_interpret():
    """Sinks off the group grid with s a multiple of the blocks (the paper's geometry, where
    the kernels visit narrow head/tail blocks: `blocks.narrow_head` / `narrow_tail`): forward
    and dq windows starting in the last keys of a key block, dk/dv key blocks last seen in
    the first rows of a query block. Narrow edges on and off, against float64."""
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    g, s, n, length = 4, 32, 3, 128
    q, k, v, ct = make_inputs(1, length, 2, 1, 64, seed=5)
    pattern = CCA(g, s, n)
    raw_lo = np.asarray(pattern.raw_start(np.arange(length)))
    heads = [blocks.narrow_head(blocks.raw_blocks_for_rows(r0, r0 + 31, int(raw_lo[r0]),
                                                           int(raw_lo[r0 + 31]), 32),
                                int(raw_lo[r0]), 32, 8)[0] for r0 in range(0, length, 32)]
    assert sum(heads) >= 2, heads                    # the narrow path is exercised
    ref, ref_grads = in_float64(out_and_grads(
        lambda q, k, v: sinks_reference(q, k, v, g, s, n)), q, k, v, ct)
    tiles = dict(block_q=32, block_k=32, dq_block_q=32, dq_block_k=32, dkv_block_k=32,
                 dkv_block_q=32, dc_block_k=32, dc_block_q=32)
    for narrow in (8, 0):
        attend = functools.partial(cca_attention_pallas_gpu, group_size=g, window_size=s,
                                   sink_tokens=n, interpret=True, narrow_block=narrow,
                                   dq_narrow_block=narrow, dkv_narrow_block=narrow, **tiles)
        out, grads = jax.jit(out_and_grads(attend))(q, k, v, ct)
        assert max_err(out, ref) < OUT_TOL, narrow
        for dname, got, want in zip("qkv", grads, ref_grads):
            assert max_err(got, want) < 4 * GRAD_TOL, (narrow, dname, max_err(got, want))


def _tpu_case(grads: bool):
    """The Mosaic kernels in the TPU interpreter (out-of-bounds reads raise, fresh memory is
    NaN, races detected): L = 150 (not a multiple of g or of the 128-row blocks), G = 2,
    N = 9 > s = 7, one packed row and one plain."""
    from jax.experimental.pallas import tpu as pltpu

    from cca_jax.attention.pallas_tpu import cca_attention_pallas_tpu
    strict = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                   uninitialized_memory="nan")
    q, k, v, ct = make_inputs(2, 150, 2, 1, 128, seed=5)
    seg = make_segments(2, 150, (70,))
    attend = functools.partial(cca_attention_pallas_tpu, group_size=4, window_size=7,
                               sink_tokens=9, segment_ids=seg, interpret=strict, block_q=128,
                               block_k=128, block_c=128)
    reference = functools.partial(sinks_reference, g=4, s=7, n=9, segment_ids=seg)
    try:
        if not grads:
            out = jax.jit(attend)(q, k, v)
            assert max_err(out, in_float64(reference, q, k, v)) < 3 * OUT_TOL
            return
        out, grads = jax.jit(out_and_grads(attend))(q, k, v, ct)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    ref, ref_grads = in_float64(out_and_grads(reference), q, k, v, ct)
    assert max_err(out, ref) < 3 * OUT_TOL
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert max_err(got, want) < 4 * GRAD_TOL, (dname, max_err(got, want))


def test_pallas_tpu_kernels_interpret():
    _tpu_case(grads=False)


@pytest.mark.slow
def test_pallas_tpu_kernels_interpret_gradients():
    _tpu_case(grads=True)


@pytest.mark.parametrize("kernel", ["pallas_gpu",
                                    pytest.param("pallas_tpu", marks=pytest.mark.slow)])
def test_decode_kernels_with_sinks(kernel):
    """The decode kernels read a cache whose first slots are the sinks: against the dense
    XLA form (`cached_attention` with the cache masks) at positions before, at and after the
    sinks leave the window (t = s + g - 1 .. s + g + N - 2) and after the first core token."""
    from cca_jax.decode import cached_attention
    pat = CCA(4, 10, 3)                      # R = 14; sinks leave from t = 13
    max_len, hq, hkv, d = 60, 4, 2, 128 if kernel == "pallas_tpu" else 16
    ring, slots = blocks.ring_size(pat, max_len), pat.max_slots(max_len)
    positions = np.asarray([0, 2, 12, 13, 14, 15, 16, 59])
    rng = np.random.default_rng(7)
    q, kr, vr = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
                 ((8, hq, d), (8, ring, hkv, d), (8, ring, hkv, d)))
    ck, cv = (jnp.asarray(rng.standard_normal((8, slots, hq, d)), jnp.float32) for _ in "kv")
    bounds = blocks.decode_bounds(pat, positions, ring, slots)
    if kernel == "pallas_gpu":
        from pallas_kernels.gpu import decode_attention_pallas_gpu
        out = decode_attention_pallas_gpu(q, kr, vr, ck, cv, bounds, interpret=True, block=16)
    else:
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.tpu import decode_attention_pallas_tpu
        try:
            out = decode_attention_pallas_tpu(q, kr, vr, ck, cv, bounds,
                                              interpret=pltpu.InterpretParams())
        finally:
            pltpu.reset_tpu_interpret_mode_state()
    want = cached_attention(q, kr, vr, ck, cv,
                            jnp.asarray(blocks.cache_raw_visible(pat, positions, ring)),
                            jnp.asarray(blocks.cache_slot_visible(pat, positions, slots)))
    assert max_err(out, want) < 2e-5


# ---- on a GPU -----------------------------------------------------------------------------

def _gpu_case(length, packed, dtype):
    q, k, v, ct = make_inputs(1, length, 4, 2, 128, seed=13, dtype=dtype)
    seg = make_segments(2, length, (length // 3, 2 * length // 3))[1:] if packed else None
    return q, k, v, ct, seg


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype,packed", [("bfloat16", False), ("float32", True)])
def test_gpu_kernels_match_the_reference(dtype, packed):
    """The compiled Triton kernels (default tiling) with N = 4, g = 16, s = 256 at L = 2048
    against the float64 reference: relative L2 errors of the output and gradients (the
    tolerances of tests/test_pallas_gpu.py's plain CCA)."""
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    q, k, v, ct, seg = _gpu_case(2048, packed, dtype)
    kw = dict(group_size=16, window_size=256, sink_tokens=4)
    out, grads = jax.jit(out_and_grads(functools.partial(
        cca_attention_pallas_gpu, segment_ids=seg, **kw)))(q, k, v, ct)
    ref, ref_grads = in_float64(out_and_grads(
        lambda q, k, v: sinks_reference(q, k, v, 16, 256, 4, seg)), q, k, v, ct)
    tol = {"bfloat16": (6.3e-3, 1.05e-2), "float32": (1.1e-3, 1.6e-3)}[dtype]

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert rel(out, ref) < tol[0], rel(out, ref)
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert rel(got, want) < tol[1], (dname, rel(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_gpu_decode_and_prefill_equal_one_forward():
    """Property 6 on the GPU with the Pallas prefill and decode kernels (float32 model):
    a prompt prefilled in chunks of 16 then decoded, against one forward of the same weights
    through the dense naive implementation."""
    from flax import nnx

    from cca_jax.decode import decode_step
    from cca_jax.prefill import prefill
    from cca_jax.kv_cache import init_cache
    cfg = LlamaConfig(**dict(TINY, head_dim=64, max_position_embeddings=256),
                      attention=dict(kind="cca", group_size=4, window_size=24, sink_tokens=4,
                                     implementation="pallas_gpu"))
    model = tiny_model(cfg)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 120)),
                      jnp.int32)
    ref, plain = (np.asarray(tiny_model(cfg.replace(implementation="naive", **kw))(ids))
                  for kw in ({}, {"sink_tokens": 0}))
    tol = 1e-2 * np.abs(ref).max()      # TF32 dots on the GPU; the sinks change ~0.1 of it
    assert max_err(plain, ref) > 10 * tol
    cache = init_cache(cfg, 2, 128)
    cache, _, logits = prefill(model, cache, ids[:, :70], chunk_size=16,
                               return_all_logits=True)
    assert max_err(logits, ref[:, :70]) < tol
    state = nnx.split(model)
    for t in range(70, 120):
        out, cache = decode_step(state, cache, ids[:, t])
        assert max_err(out, ref[:, t]) < tol, t


def test_pallas_gpu_compiles_the_narrow_head_only_where_it_pays():
    """The backend turns the forward's narrow head off when no query block would take one
    (it costs codegen even unused) and keeps it, or an explicit setting, otherwise."""
    from cca_jax.attention.pallas_gpu import _narrow_where_it_pays
    q = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)
    assert _narrow_where_it_pays(CCA(16, 1024, 0), q, {}) == {"narrow_block": 0}
    assert _narrow_where_it_pays(CCA(16, 1024, 4), q, {}) == {}
    assert _narrow_where_it_pays(CCA(16, 1024, 0), q, {"narrow_block": 16}) == {
        "narrow_block": 16}
