"""The visibility arithmetic (cca_jax.blocks) against brute-force constructions from SPEC text.

The brute force below never uses the `n_core` formula: a group becomes a core token once its
last token is `s` positions back (SPEC 4: "visible ... from t = (j+1)*g + s - 1 on"), and the
raw window starts where the visible groups end (SPEC 2: no overlap, no gap). The other
options (full, sliding, streaming), and the KV cache's ring and slots, are checked against the
per-query oracle of `tests/visibility_oracle.py` (also written from SPEC, not from `blocks`).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from tests import visibility_oracle as oracle


# ---- brute force from the SPEC text --------------------------------------------------------

def brute_n_core(p, g, s):
    """Core tokens visible at in-document position p: the groups j with p >= (j+1)g + s - 1
    (SPEC 4), i.e. whose last token (j+1)g - 1 is at least s positions before p."""
    return sum(1 for j in range(p // g + 1) if p >= (j + 1) * g + s - 1)


def brute_raw_start(p, g, s):
    """The smallest u such that every position before u is inside a visible core group."""
    covered = {u for j in range(brute_n_core(p, g, s)) for u in range(j * g, (j + 1) * g)}
    u = 0
    while u in covered:
        u += 1
    return u


def documents(segment_ids, length):
    """(start, end) of each maximal run of equal ids."""
    seg = np.zeros(length, int) if segment_ids is None else np.asarray(segment_ids)
    starts = [t for t in range(length) if t == 0 or seg[t] != seg[t - 1]]
    return list(zip(starts, starts[1:] + [length]))


def spec_masks(length, g, s, segment_ids=None):
    """Raw `[L, L]` and core `[L, m]` visibility of one row, from the SPEC text.

    Core slots are the pooled groups of all documents back to back in position order; a
    document of n tokens pools max(0, (n - s) // g) groups (SPEC 1). Also returns, per slot,
    the first position of its group.
    """
    docs = documents(segment_ids, length)
    pooled = [max(0, (d1 - d0 - s) // g) for d0, d1 in docs]
    offsets = np.concatenate([[0], np.cumsum(pooled)]).astype(int)
    raw = np.zeros((length, length), bool)
    core = np.zeros((length, offsets[-1]), bool)
    group_start = [d0 + j * g for (d0, _), n in zip(docs, pooled) for j in range(n)]
    for (d0, d1), off in zip(docs, offsets):
        for t in range(d0, d1):
            p = t - d0
            raw[t, d0 + brute_raw_start(p, g, s): t + 1] = True
            core[t, off: off + brute_n_core(p, g, s)] = True
    return raw, core, group_start


def test_brute_force_partitions_the_past():
    """The brute force itself has SPEC 2's properties (so it is a fair oracle): every earlier
    position is seen raw or through exactly one core token, and the window holds s .. s+g-1
    tokens once p >= s - 1 (all of 0..p before)."""
    for g, s in itertools.product([1, 2, 3, 4, 5], [1, 2, 3, 5, 6, 8]):
        for p in range(40):
            nc, u = brute_n_core(p, g, s), brute_raw_start(p, g, s)
            assert u == g * nc and (nc == 0 or (nc * g - 1) + s <= p)
            window = p + 1 - u
            assert (window == p + 1) if p < s - 1 else (s <= window <= s + g - 1), (g, s, p)


# ---- every option against the per-query oracle ----------------------------------------------

ORACLE_PATTERNS = [
    blocks.parse_option("full"),
    *[blocks.parse_option("sliding", window_size=w) for w in (1, 2, 5, 7)],
    *[blocks.parse_option("streaming", window_size=w, sink_tokens=n)
      for w, n in ((1, 1), (3, 0), (4, 2), (5, 3), (2, 6))],
    *[blocks.CCA(g, s) for g, s in ((1, 3), (3, 5), (4, 2), (2, 7))],
]


def _pattern_id(p):
    return f"{p.kind}-g{p.group_size}-w{p.window_size}-n{p.sink_tokens}"


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS, ids=_pattern_id)
def test_oracle_sees_every_spec_key_exactly_once(pattern):
    """The oracle is fair: each key SPEC's one-line rule says query p attends to is seen
    raw or inside exactly one slot, and nothing else is; windows hold W keys (sliding,
    streaming) or s .. s+g-1 (cca)."""
    for p in range(30):
        count = np.zeros(p + 1, int)
        for u in range(p + 1):
            count[u] += oracle.sees_raw(pattern, p, u)
        for c in oracle.slots_seen(pattern, p):
            count[oracle.slot_tokens(pattern, c)] += 1
        want = [oracle.spec_sees(pattern, p, u) for u in range(p + 1)]
        np.testing.assert_array_equal(count, want, err_msg=f"p={p}")
        window = sum(oracle.sees_raw(pattern, p, u) for u in range(p + 1))
        if pattern.kind in ("sliding", "streaming"):
            assert window == min(p + 1, pattern.window_size)
        if pattern.kind == "cca":
            g, s = pattern.group_size, pattern.window_size
            assert window == p + 1 if p < s - 1 else s <= window <= s + g - 1


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS, ids=_pattern_id)
@pytest.mark.parametrize("packed", [False, True])
def test_pattern_ranges_match_the_oracle(pattern, packed):
    """`pattern_ranges` / `pattern_dense_visibility` (every option, with and without
    segment_ids, an id reused by two documents) against the per-query oracle: raw keys,
    slots (documents back to back) and the first token of each slot."""
    length = 29
    seg = (np.repeat([3, 1, 3, 0], [6, 11, 2, 10]) if packed else None)
    raw, slot, start = oracle.dense_masks(pattern, length, seg)
    got_raw, got_slot = blocks.pattern_dense_visibility(
        pattern, length, None if seg is None else seg[None])
    np.testing.assert_array_equal(got_raw[0], raw)
    m = slot.shape[1]
    assert got_slot.shape[2] >= m
    np.testing.assert_array_equal(got_slot[0][:, :m], slot)
    assert not got_slot[0][:, m:].any()
    if packed:
        r = blocks.pattern_ranges(pattern, length, seg[None])
        np.testing.assert_array_equal(np.asarray(r.group_start[0])[:m], start)
    else:
        assert pattern.max_slots(length) == m
        assert pattern.visible_scores(length) == raw.sum() + slot.sum()


# ---- n_core and raw_start --------------------------------------------------------------------

GS = list(itertools.product([1, 2, 3, 4, 5, 16], [1, 2, 3, 5, 6, 8, 17]))


def test_n_core_and_raw_start_match_brute_force():
    """On Python ints, numpy and jnp arrays, eager and under jit."""
    p = np.arange(60)
    jitted = jax.jit(lambda p, g, s: (blocks.n_core(p, g, s), blocks.raw_start(p, g, s)))
    for g, s in GS:
        want_nc = np.array([brute_n_core(int(x), g, s) for x in p])
        want_u = np.array([brute_raw_start(int(x), g, s) for x in p])
        assert [blocks.n_core(int(x), g, s) for x in p] == list(want_nc), (g, s)
        assert [blocks.raw_start(int(x), g, s) for x in p] == list(want_u), (g, s)
        assert isinstance(blocks.n_core(5, g, s), int)
        for arr in (p, jnp.asarray(p, jnp.int32)):
            np.testing.assert_array_equal(blocks.n_core(arr, g, s), want_nc)
            np.testing.assert_array_equal(blocks.raw_start(arr, g, s), want_u)
        nc, u = jitted(jnp.asarray(p, jnp.int32), jnp.int32(g), jnp.int32(s))
        np.testing.assert_array_equal(nc, want_nc)
        np.testing.assert_array_equal(u, want_u)


class TruncDivArray(np.ndarray):
    """Integer array whose `//` divides like C, Triton and `lax.div`: truncating toward zero."""
    divisions = 0

    def __floordiv__(self, other):
        TruncDivArray.divisions += 1
        a = jnp.asarray(np.asarray(self), jnp.int32)
        return np.asarray(jax.lax.div(a, jnp.asarray(other, jnp.int32))).view(TruncDivArray)


def test_n_core_is_truncation_safe():
    """n_core (and raw_start) give the floor-division result even when `//` truncates, as it
    does in C, Triton and `lax.div`, including rows with t + 1 - s < 0. Rows s .. s+g-2 must
    see no core token (the authors' Triton kernel got this wrong)."""
    minus_one = np.array([-1, -5, 7]).view(TruncDivArray) // 4
    assert list(minus_one) == [0, -1, 1]  # the harness truncates (flooring gives -1, -2, 1)
    t = np.arange(0, 300).view(TruncDivArray)
    for g, s in [(16, 64), (16, 17), (4, 6), (3, 1), (1, 5), (5, 3), (7, 100)]:
        TruncDivArray.divisions = 0
        nc = blocks.n_core(t, g, s)
        assert TruncDivArray.divisions, "n_core no longer divides with `//`: recheck this"
        TruncDivArray.divisions = 0
        u = blocks.raw_start(t, g, s)
        assert TruncDivArray.divisions, "raw_start no longer divides with `//`: recheck this"
        x = np.asarray(t) + 1 - s
        floor_nc = np.maximum(np.floor_divide(x, g), 0)  # SPEC 2 with floor division
        np.testing.assert_array_equal(np.asarray(nc), floor_nc)
        np.testing.assert_array_equal(np.asarray(u), g * floor_nc)
        assert (s == 1 or np.any(x < 0)) and np.all(np.asarray(nc)[s - 1: s + g - 1] == 0)
    g, s = 16, 1024
    assert all(blocks.n_core(t, g, s) == 0 for t in range(s + g - 1))
    assert blocks.n_core(s + g - 1, g, s) == 1


# ---- row ranges and dense visibility ---------------------------------------------------------

@pytest.mark.parametrize("g,s", [(1, 1), (1, 5), (2, 2), (3, 8), (4, 13), (4, 5), (8, 2),
                                 (8, 8), (5, 1), (2, 13)])
def test_row_ranges_match_spec(g, s):
    length = 41
    raw, core, _ = spec_masks(length, g, s)
    got_raw, got_core = blocks.pattern_dense_visibility(blocks.CCA(g, s), length)
    np.testing.assert_array_equal(got_raw[0], raw)
    np.testing.assert_array_equal(got_core[0], core)


@pytest.mark.parametrize("seed", range(4))
def test_row_ranges_with_segments_match_spec(seed):
    rng = np.random.default_rng(seed)
    length, g, s = 57, int(rng.integers(1, 5)), int(rng.integers(1, 9))
    seg = np.sort(rng.integers(0, 4, length))[None]
    if seed == 3:   # an id reused by two documents that are not adjacent
        seg = np.repeat([2, 0, 2, 1], [9, 3, 30, 15])[None]
    raw, core, group_start = spec_masks(length, g, s, seg[0])
    got_raw, got_core = blocks.pattern_dense_visibility(blocks.CCA(g, s), length, seg)
    np.testing.assert_array_equal(got_raw[0], raw)
    m = core.shape[1]   # the slots real documents pool; the row may reserve more
    np.testing.assert_array_equal(got_core[0][:, :m], core)
    assert not got_core[0][:, m:].any()
    r = blocks.pattern_ranges(blocks.CCA(g, s), length, seg)
    np.testing.assert_array_equal(np.asarray(r.group_start[0])[:m], group_start)
    for x in (r.raw_lo, r.core_lo, r.core_hi):
        assert np.all(np.diff(np.asarray(x)[0]) >= 0), "bounds must be non-decreasing"


# ---- block bounds (forward kernels: key blocks per query block) -----------------------------

def check_block_range(bounds, tiles, tight=True):
    """`bounds` = (first, full_first, full_last, last) over blocks 0..len(tiles)-1.

    Visit `[first, last)` must contain every block whose tile has a visible entry (exactly
    those when `tight`); `[full_first, full_last)` only full-size tiles that are all visible.
    """
    first, ffirst, flast, last = (int(x) for x in bounds)
    assert first <= ffirst <= flast <= last
    for i, (tile, full_size) in enumerate(tiles):
        if tile.any():
            assert first <= i < last, (i, bounds)
        elif tight:
            assert not first <= i < last, (i, bounds)
        if ffirst <= i < flast:
            assert full_size and tile.all(), (i, bounds)


def raw_tiles(raw, rows, bk):
    length = raw.shape[1]
    return [(raw[rows, kb * bk: (kb + 1) * bk], (kb + 1) * bk <= length)
            for kb in range(-(-length // bk))]


def core_tiles(core, rows, bc):
    m = core.shape[1]
    return [(core[rows, cb * bc: (cb + 1) * bc], (cb + 1) * bc <= m)
            for cb in range(-(-max(m, 1) // bc))]


@pytest.mark.parametrize("g,s,bq,bk", [(1, 1, 4, 4), (4, 6, 8, 4), (3, 7, 4, 8), (16, 32, 16, 16),
                                       (2, 5, 16, 4), (5, 3, 8, 8)])
@pytest.mark.parametrize("length", [1, 37, 64])
def test_block_bounds_cover_exactly_the_visible_keys(g, s, bq, bk, length):
    raw, core, _ = spec_masks(length, g, s)
    for qb in range(-(-length // bq)):
        r0, r1 = qb * bq, min((qb + 1) * bq, length) - 1
        rows = slice(r0, r1 + 1)
        bounds = blocks.raw_block_bounds(blocks.CCA(g, s), qb, bq, bk, length)
        assert bounds == blocks.raw_blocks_for_rows(r0, r1, blocks.raw_start(r0, g, s),
                                                    blocks.raw_start(r1, g, s), bk)
        check_block_range(bounds, raw_tiles(raw, rows, bk))
        cbounds = blocks.core_block_bounds(blocks.CCA(g, s), qb, bq, bk, length)
        assert cbounds == blocks.core_blocks_for_rows(0, 0, blocks.n_core(r0, g, s),
                                                      blocks.n_core(r1, g, s), bk)
        check_block_range(cbounds, core_tiles(core, rows, bk))


def test_block_bounds_traced_and_at_paper_sizes():
    """Paper sizes (L = 4096, g = 16, s = 1024, blocks of 64): the bounds against the SPEC
    brute force, and the same arithmetic traced under jit (the kernels compute it from
    program ids) gives the Python-int values; that part alone is not a numeric check, it
    tests that the bounds trace (no Python control flow on values)."""
    length, g, s, b = 4096, 16, 1024, 64
    pattern = blocks.CCA(g, s)
    fn = jax.jit(lambda i: jnp.stack(blocks.raw_block_bounds(pattern, i, b, b, length)
                                     + blocks.core_block_bounds(pattern, i, b, b, length)))
    n_slots = max(0, (length - s) // g)
    for qb in (0, 16, 17, 18, 63):
        rows = range(qb * b, (qb + 1) * b)
        raw = np.zeros((b, length), bool)
        core = np.zeros((b, n_slots), bool)
        for i, t in enumerate(rows):
            raw[i, brute_raw_start(t, g, s): t + 1] = True
            core[i, :brute_n_core(t, g, s)] = True
        want = blocks.raw_block_bounds(blocks.CCA(g, s), qb, b, b, length)
        check_block_range(want, raw_tiles(raw, slice(None), b))
        cwant = blocks.core_block_bounds(blocks.CCA(g, s), qb, b, b, length)
        check_block_range(cwant, core_tiles(core, slice(None), b))
        assert tuple(int(x) for x in fn(qb)) == tuple(want) + tuple(cwant)


# ---- query blocks per key block / core block (backward kernels) ----------------------------

@pytest.mark.parametrize("g,s,bq,bk", [(1, 1, 4, 4), (4, 6, 8, 4), (3, 7, 4, 8), (2, 5, 16, 4),
                                       (5, 3, 8, 8)])
# Packed rows have the length of test_row_ranges_with_segments_match_spec: eager jnp compiles
# each op once per shape, so shared lengths are cheap.
@pytest.mark.parametrize("length,seed", [(37, None), (64, None), (57, 0), (57, 1)])
def test_row_blocks_for_key_blocks_cover_exactly_the_visible_rows(g, s, bq, bk, length, seed):
    seg = None
    if seed is not None:
        rng = np.random.default_rng(seed)
        seg = np.sort(rng.integers(0, 3, length))[None]
    raw, core, _ = spec_masks(length, g, s, None if seg is None else seg[0])
    r = blocks.pattern_ranges(blocks.CCA(g, s), length, seg)
    raw_lo, core_lo, core_hi = (np.broadcast_to(np.asarray(x), (1, length))
                                for x in (r.raw_lo, r.core_lo, r.core_hi))
    m = core.shape[1]
    num_slots = -(-max(m, 1) // bk) * bk          # padded like the kernels do
    last_row = np.asarray(blocks.raw_key_rows(raw_lo))[0]
    first_row, end_row = (np.asarray(x)[0] for x in blocks.core_slot_rows(core_lo, core_hi,
                                                                          num_slots))
    # Asked for some keys / slots only (the Mosaic tables ask for each block's two ends).
    some = np.array([length - 1, 0, length // 2, 0])
    np.testing.assert_array_equal(np.asarray(blocks.raw_key_rows(raw_lo, some))[0],
                                  last_row[some])
    some = np.array([num_slots - 1, 0, num_slots // 2])
    for got, want in zip(blocks.core_slot_rows(core_lo, core_hi, num_slots, some),
                         (first_row, end_row)):
        np.testing.assert_array_equal(np.asarray(got)[0], want[some])
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

    def row_tiles(mask, cols, width):
        tiles = []
        for qb in range(nq):
            tile = mask[qb * bq: (qb + 1) * bq, cols]
            tiles.append((np.pad(tile, ((0, 0), (0, width - tile.shape[1]))),
                          tile.shape[0] == bq))
        return tiles

    for kb in range(-(-length // bk)):
        k0, k1 = kb * bk, min((kb + 1) * bk, length) - 1
        bounds = blocks.row_blocks_for_interval(k0, k1, last_row[k0], last_row[k1], bq)
        check_block_range(bounds, row_tiles(raw, slice(k0, k1 + 1), bk))
    padded_core = np.pad(core, ((0, 0), (0, num_slots - m)))
    for cb in range(num_slots // bk):
        c0, c1 = cb * bk, (cb + 1) * bk - 1
        bounds = blocks.row_blocks_for_interval(first_row[c0], first_row[c1], end_row[c0],
                                                end_row[c1], bq)
        # Packed: a document's slots may go unseen by the rows between, so not tight.
        check_block_range(bounds, row_tiles(padded_core, slice(c0, c1 + 1), bk),
                          tight=seg is None)


def test_row_blocks_for_interval_traced_and_at_paper_sizes():
    """Members x0 < x1 of a key/slot block are seen by rows [a0, b0] and [a1, b1]: rows in
    [a0, b1] see some member, rows in [a1, b0] see all. Checked at large sizes against that
    brute force, and traced under jit against the Python-int values (that part tests that
    the arithmetic traces, not the numbers)."""
    bq = 64
    fn = jax.jit(lambda a0, a1, b0, b1: jnp.stack(blocks.row_blocks_for_interval(
        a0, a1, b0, b1, bq)))
    for a0, a1, b0, b1 in [(0, 63, 1100, 1163), (4096, 4159, 131071, 131071),
                           (1000, 1030, 1200, 1300), (5, 9, 4, 4)]:
        want = blocks.row_blocks_for_interval(a0, a1, b0, b1, bq)
        first, ffirst, flast, last = want
        some = {t // bq for t in range(a0, b1 + 1)}
        if some:
            assert set(range(first, last)) == some, want
        allrows = {qb for qb in range(b1 // bq + 1)
                   if a1 <= qb * bq and (qb + 1) * bq - 1 <= b0}
        assert set(range(ffirst, flast)) == allrows, want
        assert tuple(int(x) for x in fn(a0, a1, b0, b1)) == tuple(want)


@pytest.mark.parametrize("g,s,length", [(1, 1, 30), (4, 6, 41), (3, 7, 5), (16, 32, 200)])
def test_visible_scores_match_spec(g, s, length):
    want = sum(brute_n_core(t, g, s) + t + 1 - brute_raw_start(t, g, s) for t in range(length))
    assert blocks.CCA(g, s).visible_scores(length) == want


# ---- decode bounds (the Pallas GPU decode kernel) ------------------------------------------

DECODE_PATTERNS = [
    blocks.CCA(4, 6),
    blocks.CCA(16, 8),
    blocks.parse_option("sliding", window_size=7),
    blocks.parse_option("streaming", window_size=7, sink_tokens=3),
    blocks.parse_option("full"),
]


@pytest.mark.parametrize("pattern", DECODE_PATTERNS, ids=lambda p: p.kind)
@pytest.mark.parametrize("max_len", [23, 64])
def test_decode_bounds_match_the_dense_cache_masks(pattern, max_len):
    ring, num_slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    t = np.arange(max_len)
    bounds = blocks.decode_bounds(pattern, t, ring, num_slots)
    entries = (bounds.ring_first[:, None] + np.arange(ring)) % ring
    raw = np.zeros((max_len, ring), bool)
    for row in range(max_len):
        assert 1 <= bounds.ring_count[row] <= ring
        raw[row, entries[row, :bounds.ring_count[row]]] = True
    want_raw, want_slots = oracle.cache_masks(pattern, t, ring, num_slots)
    np.testing.assert_array_equal(raw, want_raw)
    np.testing.assert_array_equal(blocks.cache_raw_visible(pattern, t, ring), want_raw)
    # The newest visible entry holds the query's own position.
    np.testing.assert_array_equal((bounds.ring_first + bounds.ring_count - 1) % ring, t % ring)
    slots = np.arange(num_slots) < bounds.num_slots[:, None]
    np.testing.assert_array_equal(slots, want_slots)
    np.testing.assert_array_equal(blocks.cache_slot_visible(pattern, t, num_slots), want_slots)
    traced = jax.jit(lambda t: blocks.decode_bounds(pattern, t, ring, num_slots))(
        jnp.asarray(t, jnp.int32))
    for got, want in zip(traced, bounds):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.dtype == jnp.int32


def test_decode_bounds_clip_slots_to_the_cache_and_take_python_ints():
    pattern = blocks.CCA(16, 1024)
    assert blocks.decode_bounds(pattern, 1024 + 16 * 100, 1040, 64).num_slots == 64
    first, count, slots = blocks.decode_bounds(pattern, 131071, 1040, 8192)
    assert (int(first), int(count), int(slots)) == (
        (16 * 8128) % 1040, 131071 - 16 * 8128 + 1, 8128)


# ---- visit tables on a static grid (the Pallas TPU kernels' scalar prefetch) ---------------

TABLE_PATTERNS = [blocks.CCA(4, 6), blocks.CCA(3, 13), blocks.CCA(1, 2),
                  blocks.parse_option("sliding", window_size=9),
                  blocks.parse_option("streaming", window_size=7, sink_tokens=3),
                  blocks.parse_option("full")]


def _padded_bounds(pattern, length, padded, seg):
    from cca_jax.padding import pad_row_bounds
    r = blocks.pattern_ranges(pattern, length, seg)
    b = 1 if seg is None else seg.shape[0]
    bounds = [jnp.broadcast_to(x, (b, length)).astype(jnp.int32)
              for x in (r.raw_lo, r.core_lo, r.core_hi)]
    return [np.asarray(x) for x in pad_row_bounds(*bounds, padded)]


@pytest.mark.parametrize("pattern", TABLE_PATTERNS, ids=lambda p: f"{p.kind}{p.group_size}")
@pytest.mark.parametrize("length,packed,bq,bk,bc", [(45, False, 8, 8, 8), (64, False, 16, 8, 4),
                                                   (57, True, 8, 16, 8)])
def test_visit_tables_cover_exactly_the_visible_blocks(pattern, length, packed, bq, bk, bc):
    """Dense masks from the padded row bounds against the tables of the TPU kernels: forward
    and dq (key and slot blocks per query block), dk/dv (query blocks per key block), dck/dcv
    (query blocks per slot block), and the static step bounds hold for every packing."""
    rng = np.random.default_rng(length + bq)
    seg = np.sort(rng.integers(0, 4, (2, length)), axis=1) if packed else None
    unit = int(np.lcm.reduce([bq, bk]))
    padded = -(-length // unit) * unit
    m = pattern.max_slots(length, packed=packed)
    slots = -(-max(m, 1) // bc) * bc
    raw_lo, core_lo, core_hi = _padded_bounds(pattern, length, padded, seg)
    t = np.arange(padded)
    raw = (t[None, None] >= raw_lo[..., None]) & (t[None, None] <= t[None, :, None])
    c = np.arange(slots)
    core = (c >= core_lo[..., None]) & (c < core_hi[..., None])
    nq, nk, nc = padded // bq, padded // bk, slots // bc
    width = blocks.widest_window(pattern, length)
    raw_steps, core_steps = blocks.query_block_steps(width, padded, bq, bk, nc)
    key_steps = blocks.key_block_steps(width, padded, bk, bq)
    fwd = blocks.query_block_visits(raw_lo, core_lo, core_hi, bq, bk, bc)
    traced = blocks.query_block_visits(*map(jnp.asarray, (raw_lo, core_lo, core_hi)), bq, bk, bc)
    np.testing.assert_array_equal(np.asarray(traced), fwd)
    keys = np.asarray(blocks.key_block_visits(jnp.asarray(raw_lo), bk, bq))
    slot_visits = np.asarray(blocks.slot_block_visits(jnp.asarray(core_lo),
                                                      jnp.asarray(core_hi), slots, bc, bq))
    for b in range(raw_lo.shape[0]):
        for qb in range(nq):
            rows = slice(qb * bq, (qb + 1) * bq)
            check_block_range(fwd[b, qb, :4], [(raw[b, rows, j * bk:(j + 1) * bk], True)
                                               for j in range(nk)])
            check_block_range(fwd[b, qb, 4:], [(core[b, rows, j * bc:(j + 1) * bc], True)
                                               for j in range(nc)], tight=not packed)
            assert fwd[b, qb, 3] - fwd[b, qb, 0] <= raw_steps
            assert fwd[b, qb, 7] - fwd[b, qb, 4] <= core_steps
        for kb in range(nk):
            check_block_range(keys[b, kb], [(raw[b, i * bq:(i + 1) * bq, kb * bk:(kb + 1) * bk],
                                             True) for i in range(nq)])
            assert keys[b, kb, 3] - keys[b, kb, 0] <= key_steps
        for cb in range(nc):
            check_block_range(slot_visits[b, cb],
                              [(core[b, i * bq:(i + 1) * bq, cb * bc:(cb + 1) * bc], True)
                               for i in range(nq)], tight=not packed)


def test_visit_steps_at_paper_sizes():
    """128K, g = 16, s = 1024, blocks of 512: a query block visits at most 4 raw key blocks
    (the window of s + g - 1 keys plus its own rows) and the 16 blocks of 8128 slots; a raw
    key block is seen by at most 4 query blocks."""
    pattern, length = blocks.CCA(16, 1024), 131072
    nc = -(-pattern.max_slots(length) // 512)
    width = blocks.widest_window(pattern, length)
    assert blocks.query_block_steps(width, length, 512, 512, nc) == (4, 16)
    assert blocks.key_block_steps(width, length, 512, 512) == 4


@pytest.mark.parametrize("pattern", DECODE_PATTERNS, ids=lambda p: p.kind)
@pytest.mark.parametrize("max_len,block_r,block_c", [(23, 4, 2), (64, 16, 8), (64, 5, 3)])
def test_decode_block_visits_hold_the_visible_entries(pattern, max_len, block_r, block_c):
    """The TPU decode kernel's walk: every visible ring entry and slot lies in a visited block,
    the visited blocks exist, and `ring_entry_visible` is the oracle's ring mask."""
    ring, num_slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    t = np.arange(max_len)
    bounds = blocks.decode_bounds(pattern, t, ring, num_slots)
    table = blocks.decode_block_visits(bounds, ring, block_r, block_c)
    traced = jax.jit(lambda b: blocks.decode_block_visits(b, ring, block_r, block_c))(
        blocks.DecodeBounds(*map(jnp.asarray, bounds)))
    np.testing.assert_array_equal(np.asarray(traced), table)
    entries = np.arange(-(-ring // block_r) * block_r)
    visible = blocks.ring_entry_visible(entries[None], bounds.ring_first[:, None],
                                        bounds.ring_count[:, None], ring)
    np.testing.assert_array_equal(visible[:, :ring],
                                  oracle.cache_masks(pattern, t, ring, num_slots)[0])
    assert not visible[:, ring:].any()
    block_first, ring_blocks, slot_blocks = table[:, 3], table[:, 4], table[:, 5]
    assert np.all(ring_blocks >= 1) and np.all(block_first + ring_blocks <= -(-ring // block_r))
    visited = ((entries[None] // block_r >= block_first[:, None])
               & (entries[None] // block_r < (block_first + ring_blocks)[:, None]))
    assert not np.any(visible & ~visited)
    assert np.all(slot_blocks * block_c >= bounds.num_slots)
    assert np.all(slot_blocks <= -(-num_slots // block_c))


# ---- narrow edge blocks (the Pallas GPU kernels' raw walks) ---------------------------------

@pytest.mark.parametrize("pattern", [blocks.CCA(4, 16, 3), blocks.CCA(3, 5, 0),
                                     blocks.CCA(4, 32, 6), blocks.Streaming(9, 2)])
@pytest.mark.parametrize("packed", [False, True])
def test_narrow_edges_still_visit_every_visible_key(pattern, packed):
    """With a narrow head (query blocks' raw walks) or tail (key blocks' walks over query
    blocks) split off, the narrow block plus the remaining blocks still hold every visible
    (row, key), the unmasked middle stays all visible, and the narrow cases do occur."""
    length, bq, bk, narrow = 96, 16, 16, 4
    seg = np.repeat([0, 1], [41, 55])[None] if packed else None
    raw, _ = blocks.pattern_dense_visibility(pattern, length, seg)
    raw = raw[0]
    raw_lo = np.asarray(blocks.pattern_ranges(pattern, length, seg).raw_lo)
    raw_lo = np.broadcast_to(raw_lo, (1, length))[0]
    heads = tails = 0
    for qb in range(length // bq):
        r0, r1 = qb * bq, qb * bq + bq - 1
        bounds = blocks.raw_blocks_for_rows(r0, r1, int(raw_lo[r0]), int(raw_lo[r1]), bk)
        head, start, rest = blocks.narrow_head(bounds, int(raw_lo[r0]), bk, narrow)
        heads += head
        keys = set(range(start, start + narrow)) if head else set()
        keys |= set(range(rest[0] * bk, rest[3] * bk))
        assert set(np.nonzero(raw[r0:r1 + 1].any(axis=0))[0]) <= keys, qb
        assert raw[r0:r1 + 1, rest[1] * bk: rest[2] * bk].all()
    last_row = np.asarray(blocks.raw_key_rows(raw_lo[None]))[0]
    for kb in range(length // bk):
        k0, k1 = kb * bk, kb * bk + bk - 1
        bounds = blocks.row_blocks_for_interval(k0, k1, last_row[k0], last_row[k1], bq)
        tail, start, rest = blocks.narrow_tail(bounds, int(last_row[k1]), bq, narrow)
        tails += tail
        rows = set(range(start, start + narrow)) if tail else set()
        rows |= set(range(rest[0] * bq, rest[3] * bq))
        assert set(np.nonzero(raw[:, k0:k1 + 1].any(axis=1))[0]) <= rows, kb
        assert raw[rest[1] * bq: rest[2] * bq, k0:k1 + 1].all()
    if not packed and pattern.sink_tokens % getattr(pattern, "group_size", 1):
        # One document, sinks off the group grid with s a multiple of the blocks: the case this is for.
        assert heads > 2 and tails > 2, (heads, tails)


def test_narrow_edges_traced():
    """The narrow splits trace (kernels compute them from program ids): same values."""
    def both(lo, hi):
        head, head_start, head_rest = blocks.narrow_head((3, 4, 7, 9), lo, 16, 4)
        tail, tail_start, tail_rest = blocks.narrow_tail((3, 4, 7, 9), hi, 16, 4)
        return (head, head_start, *head_rest, tail, tail_start, *tail_rest)
    fn = jax.jit(lambda lo, hi: jnp.stack(both(lo, hi)))
    for lo, hi in [(60, 130), (59, 131), (63, 135)]:
        assert tuple(int(x) for x in fn(lo, hi)) == both(lo, hi)


def test_narrow_heads_at_paper_sizes():
    """128K, g = 16, s = 1024, blocks of 128: aligned windows take no narrow head; with 4
    sinks nearly every query block does (1015 of 1024, the extra block the sinks cost)."""
    count = functools.partial(blocks.narrow_heads, length=131072, block_q=128, block_k=128,
                              narrow=16)
    assert count(blocks.CCA(16, 1024, 0)) == 0 == count(blocks.CCA(16, 1024, 16))
    assert count(blocks.CCA(16, 1024, 4)) == 1015
    assert count(blocks.Sliding(1024)) == 0 == count(blocks.Full())
    assert blocks.narrow_heads(blocks.CCA(16, 1024, 4), 131072, 128, 128, narrow=0) == 0
