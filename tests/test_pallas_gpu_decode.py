"""The Pallas GPU decode kernel against `cca_jax.decode.cached_attention` (XLA, dense masks).

On CPU the kernels run in interpret mode: tiny shapes and 16-wide blocks, so that walks have
several blocks, ragged last blocks, ring segments that wrap and splits that are empty. The
masks of the reference and the kernel's bounds both come from `cca_jax.blocks`. Ring entries
and slots a row must not see are NaN in the kernel's inputs (the reference gets the clean
arrays): a kernel that read them unmasked would fail. Each test case compiles once; its
batches of positions reuse the compilation. `slow`: more variants; `gpu`: compiled on a GPU.
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.decode import cached_attention
from pallas_kernels.gpu import DecodeConfig, decode_attention_pallas_gpu

D = 16
SMALL = dict(block=16)

CCA = blocks.cca_pattern(4, 40)                               # R = 44, C = 20 at 120
SLIDING = blocks.AttentionPattern("sliding", window_size=20)  # R = 20, no slots
STREAMING = blocks.AttentionPattern("streaming", window_size=20, sink_tokens=3)
FULL = blocks.AttentionPattern("full")                        # R = max_len, no slots

# Rows of one batch at different positions: first tokens, the first core token (t = 43 for
# cca), ring wraps (multiples of R), window edges, the last position.
POSITIONS = {
    "cca": [[0, 1, 42, 43, 44, 45], [47, 86, 87, 88, 100, 119]],
    "sliding": [[0, 18, 19, 20, 21, 39], [40, 41, 59, 60, 77, 99]],
    "streaming": [[0, 19, 20, 21, 22, 23], [39, 40, 41, 60, 80, 99]],
    "full": [[0, 1, 15, 16, 17, 31], [32, 33, 34, 37, 38, 39]],
}


_reference = jax.jit(cached_attention)


def _inputs(pattern, max_len, positions, hq, hkv, dtype=jnp.float32, seed=0):
    """(kernel args with invisible entries NaN, bounds, reference output) for positions."""
    ring, num_slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    t = np.asarray(positions)
    b = len(t)
    rng = np.random.default_rng(seed)

    def normal(*shape):   # values exactly representable in dtype (the reference's too)
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float32)
    q, k, v = normal(b, hq, D), normal(b, ring, hkv, D), normal(b, ring, hkv, D)
    ck, cv = normal(b, num_slots, hq, D), normal(b, num_slots, hq, D)
    raw_vis = blocks.cache_raw_visible(pattern, t, ring)
    slot_vis = blocks.cache_slot_visible(pattern, t, num_slots)
    cast = lambda *xs: [jnp.asarray(x, dtype) for x in xs]  # noqa: E731
    ref = _reference(*cast(q, k, v, ck, cv), raw_vis, slot_vis)
    poison = lambda x, vis: np.where(vis[:, :, None, None], x, np.nan)  # noqa: E731
    args = cast(q, poison(k, raw_vis), poison(v, raw_vis), poison(ck, slot_vis),
                poison(cv, slot_vis))
    return args, blocks.decode_bounds(pattern, t, ring, num_slots), ref


def _check(pattern, max_len, hq, hkv, tiling, positions, dtype=jnp.float32, tol=2e-5,
           seed=0):
    if jax.default_backend() == "gpu" and dtype == jnp.float32:
        tol = max(tol, 5e-3)   # float32 dots run as TF32 on the GPU (kernel and reference)
    for i, batch in enumerate(positions):
        args, bounds, ref = _inputs(pattern, max_len, batch, hq, hkv, dtype, seed + i)
        out = decode_attention_pallas_gpu(*args, bounds, **tiling)
        assert out.shape == ref.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=tol, rtol=tol,
                                   err_msg=f"positions {batch}")


def _random_positions(max_len, rows=6, batches=2, seed=0):
    rng = np.random.default_rng(seed)
    return [sorted(rng.choice(max_len, rows, replace=False).tolist()) for _ in range(batches)]


# ---- against the XLA reference, every attention option ------------------------------------

@pytest.mark.parametrize("hq,hkv,splits", [(4, 2, dict(splits=2)), (4, 4, dict(splits=4)),
                                           (4, 2, dict(splits=2, dots=False))],
                         ids=["gqa", "mha", "gqa_no_dots"])
def test_cca_matches_cached_attention(hq, hkv, splits):
    """Positions crossing the first core token, ring wraps and group edges; C = 20 is not a
    multiple of the block; rows with no visible slot; splits with nothing to do; scores by
    MMA dots (default) and by multiply-and-sum."""
    positions = POSITIONS["cca"] + _random_positions(120, seed=hkv)
    assert min(blocks.decode_bounds(CCA, np.asarray(positions[0]), 44, 20).num_slots) == 0
    _check(CCA, 120, hq, hkv, {**SMALL, **splits}, positions)


@pytest.mark.parametrize("pattern,max_len", [(SLIDING, 100), (STREAMING, 100), (FULL, 40)],
                         ids=["sliding", "streaming", "full"])
def test_other_options_match_cached_attention(pattern, max_len):
    """sliding and full: no slots (C = 0, the ring alone); streaming: 3 sinks as slots;
    full: a ring of max_len that never wraps."""
    _check(pattern, max_len, 4, 2, {**SMALL, "splits": 2},
           POSITIONS[pattern.kind] + _random_positions(max_len, batches=1, seed=3))


def test_stacked_bf16_cache_with_head_major_slots_and_default_tiling():
    """The cache stacked over layers, read at a traced layer index inside a `lax.scan`, with
    slots in the [L, B, Hq, C, D] layout, bf16, default blocks (64: larger than the ring and
    the slots) and automatic split counts: equal to `cached_attention` of each layer alone
    (computed in float32 from the same bf16 values)."""
    layers, hq, hkv = 3, 4, 2
    per_layer = [_inputs(CCA, 120, POSITIONS["cca"][i % 2], hq, hkv, jnp.bfloat16, 10 + i)
                 for i in range(layers)]
    stack = lambda j: jnp.stack([p[0][j] for p in per_layer])  # noqa: E731
    q, k, v = stack(0), stack(1), stack(2)
    ck_hm, cv_hm = (jnp.swapaxes(stack(j), 2, 3) for j in (3, 4))   # [L, B, Hq, C, D]
    bounds = jax.tree.map(lambda *x: jnp.stack(x), *(p[1] for p in per_layer))

    def body(_, xs):
        i, q_i, bounds_i = xs
        return None, decode_attention_pallas_gpu(q_i, k, v, ck_hm, cv_hm, bounds_i, layer=i,
                                                 slot_layout="bhcd")
    _, out = jax.lax.scan(body, None, (jnp.arange(layers), q, bounds))
    for i, (_, _, ref) in enumerate(per_layer):
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(ref), atol=2e-2, rtol=2e-2)


# ---- argument checks ----------------------------------------------------------------------

def test_rejects_unsupported_shapes_and_settings():
    (q, k, v, ck, cv), bounds, _ = _inputs(CCA, 120, POSITIONS["cca"][0], 4, 2)
    call = decode_attention_pallas_gpu
    with pytest.raises(ValueError, match="head_dim"):
        call(q[..., :12], k[..., :12], v[..., :12], ck[..., :12], cv[..., :12], bounds)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        call(q[:, :3], k, v, ck[:, :, :3], cv[:, :, :3], bounds)
    with pytest.raises(ValueError, match="ck and cv"):
        call(q, k, v, ck[:, :, :2], cv[:, :, :2], bounds)
    with pytest.raises(ValueError, match="ring_count"):
        call(q, k, v, ck, cv, bounds._replace(ring_count=bounds.ring_count[:2]))
    with pytest.raises(ValueError, match="bounds must be"):
        call(q, k, v, ck, cv, bounds[:2])
    with pytest.raises(ValueError, match="layer="):
        call(q, k, v, ck, cv, bounds, layer=0)
    with pytest.raises(ValueError, match="block"):
        call(q, k, v, ck, cv, bounds, block=48)
    with pytest.raises(ValueError, match="splits must be a positive"):
        call(q, k, v, ck, cv, bounds, splits=0)
    with pytest.raises(ValueError, match="power of two"):
        call(q, k, v, ck, cv, bounds, splits=3)
    with pytest.raises(ValueError, match="dots must be a bool"):
        call(q, k, v, ck, cv, bounds, dots=1)
    with pytest.raises(ValueError, match="slot_layout"):
        call(q, k, v, ck, cv, bounds, slot_layout="cbhd")
    with pytest.raises(ValueError, match="unknown"):
        call(q, k, v, ck, cv, bounds, block_q=16)
    assert DecodeConfig().slot_layout == "bchd"


# ---- more variants (slow) -------------------------------------------------------------------

@pytest.mark.slow
def test_bfloat16_with_default_tiling_matches_cached_attention():
    """bf16 cache and query, default tiling, one layer in the KVCache layout."""
    _check(CCA, 120, 4, 2, {}, POSITIONS["cca"], dtype=jnp.bfloat16, tol=2e-2)


@pytest.mark.slow
def test_mqa_and_many_splits_match_cached_attention():
    """One KV head for 4 query heads, more splits than blocks (most of them empty)."""
    _check(CCA, 120, 4, 1, {**SMALL, "splits": 8},
           POSITIONS["cca"] + _random_positions(120, seed=7))


@pytest.mark.slow
def test_paper_group_sizes_match_cached_attention():
    """g = 16 and a window of 64 (R = 80), block 32, rows well past the first ring wraps."""
    pattern = blocks.cca_pattern(16, 64)
    _check(pattern, 400, 4, 2, dict(block=32, splits=2),
           [[0, 78, 79, 80, 160, 399]] + _random_positions(400, seed=11))


# ---- compiled on a GPU ------------------------------------------------------------------------

def _gpu_case(batch, hq, hkv, max_len, context, seed=0):
    pattern = blocks.cca_pattern(16, 1024)
    ring, num_slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    d = 128
    bf = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(  # noqa: E731
        jnp.bfloat16)
    args = (bf(ks[0], (batch, hq, d)), bf(ks[1], (batch, ring, hkv, d)),
            bf(ks[2], (batch, ring, hkv, d)), bf(ks[3], (batch, num_slots, hq, d)),
            bf(ks[4], (batch, num_slots, hq, d)))
    t = jnp.asarray(context - 1 - 37 * np.arange(batch), jnp.int32)
    masks = (blocks.cache_raw_visible(pattern, t, ring),
             blocks.cache_slot_visible(pattern, t, num_slots))
    return args, masks, blocks.decode_bounds(pattern, t, ring, num_slots)


def _median_ms(fn, *args, iters=30):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("batch,hkv", [(2, 8), (3, 32)])
def test_gpu_compiled_matches_cached_attention(batch, hkv):
    args, masks, bounds = _gpu_case(batch, 32, hkv, max_len=8192, context=5000)
    ref = jax.jit(cached_attention)(*args, *masks)
    out = jax.jit(decode_attention_pallas_gpu)(*args, bounds)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_gpu_faster_than_xla_when_the_cache_is_mostly_empty():
    """32K of context in a 128K-sized cache: the kernel reads a quarter of the slots."""
    args, masks, bounds = _gpu_case(1, 32, 32, max_len=131072, context=32768)
    xla_ms = _median_ms(jax.jit(cached_attention), *args, *masks)
    pallas_ms = _median_ms(jax.jit(decode_attention_pallas_gpu), *args, bounds)
    print(f"xla {xla_ms:.3f} ms, pallas {pallas_ms:.3f} ms")
    assert pallas_ms < xla_ms and math.isfinite(pallas_ms)
