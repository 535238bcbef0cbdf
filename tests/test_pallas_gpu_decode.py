"""The Pallas GPU decode kernel against `cca_jax.decode.cached_attention` (XLA, dense masks).

On CPU the kernels run in interpret mode: tiny shapes and 16-wide blocks, so that walks have
several blocks, ragged last blocks, ring segments that wrap and splits that are empty. The
kernel's bounds come from `cca_jax.blocks.decode_bounds` (under test); the reference's masks
from the SPEC oracle `tests/visibility_oracle.py`, and the reference runs in float32 (from
the same, exactly representable, values) at full matmul precision. Ring entries and slots a
row must not see are NaN in the kernel's inputs: a kernel that read them unmasked would fail.
Errors are judged per output row (one row and query head): its largest absolute error
relative to the row's norm, so that one wrong row (a window off by one, a dropped core slot)
cannot hide among many right ones. Each test case compiles once; its batches of positions
reuse the compilation. `slow`: more variants; `gpu`: compiled on a GPU. (Timing against XLA
is a measurement, not a test: benchmarks/decode_kernel.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.decode import cached_attention
from pallas_kernels.gpu import DecodeConfig, decode_attention_pallas_gpu
from tests import visibility_oracle as oracle

D = 16
SMALL = dict(block=16)

CCA = blocks.CCA(4, 40)                               # R = 44, C = 20 at 120
SLIDING = blocks.parse_option("sliding", window_size=20)  # R = 20, no slots
STREAMING = blocks.parse_option("streaming", window_size=20, sink_tokens=3)
FULL = blocks.parse_option("full")                        # R = max_len, no slots

# Rows of one batch at different positions: first tokens, the first core token (t = 43 for
# cca), ring wraps (multiples of R), window edges, the last position.
POSITIONS = {
    "cca": [[0, 1, 42, 43, 44, 45], [47, 86, 87, 88, 100, 119]],
    "sliding": [[0, 18, 19, 20, 21, 39], [40, 41, 59, 60, 77, 99]],
    "streaming": [[0, 19, 20, 21, 22, 23], [39, 40, 41, 60, 80, 99]],
    "full": [[0, 1, 15, 16, 17, 31], [32, 33, 34, 37, 38, 39]],
}


@jax.jit
def _reference(*args):
    """`cached_attention` at full float32 precision (no TF32 or bf16 passes on a GPU)."""
    with jax.default_matmul_precision("highest"):
        return cached_attention(*args)


def row_errors(out, ref):
    """`[..., D]` outputs: per row, the largest absolute error over its D values relative
    to the reference row's L2 norm (shape `[...]`)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.abs(out - ref).max(-1) / np.linalg.norm(ref, axis=-1)


def assert_rows_match(out, ref, tol, positions=None):
    err = row_errors(out, ref)
    worst = np.unravel_index(np.argmax(err), err.shape)
    where = f"row {worst}" + ("" if positions is None else f" (t = {positions[worst[0]]})")
    assert err.max() <= tol, (f"largest per-row error {err.max():.2e} > {tol:.1e} at {where}; "
                              f"rows over: {int((err > tol).sum())} of {err.size}")


# Largest per-row error (max |error| / row norm) of the kernel against the float32 reference.
# float32 in the CPU interpreter: measured <= 2.8e-7 -> 2e-6. bf16 inputs (or float32 dots
# run as TF32 on the GPU): the probabilities are rounded to bf16 for the value product; at
# D = 128 a CPU simulation of that rounding at the 7B shape measured 6.5e-4, while the bugs
# this guards against (one ring entry too many or too few, the newest core slot dropped)
# measured 9e-3 to 7e-2 there: 2e-3. A row's norm grows as sqrt(D) and its largest error
# does not, so the bf16 tolerance scales with sqrt(128 / D) (D = 16 here: measured 1.5e-3,
# tolerance 5.7e-3).
ROW_TOL = {"interpret": 2e-6, "bf16": 2e-3}


def _tol(dtype, d=D):
    if dtype == jnp.float32 and jax.default_backend() != "gpu":
        return ROW_TOL["interpret"]
    return ROW_TOL["bf16"] * (128 / d) ** 0.5


def _inputs(pattern, max_len, positions, hq, hkv, dtype=jnp.float32, seed=0, d=D):
    """(kernel args with invisible entries NaN, bounds, float32 reference output)."""
    ring, num_slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    t = np.asarray(positions)
    b = len(t)
    rng = np.random.default_rng(seed)

    def normal(*shape):   # values exactly representable in dtype (the reference's too)
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float32)
    q, k, v = normal(b, hq, d), normal(b, ring, hkv, d), normal(b, ring, hkv, d)
    ck, cv = normal(b, num_slots, hq, d), normal(b, num_slots, hq, d)
    raw_vis, slot_vis = oracle.cache_masks(pattern, t, ring, num_slots)
    ref = _reference(q, k, v, ck, cv, raw_vis, slot_vis)
    cast = lambda *xs: [jnp.asarray(x, dtype) for x in xs]  # noqa: E731
    poison = lambda x, vis: np.where(vis[:, :, None, None], x, np.nan)  # noqa: E731
    args = cast(q, poison(k, raw_vis), poison(v, raw_vis), poison(ck, slot_vis),
                poison(cv, slot_vis))
    return args, blocks.decode_bounds(pattern, t, ring, num_slots), ref


def _check(pattern, max_len, hq, hkv, tiling, positions, dtype=jnp.float32, seed=0, d=D):
    for i, batch in enumerate(positions):
        args, bounds, ref = _inputs(pattern, max_len, batch, hq, hkv, dtype, seed + i, d)
        out = decode_attention_pallas_gpu(*args, bounds, **tiling)
        assert out.shape == ref.shape and out.dtype == jnp.float32
        assert_rows_match(out, ref, _tol(dtype, d), batch)


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


@pytest.mark.parametrize("d", [24, 80])
def test_head_dims_between_widths_are_read_in_place(d):
    """D = 24 and 80 run at widths 32 and 128: the query is zero-padded, the cache is not
    (its loads are masked past D, so NaN past a row's end would show), and the output has
    D columns."""
    positions = POSITIONS["cca"][:1]
    _check(CCA, 120, 4, 2, {**SMALL, "splits": 2}, positions, d=d)
    args, bounds, _ = _inputs(CCA, 120, positions[0], 4, 2, d=d)
    program = str(jax.make_jaxpr(lambda *a: decode_attention_pallas_gpu(*a, bounds, **SMALL))(
        *args))
    assert program.count(" pad[") == 1      # the query's


@pytest.mark.parametrize("d", [80, 96])
def test_lowers_for_cuda_at_head_dims_between_widths(d):
    """Cross-lowered for CUDA (any machine): the Triton lowering takes the 128-wide masked
    loads of a D = 80 / 96 cache (its loads must be powers of two), in two kernels."""
    s = jax.ShapeDtypeStruct
    cache = s((4, 2, 1040, 8, d), jnp.bfloat16)
    slots = s((4, 2, 512, 32, d), jnp.bfloat16)
    ints = s((2,), jnp.int32)

    def f(q, k, v, ck, cv, first, count, n, layer):
        return decode_attention_pallas_gpu(q, k, v, ck, cv, blocks.DecodeBounds(first, count, n),
                                           layer=layer, interpret=False)
    text = jax.jit(f).trace(s((2, 32, d), jnp.bfloat16), cache, cache, slots, slots, ints,
                            ints, ints, s((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 2       # the attention kernel and the merge


def test_stacked_bf16_cache_with_head_major_slots_and_default_tiling():
    """The cache stacked over layers, read at a traced layer index inside a `lax.scan`, with
    slots in the [L, B, Hq, C, D] layout, bf16, default blocks (64: larger than the ring and
    the slots) and automatic split counts: equal to `cached_attention` of each layer alone
    (computed in float32 from the same bf16 values), row by row."""
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
        assert_rows_match(out[i], ref, _tol(jnp.bfloat16), POSITIONS["cca"][i % 2])


# ---- argument checks ----------------------------------------------------------------------

def test_rejects_unsupported_shapes_and_settings():
    (q, k, v, ck, cv), bounds, _ = _inputs(CCA, 120, POSITIONS["cca"][0], 4, 2)
    call = decode_attention_pallas_gpu
    wide, _, _ = _inputs(CCA, 120, POSITIONS["cca"][0], 4, 2, d=320)
    with pytest.raises(ValueError, match="head_dim up to 256.*'xla'"):
        call(*wide, bounds)
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
    _check(CCA, 120, 4, 2, {}, POSITIONS["cca"], dtype=jnp.bfloat16)


@pytest.mark.slow
def test_mqa_and_many_splits_match_cached_attention():
    """One KV head for 4 query heads, more splits than blocks (most of them empty)."""
    _check(CCA, 120, 4, 1, {**SMALL, "splits": 8},
           POSITIONS["cca"] + _random_positions(120, seed=7))


@pytest.mark.slow
def test_paper_group_sizes_match_cached_attention():
    """g = 16 and a window of 64 (R = 80), block 32, rows well past the first ring wraps."""
    pattern = blocks.CCA(16, 64)
    _check(pattern, 400, 4, 2, dict(block=32, splits=2),
           [[0, 78, 79, 80, 160, 399]] + _random_positions(400, seed=11))


# ---- compiled on a GPU ------------------------------------------------------------------------

GPU_PATTERN = blocks.CCA(16, 1024)                   # R = 1040
GPU_RING = 1040
# s + g - 2 (the widest window, no core token), s + g - 1 (the first core token), s + g,
# the ring's write index wrapping (2R - 1, 2R, 3R - 1, 3R), and the last position.
GPU_POSITIONS = [1038, 1039, 1040, 2 * GPU_RING - 1, 2 * GPU_RING, 3 * GPU_RING - 1,
                 3 * GPU_RING, 4999]


def _gpu_case(hq, hkv, max_len, positions, seed=0, d=128):
    """bf16 cache and queries at 7B head shapes; (kernel args, float32 reference, bounds)."""
    pattern = GPU_PATTERN
    ring, num_slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    assert ring == GPU_RING
    batch = len(positions)
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    bf = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(  # noqa: E731
        jnp.bfloat16)
    args = (bf(ks[0], (batch, hq, d)), bf(ks[1], (batch, ring, hkv, d)),
            bf(ks[2], (batch, ring, hkv, d)), bf(ks[3], (batch, num_slots, hq, d)),
            bf(ks[4], (batch, num_slots, hq, d)))
    t = np.asarray(positions)
    masks = oracle.cache_masks(pattern, t, ring, num_slots)
    ref = _reference(*(x.astype(jnp.float32) for x in args), *masks)
    return args, ref, blocks.decode_bounds(pattern, jnp.asarray(t, jnp.int32), ring, num_slots)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("hkv,d", [(8, 128), (32, 128), (8, 80), (8, 96)],
                         ids=["gqa", "mha", "gqa_d80", "gqa_d96"])
def test_gpu_compiled_matches_cached_attention(hkv, d):
    """Hq = 32, D = 128, bf16, g = 16, s = 1024 in an 8192-sized cache: rows at the window's
    edge, the first core token, ring wraps and the last position, each row (and query head)
    within 2e-3 of float32 `cached_attention` relative to its norm. (The former atol = rtol
    = 2e-2 on outputs of mean magnitude 0.04 let a dropped newest core slot pass.)"""
    args, ref, bounds = _gpu_case(32, hkv, max_len=8192, positions=GPU_POSITIONS, d=d)
    out = jax.jit(decode_attention_pallas_gpu)(*args, bounds)
    assert out.dtype == jnp.float32 and out.shape[-1] == d
    assert_rows_match(out, ref, _tol(jnp.bfloat16, d), GPU_POSITIONS)
