"""CCA with attention sinks (SPEC section 6, `sink_tokens = N`) on every path that runs cca.

* `sinks_reference` below is a dense construction of section 6 written from the SPEC text
  (sinks seen raw, groups from position N, `n_core(t) = max(0, (t - N + 1 - s) // g)`); it
  never calls cca_jax. The implementations hold the sinks differently (slots of one token,
  once they leave the raw window: `cca_jax.blocks`), so equality checks that representation.
* Equality for several (L, g, s, N, G) (L not a multiple of g, N > s, N = 1, packed rows),
  on naive and xla; gradients against `jax.grad` of the reference in float64.
* Properties 1, 2 (g = 1 or s >= L - N: causal full attention), 5 (causality), 6 (decode and
  chunked prefill equal one forward, through the KV cache).
* N = 0 is today's CCA bit for bit (the call without the argument, every implementation).
* The Pallas GPU kernels in interpret mode and the TPU kernels in the TPU interpreter, small
  shapes; sequence sharding on 8 simulated CPU devices; the config (old config.json files
  load as plain CCA) and the CLI flags. `gpu`: the kernels compiled on a GPU.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.attention import cca_attention, run_attention
from cca_jax.blocks import CCA, parse_option
from cca_jax.config import CCA_CONFIG_KEY, AttentionConfig, LlamaConfig


# ---- the reference: SPEC section 6 by dense masks ------------------------------------------

def _documents(segment_ids, b: int, length: int):
    """(document index, in-document position), numpy `[B, L]` each."""
    seg = np.zeros((b, length), int) if segment_ids is None else np.asarray(segment_ids)
    new = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    doc = np.cumsum(new, axis=1)
    t = np.arange(length)
    start = np.maximum.accumulate(np.where(new, t, 0), axis=1)
    return doc, t - start


def spec_masks(length, g, s, n, segment_ids=None, b=1):
    """SPEC 6 visibility, numpy: raw `[B, L, L]` (sinks and the local window) and core
    `[B, L, L]` (query t sees the core token of the group ending at key position e)."""
    doc, pos = _documents(segment_ids, b, length)
    same = doc[:, :, None] == doc[:, None, :]
    causal = np.tril(np.ones((length, length), bool))[None]
    n_core = np.maximum(0, (pos - n + 1 - s) // g)                   # [B, L]
    key = pos[:, None, :]
    raw = same & causal & ((key < n) | (key >= n + g * n_core[:, :, None]))
    ends = (pos >= n + g - 1) & ((pos - n + 1) % g == 0)             # group j = (p-n+1)/g - 1
    group = (pos - n + 1) // g - 1
    core = same & causal & ends[:, None, :] & (group[:, None, :] < n_core[:, :, None])
    return raw, core


def sinks_reference(q, k, v, g, s, n, segment_ids=None, pooling="cca"):
    """SPEC 6 by dense masks in the inputs' dtype (float64 under x64): one softmax over the
    sinks, the core tokens (pooled with the query of each group's last position) and the
    local window. Differentiable (`jax.grad` gives the reference gradients)."""
    b, length, hq, d = q.shape
    reps = hq // k.shape[2]
    k, v = jnp.repeat(k, reps, axis=2), jnp.repeat(v, reps, axis=2)
    raw, core = spec_masks(length, g, s, n, segment_ids, b)
    members = np.clip(np.arange(length)[:, None] - g + 1 + np.arange(g), 0, length - 1)
    km, vm = k[:, members], v[:, members]                            # [B, L, g, H, D]
    if pooling == "cca":
        a = jax.nn.softmax(jnp.einsum("behd,beuhd->behu", q, km) / np.sqrt(d), axis=-1)
        ck, cv = jnp.einsum("behu,beuhd->behd", a, km), jnp.einsum("behu,beuhd->behd", a, vm)
    else:
        ck, cv = km.mean(axis=2), vm.mean(axis=2)
    low = jnp.finfo(q.dtype).min
    logits = jnp.concatenate([
        jnp.where(core[:, None], jnp.einsum("bthd,behd->bhte", q, ck), low),
        jnp.where(raw[:, None], jnp.einsum("bthd,buhd->bhtu", q, k), low)], axis=-1)
    p = jax.nn.softmax(logits / np.sqrt(d), axis=-1)
    return (jnp.einsum("bhte,behd->bthd", p[..., :length], cv)
            + jnp.einsum("bhtu,buhd->bthd", p[..., length:], v))


def causal_reference(q, k, v, segment_ids=None):
    """Causal full attention inside each document (what properties 1 and 2 reduce CCA to)."""
    b, length, hq, d = q.shape
    return sinks_reference(q, k, v, 1, length + 1, length, segment_ids)   # every key a sink


def _inputs(b, length, hq, hkv, d, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((b, length, h, d)), jnp.float32)
                   for h in (hq, hkv, hkv, hq))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), ct


def _segments(b, length, cuts):
    """Row 0 one document; the others cut at `cuts` (an id reused: 0 1 0 ...)."""
    seg = np.zeros((b, length), np.int32)
    for row in range(1, b):
        seg[row] = np.searchsorted(np.asarray(cuts), np.arange(length), side="right") % 2
    return seg


def _f64(fn, *args):
    with jax.enable_x64(True):
        return jax.device_get(fn(*(jnp.asarray(np.asarray(x, np.float64)) for x in args)))


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# name: (B, L, Hq, Hkv, g, s, N, packed cuts or None)
CASES = {
    "ragged_gqa": (1, 37, 4, 2, 4, 6, 2, None),           # L % g != 0, s % g != 0, G = 2
    "n_above_s_packed": (2, 40, 2, 1, 3, 5, 7, (9, 31)),  # N > s, documents shorter than N
    "one_sink_packed": (2, 29, 4, 1, 5, 3, 1, (6, 17)),   # N = 1, s < g, G = 4
}
# Against float32 naive / xla on the same inputs (|out| <= ~3): measured max 4e-7 -> x5.
OUT_TOL = 2e-6
# Gradients (|grad| <= ~10): measured max 1.9e-6 -> x5.
GRAD_TOL = 1e-5


def _case(name, seed=0, d=16):
    b, length, hq, hkv, g, s, n, cuts = CASES[name]
    q, k, v, ct = _inputs(b, length, hq, hkv, d, seed)
    seg = None if cuts is None else _segments(b, length, cuts)
    return (q, k, v, ct, seg), dict(group_size=g, window_size=s, sink_tokens=n)


def _out_and_grads(attend):
    def run(q, k, v, ct):
        def loss(q, k, v):
            out = attend(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * ct), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads
    return run


@functools.lru_cache(maxsize=None)
def _reference(name):
    (q, k, v, ct, seg), kw = _case(name)
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    return _f64(_out_and_grads(lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg)),
                q, k, v, ct)


# ---- the visibility arithmetic (blocks) -----------------------------------------------------

# (g, s, N): g = 1, s < g, s % g != 0, N > s, N > s + g, N = 1.
SMALL_PATTERNS = [(1, 2, 3), (2, 1, 1), (3, 4, 2), (3, 2, 6), (5, 7, 1), (4, 3, 9), (2, 7, 3)]


def test_bounds_see_every_earlier_position_once_as_spec_6_says():
    """`pattern_dense_visibility` (the bounds every kernel, the cache and the FLOP count read)
    against SPEC 6's masks, packed and not, for many (g, s, N): the same positions, each seen
    once (a sink raw or through its one-token slot, a group through its core token); the raw
    window never holds more than s + g - 1 keys, so the ring stays s + g; the visible scores
    (FLOP count) are the SPEC's."""
    length = 23
    seg = np.repeat([0, 1, 0, 2], [3, 9, 8, 3])[None]
    for g, s, n in SMALL_PATTERNS:
        pat = CCA(g, s, n)
        for segment_ids in (None, seg):
            raw, slot = blocks.pattern_dense_visibility(pat, length, segment_ids)
            ranges = blocks.pattern_ranges(pat, length, segment_ids)
            first = (np.arange(slot.shape[2]) if segment_ids is None
                     else np.asarray(ranges.group_start[0]))
            last = (pat.slot_last(np.arange(slot.shape[2])) if segment_ids is None
                    else np.asarray(ranges.group_last[0]))
            if segment_ids is None:
                first = pat.slot_first(first)
            seen = raw[0].astype(int)
            for c in range(slot.shape[2]):
                rows = np.flatnonzero(slot[0, :, c])
                seen[np.ix_(rows, np.arange(first[c], last[c] + 1))] += 1
                assert last[c] - first[c] + 1 in (1, g)
            want_raw, want_core = spec_masks(length, g, s, n, segment_ids)
            spec_seen = want_raw[0] | want_core[0]          # group ends stand for the group
            for e in np.flatnonzero(want_core[0].any(axis=0)):
                spec_seen[np.ix_(want_core[0][:, e], np.arange(e - g + 1, e + 1))] = True
            np.testing.assert_array_equal(seen, spec_seen.astype(int), err_msg=str((g, s, n)))
            assert (raw[0].sum(axis=1) <= s + g - 1).all()
            if segment_ids is None:
                assert pat.visible_scores(length) == raw.sum() + slot.sum()
        assert blocks.ring_size(pat, 64) == min(64, s + g)
        assert blocks.widest_window(pat, 64) <= s + g - 1


def test_sinks_as_slots_keeps_what_every_row_sees_and_splits_the_row_at_n():
    """`blocks.sinks_as_slots` (the Mosaic kernels' frame after the sinks) on unpacked rows:
    every row sees the same tokens as under `pattern_ranges` (a lead slot stands for its
    token), rows t >= N see no raw key below N, rows t < N see no slot, and shifted by N the
    raw windows are CCA's without sinks. `lead_rows` is 0 where not all N sinks are pooled;
    the function then refuses."""
    for g, s, n in SMALL_PATTERNS + [(16, 64, 4), (16, 1024, 4)]:
        pat = CCA(g, s, n)
        length = n + s + g + 37
        assert blocks.lead_rows(pat, length) == n
        assert blocks.lead_rows(pat, n + s + g - 2) == 0
        r = blocks.pattern_ranges(pat, length)
        before = [np.asarray(x) for x in r[:3]]
        after = blocks.sinks_as_slots(pat, *before)
        traced = blocks.sinks_as_slots(pat, *(jnp.asarray(x) for x in before))
        for a, b in zip(after, traced):
            np.testing.assert_array_equal(a, np.asarray(b))
        t = np.arange(length)

        def seen(raw_lo, core_lo, core_hi):
            tokens = (t[None, :] >= raw_lo[0][:, None]) & (t[None, :] <= t[:, None])
            for c in range(pat.max_slots(length)):
                rows = (c >= core_lo[0]) & (c < core_hi[0])
                first, last = pat.slot_first(c), pat.slot_last(c)
                assert not (tokens[rows, first:last + 1]).any()     # each once
                tokens[rows, first:last + 1] = True
            return tokens
        np.testing.assert_array_equal(seen(*after), seen(*before), err_msg=str(pat))
        raw_lo, core_lo, core_hi = (x[0] for x in after)
        assert (raw_lo[n:] >= n).all() and (core_hi[:n] == core_lo[:n]).all()
        assert (np.diff(raw_lo) >= 0).all() and (np.diff(core_hi) >= 0).all()
        np.testing.assert_array_equal(raw_lo[n:] - n, CCA(g, s).raw_start(t[:length - n]))
        if s + g - 1 < n:       # some rows t < N saw sinks through slots: moved back
            assert (before[2][0, :n] > 0).any()
    with pytest.raises(ValueError, match="sinks are all pooled"):
        blocks.sinks_as_slots(CCA(4, 8, 2), *(np.zeros((1, 10), np.int32),) * 3)


def test_cache_arithmetic_with_sinks():
    """The cache's slot bookkeeping: `completed_slot` is the inverse of `slot_last`; every
    slot a query sees fits in `max_slots` and was completed at or before it; `chunk_slots`'
    candidates are in order and contain exactly the slots ending in the chunk; the packed
    slot bound holds for random packings; `slot_ends_bound` holds for every window."""
    rng = np.random.default_rng(0)
    for g, s, n in SMALL_PATTERNS:
        pat = CCA(g, s, n)
        t = np.arange(40)
        done = blocks.completed_slot(pat, t)
        ends = t[done >= 0]
        np.testing.assert_array_equal(pat.slot_last(done[done >= 0]), ends)
        np.testing.assert_array_equal(done[done >= 0], np.arange(len(ends)))
        assert pat.max_slots(40) == pat.num_slots(39)
        for p0 in range(30):
            for chunk in (1, 3, 8):
                slot, start = blocks.chunk_slots(pat, np.asarray([p0]), chunk, front=50)
                want = [c for c in range(len(ends)) if p0 <= ends[c] < p0 + chunk]
                real = [int(c) for c in slot[0] if pat.slot_last(c) < p0 + chunk]
                assert real == want and (np.diff(slot[0]) == 1).all()
                np.testing.assert_array_equal(start[0] - 50 + p0, pat.slot_first(slot[0]))
        for _ in range(5):
            cuts = np.sort(rng.choice(np.arange(1, 60), rng.integers(1, 8), replace=False))
            seg = np.searchsorted(cuts, np.arange(60), side="right")[None]
            r = blocks.pattern_ranges(pat, 60, seg)
            used = int(np.asarray(r.core_hi).max())
            assert used <= pat.max_slots(60, packed=True)
            last = np.asarray(r.group_last[0])[:used]
            for rows in (1, 5, 12):
                counts = np.bincount(last // rows) if used else [0]
                assert max(counts) <= blocks.slot_ends_bound(pat, rows, packed=True)


# ---- equality with the reference, gradients, causality ---------------------------------------

def _xla_and_reference(name):
    (q, k, v, ct, seg), kw = _case(name)
    xla = jax.jit(_out_and_grads(functools.partial(cca_attention, implementation="xla",
                                                   segment_ids=seg, **kw)))
    return (q, k, v, ct), xla, _reference(name)


def test_xla_matches_the_reference_and_is_causal():
    """N = 7 > s = 5, g = 3, G = 2, packed rows (documents shorter than N and than s + g,
    an id reused): outputs and q/k/v gradients of the blocked XLA implementation (its custom
    VJP and the pooling's) against `jax.grad` of the float64 reference. Property 5 on the same
    program: changing q, k, v after position t never changes out[t]."""
    (q, k, v, ct), xla, (ref, ref_grads) = _xla_and_reference("n_above_s_packed")
    out, grads = xla(q, k, v, ct)
    assert _max_err(out, ref) < OUT_TOL, _max_err(out, ref)
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert _max_err(got, want) < GRAD_TOL, (dname, _max_err(got, want))
    base = np.asarray(out)
    for t in (0, 6, 21, 38):
        bump = jnp.zeros(q.shape[1]).at[t + 1:].set(3.0)[None, :, None, None]
        later, _ = xla(q + bump, k - bump[..., :1, :], v + bump[..., :1, :], ct)
        np.testing.assert_array_equal(np.asarray(later)[:, :t + 1], base[:, :t + 1])
        assert not np.array_equal(np.asarray(later)[:, t + 1:], base[:, t + 1:])


def test_naive_matches_the_reference_and_full_attention():
    """naive (dense masks) against the reference: N = 1, s = 3 < g = 5, G = 4, packed;
    properties 1 and 2 with sinks: g = 1, and s >= L - N, are causal full attention."""
    (q, k, v, _, seg), kw = _case("one_sink_packed")
    naive = jax.jit(lambda q, k, v, **kw: cca_attention(q, k, v, implementation="naive",
                                                        segment_ids=seg, **kw),
                    static_argnames=("group_size", "window_size", "sink_tokens"))
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    ref = _f64(lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg), q, k, v)
    assert _max_err(naive(q, k, v, **kw), ref) < OUT_TOL
    full = _f64(lambda q, k, v: causal_reference(q, k, v, seg), q, k, v)
    for g, s, n in ((1, 3, 2), (4, 27, 2)):      # L = 29: s >= L - N
        got = naive(q, k, v, group_size=g, window_size=s, sink_tokens=n)
        assert _max_err(got, full) < OUT_TOL, (g, s, n)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_naive_and_xla_match_the_reference(name):
    (q, k, v, ct, seg), kw = _case(name)
    ref, ref_grads = _reference(name)
    for impl in ("naive", "xla"):
        attend = functools.partial(cca_attention, implementation=impl, segment_ids=seg, **kw)
        out, grads = jax.jit(_out_and_grads(attend))(q, k, v, ct)
        assert _max_err(out, ref) < OUT_TOL, (impl, _max_err(out, ref))
        for dname, got, want in zip("qkv", grads, ref_grads):
            assert _max_err(got, want) < GRAD_TOL, (impl, dname, _max_err(got, want))


@pytest.mark.slow
def test_sinks_change_the_result():
    """The tests are sensitive: N sinks differ from N = 0 and from N - 1 (a sink each)."""
    (q, k, v, _, seg), kw = _case("ragged_gqa")
    outs = [np.asarray(cca_attention(q, k, v, **dict(kw, sink_tokens=n),
                                     implementation="naive")) for n in (0, 1, 2)]
    assert _max_err(outs[0], outs[1]) > 1e-2 and _max_err(outs[1], outs[2]) > 1e-2


@pytest.mark.slow
def test_mean_pooling_with_sinks():
    (q, k, v, _, seg), kw = _case("n_above_s_packed")
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    ref = _f64(lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg, pooling="mean"), q, k, v)
    out = cca_attention(q, k, v, pooling="mean", implementation="xla", segment_ids=seg, **kw)
    assert _max_err(out, ref) < OUT_TOL


@pytest.mark.slow
@pytest.mark.parametrize("g,s,n", [(1, 3, 2), (4, 30, 5), (3, 8, 40)])
def test_properties_1_and_2_on_xla(g, s, n):
    """g = 1, or s >= L - N (also N >= L): causal full attention, packed rows too."""
    q, k, v, _ = _inputs(2, 36, 2, 1, 8, seed=3)
    seg = _segments(2, 36, (13,))
    want = _f64(lambda q, k, v: causal_reference(q, k, v, seg), q, k, v)
    got = cca_attention(q, k, v, group_size=g, window_size=s, sink_tokens=n,
                        implementation="xla", segment_ids=seg)
    assert _max_err(got, want) < OUT_TOL


# ---- N = 0 is today's CCA ------------------------------------------------------------------

def test_zero_sinks_is_the_papers_cca_bit_for_bit():
    """sink_tokens=0 runs the very program of a call without it (and of the pattern written
    out): equal jaxprs, forward and gradients, on naive, xla, the Pallas GPU kernels
    (interpret mode) and the TPU kernels, so equal bits on every backend. (Against the code
    before sinks existed the outputs were compared once, bit for bit, on all these paths,
    sequence sharding and the KV cache included.) The bounds are SPEC 2's formulas."""
    from cca_jax.attention.pallas_tpu import cca_attention_pallas_tpu
    (q, k, v, ct, seg), _ = _case("n_above_s_packed", d=64)
    kw = dict(group_size=3, window_size=5, segment_ids=seg)
    entries = {impl: functools.partial(cca_attention, implementation=impl)
               for impl in ("naive", "xla", "pallas_gpu")}
    entries["pallas_tpu"] = functools.partial(cca_attention_pallas_tpu, interpret=False)
    for impl, entry in entries.items():
        programs = [str(jax.make_jaxpr(_out_and_grads(functools.partial(entry, **kw, **extra)))(
            q, k, v, ct)) for extra in ({}, {"sink_tokens": 0})]
        assert programs[0] == programs[1], impl
    plain = jax.make_jaxpr(lambda q, k, v: run_attention(
        q, k, v, CCA(3, 5), segment_ids=seg, implementation="xla"))(q, k, v)
    zero = jax.make_jaxpr(lambda q, k, v: cca_attention(q, k, v, sink_tokens=0,
                                                        implementation="xla", **kw))(q, k, v)
    assert str(plain) == str(zero)
    pat = CCA(4, 6)
    assert pat == parse_option("cca", group_size=4, window_size=6, sink_tokens=0)
    assert pat == AttentionConfig(group_size=4, window_size=6).pattern
    t = np.arange(100)
    n_core = np.maximum(0, t + 1 - 6) // 4
    np.testing.assert_array_equal(pat.num_slots(t), n_core)
    np.testing.assert_array_equal(pat.raw_start(t), 4 * n_core)
    assert pat.max_slots(100) == (100 - 6) // 4 == pat.max_slots(100, packed=True)
    # Packed (documents of 40 and 60): (40 - 6) // 4 + (60 - 6) // 4 = 21 groups of 4 tokens,
    # then 2 unused slots of the static 23.
    r = blocks.pattern_ranges(pat, 100, np.repeat([0, 1], [40, 60])[None])
    np.testing.assert_array_equal(np.asarray(r.group_last) - np.asarray(r.group_start),
                                  [[3] * 21 + [0] * 2])


# ---- the kernels ---------------------------------------------------------------------------

def test_pallas_gpu_kernels_interpret():
    """The Triton-lowered kernels (forward, dq, dk/dv, dcore) in interpret mode on a packed
    case with N > s: outputs and gradients against the float64 reference."""
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    (q, k, v, ct, seg), kw = _case("n_above_s_packed", d=64)
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    ref, ref_grads = _f64(_out_and_grads(
        lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg)), q, k, v, ct)
    small = dict(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkv_block_k=16,
                 dkv_block_q=16, dc_block_k=16, dc_block_q=16)
    attend = functools.partial(cca_attention_pallas_gpu, segment_ids=seg, interpret=True,
                               **kw, **small)
    out, grads = jax.jit(_out_and_grads(attend))(q, k, v, ct)
    assert _max_err(out, ref) < OUT_TOL
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert _max_err(got, want) < 4 * GRAD_TOL, (dname, _max_err(got, want))


@pytest.mark.slow   # ~30 s interpreted; the sinks kernels path stays in the default run
def test_pallas_gpu_narrow_edge_blocks_interpret():
    """Sinks off the group grid with s a multiple of the blocks (the paper's geometry, where
    the kernels visit narrow head/tail blocks: `blocks.narrow_head` / `narrow_tail`): forward
    and dq windows starting in the last keys of a key block, dk/dv key blocks last seen in
    the first rows of a query block. Narrow edges on and off, against float64."""
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    g, s, n, length = 4, 32, 3, 128
    q, k, v, ct = _inputs(1, length, 2, 1, 64, seed=5)
    pattern = CCA(g, s, n)
    raw_lo = np.asarray(pattern.raw_start(np.arange(length)))
    heads = [blocks.narrow_head(blocks.raw_blocks_for_rows(r0, r0 + 31, int(raw_lo[r0]),
                                                           int(raw_lo[r0 + 31]), 32),
                                int(raw_lo[r0]), 32, 8)[0] for r0 in range(0, length, 32)]
    assert sum(heads) >= 2, heads                    # the narrow path is exercised
    ref, ref_grads = _f64(_out_and_grads(
        lambda q, k, v: sinks_reference(q, k, v, g, s, n)), q, k, v, ct)
    tiles = dict(block_q=32, block_k=32, dq_block_q=32, dq_block_k=32, dkv_block_k=32,
                 dkv_block_q=32, dc_block_k=32, dc_block_q=32)
    for narrow in (8, 0):
        attend = functools.partial(cca_attention_pallas_gpu, group_size=g, window_size=s,
                                   sink_tokens=n, interpret=True, narrow_block=narrow,
                                   dq_narrow_block=narrow, dkv_narrow_block=narrow, **tiles)
        out, grads = jax.jit(_out_and_grads(attend))(q, k, v, ct)
        assert _max_err(out, ref) < OUT_TOL, narrow
        for dname, got, want in zip("qkv", grads, ref_grads):
            assert _max_err(got, want) < 4 * GRAD_TOL, (narrow, dname, _max_err(got, want))


def _tpu_case(grads: bool):
    """The Mosaic kernels in the TPU interpreter (out-of-bounds reads raise, fresh memory is
    NaN, races detected): L = 150 (not a multiple of g or of the 128-row blocks), G = 2,
    N = 9 > s = 7, one packed row and one plain."""
    from jax.experimental.pallas import tpu as pltpu

    from cca_jax.attention.pallas_tpu import cca_attention_pallas_tpu
    strict = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                   uninitialized_memory="nan")
    q, k, v, ct = _inputs(2, 150, 2, 1, 128, seed=5)
    seg = _segments(2, 150, (70,))
    attend = functools.partial(cca_attention_pallas_tpu, group_size=4, window_size=7,
                               sink_tokens=9, segment_ids=seg, interpret=strict, block_q=128,
                               block_k=128, block_c=128)
    reference = functools.partial(sinks_reference, g=4, s=7, n=9, segment_ids=seg)
    try:
        if not grads:
            out = jax.jit(attend)(q, k, v)
            assert _max_err(out, _f64(reference, q, k, v)) < 3 * OUT_TOL
            return
        out, grads = jax.jit(_out_and_grads(attend))(q, k, v, ct)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    ref, ref_grads = _f64(_out_and_grads(reference), q, k, v, ct)
    assert _max_err(out, ref) < 3 * OUT_TOL
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert _max_err(got, want) < 4 * GRAD_TOL, (dname, _max_err(got, want))


def test_pallas_tpu_kernels_interpret():
    _tpu_case(grads=False)


@pytest.mark.slow
def test_pallas_tpu_kernels_interpret_gradients():
    _tpu_case(grads=True)


@pytest.mark.parametrize("kernel", ["pallas_gpu",
                                    pytest.param("pallas_tpu", marks=pytest.mark.slow)])
def test_decode_kernels_with_sinks(kernel):
    """The decode kernels read a cache whose first slots are the sinks: against the dense
    XLA form (`cached_attention` with the cache masks) at positions before, at and after the
    sinks leave the window (t = s + g - 1 .. s + g + N - 2) and after the first core token."""
    from cca_jax.decode import cached_attention
    pat = CCA(4, 10, 3)                      # R = 14; sinks leave from t = 13
    max_len, hq, hkv, d = 60, 4, 2, 128 if kernel == "pallas_tpu" else 16
    ring, slots = blocks.ring_size(pat, max_len), pat.max_slots(max_len)
    positions = np.asarray([0, 2, 12, 13, 14, 15, 16, 59])
    rng = np.random.default_rng(7)
    q, kr, vr = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
                 ((8, hq, d), (8, ring, hkv, d), (8, ring, hkv, d)))
    ck, cv = (jnp.asarray(rng.standard_normal((8, slots, hq, d)), jnp.float32) for _ in "kv")
    bounds = blocks.decode_bounds(pat, positions, ring, slots)
    if kernel == "pallas_gpu":
        from pallas_kernels.gpu import decode_attention_pallas_gpu
        out = decode_attention_pallas_gpu(q, kr, vr, ck, cv, bounds, interpret=True, block=16)
    else:
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.tpu import decode_attention_pallas_tpu
        try:
            out = decode_attention_pallas_tpu(q, kr, vr, ck, cv, bounds,
                                              interpret=pltpu.InterpretParams())
        finally:
            pltpu.reset_tpu_interpret_mode_state()
    want = cached_attention(q, kr, vr, ck, cv,
                            jnp.asarray(blocks.cache_raw_visible(pat, positions, ring)),
                            jnp.asarray(blocks.cache_slot_visible(pat, positions, slots)))
    assert _max_err(out, want) < 2e-5


# ---- sequence sharding -----------------------------------------------------------------------

def _sharded_case(mesh_shape, packed, zigzag):
    from cca_jax.attention.sequence_parallel import sequence_sharded_attention
    from cca_jax.sharding import make_mesh
    mesh = make_mesh(mesh_shape, devices=jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    pat = CCA(3, 7, 9)                  # N > s; halo s + g - 2 = 8 <= chunks of 12
    q, k, v, ct = _inputs(2, 192, 4, 2, 8, seed=11)
    seg = jnp.asarray(_segments(2, 192, (20, 100, 131))) if packed else None
    sharded = jax.jit(_out_and_grads(lambda q, k, v: sequence_sharded_attention(
        q, k, v, pat, mesh=mesh, segment_ids=seg, zigzag=zigzag)))
    plain = jax.jit(_out_and_grads(lambda q, k, v: run_attention(
        q, k, v, pat, implementation="xla", segment_ids=seg)))
    for got, want in zip(jax.tree.leaves(sharded(q, k, v, ct)),
                         jax.tree.leaves(plain(q, k, v, ct))):
        assert _max_err(got, want) < 2e-5


def test_sequence_sharded_with_sinks():
    """8 shards, zigzag, packed rows (documents cross shard boundaries; the sinks of a
    document live on the shard of its start): outputs and gradients equal one device's."""
    _sharded_case({"sequence": 8}, packed=True, zigzag=True)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,packed,zigzag", [
    ({"sequence": 8}, False, True), ({"data": 2, "sequence": 4}, True, False),
    ({"sequence": 4}, False, False)])
def test_sequence_sharded_with_sinks_more_layouts(mesh_shape, packed, zigzag):
    _sharded_case(mesh_shape, packed, zigzag)


# ---- the KV cache: decode and chunked prefill equal one forward (property 6) ---------------

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            dtype="float32", param_dtype="float32")
LOGIT_TOL = 2e-5


def _tiny_model(cfg=None, **attention):
    """A tiny float32 model with sharper attention than the 0.02 init (weights x 4), so that
    sinks, groups and windows show in the logits; the same weights for the same config."""
    from flax import nnx

    from cca_jax.model import LlamaForCausalLM
    cfg = cfg or LlamaConfig(**TINY, attention=dict(attention, implementation="naive"))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim > 1 else p, params))
    return model


def test_property_6_decode_and_chunked_prefill_equal_one_forward():
    """g = 4, s = 6, N = 3, G = 2; rows of 29, 18 and 24 tokens: prompts of 5, 9 and 0
    tokens prefilled in chunks of 4 then decoded token by token, and every row prefilled in
    chunks of 4 (sinks, groups and windows cross the chunks); logits at every position equal
    one forward of the model (naive attention), both leave the same cache, and its first
    slots hold the sinks' raw keys and values."""
    from flax import nnx

    from cca_jax.decode import decode_step
    from cca_jax.prefill import prefill
    from cca_jax.kv_cache import init_cache
    model = _tiny_model(kind="cca", group_size=4, window_size=6, sink_tokens=3)
    cfg = model.config
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 29)).astype(np.int32)
    lengths, prompts = np.array([29, 18, 24]), np.array([5, 9, 0])
    ref = np.asarray(jax.jit(lambda ids: model(ids))(jnp.asarray(ids)))
    cache = init_cache(cfg, 3, 32)
    assert cache.num_slots == 3 + (32 - 3 - 6) // 4 and cache.ring == 10
    cache, _, logits = prefill(model, cache, ids[:, :9], prompts, chunk_size=4,
                               return_all_logits=True)
    for b, n in enumerate(prompts[:2]):       # row 2 has no prompt
        assert _max_err(np.asarray(logits)[b, :n], ref[b, :n]) < LOGIT_TOL
    # Row 1 (9 tokens): the ring still holds positions 0 .. 8; slots 0 .. 2 are the sinks'
    # raw (RoPE'd) keys and values, copied per query head (query head h reads KV head h // 2).
    for raw, slot in ((cache.k, cache.ck), (cache.v, cache.cv)):
        sinks = np.repeat(np.asarray(raw[:, 1, :3]), 2, axis=2)
        np.testing.assert_array_equal(np.asarray(slot[:, 1, :3]), sinks)
    state = nnx.split(model)
    for step in range(int((lengths - prompts).max())):
        pos = prompts + step
        active = pos < lengths
        tokens = ids[np.arange(3), np.minimum(pos, 28)]
        out, cache = decode_step(state, cache, jnp.asarray(tokens), jnp.asarray(active))
        for b in np.flatnonzero(active):
            assert _max_err(np.asarray(out)[b], ref[b, pos[b]]) < LOGIT_TOL, (b, pos[b])
    whole = init_cache(cfg, 3, 32)
    whole, _, logits = prefill(model, whole, ids, lengths, chunk_size=4,
                               return_all_logits=True)
    for b, n in enumerate(lengths):
        assert _max_err(np.asarray(logits)[b, :n], ref[b, :n]) < LOGIT_TOL
    np.testing.assert_array_equal(np.asarray(whole.lengths), lengths)
    for name in ("k", "v", "ck", "cv"):
        assert _max_err(getattr(cache, name), getattr(whole, name)) < 1e-5, name


# ---- configuration, config.json and the CLI flags -------------------------------------------

OLD_CCA_RECORD = {"kind": "cca", "group_size": 16, "window_size": 1024, "sink_tokens": 4,
                  "pooling": "cca", "implementation": "auto"}
HF = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_defaults_per_option():
    assert AttentionConfig().sink_tokens == 0 and AttentionConfig().pattern == CCA(16, 1024)
    assert AttentionConfig(kind="streaming").sink_tokens == 4
    assert AttentionConfig(kind="cca", sink_tokens=4).pattern.sink_tokens == 4
    c = LlamaConfig(**HF)
    assert c.replace(attention="streaming").attention.sink_tokens == 4   # its own default
    s8 = c.replace(attention="streaming", sink_tokens=8)
    assert s8.attention.sink_tokens == 8
    assert s8.replace(attention="cca").attention.sink_tokens == 0        # cca's default
    assert s8.replace(window_size=9).attention.sink_tokens == 8          # same option: kept
    sinks = c.replace(sink_tokens=4)
    assert sinks.attention.pattern == CCA(16, 1024, 4)
    assert sinks.replace(attention="cca").attention.sink_tokens == 4
    with pytest.raises(ValueError, match="sink_tokens"):
        c.replace(sink_tokens=-1)


def test_old_cca_config_json_loads_as_plain_cca_and_new_ones_round_trip(tmp_path):
    """A config.json written before sinks applied to cca (no "format", sink_tokens 4 from
    the streaming default) loads with 0 sinks; streaming's 4 stay; a new cca config with
    sinks round-trips through config.json, with the format marker written."""
    old = LlamaConfig.from_hf_dict({**HF, CCA_CONFIG_KEY: OLD_CCA_RECORD})
    assert old.attention.sink_tokens == 0 and old.attention.pattern == CCA(16, 1024)
    old_streaming = LlamaConfig.from_hf_dict(
        {**HF, CCA_CONFIG_KEY: dict(OLD_CCA_RECORD, kind="streaming", sink_tokens=6)})
    assert old_streaming.attention.sink_tokens == 6
    # Overrides (the CLI flags) still apply to an old file.
    assert LlamaConfig.from_hf_dict({**HF, CCA_CONFIG_KEY: OLD_CCA_RECORD},
                                    sink_tokens=4).attention.sink_tokens == 4
    new = LlamaConfig(**HF).replace(sink_tokens=4, group_size=8, window_size=64)
    written = new.to_hf_dict()
    assert written[CCA_CONFIG_KEY]["format"] == 2 and written[CCA_CONFIG_KEY]["sink_tokens"] == 4
    (tmp_path / "config.json").write_text(json.dumps(written))
    back = LlamaConfig.from_pretrained_dir(tmp_path)
    assert back == new and back.attention.pattern == CCA(8, 64, 4)
    plain = LlamaConfig(**HF)
    assert LlamaConfig.from_hf_dict(plain.to_hf_dict()) == plain
    with pytest.raises(ValueError, match="update cca-jax"):
        LlamaConfig.from_hf_dict({**HF, CCA_CONFIG_KEY: dict(OLD_CCA_RECORD, format=99)})


def test_cli_flags_reach_cca():
    """--sink-tokens with --attention cca in generate / eval (shared flags) and
    train.finetune: the model config they build runs CCA with sinks."""
    import argparse

    from cca_jax.cli import add_attention_args, attention_overrides
    from train.config import TrainConfig
    ap = argparse.ArgumentParser()
    add_attention_args(ap)
    a = ap.parse_args(["--attention", "cca", "--group-size", "8", "--sink-tokens", "4"])
    cfg = LlamaConfig(**HF).replace(**attention_overrides(a))
    assert cfg.attention.pattern == CCA(8, 1024, 4)
    plain = LlamaConfig(**HF).replace(**attention_overrides(ap.parse_args(["--attention",
                                                                           "cca"])))
    assert plain.attention.sink_tokens == 0
    train = TrainConfig(out="x", preset="tiny", attention="cca", sink_tokens=4)
    assert LlamaConfig(**HF).replace(**train.model_overrides()).attention.sink_tokens == 4


@pytest.mark.slow
def test_converter_records_sinks(tmp_path):
    """convert.hf_to_flax's settings (what --sink-tokens passes) are recorded in the
    converted config.json and load back."""
    from convert.hf_to_flax import convert_hf_to_flax
    from tests.hf_fixtures import make_tiny_hf
    make_tiny_hf("llama2", tmp_path / "hf")
    out = convert_hf_to_flax(tmp_path / "hf", tmp_path / "ours", attention="cca",
                             group_size=4, window_size=16, sink_tokens=4, verbose=False)
    record = json.loads((out / "config.json").read_text())[CCA_CONFIG_KEY]
    assert record["sink_tokens"] == 4 and record["format"] == 2
    assert (LlamaConfig.from_pretrained_dir(out).attention.pattern == CCA(4, 16, 4))


# ---- on a GPU -----------------------------------------------------------------------------

def _gpu_case(length, packed, dtype):
    q, k, v, ct = _inputs(1, length, 4, 2, 128, seed=13, dtype=dtype)
    seg = _segments(2, length, (length // 3, 2 * length // 3))[1:] if packed else None
    return q, k, v, ct, seg


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype,packed", [("bfloat16", False), ("float32", True)])
def test_gpu_kernels_match_the_reference(dtype, packed):
    """The compiled Triton kernels (default tiling) with N = 4, g = 16, s = 256 at L = 2048
    against the float64 reference: relative L2 errors of the output and gradients (the
    tolerances of tests/test_pallas_gpu.py's plain CCA)."""
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    q, k, v, ct, seg = _gpu_case(2048, packed, dtype)
    kw = dict(group_size=16, window_size=256, sink_tokens=4)
    out, grads = jax.jit(_out_and_grads(functools.partial(
        cca_attention_pallas_gpu, segment_ids=seg, **kw)))(q, k, v, ct)
    ref, ref_grads = _f64(_out_and_grads(
        lambda q, k, v: sinks_reference(q, k, v, 16, 256, 4, seg)), q, k, v, ct)
    tol = {"bfloat16": (6.3e-3, 1.05e-2), "float32": (1.1e-3, 1.6e-3)}[dtype]

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert rel(out, ref) < tol[0], rel(out, ref)
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert rel(got, want) < tol[1], (dname, rel(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_gpu_decode_and_prefill_equal_one_forward():
    """Property 6 on the GPU with the Pallas prefill and decode kernels (float32 model):
    a prompt prefilled in chunks of 16 then decoded, against one forward of the same weights
    through the dense naive implementation."""
    from flax import nnx

    from cca_jax.decode import decode_step
    from cca_jax.prefill import prefill
    from cca_jax.kv_cache import init_cache
    cfg = LlamaConfig(**dict(TINY, head_dim=64, max_position_embeddings=256),
                      attention=dict(kind="cca", group_size=4, window_size=24, sink_tokens=4,
                                     implementation="pallas_gpu"))
    model = _tiny_model(cfg)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 120)),
                      jnp.int32)
    ref, plain = (np.asarray(_tiny_model(cfg.replace(implementation="naive", **kw))(ids))
                  for kw in ({}, {"sink_tokens": 0}))
    tol = 1e-2 * np.abs(ref).max()      # TF32 dots on the GPU; the sinks change ~0.1 of it
    assert _max_err(plain, ref) > 10 * tol
    cache = init_cache(cfg, 2, 128)
    cache, _, logits = prefill(model, cache, ids[:, :70], chunk_size=16,
                               return_all_logits=True)
    assert _max_err(logits, ref[:, :70]) < tol
    state = nnx.split(model)
    for t in range(70, 120):
        out, cache = decode_step(state, cache, ids[:, t])
        assert _max_err(out, ref[:, t]) < tol, t


def test_pallas_gpu_compiles_the_narrow_head_only_where_it_pays():
    """The backend turns the forward's narrow head off when no query block would take one
    (it costs codegen even unused) and keeps it, or an explicit setting, otherwise."""
    from cca_jax.attention.pallas_gpu import _narrow_where_it_pays
    q = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)
    assert _narrow_where_it_pays(CCA(16, 1024, 0), q, {}) == {"narrow_block": 0}
    assert _narrow_where_it_pays(CCA(16, 1024, 4), q, {}) == {}
    assert _narrow_where_it_pays(CCA(16, 1024, 0), q, {"narrow_block": 16}) == {
        "narrow_block": 16}
