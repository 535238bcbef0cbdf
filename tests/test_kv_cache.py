"""The KV cache through the model (SPEC section 4, property 6), float32 on the CPU.

* Decode equals prefill for every option: logits at every position of a batch of mixed
  lengths, token by token through `decode_step` and by chunked prefills, equal one full
  forward `model(ids)` (the dense `naive` attention: independent of the blocked code the
  prefill uses); the caches they leave are equal. The decode step compiles once.
* A chunked prefill equals one prefill (cache and logits) for chunk sizes that divide neither
  g nor s, starting from per-row cache lengths; chunks into some rows equal the whole batch;
  scanned and unrolled layers agree.
* The ablation poolings (`mean`, `max`) through the cache: decode equals prefill.
* The cache holds SPEC's layout; bad inputs are refused.

Speed: one tiny float32 model per option (`kv_cache_cases`, built once per worker); shapes are
shared between tests so the jitted prefill / decode functions compile once per (option, chunk
size).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cca_jax import blocks
from cca_jax.attention.backends import BACKENDS
from cca_jax.decode import decode_step, decode_step_traced
from cca_jax.kv_cache import init_cache
from cca_jax.model import LlamaForCausalLM
from cca_jax.prefill import prefill, prefill_chunk
from cca_jax.rope import apply_rope, rope_cos_sin
from tests.kv_cache_cases import (LOGIT_TOL, MAX_LEN, OPTIONS, PROMPT_LENGTHS, ROW_LENGTHS, SEQ,
                                  SLOW_OPTIONS, TINY, assert_caches_equal, get_setup, sharpen)

# one worker runs the whole module: the option setups of `kv_cache_cases` are built once
pytestmark = pytest.mark.xdist_group("kv_cache")


# ---- decode equals prefill -----------------------------------------------------------------

@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_OPTIONS else n for n in OPTIONS])
def setup(request):
    return get_setup(request.param)


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


@functools.cache
def _pooling_setup(pooling):
    """A one-layer cca model (g = 4, s = 6) with `pooling`, sharp weights, and its full
    forward (`naive`) on two rows of 24 tokens; the same weights for every pooling."""
    cfg = TINY.replace(num_hidden_layers=1, attention="cca", group_size=4, window_size=6,
                       pooling=pooling)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    sharpen(model)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    return cfg, model, ids, np.asarray(forward(state, jnp.asarray(ids)))


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
