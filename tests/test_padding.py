"""cca_jax.padding: block padding shared by the blocked XLA path and the Pallas kernels."""

import jax.numpy as jnp
import numpy as np

from cca_jax.padding import pad_row_bounds, pad_rows, round_up, softmax_delta


def test_round_up():
    assert [round_up(x, 16) for x in (0, 1, 15, 16, 17, 33)] == [0, 16, 16, 16, 32, 48]
    assert round_up(7, 1) == 7


def test_pad_rows_zero_pads_axis_1_only():
    x = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4) + 1
    y = pad_rows(x, 5)
    assert y.shape == (2, 5, 4)
    np.testing.assert_array_equal(y[:, :3], x)
    np.testing.assert_array_equal(y[:, 3:], 0)
    assert pad_rows(x, 3) is x          # nothing to pad: the same array
    assert pad_rows(jnp.zeros((1, 0, 2)), 4).shape == (1, 4, 2)   # no slots (m = 0)


def test_pad_row_bounds_padded_rows_see_only_themselves():
    raw_lo = jnp.array([[0, 0, 1, 3], [0, 1, 1, 2]], jnp.int32)
    core_lo = jnp.array([[0, 0, 0, 1], [0, 0, 2, 2]], jnp.int32)
    core_hi = jnp.array([[0, 1, 1, 2], [0, 1, 2, 3]], jnp.int32)
    rlo, clo, chi = pad_row_bounds(raw_lo, core_lo, core_hi, 7)
    assert rlo.dtype == jnp.int32 and rlo.shape == clo.shape == chi.shape == (2, 7)
    np.testing.assert_array_equal(rlo[:, 4:], [[4, 5, 6]] * 2)    # raw keys [t, t]: itself
    np.testing.assert_array_equal(clo[:, 4:], [[1] * 3, [2] * 3])  # last row's slots (edge)
    np.testing.assert_array_equal(chi[:, 4:], [[2] * 3, [3] * 3])
    for x, orig in ((rlo, raw_lo), (clo, core_lo), (chi, core_hi)):
        np.testing.assert_array_equal(x[:, :4], orig)
        assert np.all(np.diff(np.asarray(x), axis=1) >= 0)       # still non-decreasing
    same = pad_row_bounds(raw_lo, core_lo, core_hi, 4)
    assert all(a is b for a, b in zip(same, (raw_lo, core_lo, core_hi)))


def test_softmax_delta_is_float32_rowsum():
    rng = np.random.default_rng(0)
    dout = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    out = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    got = softmax_delta(jnp.asarray(dout, jnp.bfloat16), jnp.asarray(out, jnp.bfloat16))
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 5)     # [B, Hq, L]
    d16 = np.asarray(jnp.asarray(dout, jnp.bfloat16), np.float64)
    o16 = np.asarray(jnp.asarray(out, jnp.bfloat16), np.float64)
    np.testing.assert_allclose(got, np.einsum("bqhd,bqhd->bhq", d16, o16), rtol=1e-6,
                               atol=1e-6)
