"""The visibility arithmetic (cca_jax.blocks) against masks built straight from SPEC section 2."""

import itertools

import numpy as np
import pytest

from cca_jax import blocks


def spec_masks(length, g, s, segment_ids=None):
    """Raw [L, L] and per-document core visibility, from the SPEC text (one row)."""
    seg = np.zeros(length, int) if segment_ids is None else np.asarray(segment_ids)
    raw = np.zeros((length, length), bool)
    core = []  # (query t, document start, group j) triples that are visible
    for t in range(length):
        d = t
        while d > 0 and seg[d - 1] == seg[t]:
            d -= 1
        nc = max(0, (t - d + 1 - s) // g)
        raw[t, d + g * nc: t + 1] = True
        core += [(t, d, j) for j in range(nc)]
    return raw, core


@pytest.mark.parametrize("g,s", list(itertools.product([1, 2, 3, 4, 8], [1, 2, 5, 8, 13])))
def test_row_ranges_match_spec(g, s):
    length = 41
    raw, core = spec_masks(length, g, s)
    got_raw, got_core = blocks.dense_visibility(length, g, s)
    np.testing.assert_array_equal(got_raw[0], raw)
    assert sorted(zip(*np.nonzero(got_core[0]))) == sorted((t, j) for t, _, j in core)
    assert got_core.shape[-1] == blocks.num_pooled_groups(length, g, s)


@pytest.mark.parametrize("seed", range(6))
def test_row_ranges_with_segments_match_spec(seed):
    rng = np.random.default_rng(seed)
    length, g, s = 57, int(rng.integers(1, 5)), int(rng.integers(1, 9))
    seg = np.sort(rng.integers(0, 4, length))[None]
    raw, core = spec_masks(length, g, s, seg[0])
    got_raw, got_core = blocks.dense_visibility(length, g, s, seg)
    np.testing.assert_array_equal(got_raw[0], raw)
    r = blocks.row_ranges(length, g, s, seg)
    starts = np.asarray(r.group_start[0])
    # Every visible core slot is the right group: document start + j * g.
    seen = sorted((t, int(starts[c])) for t, c in zip(*np.nonzero(got_core[0])))
    assert seen == sorted((t, d + j * g) for t, d, j in core)
    for x in (r.raw_lo, r.core_lo, r.core_hi):
        assert np.all(np.diff(np.asarray(x)[0]) >= 0), "bounds must be non-decreasing"


def test_raw_window_and_core_partition_the_past():
    """Every earlier position is seen raw or through exactly one core token (SPEC 2)."""
    length, g, s = 70, 4, 6
    for t in range(length):
        nc = blocks.n_core(t, g, s)
        covered = list(range(g * nc)) + list(range(blocks.raw_start(t, g, s), t + 1))
        assert covered == list(range(t + 1))
        assert t + 1 < s or s <= t + 1 - g * nc <= s + g - 1


def test_n_core_is_truncation_safe():
    # Rows s .. s+g-2 must see no core token (the authors' Triton kernel got this wrong).
    g, s = 16, 1024
    assert all(blocks.n_core(t, g, s) == 0 for t in range(s + g - 1))
    assert blocks.n_core(s + g - 1, g, s) == 1


@pytest.mark.parametrize("g,s,bq,bk", [(1, 1, 4, 4), (4, 6, 8, 4), (3, 7, 4, 8), (4, 16, 8, 8),
                                       (16, 32, 16, 16), (2, 5, 16, 4), (5, 3, 8, 8)])
@pytest.mark.parametrize("length", [1, 37, 64])
def test_block_bounds_cover_exactly_the_visible_keys(g, s, bq, bk, length):
    raw, core = blocks.dense_visibility(length, g, s)
    raw, core = raw[0], core[0]
    m = core.shape[1]
    for qb in range(-(-length // bq)):
        rows = slice(qb * bq, min((qb + 1) * bq, length))
        first, ffirst, flast, last = blocks.raw_block_bounds(qb, bq, bk, length, g, s)
        assert first <= ffirst <= flast <= last
        for kb in range(-(-length // bk)):
            cols = slice(kb * bk, min((kb + 1) * bk, length))
            tile = raw[rows, cols]
            assert (first <= kb < last) == bool(tile.any()), (qb, kb)
            full = tile.all() and cols.stop - cols.start == bk
            if ffirst <= kb < flast:
                assert full, (qb, kb)
        cfirst, cffirst, cflast, clast = blocks.core_block_bounds(qb, bq, bk, length, g, s)
        assert cfirst <= cffirst <= cflast <= clast
        for cb in range(-(-max(m, 1) // bk)):
            tile = core[rows, cb * bk:(cb + 1) * bk]
            assert (cfirst <= cb < clast) == bool(tile.any()), (qb, cb)
            if cffirst <= cb < cflast:
                assert tile.all() and tile.shape[1] == bk, (qb, cb)


def test_core_block_bounds_are_analytic_for_traced_values():
    import jax
    import jax.numpy as jnp
    fn = jax.jit(lambda i: jnp.stack(blocks.raw_block_bounds(i, 64, 64, 4096, 16, 1024)
                                     + blocks.core_block_bounds(i, 64, 64, 4096, 16, 1024)))
    for i in (0, 17, 63):
        want = blocks.raw_block_bounds(i, 64, 64, 4096, 16, 1024) + blocks.core_block_bounds(
            i, 64, 64, 4096, 16, 1024)
        assert tuple(int(x) for x in fn(i)) == tuple(want)


# ---- query blocks per key block / core block (backward kernels) ----------------------------

def _rows_seeing(raw, core):
    """Per key / per slot, the rows that see it, straight from the dense masks."""
    return raw.T, core.T


@pytest.mark.parametrize("g,s,bq,bk", [(1, 1, 4, 4), (4, 6, 8, 4), (3, 7, 4, 8), (4, 16, 8, 8),
                                       (2, 5, 16, 4), (5, 3, 8, 8)])
@pytest.mark.parametrize("length,seed", [(37, None), (64, None), (53, 0), (61, 1)])
def test_row_blocks_for_key_blocks_cover_exactly_the_visible_rows(g, s, bq, bk, length, seed):
    seg = None
    if seed is not None:
        rng = np.random.default_rng(seed)
        seg = np.sort(rng.integers(0, 3, length))[None]
    raw, core = blocks.dense_visibility(length, g, s, seg)
    raw, core = raw[0], core[0]
    r = blocks.row_ranges(length, g, s, seg)
    raw_lo = np.broadcast_to(np.asarray(r.raw_lo), (1, length))
    core_lo = np.broadcast_to(np.asarray(r.core_lo), (1, length))
    core_hi = np.broadcast_to(np.asarray(r.core_hi), (1, length))
    m = core.shape[1]
    num_slots = -(-max(m, 1) // bk) * bk          # padded like the kernels do
    last_row = np.asarray(blocks.raw_key_rows(raw_lo))[0]
    first_row, end_row = (np.asarray(x)[0] for x in blocks.core_slot_rows(core_lo, core_hi,
                                                                          num_slots))
    # The kernels read a block's bounds as its first and last entries.
    for x in (last_row, first_row, end_row):
        assert np.all(np.diff(x) >= 0), "per-key/slot row bounds must be non-decreasing"
    # Per member: exactly the rows that see it.
    for u in range(length):
        np.testing.assert_array_equal(np.nonzero(raw[:, u])[0], np.arange(u, last_row[u] + 1))
    for c in range(num_slots):
        want = np.nonzero(core[:, c])[0] if c < m else np.zeros(0, int)
        np.testing.assert_array_equal(want, np.arange(first_row[c], end_row[c] + 1))
    nq = -(-length // bq)

    def check(tile_fn, bounds, tight):
        first, ffirst, flast, last = (int(x) for x in bounds)
        assert first <= ffirst <= flast <= last
        for qb in range(nq):
            tile = tile_fn(slice(qb * bq, min((qb + 1) * bq, length)))
            if tile.any():
                assert first <= qb < last, qb
            elif tight:
                assert not first <= qb < last, qb
            if ffirst <= qb < flast:
                assert tile.all() and tile.shape[0] == bq, qb

    for kb in range(-(-length // bk)):
        k0, k1 = kb * bk, min((kb + 1) * bk, length) - 1
        bounds = blocks.row_blocks_for_interval(k0, k1, last_row[k0], last_row[k1], bq)
        full_width = k1 - k0 + 1 == bk
        check(lambda rows: raw[rows, k0:k1 + 1] if full_width else
              np.pad(raw[rows, k0:k1 + 1], ((0, 0), (0, bk - (k1 - k0 + 1)))),
              bounds, tight=True)
    padded_core = np.pad(core, ((0, 0), (0, num_slots - m)))
    for cb in range(num_slots // bk):
        c0, c1 = cb * bk, (cb + 1) * bk - 1
        bounds = blocks.row_blocks_for_interval(first_row[c0], first_row[c1], end_row[c0],
                                                end_row[c1], bq)
        check(lambda rows: padded_core[rows, c0:c1 + 1], bounds, tight=seg is None)


def test_row_blocks_for_interval_traced():
    import jax
    import jax.numpy as jnp
    fn = jax.jit(lambda a0, a1, b0, b1: jnp.stack(blocks.row_blocks_for_interval(
        a0, a1, b0, b1, 64)))
    for args in [(0, 63, 1100, 1163), (4096, 4159, 131071, 131071), (5, 9, 4, 4)]:
        assert tuple(int(x) for x in fn(*args)) == tuple(
            blocks.row_blocks_for_interval(*args, 64))


@pytest.mark.parametrize("g,s,length", [(1, 1, 30), (4, 6, 41), (3, 7, 5), (16, 32, 200)])
def test_visible_score_count_matches_dense_masks(g, s, length):
    raw, core = blocks.dense_visibility(length, g, s)
    assert blocks.visible_score_count(length, g, s) == int(raw.sum() + core.sum())
