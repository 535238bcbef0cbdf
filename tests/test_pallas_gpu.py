"""Pallas GPU (Triton lowering) CCA kernels against the dense `naive` implementation.

On CPU the kernels run with interpret=True (slow: small shapes, small blocks so that every
loop has several blocks and the masked/unmasked split is exercised). GPU-only tests are
marked `gpu` and skip without one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax.attention import cca_attention, cca_attention_naive, resolve_implementation
from cca_jax.attention import cca_attention_xla
from pallas_kernels.gpu import cca_attention_pallas_gpu, kernel_config

SMALL = dict(block_q=32, block_k=16, dq_block_q=16, dq_block_k=32, dkv_block_k=16,
             dkv_block_q=32, dc_block_k=32, dc_block_q=16)


def _inputs(seed, b, length, hq, hkv, d, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, length, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, length, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, length, hkv, d), jnp.float32)
    ct = jax.random.normal(ks[3], (b, length, hq, d), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), ct


def _value_and_grads(fn, q, k, v, ct):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


CASES = [
    # (name, B, L, Hq, Hkv, g, s, pooling, segments)
    ("gqa_ragged", 1, 150, 2, 1, 4, 37, "cca", False),    # L % g, L % block, s % g != 0, G=2
    ("g1_full_causal", 1, 67, 1, 1, 1, 5, "cca", False),   # g = 1: CCA == causal attention
    ("short_L_lt_s", 1, 50, 2, 2, 4, 64, "cca", False),    # L < s: no core token at all
    ("packed", 2, 130, 2, 1, 3, 10, "cca", True),           # segment_ids, two batch rows
    ("mean", 1, 72, 2, 1, 4, 21, "mean", False),
    ("max", 1, 72, 2, 1, 4, 21, "max", False),
]


def _segments(b, length, seed):
    rng = np.random.default_rng(seed)
    cuts = [np.sort(rng.choice(np.arange(1, length), 2, replace=False)) for _ in range(b)]
    return jnp.asarray(np.stack([np.searchsorted(c, np.arange(length), side="right")
                                 for c in cuts]), jnp.int32)


def _assert_matches_naive_float32(q, k, v, ct, kw, tiling):
    """Kernels (interpret mode, `tiling`) against naive: outputs and q/k/v grads, finite and
    within float32 tolerances."""
    out, grads = _value_and_grads(
        lambda q, k, v: cca_attention_pallas_gpu(q, k, v, interpret=True, **kw, **tiling),
        q, k, v, ct)
    ref, ref_grads = _value_and_grads(lambda q, k, v: cca_attention_naive(q, k, v, **kw),
                                      q, k, v, ct)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(got))), name
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_naive_float32(case):
    _, b, length, hq, hkv, g, s, pooling, packed = case
    q, k, v, ct = _inputs(len(case[0]), b, length, hq, hkv, 64)
    seg = _segments(b, length, 3) if packed else None
    kw = dict(group_size=g, window_size=s, pooling=pooling, segment_ids=seg)
    _assert_matches_naive_float32(q, k, v, ct, kw, SMALL)


@pytest.mark.parametrize("style", ["split", "one_loop"])
def test_every_kernel_in_either_loop_style_matches_naive(style, monkeypatch):
    """Each kernel's walk may be split loops or one loop with a branched mask (the defaults
    differ per kernel); both must give the same result, packed rows included."""
    from pallas_kernels.gpu import kernels as K
    loops = K._split_loops if style == "split" else K._cond_loops
    for name in ("_FORWARD_LOOPS", "_DQ_LOOPS", "_KEY_LOOPS"):
        monkeypatch.setattr(K, name, loops)
    q, k, v, ct = _inputs(21, 2, 130, 2, 1, 64)
    kw = dict(group_size=3, window_size=10, segment_ids=_segments(2, 130, 5))
    _assert_matches_naive_float32(q, k, v, ct, kw, SMALL)


@pytest.mark.parametrize("heavy_first", [False, True])
def test_either_launch_order_matches_naive(heavy_first, monkeypatch):
    """Heavy-first launch order (query blocks last to first; dck/dcv heads on the fastest
    grid axis) only reorders CTAs: every kernel matches naive either way, packed rows too."""
    from pallas_kernels.gpu import kernels as K
    for name in ("_FORWARD_HEAVY_FIRST", "_DQ_HEAVY_FIRST", "_DCORE_HEAVY_FIRST"):
        monkeypatch.setattr(K, name, heavy_first)
    q, k, v, ct = _inputs(22, 2, 130, 2, 1, 64)
    kw = dict(group_size=3, window_size=10, segment_ids=_segments(2, 130, 6))
    _assert_matches_naive_float32(q, k, v, ct, kw, SMALL)


def test_matches_naive_bfloat16_default_blocks():
    """bf16 inputs, the default (GPU) tiling, G = 2, several query and core blocks."""
    q, k, v, ct = _inputs(7, 1, 300, 2, 1, 64, jnp.bfloat16)
    kw = dict(group_size=4, window_size=70)
    out, grads = _value_and_grads(
        lambda q, k, v: cca_attention_pallas_gpu(q, k, v, interpret=True, **kw), q, k, v, ct)
    ref, ref_grads = _value_and_grads(
        lambda q, k, v: cca_attention_naive(q.astype(jnp.float32), k.astype(jnp.float32),
                                            v.astype(jnp.float32), **kw), q, k, v, ct)
    assert out.dtype == jnp.bfloat16
    assert _rel(out, ref) < 1e-2
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.dtype == jnp.bfloat16
        assert _rel(got, want) < 2e-2, name


def test_under_jit_remat_and_scan():
    """Two stacked layers through lax.scan with remat, differentiated end to end."""
    q, k, v, ct = _inputs(11, 1, 64, 2, 1, 64)
    kw = dict(group_size=4, window_size=9)

    def model(attn):
        def layer(x, w):
            y = attn(x * w, k, v)
            return x + y, None
        layer = jax.checkpoint(layer)
        return lambda x: jnp.sum(jax.lax.scan(layer, x, jnp.array([1.0, 0.5]))[0] * ct)

    pallas = lambda q, k, v: cca_attention_pallas_gpu(q, k, v, interpret=True, **kw, **SMALL)
    naive = lambda q, k, v: cca_attention_naive(q, k, v, **kw)
    got = jax.jit(jax.grad(model(pallas)))(q)
    want = jax.grad(model(naive))(q)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_dispatch():
    assert resolve_implementation("auto", "gpu") == "pallas_gpu"
    assert resolve_implementation("auto", "cuda") == "pallas_gpu"
    assert resolve_implementation("auto", "cpu") == "xla"
    q, k, v, _ = _inputs(2, 1, 40, 2, 1, 64)
    got = cca_attention(q, k, v, group_size=4, window_size=8, implementation="pallas_gpu")
    want = cca_attention_xla(q, k, v, group_size=4, window_size=8)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_auto_falls_back_to_xla_for_other_head_dims(monkeypatch):
    q, k, v, _ = _inputs(1, 1, 40, 2, 1, 96)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = cca_attention(q, k, v, group_size=4, window_size=8)   # "auto" -> xla, no error
    want = cca_attention_xla(q, k, v, group_size=4, window_size=8)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_bad_inputs():
    q, k, v, _ = _inputs(0, 1, 32, 2, 1, 96)
    with pytest.raises(ValueError, match="implementation='xla'"):
        cca_attention_pallas_gpu(q, k, v, group_size=4, window_size=8)
    with pytest.raises(ValueError, match="implementation='xla'"):
        cca_attention(q, k, v, group_size=4, window_size=8, implementation="pallas_gpu")
    q, k, v, _ = _inputs(0, 1, 32, 2, 1, 64)
    with pytest.raises(ValueError, match="power of two"):
        cca_attention_pallas_gpu(q, k, v, group_size=4, window_size=8, block_q=48)
    with pytest.raises(ValueError, match="unknown kernel setting"):
        kernel_config(4, 8, 64, dq_blockq=16)


@pytest.mark.parametrize("dtype,d,hkv", [("bfloat16", 128, 8), ("float16", 64, 4),
                                         ("float32", 128, 4)])
def test_lowers_through_triton_for_cuda(dtype, d, hkv):
    """Cross-lower fwd+bwd for CUDA on any machine: every kernel goes through the Triton
    lowering (catches unsupported ops and shapes; not shared-memory limits or Triton's own
    compile, which happen on the GPU)."""
    q = jax.ShapeDtypeStruct((1, 1024, 8, d), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, 1024, hkv, d), jnp.dtype(dtype))

    def loss(q, k, v):
        return jnp.sum(cca_attention_pallas_gpu(q, k, v, group_size=16, window_size=256,
                                                interpret=False).astype(jnp.float32))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 4   # fwd, dq, dk/dv, dck/dcv


@pytest.mark.slow
def test_large_batches_run_in_chunks(monkeypatch):
    """Arrays over 2**31 elements (int32 offsets in Triton) are split along the batch."""
    import pallas_kernels.gpu.api as api
    q, k, v, ct = _inputs(4, 3, 32, 2, 1, 64)
    monkeypatch.setattr(api, "_MAX_ELEMS", 2 * (32 + 32) * 2 * 64 + 1)  # 2 rows a chunk
    kw = dict(group_size=4, window_size=9)
    small = dict(block_q=32, block_k=32, dq_block_q=32, dq_block_k=32, dkv_block_k=32,
                 dkv_block_q=32, dc_block_k=32, dc_block_q=32)
    _assert_matches_naive_float32(q, k, v, ct, kw, small)
    monkeypatch.setattr(api, "_MAX_ELEMS", 100)
    with pytest.raises(ValueError, match="implementation='xla'"):
        cca_attention_pallas_gpu(q, k, v, interpret=True, **kw)


def test_kernel_config_defaults():
    bf16 = kernel_config(16, 1024, 128, dtype=jnp.bfloat16)
    f32 = kernel_config(16, 1024, 128, dtype=jnp.float32)
    assert (bf16.block_q, bf16.block_k, bf16.num_warps) == (128, 128, 8)
    assert f32.block_q * f32.block_k < bf16.block_q * bf16.block_k
    assert kernel_config(16, 1024, 128, dtype=jnp.float32, block_q=128).block_q == 128


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_gpu_matches_xla():
    q, k, v, ct = _inputs(5, 1, 4096, 4, 2, 128, jnp.bfloat16)
    kw = dict(group_size=16, window_size=1024)
    out, grads = _value_and_grads(
        lambda q, k, v: cca_attention_pallas_gpu(q, k, v, **kw), q, k, v, ct)
    ref, ref_grads = _value_and_grads(lambda q, k, v: cca_attention_xla(q, k, v, **kw),
                                      q, k, v, ct)
    assert _rel(out, ref) < 1e-2
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 2e-2


def test_whole_model_grad_matches_xla():
    """The kernels inside the Flax model: scanned layers, full remat, packed documents, grad
    of the loss w.r.t. every parameter, equal to the `xla` implementation's."""
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      attention="cca", dtype="float32", param_dtype="float32", remat="full",
                      scan_layers=True,
                      cca={"group_size": 4, "window_size": 20, "implementation": "pallas_gpu"})
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 97, (2, 100)), jnp.int32)
    seg = jnp.asarray(np.repeat([[0] * 37 + [1] * 63], 2, axis=0), jnp.int32)

    def loss_and_grads(config):
        graphdef, state = nnx.split(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))

        def loss(state):
            logits = nnx.merge(graphdef, state)(x, segment_ids=seg)
            return jnp.mean(jax.nn.logsumexp(logits, -1)
                            - jnp.take_along_axis(logits, x[..., None], -1)[..., 0])
        grad = jax.value_and_grad(loss)
        return jax.jit(grad)(state), str(jax.make_jaxpr(grad)(state))

    (l1, g1), program = loss_and_grads(cfg)
    assert program.count("pallas_call") >= 4   # forward + the 3 backward kernels (scanned body)
    (l2, g2), program = loss_and_grads(cfg.replace(cca_implementation="xla"))
    assert "pallas_call" not in program
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2) > 0
    for a, b in zip(leaves1, leaves2):
        assert np.all(np.isfinite(np.asarray(a)))
        assert _rel(a, b) < 1e-4
