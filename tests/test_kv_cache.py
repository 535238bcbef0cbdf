"""The KV cache (SPEC section 4): cache visibility from `blocks`, size, chunked prefill, decode.

* The cache arithmetic of `blocks` (ring entries, slots, chunk bounds) against the per-query
  oracle of `tests/visibility_oracle.py` (written from SPEC, not from `blocks`), exhaustively
  on small sizes, for every attention option.
* Decode equals prefill (SPEC property 6) for every option: logits at every position of a
  batch of mixed lengths, token by token through `decode_step` and by chunked prefills, equal
  one full forward `model(ids)` (the dense `naive` attention: independent of the blocked code
  the prefill uses); the caches they leave are equal.
* A chunked prefill equals one prefill (cache and logits) for chunk sizes that divide neither
  g nor s, starting from per-row cache lengths.
* The ablation poolings (`mean`, `max`) through the cache: decode equals prefill.
* Cache size = SPEC's formula; the decode step compiles once.
* bf16: the decode path is as close to a float32 forward as the prefill path (`gpu`: the
  Pallas kernels at LLaMA-2-7B head shapes over 3200 tokens; the CPU-sized case is `slow`).

Speed: one tiny float32 model per option (module fixtures); shapes are shared between tests so
the jitted prefill / decode functions compile once per (option, chunk size).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cca_jax import blocks
from cca_jax.blocks import parse_option
from cca_jax.config import LlamaConfig
from cca_jax.attention.backends import BACKENDS
from cca_jax.decode import decode_step, decode_step_traced
from cca_jax.prefill import prefill, prefill_chunk
from cca_jax.kv_cache import (SLOT_TILE, KVCache, cache_bytes, cache_shapes, full_cache_bytes,
                              init_cache, slot_capacity)
from cca_jax.model import LlamaForCausalLM
from cca_jax.padding import round_up
from cca_jax.rope import apply_rope, rope_cos_sin
from tests import visibility_oracle as oracle

# one worker runs the whole module: its module-scoped fixtures are built once, not per worker
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


# ---- decode equals prefill -----------------------------------------------------------------

TINY = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   dtype="float32", param_dtype="float32",
                   attention={"implementation": "naive"})
OPTIONS = {
    "cca": dict(attention="cca", group_size=4, window_size=6),   # G = 2, s % g != 0
    "full": dict(attention="full"),
    "sliding": dict(attention="sliding", window_size=5),
    "streaming": dict(attention="streaming", window_size=5, sink_tokens=2),
    "cca_s_below_g": dict(attention="cca", group_size=5, window_size=3),
}
SLOW_OPTIONS = {"cca_s_below_g"}
MAX_LEN = 32
WEIGHT_SCALE = 4.0
SEQ = 29
ROW_LENGTHS = np.array([29, 18, 24])       # total tokens per row
PROMPT_LENGTHS = np.array([5, 9, 0])       # prefilled before decoding (row 2: decode only)
LOGIT_TOL = 2e-5
# Cache entries written by differently shaped programs (chunks of 1, 7, the whole prompt)
# differ by float32 summation order: measured up to 1.3e-5 on entries up to 6.3 (about 25
# ulps; 1.07e-5 in cca with chunks of 1). Allowed: 4e-6 of the array's largest entry
# (about 34 ulps there); a misplaced entry or slot is off by O(1).
CACHE_RTOL = 4e-6


class Setup:
    def __init__(self, name):
        self.name = name
        self.cfg = TINY.replace(**OPTIONS[name])
        self.model = LlamaForCausalLM(self.cfg, rngs=nnx.Rngs(0))
        # Sharper attention than the 0.02 init: pooling weights and windows then matter in
        # the logits (cca vs mean pooling differ by ~2 at scale 4, ~4e-4 at scale 1).
        params = nnx.state(self.model, nnx.Param)
        nnx.update(self.model, jax.tree.map(lambda p: p * WEIGHT_SCALE if p.ndim > 1 else p,
                                            params))
        rng = np.random.default_rng(1)
        self.ids = rng.integers(0, self.cfg.vocab_size, (3, SEQ)).astype(np.int32)
        graphdef, state = nnx.split(self.model)
        forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
        self.ref = np.asarray(forward(state, jnp.asarray(self.ids)))   # [3, SEQ, V]
        self._one = None

    def one_prefill(self):
        """One prefill of every row (one chunk): (cache, logits [3, SEQ, V])."""
        if self._one is None:
            cache = init_cache(self.cfg, 3, MAX_LEN)
            cache, _, logits = prefill(self.model, cache, self.ids, ROW_LENGTHS,
                                       chunk_size=SEQ, return_all_logits=True)
            self._one = (jax.tree.map(np.asarray, cache), np.asarray(logits))
        return self._one


_SETUPS: dict[str, Setup] = {}


def get_setup(name: str) -> Setup:
    """One Setup per option for the whole module (its compiled functions are reused)."""
    if name not in _SETUPS:
        _SETUPS[name] = Setup(name)
    return _SETUPS[name]


@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_OPTIONS else n for n in OPTIONS])
def setup(request):
    return get_setup(request.param)


def assert_caches_equal(got: KVCache, want: KVCache, rtol=CACHE_RTOL) -> float:
    """The largest difference of any cache array, checked against `rtol` of that array's
    largest entry; returns the largest difference."""
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    err = 0.0
    for name in ("k", "v", "ck", "cv"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert a.shape == b.shape
        if a.size:
            diff = float(np.abs(a - b).max())
            assert diff <= rtol * max(float(np.abs(b).max()), 1.0), (name, diff)
            err = max(err, diff)
    return err


def test_scanned_decode_layers_equal_unrolled():
    """`decode_step(unroll_layers=False)` (the layers scanned: one compiled layer, a research
    setting for compile time) gives the unrolled step's logits and cache over steps that
    pool, wrap the ring and skip a finished row."""
    s = get_setup("cca")
    state = nnx.split(s.model)
    cache, _ = s.one_prefill()
    caches = [jax.tree.map(jnp.asarray, cache) for _ in range(2)]
    caches = [c.replace(lengths=jnp.asarray([20, 3, 9], jnp.int32)) for c in caches]
    active = jnp.asarray([True, True, False])
    for step in range(6):
        tokens = jnp.asarray(s.ids[:, step])
        outs = []
        for n, unroll in enumerate((True, False)):
            out, caches[n] = decode_step(state, caches[n], tokens, active, pool_slots=True,
                                         unroll_layers=unroll)
            outs.append(np.asarray(out))
        np.testing.assert_allclose(outs[1][:2], outs[0][:2], atol=1e-5, err_msg=str(step))
    assert_caches_equal(caches[1], caches[0])


@pytest.mark.parametrize("rows,lengths", [((1,), (7, 3, 12)), ((2, 0), (5, 9, 24))])
def test_chunk_into_some_rows_equals_the_whole_batch(rows, lengths):
    """A chunk for some rows (`rows`, in any order: the server's P rows of B) read and written
    in place, ring and new slots row by row, equals the same chunk through every row with no
    tokens for the others: the same cache, every row, and the same logits. Row 2 at 24 of
    32 positions completes slots whose window reaches the cache's last slot (the clamped
    window)."""
    s = get_setup("cca")
    state = nnx.split(s.model)
    cache, _ = s.one_prefill()
    base = jax.tree.map(jnp.asarray, cache).replace(lengths=jnp.asarray(lengths, jnp.int32))
    ids = jnp.asarray(s.ids[:, 12:18])
    chosen = np.asarray(rows)
    n_valid = np.zeros(3, np.int32)
    n_valid[chosen] = 6
    whole, whole_logits = prefill_chunk(state, jax.tree.map(jnp.copy, base), ids,
                                        jnp.asarray(n_valid), unroll_layers=False)
    some, some_logits = prefill_chunk(state, jax.tree.map(jnp.copy, base), ids[chosen],
                                      jnp.asarray(n_valid[chosen]),
                                      rows=jnp.asarray(chosen, jnp.int32), unroll_layers=False)
    np.testing.assert_allclose(np.asarray(some_logits), np.asarray(whole_logits)[chosen],
                               atol=1e-5)
    assert_caches_equal(some, whole)
    assert int(np.asarray(some.lengths)[2]) == lengths[2] + (6 if 2 in rows else 0)


@pytest.mark.parametrize("rows,all_logits", [(None, False), ((1,), False), (None, True)])
def test_unrolled_prefill_chunk_equals_scanned(rows, all_logits):
    """`prefill_chunk(unroll_layers=True)` (every weight a static slice, read in place: the
    default for small chunks on a GPU) leaves the scanned chunk's cache and logits, also for
    one row of three (`rows`) and with every position's logits."""
    s = get_setup("cca")
    state = nnx.split(s.model)
    cache, _ = s.one_prefill()
    base = jax.tree.map(jnp.asarray, cache).replace(lengths=jnp.asarray([7, 3, 12], jnp.int32))
    p = 3 if rows is None else len(rows)
    ids = jnp.asarray(s.ids[:p, 12:18])
    n_valid = jnp.asarray([6, 4, 5][:p], jnp.int32)
    idx = None if rows is None else jnp.asarray(rows, jnp.int32)
    outs = [prefill_chunk(state, jax.tree.map(jnp.copy, base), ids, n_valid, rows=idx,
                          all_logits=all_logits, unroll_layers=unroll)
            for unroll in (False, True)]
    for got, want in zip(outs[1][1:], outs[0][1:]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert_caches_equal(outs[1][0], outs[0][0])


def test_idle_rows_attend_at_position_zero(monkeypatch):
    """A decode step hands the attention each active row's length and position 0 for idle
    rows (a server's free and prefilling rows): the kernels then read one entry of an idle
    row, not its stale context. Active rows' logits are those of the all-active step."""
    s = get_setup("cca")
    state = nnx.split(s.model)
    cache, _ = s.one_prefill()
    lengths = jnp.asarray([20, 3, 9], jnp.int32)
    tokens = jnp.asarray(s.ids[:, 0])
    backend = BACKENDS["xla"]
    seen = []

    def recording(q, k_all, v_all, ck, cv, layer, pattern, positions):
        seen.append(np.asarray(positions))
        return type(backend).decode(backend, q, k_all, v_all, ck, cv, layer, pattern,
                                    positions)
    monkeypatch.setattr(backend, "decode", recording)
    outs = {}
    for name, active in (("idle", [True, False, True]), ("all", [True, True, True])):
        seen.clear()
        c = jax.tree.map(jnp.asarray, cache).replace(lengths=lengths)
        outs[name], _ = decode_step_traced(state, c, tokens, jnp.asarray(active),
                                           implementation="xla")
        assert len(seen) == s.cfg.num_hidden_layers
        want = np.where(active, np.asarray(lengths), 0)
        assert all((p == want).all() for p in seen), (name, seen[0])
    np.testing.assert_array_equal(np.asarray(outs["idle"])[[0, 2]],
                                  np.asarray(outs["all"])[[0, 2]])


def test_decode_equals_prefill(setup):
    """SPEC property 6 for a batch of mixed lengths (29, 18 and 24 tokens):
    * prompts of 5, 9 and 0 tokens prefilled in chunks of 4, then the rest token by token
      with `decode_step` (rows stop at their own lengths: `active`);
    * every row whole, prefilled in chunks of 4.
    Logits at every position equal one full forward (across group and window boundaries),
    and both leave the same cache. The decode step compiles once for all steps."""
    s = setup
    cache = init_cache(s.cfg, 3, MAX_LEN)
    width = int(PROMPT_LENGTHS.max())
    cache, last, logits = prefill(s.model, cache, s.ids[:, :width], PROMPT_LENGTHS,
                                  chunk_size=4, return_all_logits=True)
    logits = np.asarray(logits)
    err_prompt = max(float(np.abs(logits[b, :n] - s.ref[b, :n]).max())
                     for b, n in enumerate(PROMPT_LENGTHS) if n)
    for b, n in enumerate(PROMPT_LENGTHS):
        if n:
            np.testing.assert_allclose(np.asarray(last)[b], s.ref[b, n - 1], atol=LOGIT_TOL)
    model_state = nnx.split(s.model)
    compiled = None
    err_decode = 0.0
    for step in range(int((ROW_LENGTHS - PROMPT_LENGTHS).max())):
        pos = PROMPT_LENGTHS + step
        active = pos < ROW_LENGTHS
        tokens = s.ids[np.arange(3), np.minimum(pos, SEQ - 1)]
        # Pooling only in steps where an active row completes a slot (as generate runs).
        pool = bool(blocks.completes_slot(cache.pattern, pos[active], cache.num_slots).any())
        out, cache = decode_step(model_state, cache, jnp.asarray(tokens), jnp.asarray(active),
                                 pool_slots=pool)
        out = np.asarray(out)
        for b in np.flatnonzero(active):
            err_decode = max(err_decode, float(np.abs(out[b] - s.ref[b, pos[b]]).max()))
        if compiled is None:
            compiled = decode_step._cache_size()
    # No recompilation per token: one program with pooling, one without.
    assert decode_step._cache_size() <= compiled + 1

    chunked = init_cache(s.cfg, 3, MAX_LEN)
    chunked, _, logits = prefill(s.model, chunked, s.ids, ROW_LENGTHS, chunk_size=4,
                                 return_all_logits=True)
    logits = np.asarray(logits)
    err_chunked = max(float(np.abs(logits[b, :n] - s.ref[b, :n]).max())
                      for b, n in enumerate(ROW_LENGTHS))
    err_cache = assert_caches_equal(cache, chunked)
    print(f"\n{s.name}: max |logit error| vs full forward (|logits| <= "
          f"{np.abs(s.ref).max():.1f}): prompts {err_prompt:.1e}, decode {err_decode:.1e}, "
          f"whole rows chunked {err_chunked:.1e}; cache decode vs prefill {err_cache:.1e}")
    assert max(err_prompt, err_decode, err_chunked) < LOGIT_TOL


@pytest.mark.parametrize("name,chunk", [
    ("cca", 5),
    *[pytest.param(n, c, marks=pytest.mark.slow)
      for n, c in (("cca", 1), ("cca", 3), ("cca", 7), ("cca_s_below_g", 2), ("full", 3),
                   ("sliding", 3), ("streaming", 7))]])
def test_chunked_prefill_equals_one_prefill(name, chunk):
    """Two chunked prefills (prompts of 5, 9, 0 tokens; then each row's rest, from its own
    cache length) leave the cache one prefill (one chunk) leaves, with the same logits.
    Chunks of 5 and 7 divide neither g = 4 nor s = 6 (7 and the others: -m slow). (Every
    option runs chunks of 4 against the full forward and the token-by-token cache in
    test_decode_equals_prefill.)"""
    s = get_setup(name)
    one_cache, one_logits = s.one_prefill()
    for b, n in enumerate(ROW_LENGTHS):
        np.testing.assert_allclose(one_logits[b, :n], s.ref[b, :n], atol=LOGIT_TOL)
    cache = init_cache(s.cfg, 3, MAX_LEN)
    width = int(PROMPT_LENGTHS.max())
    cache, _, first = prefill(s.model, cache, s.ids[:, :width], PROMPT_LENGTHS,
                              chunk_size=chunk, return_all_logits=True)
    rest = np.zeros_like(s.ids)
    for b, (p, n) in enumerate(zip(PROMPT_LENGTHS, ROW_LENGTHS)):
        rest[b, : n - p] = s.ids[b, p:n]
    cache, last, second = prefill(s.model, cache, rest, ROW_LENGTHS - PROMPT_LENGTHS,
                                  chunk_size=chunk, return_all_logits=True)
    first, second = np.asarray(first), np.asarray(second)
    for b, (p, n) in enumerate(zip(PROMPT_LENGTHS, ROW_LENGTHS)):
        got = np.concatenate([first[b, :p], second[b, : n - p]])
        np.testing.assert_allclose(got, s.ref[b, :n], atol=LOGIT_TOL)
        np.testing.assert_allclose(np.asarray(last)[b], s.ref[b, n - 1], atol=LOGIT_TOL)
    assert_caches_equal(cache, one_cache)


_POOLING_LOGITS = {}


def _pooling_setup(pooling):
    """A one-layer cca model (g = 4, s = 6) with `pooling`, sharp weights, and its full
    forward (`naive`) on two rows of 24 tokens; the same weights for every pooling."""
    cfg = TINY.replace(num_hidden_layers=1, attention="cca", group_size=4, window_size=6,
                       pooling=pooling)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * WEIGHT_SCALE if p.ndim > 1 else p, params))
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    if pooling not in _POOLING_LOGITS:
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
        _POOLING_LOGITS[pooling] = np.asarray(forward(state, jnp.asarray(ids)))
    return cfg, model, ids, _POOLING_LOGITS[pooling]


@pytest.mark.parametrize("pooling", ["mean", "max"])
def test_mean_and_max_pooling_decode_equals_prefill(pooling):
    """SPEC property 6 for the ablation poolings: a prefill of 9 and 5 tokens (one chunk,
    its slots pooled by the prefill), then token by token to 24 (slots pooled by the decode
    step), gives the full forward's logits at every position; and the pooling is really in
    use: its logits differ from the query-weighted `cca` pooling's."""
    cfg, model, ids, ref = _pooling_setup(pooling)
    _, _, _, ref_cca = _pooling_setup("cca")
    beyond = slice(6 + 4 - 1, None)         # positions that see a core token (n_core >= 1)
    assert np.abs(ref[:, beyond] - ref_cca[:, beyond]).max() > 0.1
    np.testing.assert_allclose(ref[:, :9], ref_cca[:, :9], atol=1e-5)   # no core token yet
    prompt = np.array([9, 5])
    cache, _, logits = prefill(model, init_cache(cfg, 2, MAX_LEN), ids[:, :9], prompt,
                               chunk_size=9, return_all_logits=True)
    logits = np.asarray(logits)
    for b, n in enumerate(prompt):
        np.testing.assert_allclose(logits[b, :n], ref[b, :n], atol=LOGIT_TOL)
    model_state = nnx.split(model)
    for step in range(24 - int(prompt.min())):
        pos = prompt + step
        active = pos < 24
        out, cache = decode_step(model_state, cache, jnp.asarray(ids[[0, 1], np.minimum(pos, 23)]),
                                 jnp.asarray(active))
        out = np.asarray(out)
        for b in np.flatnonzero(active):
            np.testing.assert_allclose(out[b], ref[b, pos[b]], atol=LOGIT_TOL,
                                       err_msg=f"{pooling}: row {b}, position {pos[b]}")


def test_prefill_runs_the_last_layer_for_the_last_tokens_only(monkeypatch):
    """Without `return_all_logits`, the last layer's attention (the decode attention over the
    filled cache, through the backend's `decode` entry), output projection and MLP run
    for each row's last token only. Chunks of 5
    (a first chunk, then chunks at an offset) with `xla`, a blocked implementation, whose
    first chunk pools its slots once for the attention and the cache (the other tests run the
    `naive` model's own attention, with all logits): the last logits are the full forward's,
    the cache is one prefill's."""
    from cca_jax.attention.xla import XLA
    traced = []
    real = XLA._decode
    monkeypatch.setattr(XLA, "_decode", lambda *a: traced.append(1) or real(*a))
    jax.clear_caches()      # trace the chunk programs here
    s = get_setup("cca")
    one_cache, _ = s.one_prefill()
    cfg = s.cfg.replace(implementation="xla")
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(s.model, nnx.Param))
    cache, last = prefill(model, init_cache(cfg, 3, MAX_LEN), s.ids, ROW_LENGTHS, chunk_size=5)
    for b, n in enumerate(ROW_LENGTHS):
        np.testing.assert_allclose(np.asarray(last)[b], s.ref[b, n - 1], atol=LOGIT_TOL)
    assert_caches_equal(cache, one_cache)
    assert traced


def test_prefill_pools_the_slots_its_backend_asks_for(monkeypatch):
    """A first chunk pools `Backend.slots_to_pool(needed)` slots (the Mosaic backend asks
    for whole slot blocks, so that its kernels pad none) and stores the ones it needs: with
    `xla` asking for 3 more (10 pooled; 7 groups end in the prompt), one
    whole-prompt chunk gives the same last logits as the full forward and the same cache as
    one prefill."""
    from cca_jax.attention.xla import XLA
    asked = []
    monkeypatch.setattr(XLA, "slots_to_pool", lambda n, d: asked.append(n) or n + 3)
    jax.clear_caches()
    s = get_setup("cca")
    one_cache, _ = s.one_prefill()
    cfg = s.cfg.replace(implementation="xla")
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(s.model, nnx.Param))
    cache, last = prefill(model, init_cache(cfg, 3, MAX_LEN), s.ids, ROW_LENGTHS,
                          chunk_size=SEQ)
    for b, n in enumerate(ROW_LENGTHS):
        np.testing.assert_allclose(np.asarray(last)[b], s.ref[b, n - 1], atol=LOGIT_TOL)
    assert_caches_equal(cache, one_cache)
    # 7 groups end in 29 tokens; the cache has room for 8 (6 seen by positions < 32, whole
    # tiles: `slot_capacity`)
    assert asked and set(asked) == {7}


@pytest.mark.parametrize("unroll", [False, True], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("rows", [None, np.array([1], np.int32)], ids=["all rows", "one row"])
def test_a_chunk_at_an_offset_copies_no_stacked_cache_array(rows, unroll):
    """A prefill chunk at an offset updates the donated cache in place: its compiled program
    (XLA's CPU pipeline; copy insertion is the GPU's too) holds no copy of a stacked cache
    array. Two crept in: XLA read layer i's ring straight from the input, unordered with
    layer i - 1's in-place update, and kept both by copying the whole cache (the server's
    chunk into one of 64 tiny rows took 30.45 ms against 5.88 since,
    benchmarks/results/research/serve_chunk_copies_cpu.md)."""
    cfg = TINY.replace(attention="cca", group_size=4, window_size=8, implementation="xla",
                       max_position_embeddings=256)
    model_state = nnx.split(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    cache = init_cache(cfg, 3, 256)     # 62 slots: a chunk's candidates are a window of them
    p = 3 if rows is None else len(rows)
    text = prefill_chunk.lower(model_state, cache, np.ones((p, 8), np.int32),
                               np.full(p, 8, np.int32), rows=rows,
                               unroll_layers=unroll).compile().as_text()
    stacked = {",".join(map(str, getattr(cache, n).shape)) for n in ("k", "v", "ck", "cv")}
    copies = [line.strip()[:120] for line in text.splitlines()
              if " copy(" in line and any(f"[{shape}]" in line for shape in stacked)]
    assert not copies, copies


def test_cache_contents_are_the_spec_layout():
    """The ring holds each position's RoPE'd key at entry u % R (unwritten entries zero), and
    cca slot c is SPEC section 1's pooling of group c with the query of its last token."""
    s = get_setup("cca")
    cache, _ = s.one_prefill()
    cfg, model = s.cfg, s.model
    graphdef, state = nnx.split(model)

    @jax.jit
    def layer0_qk(state, ids):
        """Layer 0's q, k straight from the model's own submodules."""
        model = nnx.merge(graphdef, state)
        layers_def, stacked = nnx.split(model.layers)
        layer = nnx.merge(layers_def, jax.tree.map(lambda p: p[0], stacked))
        cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(SEQ), ids.shape), cfg)
        h = layer.input_layernorm(model.embed_tokens(ids))
        q = apply_rope(layer.self_attn.q_proj(h).reshape(3, SEQ, 4, 8), cos, sin)
        return q, apply_rope(layer.self_attn.k_proj(h).reshape(3, SEQ, 2, 8), cos, sin)

    q, k = map(np.asarray, layer0_qk(state, jnp.asarray(s.ids)))
    ring = cache.ring
    for b, n in enumerate(ROW_LENGTHS):
        for u in range(max(0, n - ring), n):
            np.testing.assert_allclose(cache.k[0, b, u % ring], k[b, u], atol=1e-5)
        g = 4
        for c in range(cache.num_slots):
            if (c + 1) * g > n:
                assert not np.asarray(cache.ck[0, b, c]).any()
                continue
            kk = np.repeat(k[b, c * g:(c + 1) * g], 2, axis=1)   # [g, Hq, D]: head h -> h // 2
            a = np.einsum("hd,uhd->hu", q[b, (c + 1) * g - 1], kk) / math.sqrt(8)
            a = np.exp(a - a.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            np.testing.assert_allclose(cache.ck[0, b, c], np.einsum("hu,uhd->hd", a, kk),
                                       atol=1e-5)


def test_bad_inputs_are_refused():
    s = get_setup("sliding")
    other = init_cache(TINY.replace(attention="full"), 3, MAX_LEN)
    with pytest.raises(ValueError, match="cache was made for"):
        prefill(s.model, other, s.ids, chunk_size=4)
    cache = init_cache(s.cfg, 3, 8)
    with pytest.raises(ValueError, match="exceeds the cache's max_len=8"):
        prefill(s.model, cache, s.ids, chunk_size=4)
    with pytest.raises(ValueError, match=r"token ids of row 0 must lie in \[0, 61\)"):
        prefill(s.model, cache, np.full((3, 4), 61, np.int32), chunk_size=4)
    with pytest.raises(ValueError, match="lengths must be"):
        prefill(s.model, cache, s.ids[:, :4], [5, 1, 1], chunk_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["pallas_gpu", "pallas_tpu"])
def test_chunked_prefill_through_pallas_kernels(kernels):
    """Chunks at an offset run through the Pallas GPU / TPU kernels (interpreters here) when
    the model's implementation is theirs: a prefill in chunks of 8 (the later ones with ring
    rows in front, `chunk_blocking`; the TPU grid sized by the widest raw window) gives the
    full forward's logits and the cache of the reference implementation."""
    cfg = TINY.replace(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, num_hidden_layers=1, attention="cca", group_size=4,
                       window_size=6,
                       implementation=kernels)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * WEIGHT_SCALE if p.ndim > 1 else p, params))
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
    lengths = np.array([21, 13])
    graphdef, state = nnx.split(model)
    ref = np.asarray(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(state, jnp.asarray(ids)))
    cache, _, logits = prefill(model, init_cache(cfg, 2, MAX_LEN), ids, lengths, chunk_size=8,
                               return_all_logits=True)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], ref[b, :n], atol=LOGIT_TOL)
    xla_model = LlamaForCausalLM(cfg.replace(implementation="xla"), rngs=nnx.Rngs(0))
    nnx.update(xla_model, nnx.state(model, nnx.Param))
    want, _ = prefill(xla_model, init_cache(xla_model.config, 2, MAX_LEN), ids, lengths,
                      chunk_size=8)
    assert_caches_equal(cache, want)


@pytest.mark.slow   # about 12 s: the Triton kernels interpreted
def test_chunk_into_some_rows_through_pallas_gpu_kernels():
    """A chunk for one row of two, in place, through the Pallas GPU kernels (the blocked
    kernel, and the decode kernel on the row's one-layer view for its last token; Triton's
    interpreter here) equals the chunk through both rows with no tokens for the other."""
    cfg = TINY.replace(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, num_hidden_layers=2, attention="cca", group_size=4,
                       window_size=6, implementation="pallas_gpu")
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    state = nnx.split(model)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
    cache, _ = prefill(model, init_cache(cfg, 2, MAX_LEN), ids[:, :13], [13, 9], chunk_size=8)
    chunk = jnp.asarray(ids[:, 13:21])
    whole, whole_logits = prefill_chunk(state, jax.tree.map(jnp.copy, cache), chunk,
                                        jnp.asarray([0, 8], jnp.int32))
    some, some_logits = prefill_chunk(state, jax.tree.map(jnp.copy, cache), chunk[1:],
                                      jnp.asarray([8], jnp.int32),
                                      rows=jnp.asarray([1], jnp.int32))
    np.testing.assert_allclose(np.asarray(some_logits)[0], np.asarray(whole_logits)[1],
                               atol=1e-5)
    assert_caches_equal(some, whole)


@pytest.mark.slow   # 50-100 s each: the Mosaic GPU kernels interpreted, 2 layers, twice
@pytest.mark.parametrize("rows,splits", [(None, 1), ([1], None)],
                         ids=["all rows, unsplit", "one row, keys split"])
def test_a_chunk_through_the_mosaic_kernel_reads_the_slots_in_the_cache(monkeypatch, rows,
                                                                        splits):
    """A bfloat16 chunk at an offset through the Mosaic GPU forward (its GPU interpreter here)
    reads each layer's slots in place in the stacked cache (`Backend.blocked_in_cache`, the
    chunk's rows only) and gives the logits and cache of the same kernel on slots sliced out
    of the cache: bit for bit with its keys unsplit; within bfloat16 rounding with them
    split over CTAs as a small chunk is by default (`prefill_key_splits`: 4 here)."""
    from cca_jax.attention import pallas_mosaic_gpu
    cfg = TINY.replace(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, attention="cca", group_size=4, window_size=6,
                       dtype="bfloat16", param_dtype="bfloat16", implementation="mosaic_gpu")
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)   # weights scaled up: attention moves the logits
    nnx.update(model, jax.tree.map(lambda p: p * WEIGHT_SCALE if p.ndim > 1 else p, params))
    state = nnx.split(model)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
    cache, _ = prefill(model, init_cache(cfg, 2, 40), ids[:, :13], [13, 9], chunk_size=16)
    assert cache.num_slots == 8     # a whole shared-memory tile: read in place
    chunk, n_valid = jnp.asarray(ids[:, 13:21]), jnp.asarray([8, 6], jnp.int32)
    if rows is not None:
        chunk, n_valid, rows = chunk[1:], n_valid[1:], jnp.asarray(rows, jnp.int32)
    backend = pallas_mosaic_gpu.MOSAIC_GPU
    chosen = []
    heuristic = pallas_mosaic_gpu.prefill_key_splits
    monkeypatch.setattr(pallas_mosaic_gpu, "prefill_key_splits",
                        lambda *a: chosen.append(splits or heuristic(*a)) or chosen[-1])
    got, got_logits = prefill_chunk(state, jax.tree.map(jnp.copy, cache), chunk, n_valid,
                                    rows=rows)
    assert chosen and set(chosen) == {splits or 4}   # the layers read in place (one scan)
    monkeypatch.setattr(type(backend), "reads_slots_in_cache", lambda self, *a: False)
    want, want_logits = prefill_chunk(state, jax.tree.map(jnp.copy, cache), chunk, n_valid,
                                      rows=rows)
    if splits == 1:
        np.testing.assert_array_equal(np.asarray(got_logits, np.float32),
                                      np.asarray(want_logits, np.float32))
        for name in ("k", "v", "ck", "cv", "lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name), np.float32),
                                          np.asarray(getattr(want, name), np.float32))
        return
    got_logits, want_logits = (np.asarray(x, np.float64) for x in (got_logits, want_logits))
    assert np.abs(got_logits - want_logits).max() < 0.05 * want_logits.std()
    for name in ("k", "v", "ck", "cv"):    # layer 1's entries saw layer 0's output
        a, b = (np.asarray(getattr(x, name), np.float64) for x in (got, want))
        assert np.abs(a - b).max() <= 0.02 * np.abs(b).max(), name


def test_prefill_key_splits_fill_the_gpu_once():
    from cca_jax.attention.pallas_mosaic_gpu import prefill_key_splits
    assert prefill_key_splits(256, 128, 32, 1, 132) == 2     # 64 CTAs: 2 splits
    assert prefill_key_splits(128, 128, 32, 1, 132) == 4     # 32 CTAs: 4
    assert prefill_key_splits(2048, 128, 32, 1, 132) == 1    # 512 CTAs fill it alone
    assert prefill_key_splits(200, 128, 32, 2, 132) == 1     # 2 rows x 2 blocks: 128
    assert prefill_key_splits(8, 128, 2, 1, 132) == 4        # at most 4


@pytest.mark.parametrize("name", ["cca", pytest.param("streaming", marks=pytest.mark.slow)])
def test_decode_step_through_pallas_gpu_kernel(name):
    """decode_step with the Pallas GPU decode kernel (interpret mode here; the stacked cache
    read in place at the scan's layer) gives the XLA step's logits and cache, token by
    token past group and window boundaries, rows at different positions."""
    cfg = TINY.replace(head_dim=16, **OPTIONS[name])
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * WEIGHT_SCALE if p.ndim > 1 else p, params))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    model_state = nnx.split(model)
    caches = {}
    for impl in ("xla", "pallas_gpu"):
        cache, _ = prefill(model, init_cache(cfg, 2, MAX_LEN), ids[:, :8], [3, 8],
                           chunk_size=8)
        logits = []
        for step in range(8):
            out, cache = decode_step(model_state, cache, jnp.asarray(ids[:, 8 + step]),
                                     None, implementation=impl)
            logits.append(np.asarray(out))
        caches[impl] = (cache, np.stack(logits))
    np.testing.assert_allclose(caches["pallas_gpu"][1], caches["xla"][1], atol=LOGIT_TOL)
    assert_caches_equal(caches["pallas_gpu"][0], caches["xla"][0])


# ---- decode equals prefill in bfloat16 (on the GPU at LLaMA-2-7B head shapes) ----------------

def _row_errors(got, ref):
    """Per logit row: largest absolute error relative to the row's standard deviation."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.abs(got - ref).max(-1) / ref.std(-1)


def check_bf16_decode_equals_prefill(hq, hkv, d, g, s, prompt, total, chunk, *,
                                     decode_implementation=None, layers=2, batch=2):
    """A bf16 model (`layers` layers, heads `hq`/`hkv` of `d`), rows of `total` tokens:
    `prompt` tokens prefilled in chunks of `chunk`, the rest decoded token by token (rows
    offset by 37 tokens, so they complete groups and wrap the ring at different steps). Each
    decoded position's logits against (a) the bf16 one-shot forward (`auto` implementation:
    the Pallas kernels on a GPU) and (b) a float32 forward of the same weights: the decode
    path is no less accurate than the prefill path. Returns (decode, prefill) errors."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=hq * d, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=hkv,
                      head_dim=d, max_position_embeddings=total, dtype="bfloat16",
                      param_dtype="bfloat16",
                      attention=dict(kind="cca", group_size=g, window_size=s))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    # Scores q.k / sqrt(D) of about unit scale at any hidden size (q and k weights scaled):
    # attention neither uniform nor one-hot. The other weights keep their init, so bf16
    # rounding stays small in the logits (scaling every weight made bf16 and float32 logits
    # differ by more than a wrong window does).
    std = float(np.asarray(params["layers"]["self_attn"]["q_proj"]["kernel"], np.float32).std())
    scale = 1.2 / (std * math.sqrt(cfg.hidden_size))
    attn = params["layers"]["self_attn"]
    for name in ("q_proj", "k_proj"):
        kernel = attn[name]["kernel"]
        kernel[...] = (kernel[...].astype(jnp.float32) * scale).astype(kernel.dtype)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, cfg.vocab_size, (batch, total)).astype(np.int32)
    lengths = prompt - 37 * np.arange(batch)      # row b: prompt - 37 b tokens prefilled
    assert lengths.min() > 0

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    prefill_logits = np.asarray(forward(state, jnp.asarray(ids)))
    cfg32 = cfg.replace(dtype="float32", param_dtype="float32", implementation="xla")
    model32 = LlamaForCausalLM(cfg32, rngs=nnx.Rngs(0))
    nnx.update(model32, jax.tree.map(lambda p: p.astype(jnp.float32),
                                     nnx.state(model, nnx.Param)))
    graphdef32, state32 = nnx.split(model32)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.jit(lambda s, i: nnx.merge(graphdef32, s)(i))(state32,
                                                                          jnp.asarray(ids)))

    cache = init_cache(cfg, batch, total)
    cache, _ = prefill(model, cache, ids, lengths, chunk_size=chunk)
    model_state = nnx.split(model)
    decoded = np.zeros_like(prefill_logits)
    for step in range(total - int(lengths.min())):
        pos = lengths + step
        active = pos < total
        out, cache = decode_step(model_state, cache, jnp.asarray(ids[np.arange(batch),
                                                                     np.minimum(pos, total - 1)]),
                                 jnp.asarray(active), implementation=decode_implementation)
        out = np.asarray(out)
        for b in np.flatnonzero(active):
            decoded[b, pos[b]] = out[b]
    rows = [(b, t) for b in range(batch) for t in range(lengths[b], total)]
    pick = lambda x: np.stack([x[b, t] for b, t in rows])  # noqa: E731
    err_decode = _row_errors(pick(decoded), pick(ref))
    err_prefill = _row_errors(pick(prefill_logits), pick(ref))
    err_between = _row_errors(pick(decoded), pick(prefill_logits))
    worst = int(np.argmax(err_decode))
    print(f"\nbf16 decode vs float32: max row error {err_decode.max():.2e} (row {rows[worst]}), "
          f"mean {err_decode.mean():.2e}; prefill vs float32: max {err_prefill.max():.2e}, "
          f"mean {err_prefill.mean():.2e}; decode vs prefill: max {err_between.max():.2e}")
    assert np.all(np.isfinite(decoded[0, lengths[0]:]))
    # bf16 against float32, measured on CPU (XLA both ways): max row error 4.1e-2 decoding,
    # 4.5e-2 prefilling (means 2.5e-2, 2.6e-2). Broken on purpose, the decode path's max
    # became 1.7 (newest core token dropped) and 2.1 (window one key short): a wrong window,
    # slot or ring entry adds an error of its own, so decode must stay as close to float32
    # as the prefill path is (whatever kernels each path runs).
    assert err_decode.max() <= 2 * err_prefill.max() + 0.02, (err_decode.max(),
                                                              err_prefill.max())
    assert err_decode.mean() <= 1.5 * err_prefill.mean() + 0.005, (err_decode.mean(),
                                                                   err_prefill.mean())
    return err_decode, err_prefill


@pytest.mark.slow   # about 30 s of XLA compiles of bf16 programs on CPU
def test_bf16_decode_equals_prefill_small():
    """The bf16 check at CPU size (the XLA paths): 4/2 heads of 64, g = 4, s = 24 (ring
    28), 136 tokens, 60 and 23 prefilled in one chunk, the rest decoded. (float32 decode
    equals prefill for every option by default: test_decode_equals_prefill.)"""
    check_bf16_decode_equals_prefill(4, 2, 64, 4, 24, prompt=60, total=136, chunk=64)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("hkv", [32, 8], ids=["mha", "gqa"])
def test_gpu_bf16_decode_equals_prefill_at_7b_head_shapes(hkv):
    """LLaMA-2-7B attention (Hq = 32, D = 128; Hkv = 32, and GQA with 8), the paper's g = 16,
    s = 1024 (ring 1040), 3200 tokens: rows of 2900 and 2863 prompt tokens prefilled in
    chunks of 1024 (the Pallas prefill kernels: a first chunk, then chunks at an offset),
    then 300+ tokens each through the Pallas decode kernel: about 20 completed groups per
    row, and position 3120 = 3 R where the ring's write index wraps."""
    check_bf16_decode_equals_prefill(32, hkv, 128, 16, 1024, prompt=2900, total=3200,
                                     chunk=1024)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_gpu_cache_programs_skip_xla_rematerialization(capfd):
    """A cache of 70% of JAX's memory (compiled from shapes; nothing allocated): XLA's GPU
    rematerialization counts the donated cache twice and warns "Can't reduce memory use
    below ..." for `prefill_chunk` (compiled without `CACHE_PROGRAM_COMPILER_OPTIONS`: the
    control, the reason they exist), and not for the programs that carry them: the server's
    chunk into one row and a decode step."""
    from cca_jax.serve.programs import prefill_and_sample

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=128, max_position_embeddings=131072, dtype="bfloat16",
                      param_dtype="bfloat16", attention=dict(kind="cca", group_size=16,
                                                             window_size=1024))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    state = nnx.split(model)
    limit = jax.devices()[0].memory_stats()["bytes_limit"]
    per_row = cache_bytes(cache_shapes(cfg, 1, 131072))
    cache = cache_shapes(cfg, int(0.7 * limit // per_row), 131072)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    floats = jax.ShapeDtypeStruct((1,), jnp.float32)
    warning = "Can't reduce memory use"

    prefill_chunk.lower(state, cache, ints(1, 256), ints(1), rows=ints(1)).compile()
    assert warning in capfd.readouterr().err
    prefill_and_sample.lower(state, cache, ints(1), ints(1, 256), ints(1), ints(1), floats,
                             ints(1), floats, unroll=True).compile()
    decode_step.lower(state, cache, ints(cache.batch)).compile()
    assert warning not in capfd.readouterr().err


def test_no_cache_program_turns_gemm_autotuning_off():
    """Without XLA's GEMM autotuning the GEMM fusions run an untuned default tiling: at the
    7B shape on an H100 a 256-token serving chunk took 256.90 ms against 14.37 with it
    (research/serve_step_probe_h100_6a645d8.md), and one row decoded at 12.32 ms per token
    against 5.26 on the H200 (research/h200_2026-12-07.md). So no program of the library sets
    the option: not the cache programs' shared options, not any module's own."""
    import pathlib

    from cca_jax.decode import DECODE_COMPILER_OPTIONS
    from cca_jax.kv_cache import CACHE_PROGRAM_COMPILER_OPTIONS
    for options in (CACHE_PROGRAM_COMPILER_OPTIONS, DECODE_COMPILER_OPTIONS):
        assert "xla_gpu_autotune_level" not in options, options
    library = pathlib.Path(__file__).parents[1] / "cca_jax"
    setting = [str(p) for p in library.rglob("*.py") if "xla_gpu_autotune_level" in p.read_text()]
    assert not setting, setting
