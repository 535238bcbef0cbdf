"""SPEC properties 1-5 for the `naive` and `xla` CCA implementations, and bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import cca_attention
from cca_jax.attention import cca_attention_naive, cca_attention_xla, resolve_implementation
from tests.reference import cca_reference

# (B, L, Hq, Hkv, D, g, s): L not a multiple of g, s not a multiple of g, L < s, G > 1, g = 1.
SHAPES = [
    (1, 37, 2, 1, 8, 4, 6),
    (2, 50, 4, 2, 16, 3, 7),
    (1, 45, 2, 2, 8, 4, 5),
    (1, 20, 2, 1, 8, 4, 30),     # L < s: no core tokens
    (1, 33, 4, 1, 8, 1, 3),      # g = 1
    (2, 64, 4, 4, 8, 8, 16),     # multiples everywhere
    (1, 71, 6, 2, 8, 5, 1),      # s = 1
]



def _jit(fn):
    return jax.jit(fn, static_argnames=("group_size", "window_size", "pooling"))


# xla with small blocks so that several query and core blocks (and ragged edges) occur; the
# default blocking is covered by test_public_api_dispatch_and_dtype and the model tests.
IMPLS = {
    "naive": _jit(cca_attention_naive),
    "xla": _jit(functools.partial(cca_attention_xla, block_q=16, block_c=8)),
}


def make_inputs(shape, dtype=np.float32, seed=0):
    b, length, hq, hkv, d, _, _ = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, length, hq, d)).astype(dtype)
    k = rng.standard_normal((b, length, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, length, hkv, d)).astype(dtype)
    return q, k, v


def packed_segments(b, length, seed):
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, 4, (b, length)), axis=1).astype(np.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pooling", ["cca", "mean", "max"])
def test_matches_spec_reference_float32(impl, shape, pooling):
    """Property 3: equality with an independent construction of SPEC sections 1-3."""
    q, k, v = make_inputs(shape, seed=hash((shape, pooling)) % 1000)
    g, s = shape[5], shape[6]
    out = IMPLS[impl](q, k, v, group_size=g, window_size=s, pooling=pooling)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    np.testing.assert_allclose(out, cca_reference(q, k, v, g, s, pooling), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pooling", ["cca", "mean", "max"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_segments_match_reference(impl, pooling, seed):
    shape = (2, 61, 4, 2, 8, 3, 5)
    q, k, v = make_inputs(shape, seed=seed)
    seg = packed_segments(2, 61, seed)
    out = IMPLS[impl](q, k, v, group_size=3, window_size=5, pooling=pooling, segment_ids=seg)
    ref = cca_reference(q, k, v, 3, 5, pooling, seg)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_close_to_float64_reference(impl):
    shape = (2, 80, 4, 2, 32, 4, 10)
    q, k, v = make_inputs(shape, seed=3)
    ref = cca_reference(q, k, v, 4, 10)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out = IMPLS[impl](qb, kb, vb, group_size=4, window_size=10)
    assert out.dtype == jnp.bfloat16
    err = np.abs(np.asarray(out, np.float32) - ref)
    assert err.max() < 0.05 and err.mean() < 5e-3, (err.max(), err.mean())


def causal_reference(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 37, 2, 1, 8, 1, 5), (2, 29, 4, 2, 8, 1, 1)])
def test_group_size_one_is_full_attention(impl, shape):
    """Property 1."""
    q, k, v = make_inputs(shape)
    out = IMPLS[impl](q, k, v, group_size=1, window_size=shape[6])
    np.testing.assert_allclose(out, causal_reference(q, k, v), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("s", [40, 41, 500])
def test_window_covering_sequence_is_full_attention(impl, s):
    """Property 2: s >= L means no core tokens."""
    shape = (2, 40, 4, 2, 8, 4, s)
    q, k, v = make_inputs(shape, seed=s)
    out = IMPLS[impl](q, k, v, group_size=4, window_size=s)
    np.testing.assert_allclose(out, causal_reference(q, k, v), atol=2e-5, rtol=2e-5)


def _grads(fn, q, k, v, cot, **kw):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, **kw) * cot), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:5])
@pytest.mark.parametrize("pooling", ["cca", "mean", "max"])
def test_xla_gradients_equal_reference_gradients(shape, pooling):
    """Property 4, float32: the custom VJP against jax.grad of the dense reference."""
    q, k, v = make_inputs(shape, seed=7)
    cot = np.random.default_rng(8).standard_normal(q.shape).astype(np.float32)
    kw = dict(group_size=shape[5], window_size=shape[6], pooling=pooling)
    want = _grads(cca_attention_naive, q, k, v, cot, **kw)
    got = jax.jit(lambda q, k, v: _grads(IMPLS["xla"], q, k, v, cot, **kw))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")


def test_xla_gradients_with_packed_segments():
    shape = (2, 61, 4, 2, 8, 3, 5)
    q, k, v = make_inputs(shape, seed=9)
    seg = packed_segments(2, 61, 9)
    cot = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    kw = dict(group_size=3, window_size=5, segment_ids=seg)
    want = _grads(cca_attention_naive, q, k, v, cot, **kw)
    got = _grads(IMPLS["xla"], q, k, v, cot, **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


def test_xla_gradients_bfloat16_close():
    shape = (1, 96, 4, 2, 32, 4, 12)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make_inputs(shape, seed=11))
    cot = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.bfloat16)
    kw = dict(group_size=4, window_size=12)
    want = _grads(cca_attention_naive, *(x.astype(jnp.float32) for x in (q, k, v)),
                  cot.astype(jnp.float32), **kw)
    got = _grads(IMPLS["xla"], q, k, v, cot, **kw)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


def test_naive_gradients_match_finite_differences():
    """The reference itself is differentiable through the pooling weights."""
    from jax.test_util import check_grads
    shape = (1, 13, 2, 1, 4, 3, 4)
    q, k, v = (x.astype(np.float64) for x in make_inputs(shape, seed=5))
    with jax.enable_x64(True):
        fn = functools.partial(cca_attention_naive, group_size=3, window_size=4)
        check_grads(fn, (q, k, v), order=1, modes=("rev",), atol=1e-5, rtol=1e-5)


def test_pooling_gradient_reaches_last_query_of_group():
    """Property 4: q at a group's last position gets gradient from a core token it pooled."""
    shape = (1, 24, 2, 2, 8, 4, 4)
    q, k, v = make_inputs(shape, seed=6)
    # Loss on the last row only: it sees core tokens 0..4 and raw keys 20..23.
    dq = jax.grad(lambda q: jnp.sum(cca_attention_xla(q, k, v, group_size=4, window_size=4)[
        :, -1]))(q)
    dq = np.abs(np.asarray(dq)).sum(axis=(0, 2, 3))
    assert all(dq[e] > 0 for e in (3, 7, 11, 15, 19)), dq
    assert all(dq[t] == 0 for t in range(20) if t % 4 != 3), dq


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [0, 9, 22, 39])
def test_causality(impl, t):
    """Property 5: changing inputs after t never changes out[:t+1]."""
    shape = (1, 40, 4, 2, 8, 3, 7)
    q, k, v = make_inputs(shape, seed=t)
    q2, k2, v2 = (x.copy() for x in (q, k, v))
    rng = np.random.default_rng(100 + t)
    for x in (q2, k2, v2):
        x[:, t + 1:] = rng.standard_normal(x[:, t + 1:].shape)
    fn = functools.partial(IMPLS[impl], group_size=3, window_size=7)
    np.testing.assert_array_equal(np.asarray(fn(q, k, v))[:, :t + 1],
                                  np.asarray(fn(q2, k2, v2))[:, :t + 1])


def test_public_api_dispatch_and_dtype():
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make_inputs((1, 40, 4, 2, 8, 4, 8)))
    out = cca_attention(q, k, v, group_size=4, window_size=8)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    naive = cca_attention(q, k, v, group_size=4, window_size=8, implementation="naive")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(naive, np.float32),
                               atol=0.05)
    assert resolve_implementation("auto", "cpu") == "xla"
    jitted = jax.jit(functools.partial(cca_attention, group_size=4, window_size=8))
    np.testing.assert_array_equal(np.asarray(jitted(q, k, v)), np.asarray(out))
    ref = cca_reference(*(np.asarray(x, np.float32) for x in (q, k, v)), 4, 8)
    assert np.abs(np.asarray(out, np.float32) - ref).max() < 0.05


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
    q, k, v = make_inputs((1, 40, 4, 2, 8, 4, 8))
    with pytest.raises(NotImplementedError, match="implementation='xla'"):
        cca_attention(q, k, v, group_size=4, window_size=8, implementation="pallas_tpu")
