"""CCA with attention sinks (SPEC section 6, `sink_tokens = N`): the visibility arithmetic and
the XLA paths against the SPEC's dense reference (`tests/cca_sinks_cases.py`).

* The implementations hold the sinks differently from the SPEC text (slots of one token, once
  they leave the raw window: `cca_jax.blocks`), so equality checks that representation.
* Equality for several (L, g, s, N, G) (L not a multiple of g, N > s, N = 1, packed rows),
  on naive and xla; gradients against `jax.grad` of the reference in float64.
* Properties 1, 2 (g = 1 or s >= L - N: causal full attention) and 5 (causality).
* N = 0 is today's CCA bit for bit (the call without the argument, every implementation).

The kernels with sinks: tests/test_cca_sinks_kernels.py; sharding, the KV cache (property 6),
config.json and the CLI flags: tests/test_cca_sinks_model.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.attention import cca_attention, run_attention
from cca_jax.blocks import CCA, parse_option
from cca_jax.config import AttentionConfig
from tests.cca_sinks_cases import (
    CASES,
    GRAD_TOL,
    OUT_TOL,
    causal_reference,
    in_float64,
    make_inputs,
    make_segments,
    max_err,
    out_and_grads,
    reference_out_and_grads,
    sinks_case,
    sinks_reference,
    spec_masks)


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
    (q, k, v, ct, seg), kw = sinks_case(name)
    xla = jax.jit(out_and_grads(functools.partial(cca_attention, implementation="xla",
                                                  segment_ids=seg, **kw)))
    return (q, k, v, ct), xla, reference_out_and_grads(name)


def test_xla_matches_the_reference_and_is_causal():
    """N = 7 > s = 5, g = 3, G = 2, packed rows (documents shorter than N and than s + g,
    an id reused): outputs and q/k/v gradients of the blocked XLA implementation (its custom
    VJP and the pooling's) against `jax.grad` of the float64 reference. Property 5 on the same
    program: changing q, k, v after position t never changes out[t]."""
    (q, k, v, ct), xla, (ref, ref_grads) = _xla_and_reference("n_above_s_packed")
    out, grads = xla(q, k, v, ct)
    assert max_err(out, ref) < OUT_TOL, max_err(out, ref)
    for dname, got, want in zip("qkv", grads, ref_grads):
        assert max_err(got, want) < GRAD_TOL, (dname, max_err(got, want))
    base = np.asarray(out)
    for t in (0, 6, 21, 38):
        bump = jnp.zeros(q.shape[1]).at[t + 1:].set(3.0)[None, :, None, None]
        later, _ = xla(q + bump, k - bump[..., :1, :], v + bump[..., :1, :], ct)
        np.testing.assert_array_equal(np.asarray(later)[:, :t + 1], base[:, :t + 1])
        assert not np.array_equal(np.asarray(later)[:, t + 1:], base[:, t + 1:])


def test_naive_matches_the_reference_and_full_attention():
    """naive (dense masks) against the reference: N = 1, s = 3 < g = 5, G = 4, packed;
    properties 1 and 2 with sinks: g = 1, and s >= L - N, are causal full attention."""
    (q, k, v, _, seg), kw = sinks_case("one_sink_packed")
    naive = jax.jit(lambda q, k, v, **kw: cca_attention(q, k, v, implementation="naive",
                                                        segment_ids=seg, **kw),
                    static_argnames=("group_size", "window_size", "sink_tokens"))
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    ref = in_float64(lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg), q, k, v)
    assert max_err(naive(q, k, v, **kw), ref) < OUT_TOL
    full = in_float64(lambda q, k, v: causal_reference(q, k, v, seg), q, k, v)
    for g, s, n in ((1, 3, 2), (4, 27, 2)):      # L = 29: s >= L - N
        got = naive(q, k, v, group_size=g, window_size=s, sink_tokens=n)
        assert max_err(got, full) < OUT_TOL, (g, s, n)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_naive_and_xla_match_the_reference(name):
    (q, k, v, ct, seg), kw = sinks_case(name)
    ref, ref_grads = reference_out_and_grads(name)
    for impl in ("naive", "xla"):
        attend = functools.partial(cca_attention, implementation=impl, segment_ids=seg, **kw)
        out, grads = jax.jit(out_and_grads(attend))(q, k, v, ct)
        assert max_err(out, ref) < OUT_TOL, (impl, max_err(out, ref))
        for dname, got, want in zip("qkv", grads, ref_grads):
            assert max_err(got, want) < GRAD_TOL, (impl, dname, max_err(got, want))


@pytest.mark.slow
def test_sinks_change_the_result():
    """The tests are sensitive: N sinks differ from N = 0 and from N - 1 (a sink each)."""
    (q, k, v, _, seg), kw = sinks_case("ragged_gqa")
    outs = [np.asarray(cca_attention(q, k, v, **dict(kw, sink_tokens=n),
                                     implementation="naive")) for n in (0, 1, 2)]
    assert max_err(outs[0], outs[1]) > 1e-2 and max_err(outs[1], outs[2]) > 1e-2


@pytest.mark.slow
def test_mean_pooling_with_sinks():
    (q, k, v, _, seg), kw = sinks_case("n_above_s_packed")
    g, s, n = kw["group_size"], kw["window_size"], kw["sink_tokens"]
    ref = in_float64(lambda q, k, v: sinks_reference(q, k, v, g, s, n, seg, pooling="mean"),
                     q, k, v)
    out = cca_attention(q, k, v, pooling="mean", implementation="xla", segment_ids=seg, **kw)
    assert max_err(out, ref) < OUT_TOL


@pytest.mark.slow
@pytest.mark.parametrize("g,s,n", [(1, 3, 2), (4, 30, 5), (3, 8, 40)])
def test_properties_1_and_2_on_xla(g, s, n):
    """g = 1, or s >= L - N (also N >= L): causal full attention, packed rows too."""
    q, k, v, _ = make_inputs(2, 36, 2, 1, 8, seed=3)
    seg = make_segments(2, 36, (13,))
    want = in_float64(lambda q, k, v: causal_reference(q, k, v, seg), q, k, v)
    got = cca_attention(q, k, v, group_size=g, window_size=s, sink_tokens=n,
                        implementation="xla", segment_ids=seg)
    assert max_err(got, want) < OUT_TOL


# ---- N = 0 is today's CCA ------------------------------------------------------------------

def test_zero_sinks_is_the_papers_cca_bit_for_bit():
    """sink_tokens=0 runs the very program of a call without it (and of the pattern written
    out): equal jaxprs, forward and gradients, on naive, xla, the Pallas GPU kernels
    (interpret mode) and the TPU kernels, so equal bits on every backend. (Against the code
    before sinks existed the outputs were compared once, bit for bit, on all these paths,
    sequence sharding and the KV cache included.) The bounds are SPEC 2's formulas."""
    from cca_jax.attention.pallas_tpu import cca_attention_pallas_tpu
    (q, k, v, ct, seg), _ = sinks_case("n_above_s_packed", d=64)
    kw = dict(group_size=3, window_size=5, segment_ids=seg)
    entries = {impl: functools.partial(cca_attention, implementation=impl)
               for impl in ("naive", "xla", "pallas_gpu")}
    entries["pallas_tpu"] = functools.partial(cca_attention_pallas_tpu, interpret=False)
    for impl, entry in entries.items():
        programs = [str(jax.make_jaxpr(out_and_grads(functools.partial(entry, **kw, **extra)))(
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

