"""SPEC properties 1-5 for the `naive` and `xla` CCA implementations, and bad inputs.

The oracles are in `tests/reference.py` (float64 numpy, written from the SPEC text). Every
case has a fixed seed, so a failure reproduces. Every tolerance says the error measured on
CPU (jax 0.10.2) and the margin it allows.

Speed: compiling dominates (about 1 s per program on CPU, 2-3 s for a gradient), so every
jitted function is built once per (shape, static arguments) and tests share shapes (and so
compiled programs) wherever they can.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import cca_attention, parse_option, run_attention
from cca_jax.attention import cca_attention_naive, cca_attention_xla, resolve_implementation
from tests.reference import cca_reference, causal_reference, reference_directional_grads

# (B, L, Hq, Hkv, D, g, s). Seeds: 100 + index.
CASES = [
    ("G2", (1, 37, 2, 1, 8, 4, 6)),           # L and s not multiples of g; G = 2
    ("B2-G2-D16", (2, 50, 4, 2, 16, 3, 7)),   # batch 2, G = 2, L and s not multiples of g
    ("G1", (1, 45, 2, 2, 8, 4, 5)),           # plain multi-head
    ("L<s", (1, 20, 2, 1, 8, 4, 30)),         # no core tokens: property 2
    ("s=L", (2, 40, 4, 2, 8, 4, 40)),         # the edge of property 2
    ("g1", (1, 33, 4, 1, 8, 1, 3)),           # property 1, G = 4
    ("g1-s1", (2, 29, 4, 2, 8, 1, 1)),        # property 1 with the smallest window
    ("multiples", (2, 64, 4, 4, 8, 8, 16)),   # everything a multiple of g and of the blocks
    ("s1-G3", (1, 71, 6, 2, 8, 5, 1)),        # s = 1 < g, G = 3
]
SHAPES = dict(CASES)
SEEDS = {name: 100 + i for i, (name, _) in enumerate(CASES)}
POOLINGS = ("cca", "mean", "max")

# float32 against the float64 reference, every case, pooling and packing: measured max |err|
# 4.7e-7 (outputs are O(1)); tolerance 2e-6, 4x margin.
F32_ATOL = 2e-6


def _jit(fn):
    return jax.jit(fn, static_argnames=("group_size", "window_size", "pooling"))


# xla with small blocks so that several query and core blocks (and ragged edges) occur; the
# default blocking is covered by test_public_api_* and the model tests.
IMPL_FNS = {
    "naive": cca_attention_naive,
    "xla": functools.partial(cca_attention_xla, block_q=16, block_c=8),
}
IMPLS = {name: _jit(fn) for name, fn in IMPL_FNS.items()}


def run(impl, q, k, v, g, s, pooling="cca", segment_ids=None):
    """Every call passes the same keywords: jit keys its cache on the static arguments as
    given, so an omitted default would compile the same program a second time."""
    return IMPLS[impl](q, k, v, group_size=g, window_size=s, pooling=pooling,
                       segment_ids=segment_ids)


def make_inputs(shape, dtype=np.float32, seed=0):
    b, length, hq, hkv, d, _, _ = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, length, hq, d)).astype(dtype)
    k = rng.standard_normal((b, length, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, length, hkv, d)).astype(dtype)
    return q, k, v


def case_inputs(name, dtype=np.float32):
    return make_inputs(SHAPES[name], dtype, SEEDS[name])


def assert_close(got, want, atol, what=""):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max()
    print(f"{what}: max |err| {err:.3g} (tolerance {atol:.3g})")
    assert err <= atol, f"{what}: max |err| {err:.3g} > {atol:.3g}"


# Packed rows: row 0 random documents, row 1 chosen lengths 1, 5 (= s: no core token),
# 8 (= s + g: exactly one group), 23, 24, with id 7 used by two documents that are not
# adjacent (a document is a maximal run, not an id).
PACKED_SHAPE = (2, 61, 4, 2, 8, 3, 5)


def packed_segments():
    row0 = np.sort(np.random.default_rng(5).integers(0, 4, 61))
    row1 = np.repeat([7, 3, 7, 1, 2], [1, 5, 8, 23, 24])
    return np.stack([row0, row1]).astype(np.int32)


# ---- property 3 (and 1, 2): forward against the float64 reference -------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", SHAPES)
def test_matches_spec_reference_float32(impl, name):
    """Property 3; on the g = 1 and s >= L cases also properties 1 and 2."""
    q, k, v = case_inputs(name)
    g, s = SHAPES[name][5:]
    out = run(impl, q, k, v, g, s)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    assert_close(out, cca_reference(q, k, v, g, s), F32_ATOL, "vs cca_reference")
    if g == 1 or s >= q.shape[1]:
        assert_close(out, causal_reference(q, k, v), F32_ATOL, "vs causal attention")


def test_reference_reduces_to_causal_attention():
    """The oracle itself satisfies properties 1 and 2 (and is not causal attention otherwise)."""
    for name in ("g1", "s=L", "L<s"):
        q, k, v = case_inputs(name)
        g, s = SHAPES[name][5:]
        np.testing.assert_allclose(cca_reference(q, k, v, g, s), causal_reference(q, k, v),
                                   rtol=0, atol=1e-12)
    q, k, v = case_inputs("G2")
    assert np.abs(cca_reference(q, k, v, 4, 6) - causal_reference(q, k, v)).max() > 0.1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pooling", ["mean", "max"])
def test_pooling_ablations_match_reference(impl, pooling):
    q, k, v = case_inputs("B2-G2-D16")
    out = run(impl, q, k, v, 3, 7, pooling)
    assert_close(out, cca_reference(q, k, v, 3, 7, pooling), F32_ATOL, pooling)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_packed_segments_match_reference(impl, pooling):
    q, k, v = make_inputs(PACKED_SHAPE, seed=9)
    seg = packed_segments()
    out = run(impl, q, k, v, 3, 5, pooling, seg)
    assert_close(out, cca_reference(q, k, v, 3, 5, pooling, seg), F32_ATOL, pooling)


# Low precision against the float64 reference evaluated on the same (rounded) inputs, so the
# error is the implementation's own rounding. Measured (max, mean) |err|, outputs O(1):
#   bfloat16: naive (7.6e-3, 3.5e-4), xla (7.6e-3, 4.8e-4). The max is the final rounding
#             (half a bf16 ulp is 7.8e-3 for |out| in [2, 4)); tolerance (1.2e-2, 1e-3):
#             1.5x on the max, 2x on the mean.
#   float16:  naive (9.7e-4, 4.4e-5), xla (9.7e-4, 6.1e-5) (half an ulp: 9.8e-4 in [2, 4));
#             tolerance (1.5e-3, 1.2e-4), 1.5x and 2x.
LOW_PRECISION_TOL = {"bfloat16": (1.2e-2, 1e-3), "float16": (1.5e-3, 1.2e-4)}
LOW_PRECISION_SHAPE = (2, 80, 4, 2, 32, 4, 10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", LOW_PRECISION_TOL)
def test_low_precision_close_to_float64_reference(impl, dtype):
    q, k, v = (jnp.asarray(x, dtype) for x in make_inputs(LOW_PRECISION_SHAPE, seed=3))
    ref = cca_reference(*(np.asarray(x, np.float64) for x in (q, k, v)), 4, 10)
    out = run(impl, q, k, v, 4, 10)
    assert out.dtype == jnp.dtype(dtype)
    err = np.abs(np.asarray(out, np.float64) - ref)
    print(f"{impl} {dtype}: max |err| {err.max():.3g}, mean {err.mean():.3g}")
    max_tol, mean_tol = LOW_PRECISION_TOL[dtype]
    assert err.max() <= max_tol and err.mean() <= mean_tol, (err.max(), err.mean())


# ---- property 4: gradients -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def grad_fn(impl, g, s, pooling="cca"):
    """jit(grad of sum(out * cot)) w.r.t. q, k, v; one compile per shape and dtype."""
    fn = IMPL_FNS[impl]

    def loss(q, k, v, cot, seg):
        out = fn(q, k, v, group_size=g, window_size=s, pooling=pooling, segment_ids=seg)
        return jnp.sum(out.astype(jnp.float32) * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _grad_inputs(shape, seed):
    q, k, v = make_inputs(shape, seed=seed)
    cot = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(np.float32)
    return q, k, v, cot


def _directions(q, k, v, g, seed):
    """Random directions in q only, k only, v only, all three, and q on the last row of each
    group only (the pooling path: those queries reach the output through the weights `a`;
    in packed rows, the rows g-1 mod g of the row, some of them group ends)."""
    rng = np.random.default_rng(seed)
    rand = lambda x: rng.standard_normal(x.shape)  # noqa: E731
    zero = np.zeros_like
    group_ends = np.zeros_like(q)
    group_ends[:, g - 1::g] = rand(q)[:, g - 1::g]
    return [(rand(q), zero(k), zero(v)), (zero(q), rand(k), zero(v)),
            (zero(q), zero(k), rand(v)), (rand(q), rand(k), rand(v)),
            (group_ends, zero(k), zero(v))]


# Analytic float32 gradients against central differences of the float64 reference, along the
# directions above. The error of <grad, dir> is measured relative to sum |grad * dir| (the scale
# of the dot product's rounding; |fd| itself can be small by chance): at most 4e-8 over all
# cases (fd's own error is ~1e-10); tolerance 4e-7, 10x. A wrong entry shows far above that:
# flipping the sign of one entry of dq moves it by 1e-5 to 8e-3 in these cases.
FD_RTOL = 4e-7
GRAD_CASES = [  # (case, pooling, packed): G = 2, 4 and 3; g = 1; s < g; packed rows
    ("B2-G2-D16", "cca", False),
    ("G2", "mean", False),
    ("s1-G3", "max", False),
    ("g1", "cca", False),
    ("packed", "cca", True),
]


def _grad_case(name, packed):
    shape = PACKED_SHAPE if packed else SHAPES[name]
    seed = 9 if packed else SEEDS[name]
    return shape, _grad_inputs(shape, seed), packed_segments() if packed else None, seed


@pytest.mark.parametrize("name,pooling,packed", GRAD_CASES)
def test_xla_gradients_match_finite_differences_of_reference(name, pooling, packed):
    """Property 4 against the independent oracle: the xla custom VJP (and the pooling's
    autodiff in front of it) along random directions, G > 1, packed rows, every pooling."""
    shape, (q, k, v, cot), seg, seed = _grad_case(name, packed)
    g, s = shape[5:]
    got = grad_fn("xla", g, s, pooling)(q, k, v, cot, seg)
    dirs = _directions(q, k, v, g, seed + 2)
    want = reference_directional_grads(q, k, v, cot, dirs, g=g, s=s, pooling=pooling,
                                       segment_ids=seg)
    have = np.array([sum(np.vdot(np.asarray(a, np.float64), b) for a, b in zip(got, d))
                     for d in dirs])
    scale = np.array([sum(np.abs(np.asarray(a, np.float64) * b).sum() for a, b in zip(got, d))
                      for d in dirs])
    rel = np.abs(have - want) / scale
    print(f"{name} {pooling}: relative error {rel.max():.3g} (tolerance {FD_RTOL})")
    assert rel.max() <= FD_RTOL, (rel, have, want)


# xla (custom VJP, blocked) against jax.grad of naive (dense autodiff), elementwise: catches
# an error confined to a few entries, which a handful of random directions would dilute.
# Measured max |err| 1.3e-6 (entries up to ~10); tolerance 5e-6, 4x.
GRAD_ATOL = 5e-6


@pytest.mark.parametrize("name,packed", [("B2-G2-D16", False), ("packed", True)])
def test_xla_gradients_equal_naive_gradients(name, packed):
    shape, (q, k, v, cot), seg, _ = _grad_case(name, packed)
    g, s = shape[5:]
    got = grad_fn("xla", g, s)(q, k, v, cot, seg)
    want = grad_fn("naive", g, s)(q, k, v, cot, seg)
    for x, a, b in zip("qkv", got, want):
        assert_close(a, b, GRAD_ATOL, f"d{x}")


def test_xla_gradients_bfloat16_close():
    """bf16 inputs and cotangent against float32 naive gradients of the same rounded values.
    Measured relative L2 error 2.9e-3 (dq), 3.2e-3 (dk), 3.1e-3 (dv); tolerance 6e-3, ~2x."""
    shape = SHAPES["B2-G2-D16"]
    q, k, v, cot = (jnp.asarray(x, jnp.bfloat16) for x in _grad_inputs(shape, 11))
    got = grad_fn("xla", 3, 7)(q, k, v, cot, None)
    want = grad_fn("naive", 3, 7)(*(x.astype(jnp.float32) for x in (q, k, v, cot)), None)
    for x, a, b in zip("qkv", got, want):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"d{x}: relative L2 error {rel:.3g}")
        assert rel < 6e-3, (x, rel)


def test_naive_gradients_match_finite_differences():
    """naive (the dense reference in JAX) in float64: its autodiff against finite differences
    of itself, through the pooling weights, G = 2."""
    from jax.test_util import check_grads
    shape = (1, 13, 2, 1, 4, 3, 4)
    q, k, v = (x.astype(np.float64) for x in make_inputs(shape, seed=5))
    with jax.enable_x64(True):
        fn = jax.jit(functools.partial(cca_attention_naive, group_size=3, window_size=4))
        check_grads(fn, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_pooling_gradient_reaches_last_query_of_group(impl):
    """Property 4: q at a group's last position gets gradient from a core token it pooled,
    and no other query before the window does."""
    shape = SHAPES["B2-G2-D16"]  # g = 3, s = 7, L = 50
    q, k, v, _ = _grad_inputs(shape, SEEDS["B2-G2-D16"])
    cot = np.zeros_like(q)
    cot[:, -1] = 1.0  # the last row sees core tokens 0..13 (ends 2, 5, .., 41), raw 42..49
    dq = grad_fn(impl, 3, 7)(q, k, v, cot, None)[0]
    dq = np.abs(np.asarray(dq)).sum(axis=(2, 3))
    ends = set(range(2, 42, 3))
    for b in range(2):
        assert all(dq[b, e] > 0 for e in ends), dq[b]
        assert all(dq[b, t] == 0 for t in range(42) if t not in ends), dq[b]


# ---- property 5: causality -----------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_causality(impl):
    """Changing inputs after t never changes out[:t+1] (t = 0, s - 1, 22, L - 2)."""
    q, k, v = case_inputs("B2-G2-D16")
    fn = functools.partial(run, impl, g=3, s=7)
    base = np.asarray(fn(q, k, v))
    for t in (0, 6, 22, 48):
        rng = np.random.default_rng(100 + t)
        q2, k2, v2 = (x.copy() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, t + 1:] = rng.standard_normal(x[:, t + 1:].shape)
        out = np.asarray(fn(q2, k2, v2))
        np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
        assert np.any(out[:, t + 1:] != base[:, t + 1:])


@pytest.mark.parametrize("impl", IMPLS)
def test_causality_with_segment_ids(impl):
    """Packed rows: changing q, k, v *and the segment ids* after t never changes out[:t+1]
    (later ids decide how long t's document is and how many groups the row pools)."""
    q, k, v = make_inputs(PACKED_SHAPE, seed=9)
    seg = packed_segments()
    fn = functools.partial(run, impl, g=3, s=5)
    base = np.asarray(fn(q, k, v, segment_ids=seg))
    for t in (3, 14, 30, 59):
        rng = np.random.default_rng(200 + t)
        q2, k2, v2, seg2 = (x.copy() for x in (q, k, v, seg))
        for x in (q2, k2, v2):
            x[:, t + 1:] = rng.standard_normal(x[:, t + 1:].shape)
        # Continue t's document a while, then new documents (ids 5..8 in random runs).
        seg2[:, t + 1:] = np.sort(rng.integers(4, 9, (2, 60 - t)), axis=1)
        seg2[:, t + 1:t + 4] = seg[:, t:t + 1]
        out = np.asarray(fn(q2, k2, v2, segment_ids=seg2))
        np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])


# ---- the public API --------------------------------------------------------------------------

def test_public_api_dispatch_and_dtype():
    assert resolve_implementation("auto", "cpu") == "xla"
    assert resolve_implementation("naive", "cpu") == "naive"
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make_inputs((1, 40, 4, 2, 8, 4, 8)))
    api = functools.partial(cca_attention, group_size=4, window_size=8)
    # Dispatch: "auto" on CPU builds exactly the program of the explicit xla implementation
    # (default blocking), and not naive's (lowering only: no compile).
    hlo = lambda fn: jax.jit(fn).lower(q, k, v).as_text()  # noqa: E731
    auto = hlo(api)
    assert auto == hlo(functools.partial(api, implementation="xla"))
    assert auto != hlo(functools.partial(api, implementation="naive"))
    # The public function traces under jit (static Python-int sizes) and is right in bf16:
    # measured max |err| 5.5e-3 against the reference on the same rounded inputs; tolerance
    # as in test_low_precision_close_to_float64_reference.
    out = jax.jit(api)(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    ref = cca_reference(*(np.asarray(x, np.float64) for x in (q, k, v)), 4, 8)
    assert_close(out, ref, LOW_PRECISION_TOL["bfloat16"][0], "public api, bf16")


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_size=0, window_size=8), "group_size"),
    (dict(group_size=4, window_size=-1), "window_size"),
    (dict(group_size=4.0, window_size=8), "group_size"),
    (dict(group_size=4, window_size=8, pooling="sum"), "pooling"),
    (dict(group_size=4, window_size=8, implementation="cuda"), "implementation"),
    (dict(group_size=4, window_size=8, segment_ids=np.zeros((1, 39), np.int32)), "segment_ids"),
    (dict(group_size=4, window_size=8, segment_ids=np.zeros((1, 40), np.float32)),
     "segment_ids"),
])
def test_bad_arguments_raise_clear_errors(kwargs, match):
    q, k, v = make_inputs((1, 40, 4, 2, 8, 4, 8))
    with pytest.raises(ValueError, match=match):
        cca_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("shapes,match", [
    (((1, 40, 4, 8), (1, 40, 3, 8), (1, 40, 3, 8)), "multiple"),
    (((1, 40, 4, 8), (1, 41, 2, 8), (1, 41, 2, 8)), "disagree"),
    (((1, 40, 4, 8), (1, 40, 2, 8), (1, 40, 2, 4)), "same shape"),
    (((40, 4, 8), (40, 2, 8), (40, 2, 8)), r"\[batch, seq, heads, head_dim\]"),
])
def test_bad_shapes_raise_clear_errors(shapes, match):
    q, k, v = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        cca_attention(q, k, v, group_size=4, window_size=8)


def test_mixed_dtypes_rejected():
    q, k, v = make_inputs((1, 40, 4, 2, 8, 4, 8))
    with pytest.raises(ValueError, match="dtype"):
        cca_attention(q, jnp.asarray(k, jnp.bfloat16), v, group_size=4, window_size=8)


def test_kernels_not_available_say_what_to_use():
    """A kernel asked for where it cannot run names the implementation that can."""
    q, k, v = make_inputs((1, 40, 4, 2, 8, 4, 8))
    wide = [jnp.zeros(x.shape[:-1] + (320,), x.dtype) for x in (q, k, v)]
    with pytest.raises(ValueError, match="implementation='xla'"):    # head_dim 320 > 256
        cca_attention(*wide, group_size=4, window_size=8, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="'xla'"):                   # no GPU here
        run_attention(q, k, v, parse_option("full"), implementation="cudnn")
