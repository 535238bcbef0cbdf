"""The KV cache's arithmetic and layout (SPEC section 4).

* The cache arithmetic of `blocks` (ring entries, slots, chunk bounds) against the per-query
  oracle of `tests/visibility_oracle.py` (written from SPEC, not from `blocks`), exhaustively
  on small sizes, for every attention option.
* Cache size = SPEC's formula, slots in whole tiles (spare ones unseen), a pytree that jit
  and scan take, and writes in place (no copy of the cache in any cache program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cca_jax import blocks
from cca_jax.blocks import parse_option
from cca_jax.config import LlamaConfig
from cca_jax.decode import decode_step
from cca_jax.kv_cache import (SLOT_TILE, KVCache, cache_bytes, cache_shapes, full_cache_bytes,
                              init_cache, slot_capacity)
from cca_jax.model import LlamaForCausalLM
from cca_jax.padding import round_up
from cca_jax.prefill import prefill_chunk
from tests import visibility_oracle as oracle
from tests.kv_cache_cases import MAX_LEN, TINY, get_setup

# one worker runs the whole module: the option setups of `kv_cache_cases` are built once
pytestmark = pytest.mark.xdist_group("kv_cache")


# ---- blocks: the cache's visibility arithmetic ----------------------------------------------

DENSE_LEN = 16


def small_patterns():
    yield parse_option("full")
    for g in range(1, 5):
        for s in range(1, 7):
            yield parse_option("cca", group_size=g, window_size=s)
    for w in range(1, 6):
        yield parse_option("sliding", window_size=w)
        for n in range(0, 4):
            yield parse_option("streaming", window_size=w, sink_tokens=n)


def _dense(pattern):
    """Raw `[L, L]` and slot `[L, m]` masks of one sequence from the SPEC oracle."""
    raw, core, _ = oracle.dense_masks(pattern, DENSE_LEN)
    return raw, core


@pytest.mark.parametrize("kind", ["full", "cca", "sliding", "streaming"])
def test_ring_and_slot_visibility_match_dense_masks(kind):
    """For every query t < max_len: the positions held by visible ring entries are exactly the
    raw keys t sees, the visible slots exactly its slots; the ring holds the widest window
    and every visible slot was completed (by `completed_slot`) at a position <= t whose group
    was still in the ring."""
    checked = 0
    for pattern in (p for p in small_patterns() if p.kind == kind):
        raw, core = _dense(pattern)
        for max_len in range(1, DENSE_LEN + 1):
            ring, slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
            assert blocks.widest_window(pattern, max_len) <= ring <= max_len
            if slots:
                assert pattern.slot_size <= ring
            t = np.arange(max_len)
            u = blocks.ring_positions(t, ring)
            assert ((u <= t[:, None]) & (u > t[:, None] - ring)).all()
            assert (u % ring == np.arange(ring)).all()
            vis = blocks.cache_raw_visible(pattern, t, ring)
            seen = np.zeros((max_len, DENSE_LEN), bool)
            rows = np.broadcast_to(t[:, None], u.shape)
            seen[rows[vis], u[vis]] = True
            np.testing.assert_array_equal(seen, raw[:max_len], err_msg=f"{pattern} {max_len}")
            slot_vis = blocks.cache_slot_visible(pattern, t, slots)
            np.testing.assert_array_equal(slot_vis, core[:max_len, :slots])
            assert not core[:max_len, slots:].any()
            done = blocks.completed_slot(pattern, t)
            for c in range(slots):
                at = np.flatnonzero(done == c)
                assert len(at) == 1 and at[0] == (c + 1) * pattern.slot_size - 1
                assert not slot_vis[: at[0], c].any()
            checked += 1
    assert checked


@pytest.mark.parametrize("kind", ["full", "cca", "sliding", "streaming"])
def test_chunk_ranges_and_slots_match_dense_masks(kind):
    """A chunk at [p0, p0 + n) laid out as [front - R unused | ring | chunk] (every p0 at
    once): each query row sees exactly its dense raw keys (all inside ring + chunk) and
    slots; padding rows see themselves; bounds are monotone from the first query row on; the
    candidate slots are exactly those completed inside the chunk. (numpy in, numpy out; the
    jnp path is what the prefill runs, checked by the model tests below.)"""
    for pattern in (p for p in small_patterns() if p.kind == kind):
        raw, core = _dense(pattern)
        for max_len in (7, DENSE_LEN):
            ring, slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
            p0 = np.arange(max_len)
            for n in (1, 2, 3, 5):
                front = round_up(ring, 4)
                lo, clo, chi = blocks.chunk_ranges(pattern, p0, n, front, slots)
                pad_rows = np.broadcast_to(np.arange(front), (max_len, front))
                np.testing.assert_array_equal(lo[:, :front], pad_rows)
                assert (chi[:, :front] == 0).all() and (clo == 0).all()
                assert (np.diff(lo[:, front:], axis=1) >= 0).all()
                assert (np.diff(chi[:, front:], axis=1) >= 0).all()
                order = blocks.ring_order(p0, ring)
                assert (order == (p0[:, None] - ring + np.arange(ring)) % ring).all()
                x = np.arange(front + n)
                pos = x[None] - front + p0[:, None]                 # [p0, virtual index]
                for r in range(n):
                    t = p0 + r
                    ok = t < max_len
                    sees = (x[None] >= lo[:, front + r, None]) & (x[None] <= front + r)
                    assert (lo[ok, front + r] >= front - ring).all()  # never left of the ring
                    seen = np.zeros((max_len, DENSE_LEN + n), bool)
                    rows = np.broadcast_to(p0[:, None], pos.shape)
                    seen[rows[sees], pos[sees]] = True
                    np.testing.assert_array_equal(seen[ok, :DENSE_LEN], raw[t[ok]],
                                                  err_msg=f"{pattern} {max_len} r={r}")
                    np.testing.assert_array_equal(
                        np.arange(slots)[None] < chi[ok, front + r, None], core[t[ok], :slots])
                slot, start = blocks.chunk_slots(pattern, p0, n, front)
                size = pattern.slot_size
                assert (start - front + p0[:, None] == slot * size).all()
                for b in p0:
                    real = set(slot[b][(slot[b] + 1) * size - 1 < b + n].tolist())
                    want = {c for c in range(b // size + n + 1) if b <= (c + 1) * size - 1 < b + n}
                    assert real == want and (slot[b] >= 0).all()


# ---- cache layout and size -----------------------------------------------------------------

def llama2_7b(max_len_attention="cca"):
    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       attention={"kind": max_len_attention, "group_size": 16,
                                  "window_size": 1024})


def test_cache_size_matches_spec_formula_at_7b_128k():
    """SPEC 4: about (T/g) * Hq + (s + g) * Hkv vectors per layer (keys and values). Exactly:
    C = (T - s) // g slots (those some query sees) and a ring of s + g. No allocation."""
    cfg, t = llama2_7b(), 131072
    shapes = cache_shapes(cfg, 1, t)
    g, s, hq, hkv, d = 16, 1024, 32, 32, 128
    assert shapes.k.shape == (32, 1, s + g, hkv, d)
    assert shapes.ck.shape == (32, 1, (t - s) // g, hq, d)
    vectors = (t - s) // g * hq + (s + g) * hkv              # per layer, per K (and per V)
    per_vector = 2 * d * 2                                   # k and v, bf16
    assert cache_bytes(shapes) == 32 * vectors * per_vector
    spec = t / g * hq + (s + g) * hkv                        # SPEC's "about" formula
    assert spec - s / g * hq <= vectors <= spec
    full = full_cache_bytes(cfg, 1, t)
    assert full == 32 * t * hkv * per_vector
    ratio = cache_bytes(shapes) / full
    print(f"\n7B at 128K: CCA cache {cache_bytes(shapes) / 2**30:.2f} GiB, full "
          f"{full / 2**30:.1f} GiB ({100 * ratio:.2f}%)")
    assert ratio < 0.075                                     # the target: <= 7.5%
    # The other options: sliding/streaming keep W raw entries (+ N sinks, in a whole tile of
    # slots: `slot_capacity`), full keeps T.
    for kind, ring, slots in (("full", t, 0), ("sliding", 1024, 0), ("streaming", 1024, 8)):
        sh = cache_shapes(llama2_7b(kind), 2, t)
        assert sh.k.shape[2] == ring and sh.ck.shape[2] == slots


def test_cache_is_a_pytree_that_jit_and_scan_take():
    cfg = TINY.replace(attention="cca", group_size=4, window_size=6)
    cache = init_cache(cfg, 3, 32)
    assert cache.ring == 10 and cache.num_slots == round_up((32 - 6) // 4, 8) == 8
    assert cache.batch == 3
    assert cache.k is not cache.v and cache.lengths.dtype == jnp.int32
    bumped = jax.jit(lambda c: c.replace(lengths=c.lengths + 1))(cache)
    assert isinstance(bumped, KVCache) and bumped.pattern == cache.pattern
    carried, _ = jax.lax.scan(lambda c, _: (c.replace(k=c.k + 1), None), cache, None, length=2)
    assert float(carried.k.max()) == 2.0 and carried.max_len == 32
    with pytest.raises(ValueError, match="max_len"):
        init_cache(cfg, 1, 0)


@pytest.mark.parametrize("option,max_len", [
    (dict(attention="cca", group_size=16, window_size=1024), 131136),   # 8132 slots needed
    (dict(attention="cca", group_size=16, window_size=1024, sink_tokens=4), 4100),
    (dict(attention="streaming", window_size=1024, sink_tokens=4), 8192),
    (dict(attention="cca", group_size=4, window_size=6), 30)])
def test_slot_arrays_are_allocated_in_whole_tiles(option, max_len):
    """The slots a row can need (`pattern.max_slots`), rounded up to whole tiles of
    `SLOT_TILE` (the Mosaic GPU decode kernel copied the stacked slots of every layer on every
    step otherwise: 2.9 of 9.3 ms at 7B, 128K, on an H100); at most a tile minus one spare."""
    cfg = TINY.replace(**option)
    need = cfg.attention.pattern.max_slots(max_len)
    got = cache_shapes(cfg, 1, max_len).ck.shape[2]
    assert got == slot_capacity(cfg.attention.pattern, max_len)
    assert got % SLOT_TILE == 0 and need <= got < need + SLOT_TILE


def test_spare_slots_change_nothing():
    """Decoding with the spare slots of the whole last tile (filled with junk) gives the
    logits and cache of a cache of exactly `max_slots` slots, bit for bit: no position sees a
    slot past those it can store."""
    s = get_setup("cca")
    state = nnx.split(s.model)
    cache, _ = s.one_prefill()
    need = s.cfg.attention.pattern.max_slots(MAX_LEN)
    assert cache.ck.shape[2] > need                     # (32 - 6) // 4 = 6 slots, 8 stored
    junk = lambda x: jnp.asarray(x).at[:, :, need:].set(1e4)   # noqa: E731
    spare = jax.tree.map(jnp.asarray, cache).replace(ck=junk(cache.ck), cv=junk(cache.cv))
    exact = jax.tree.map(jnp.asarray, cache).replace(ck=jnp.asarray(cache.ck)[:, :, :need],
                                                     cv=jnp.asarray(cache.cv)[:, :, :need])
    spare, exact = (c.replace(lengths=jnp.asarray([27, 14, 22], jnp.int32))
                    for c in (spare, exact))
    for step in range(5):                               # pools slot 5 (the last) at t = 29
        tokens = jnp.asarray(s.ids[:, step])
        got, spare = decode_step(state, spare, tokens, None, pool_slots=True)
        want, exact = decode_step(state, exact, tokens, None, pool_slots=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(step))
    np.testing.assert_array_equal(np.asarray(spare.ck)[:, :, :need], np.asarray(exact.ck))
    assert np.isfinite(np.asarray(spare.ck)).all()    # (steps may write spare slots: unseen)


def _temp_bytes(layers: int) -> dict:
    cfg = TINY.replace(attention="cca", group_size=4, window_size=16, num_hidden_layers=layers,
                       max_position_embeddings=8192, implementation="xla")
    state = nnx.split(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    cache = init_cache(cfg, 2, 8192)
    ids, n_valid = jnp.zeros((2, 64), jnp.int32), jnp.full((2,), 64, jnp.int32)
    programs = {"decode": decode_step.lower(state, cache, ids[:, 0], None),
                "first chunk": prefill_chunk.lower(state, cache, ids, n_valid, first=True),
                "chunk at an offset": prefill_chunk.lower(state, cache, ids, n_valid),
                "unrolled chunk": prefill_chunk.lower(state, cache, ids, n_valid,
                                                      unroll_layers=True),
                "chunk for one row": prefill_chunk.lower(state, cache, ids[:1], n_valid[:1],
                                                         rows=jnp.zeros((1,), jnp.int32))}
    temp = {k: p.compile().memory_analysis().temp_size_in_bytes for k, p in programs.items()}
    return dict(temp, cache=cache_bytes(cache))


def test_cache_writes_do_not_copy_the_cache():
    """Prefill and decode update the donated cache in place: their temporaries do not grow
    with the cache's layers (a scatter into the whole stacked cache once copied it: 1x; a
    chunk for some rows once copied those rows' whole cache out and back: 0.5x here).
    3 vs 4 layers: prefill scans all layers but the last, and XLA inlines a scan of one layer,
    whose straight-line updates then copied the cache once (a fixed cost, not growth; in a
    server it is a copy of every row's cache per chunk: chunks at an offset now copy nothing,
    `test_a_chunk_at_an_offset_copies_no_stacked_cache_array`)."""
    one, two = _temp_bytes(3), _temp_bytes(4)
    grown = two["cache"] - one["cache"]
    for name in ("decode", "first chunk", "chunk at an offset", "unrolled chunk",
                 "chunk for one row"):
        assert two[name] - one[name] < 0.25 * grown, (name, one, two)
