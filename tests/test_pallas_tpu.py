"""Pallas TPU (Mosaic) kernels in the TPU interpreter on CPU, against the naive implementation.

The interpreter simulates TPU memory: out-of-bounds reads raise, fresh memory (scratch,
outputs) reads as NaN, and race detection is on, so a block that is read before it is
written, fetched out of range, or written by two grid points shows up here. Compiling an
interpreted kernel takes seconds: the default run compiles a few cases that together cover
the SPEC edge cases (L not a multiple of g or of the block, s not a multiple of g, L < s,
G > 1, packed rows, head dims padded to 128, bf16, a pattern without slots); `-m slow` adds a
random sweep over every attention option. What the interpreter cannot check (VMEM limits,
Mosaic layouts) the AOT compile in `benchmarks/tpu_aot.py` does (`-m tpu_aot`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from cca_jax import blocks
from cca_jax.attention import resolve_implementation, run_attention
from cca_jax.blocks import CCA, Full, Sliding, Streaming, parse_option
from cca_jax.decode import cached_attention
from cca_jax.attention.pallas_tpu import attention_pallas_tpu
from pallas_kernels.tpu import (blocked_attention_pallas_tpu, decode_attention_pallas_tpu,
                                kernel_config)

STRICT = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                               uninitialized_memory="nan")
# Small tiles so that every walk has several blocks (TPU blocks are multiples of 128).
TILES = dict(block_q=128, block_k=128, block_c=128)
# Max error against naive in float32 on the same inputs (relative to the largest reference
# value where that is over 1), measured in the interpreter (jax 0.10.2, standard normal
# inputs, a cosine cotangent), times about 4: float32 outputs 1.5e-6, grads 3e-6; bf16
# inputs outputs 1.9e-3, grads 6.9e-3 (P and the outputs rounded to bf16).
TOLERANCES = {"float32": dict(out=6e-6, grad=1.2e-5), "bfloat16": dict(out=8e-3, grad=3e-2)}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """The interpreter keeps state across calls; after an exception it must be reset."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _segments(b, length, cuts):
    """Row 0 one document, the others cut at `cuts`."""
    seg = np.zeros((b, length), np.int32)
    for row in range(1, b):
        seg[row] = np.searchsorted(np.asarray(cuts), np.arange(length), side="right")
    return jnp.asarray(seg)


def _inputs(b, length, hq, hkv, d, dtype, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (b, length, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, length, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, length, hkv, d), jnp.float32).astype(dtype)
    return q, k, v


def _loss_and_out(attend):
    def f(q, k, v):
        out = attend(q, k, v)
        weights = jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32))
        return jnp.sum(out.astype(jnp.float32) * weights), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)


def _max_error(got, want):
    """Max abs error, relative to the reference's largest magnitude when that is over 1."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(1.0, jnp.max(jnp.abs(want))))


def check_against_naive(pattern, q, k, v, segment_ids=None, pooling="cca", grads=True):
    """Outputs (and gradients) of the kernels against naive run in float32 on the same
    inputs; returns the max errors (relative to the largest reference value when over 1)."""
    tpu = functools.partial(attention_pallas_tpu, pattern=pattern, pooling=pooling,
                            segment_ids=segment_ids, interpret=STRICT, **TILES)
    naive = functools.partial(run_attention, pattern=pattern, pooling=pooling,
                              segment_ids=segment_ids, implementation="naive")
    tol = TOLERANCES[jnp.dtype(q.dtype).name]
    exact = [x.astype(jnp.float32) for x in (q, k, v)]
    if not grads:
        out = jax.jit(tpu)(q, k, v)
        err = _max_error(out, naive(*exact))
        assert out.dtype == q.dtype and err <= tol["out"], err
        return err, None
    (_, out), got = jax.jit(_loss_and_out(tpu))(q, k, v)
    (_, want), expected = _loss_and_out(naive)(*exact)
    err = _max_error(out, want)
    grad_err = max(_max_error(a, b) for a, b in zip(got, expected))
    assert out.dtype == q.dtype and err <= tol["out"], err
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in got)
    assert grad_err <= tol["grad"], grad_err
    return err, grad_err


# ---- default run -----------------------------------------------------------------------------

def test_cca_forward_and_grads_packed_gqa_ragged():
    """B = 2 (row 0 one document, row 1 three), L = 302 (not a multiple of g = 4 nor of the
    128-row blocks), s = 37 (not a multiple of g), G = 2, D = 64 (padded to 128 lanes); the
    first and last documents of row 1 are shorter than s (no core token, SPEC property 2
    inside a document)."""
    q, k, v = _inputs(2, 302, 2, 1, 64, jnp.float32, seed=0)
    check_against_naive(CCA(4, 37), q, k, v, _segments(2, 302, [30, 270]))


@pytest.mark.slow
def test_bf16_cca_shorter_than_the_window_forward():
    """CCA with L < s: no slots at all (the kernels' slot inputs are left out), which is
    causal full attention (property 2); bf16, Hq = Hkv, L < one block."""
    q, k, v = _inputs(1, 100, 2, 2, 128, jnp.bfloat16, seed=1)
    check_against_naive(CCA(8, 128), q, k, v, grads=False)


def check_decode(pattern, max_len, positions, hq, hkv, d, seed, layers=1, **tiling):
    """The decode kernel against `cached_attention` (XLA, dense masks) on a random cache
    (stacked over `layers`, the last one read in place); returns the max error."""
    ring, slots = blocks.ring_size(pattern, max_len), pattern.max_slots(max_len)
    b = len(positions)
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, hq, d))
    kr, vr = (jax.random.normal(x, (layers, b, ring, hkv, d)) for x in ks[1:3])
    ck, cv = (jax.random.normal(x, (layers, b, slots, hq, d)) for x in ks[3:])
    pos = np.asarray(positions)
    bounds = blocks.decode_bounds(pattern, pos, ring, slots)
    run = jax.jit(functools.partial(decode_attention_pallas_tpu, interpret=STRICT, **tiling))
    out = run(q, kr, vr, ck, cv, bounds, layer=jnp.int32(layers - 1))
    want = cached_attention(q, kr[-1], vr[-1], ck[-1], cv[-1],
                            jnp.asarray(blocks.cache_raw_visible(pattern, pos, ring)),
                            jnp.asarray(blocks.cache_slot_visible(pattern, pos, slots)))
    err = float(jnp.max(jnp.abs(out - want)))
    assert out.dtype == jnp.float32 and err <= 2e-6, err
    return err


def test_decode_against_cached_attention():
    """G = 2, a cache stacked over 2 layers read in place, a ring of 204 and 200 slots in
    blocks of 128 (both overhang their arrays); rows before the ring fills, with the visible
    entries wrapping around its end, before any slot and with all of them."""
    check_decode(CCA(4, 200), 1000, [3, 150, 260, 999], 4, 2, 128, seed=4, layers=2,
                 decode_block_k=128, decode_block_c=128)


def test_auto_picks_pallas_tpu_on_tpu():
    for kind in ("full", "sliding", "streaming", "cca"):
        pattern = parse_option(kind, group_size=16, window_size=1024, sink_tokens=4)
        for d in (64, 128):
            assert resolve_implementation("auto", "tpu", pattern=pattern, head_dim=d,
                                          packed=True) == "pallas_tpu"
    assert resolve_implementation("auto", "cpu") == "xla"


def test_settings_are_checked():
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel_config(block_q=96)
    with pytest.raises(ValueError, match="unknown TPU kernel setting"):
        kernel_config(block_size=128)
    q, k, v = _inputs(1, 8, 2, 1, 128, jnp.float32, seed=2)
    bounds = [jnp.zeros((1, 8), jnp.int32)] * 3
    empty = jnp.zeros((1, 0, 2, 128))
    with pytest.raises(ValueError, match="window must be a positive int"):
        blocked_attention_pallas_tpu(q, k, v, empty, empty, *bounds, window=0)
    with pytest.raises(ValueError, match=r"ck and cv must be \[B, m, Hq, D\]"):
        blocked_attention_pallas_tpu(q, k, v, empty[:, :, :1], empty, *bounds)


# ---- slow: a random sweep over options and shapes ----------------------------------------------

def _random_case(seed):
    rng = np.random.default_rng(seed)
    kind = ["cca", "cca", "sliding", "streaming", "full"][seed % 5]
    length = int(rng.integers(1, 420))
    g, s = int(rng.integers(1, 9)), int(rng.integers(1, 160))
    pattern = parse_option(kind, group_size=g, window_size=s,
                           sink_tokens=int(rng.integers(0, 5)))
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.choice([1, 2, 4]))
    d = int(rng.choice([32, 64, 128]))
    b = int(rng.integers(1, 3))
    seg = None
    if rng.random() < 0.5 and length > 2:
        cuts = np.sort(rng.choice(np.arange(1, length), min(3, length - 1), replace=False))
        seg = _segments(b, length, cuts)
    pooling = str(rng.choice(["cca", "mean", "max"])) if kind == "cca" else "cca"
    dtype = jnp.bfloat16 if rng.random() < 0.3 else jnp.float32
    return pattern, (b, length, hq, hkv, d, dtype), seg, pooling


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_random_patterns_and_shapes(seed):
    pattern, shape, seg, pooling = _random_case(seed)
    q, k, v = _inputs(*shape, seed=seed)
    check_against_naive(pattern, q, k, v, seg, pooling=pooling)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [Full(), Sliding(130), Streaming(130, sink_tokens=3),
                                     CCA(16, 100), CCA(1, 5)],
                         ids=lambda p: p.kind)
def test_decode_every_option(pattern):
    rng = np.random.default_rng(5)
    check_decode(pattern, 700, rng.integers(0, 700, 5).tolist() + [0, 699], 4, 1, 128, seed=6,
                 decode_block_k=128, decode_block_c=128)


@pytest.mark.slow
def test_causality():
    """SPEC property 5: changing q, k, v after position t leaves out[:t + 1] unchanged."""
    q, k, v = _inputs(1, 260, 2, 1, 128, jnp.float32, seed=3)
    run = jax.jit(functools.partial(attention_pallas_tpu, pattern=CCA(4, 21),
                                    interpret=STRICT, **TILES))
    base = run(q, k, v)
    t = 150
    changed = [x.at[:, t + 1:].set(7.0) for x in (q, k, v)]
    np.testing.assert_array_equal(np.asarray(run(*changed))[:, :t + 1], np.asarray(base)[:, :t + 1])


# ---- ahead-of-time compilation for real TPUs (needs libtpu) -----------------------------------

# Scoped VMEM a Pallas TPU kernel may use by default (XLA's limit on v5e; v5p and v6e allow
# more): a kernel over it fails to compile there, or needs a raised limit.
_SCOPED_VMEM = 16 * 2**20
_KERNELS_OF = {"forward": {"cca_tpu_forward"},
               "backward": {"cca_tpu_forward", "cca_tpu_dq", "cca_tpu_dkv", "cca_tpu_dslots"},
               "decode": {"cca_tpu_decode"}}


@pytest.mark.tpu_aot
def test_aot_compile_for_tpu_topologies(tmp_path):
    """Forward, backward and decode compile with Mosaic for v5e, v5p and v6e at the paper's
    128K shapes (Hkv = 32 and 8) and at a ragged packed shape: every program holds the
    Pallas kernels it should (not a fallback), each within the default scoped VMEM, and the
    JSON written (to tmp_path; benchmarks/results/ is the benchmark's, not the tests') holds
    the records. Run: `/work/tpu-venv/bin/python -m pytest tests/test_pallas_tpu.py -m
    tpu_aot` (benchmarks/tpu_aot.py says how to get libtpu)."""
    pytest.importorskip("libtpu")
    import json

    from benchmarks import tpu_aot
    out = str(tmp_path / "tpu_aot")
    records = tpu_aot.run(out=out)
    assert len(records) == len(tpu_aot.TOPOLOGIES) * len(tpu_aot.SHAPES) * len(tpu_aot.KERNELS)
    failed = [(r["topology"], r["shape"], r["kernel"], r["error"]) for r in records
              if not r["compiled"]]
    assert not failed, failed
    for r in records:
        where = (r["topology"], r["shape"], r["kernel"])
        assert set(r["vmem_by_kernel"]) == _KERNELS_OF[r["kernel"]], (where,
                                                                       r["vmem_by_kernel"])
        assert all(0 < v <= _SCOPED_VMEM for v in r["vmem_by_kernel"].values()), (
            where, r["vmem_by_kernel"])
        assert r["vmem_bytes"] == max(r["vmem_by_kernel"].values())
        assert r["memory"]["temp_size_in_bytes"] >= 0
    written = json.loads((tmp_path / "tpu_aot.json").read_text())
    assert [{k: w[k] for k in r} for w, r in zip(written, records)] == records
