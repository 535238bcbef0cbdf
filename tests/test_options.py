"""The attention options full / sliding / streaming (and cca) through one dispatch.

Every implementation against an independent float64 transcription of SPEC's "other attention
options", packed rows against separate runs (ids reused), gradients against a dense
reference, transformers parity (Mistral's sliding window; LLaMA with a StreamingLLM mask),
and the dispatch never building an L x L array at long L.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import parse_option, run_attention
from cca_jax.attention import attention_xla, resolve_implementation
from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from tests.reference import documents

W, N = 7, 3   # window and sinks of the small cases (W not a multiple of anything else here)
PATTERNS = {
    "full": parse_option("full"),
    "sliding": parse_option("sliding", window_size=W),
    "streaming": parse_option("streaming", window_size=W, sink_tokens=N),
    "cca": parse_option("cca", group_size=3, window_size=W),
}
NON_CCA = ("full", "sliding", "streaming")


def _sees(kind: str, t: int, u: int, w: int, n: int) -> bool:
    """SPEC: in-document positions, u <= t; window w, sinks n."""
    if kind == "full":
        return True
    if kind == "sliding":
        return t - w < u
    return u < n or t - w < u   # streaming


def option_reference(q, k, v, kind, segment_ids=None, w=W, n=N):
    """float64, per query, from SPEC's text alone (full / sliding / streaming)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, length, hq, d = q.shape
    groups = hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(b_):
        for d0, d1 in documents(segment_ids, b, length):
            for t in range(d0, d1):
                keys = [u for u in range(d0, t + 1) if _sees(kind, t - d0, u - d0, w, n)]
                for h in range(hq):
                    s = k[b, keys, h // groups] @ q[b, t, h] / np.sqrt(d)
                    p = np.exp(s - s.max())
                    out[b, t, h] = (p / p.sum()) @ v[b, keys, h // groups]
    return out


def dense_mask(kind, length, segment_ids=None, w=W, n=N):
    """[B or 1, L, L] boolean, from the same SPEC rules (for the jax.grad reference)."""
    seg = np.zeros((1, length), int) if segment_ids is None else np.asarray(segment_ids)
    mask = np.zeros((seg.shape[0], length, length), bool)
    for b in range(seg.shape[0]):
        start = 0
        for t in range(length):
            if t and seg[b, t] != seg[b, t - 1]:
                start = t
            for u in range(start, t + 1):
                mask[b, t, u] = _sees(kind, t - start, u - start, w, n)
    return mask


def dense_attention(q, k, v, mask):
    groups = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bthd,buhd->bhtu", q, kk) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.asarray(mask)[:, None], s, -jnp.inf)
    return jnp.einsum("bhtu,buhd->bthd", jax.nn.softmax(s, axis=-1), vv)


def _inputs(b, length, hq, hkv, d, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, length, h, d)).astype(dtype)
                 for h in (hq, hkv, hkv))


# Small blocks so that several query, key and slot blocks and ragged edges occur.
_PALLAS_TILES = dict(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkv_block_k=16,
                     dkv_block_q=16, dc_block_k=16, dc_block_q=16)


def _pallas(q, k, v, pattern, segment_ids=None):
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.gpu import blocked_attention_pallas_gpu
    ck, cv, *bounds = slots_and_bounds(q, k, v, pattern, segment_ids=segment_ids)
    return blocked_attention_pallas_gpu(q, k, v, ck, cv, *bounds, interpret=True,
                                        **_PALLAS_TILES)


IMPLS = {
    "naive": lambda q, k, v, pat, seg=None: run_attention(q, k, v, pat, segment_ids=seg,
                                                          implementation="naive"),
    "xla": lambda q, k, v, pat, seg=None: attention_xla(q, k, v, pat, segment_ids=seg,
                                                        block_q=8, block_c=4),
    "pallas_gpu": _pallas,
}


@functools.lru_cache(maxsize=None)
def _jitted(impl: str):
    return jax.jit(IMPLS[impl], static_argnums=(3,))


# (B, L, Hq, Hkv, D): G > 1, L not a multiple of the blocks, L < W + N edge cases below.
SHAPE = (2, 45, 4, 2, 64)   # D = 64: the smallest head dim the Pallas kernels take
REUSED_IDS = np.array([[0] * 10 + [1] * 17 + [0] * 18, [2] * 45], np.int32)  # ids come back


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", NON_CCA)
@pytest.mark.parametrize("packed", [False, True])
def test_matches_spec_reference(impl, kind, packed):
    q, k, v = _inputs(*SHAPE, seed=11)
    seg = REUSED_IDS if packed else None
    out = _jitted(impl)(q, k, v, PATTERNS[kind], seg)
    # float32 against float64: measured max abs error <= 6.5e-7 (naive, xla); tolerance 5e-6.
    np.testing.assert_allclose(out, option_reference(q, k, v, kind, seg), atol=5e-6, rtol=5e-6)


# xla for cca and streaming (slots in several documents) by default; the other cases
# (already checked against the reference on packed rows above) in the slow run.
_PACKED_CASES = [pytest.param(impl, kind, marks=() if (impl, kind) in (
    ("xla", "cca"), ("xla", "streaming")) else pytest.mark.slow)
    for impl in IMPLS for kind in PATTERNS]


@pytest.mark.parametrize("impl,kind", _PACKED_CASES)
def test_packed_rows_equal_separate_runs(impl, kind):
    """Three documents, the first id reused by the third: each equals its own run."""
    q, k, v = _inputs(1, 45, 4, 2, 64, seed=5)
    seg = REUSED_IDS[:1]
    packed = np.asarray(_jitted(impl)(q, k, v, PATTERNS[kind], seg))
    for d0, d1 in ((0, 10), (10, 27), (27, 45)):
        alone = _jitted(impl)(q[:, d0:d1], k[:, d0:d1], v[:, d0:d1], PATTERNS[kind], None)
        np.testing.assert_allclose(packed[:, d0:d1], alone, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("impl,kind", [
    *[("xla", kind) for kind in NON_CCA], ("pallas_gpu", "sliding"),
    *[pytest.param("pallas_gpu", kind, marks=pytest.mark.slow) for kind in ("full", "streaming")]])
def test_gradients_equal_dense_reference(impl, kind):
    q, k, v = _inputs(*SHAPE, seed=3)
    cot = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)
    mask = dense_mask(kind, SHAPE[1], REUSED_IDS)

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2))(q, k, v)

    got = grads(lambda q, k, v: IMPLS[impl](q, k, v, PATTERNS[kind], REUSED_IDS))
    want = grads(lambda q, k, v: dense_attention(q, k, v, mask))
    for g, w in zip(got, want):
        # measured max abs error <= 1.1e-6 (xla); tolerance 1e-5
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", NON_CCA)
def test_causality(kind):
    """SPEC property 5 for every option: the future never changes the past."""
    q, k, v = _inputs(1, 40, 2, 1, 8, seed=8)
    out = np.asarray(_jitted("xla")(q, k, v, PATTERNS[kind], None))
    t = 23
    q2, k2, v2 = (x.copy() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, t + 1:] = np.random.default_rng(9).standard_normal(x[:, t + 1:].shape)
    out2 = np.asarray(_jitted("xla")(q2, k2, v2, PATTERNS[kind], None))
    np.testing.assert_array_equal(out[:, :t + 1], out2[:, :t + 1])


def test_short_sequences_and_window_edges():
    """L <= W: sliding and streaming are full attention; W = 1 sees itself only."""
    q, k, v = _inputs(1, 6, 2, 2, 8, seed=1)
    full = option_reference(q, k, v, "full")
    for kind in ("sliding", "streaming"):
        np.testing.assert_allclose(_jitted("xla")(q, k, v, PATTERNS[kind], None), full,
                                   atol=2e-5)
    one = parse_option("sliding", window_size=1)
    np.testing.assert_allclose(_jitted("xla")(q, k, v, one, None),
                               np.repeat(v, 1, axis=2), atol=1e-6)
    # Streaming sinks never exceed the tokens that left the window.
    pat = parse_option("streaming", window_size=4, sink_tokens=10)
    assert [pat.num_slots(t) for t in range(8)] == [0, 0, 0, 0, 1, 2, 3, 4]
    assert pat.max_slots(8) == 4


def test_dispatch_choices():
    pat = PATTERNS
    assert resolve_implementation("auto", "cpu", pattern=pat["full"]) == "xla"
    assert resolve_implementation("auto", "gpu", pattern=pat["full"]) == "cudnn"
    assert resolve_implementation("auto", "gpu", pattern=pat["sliding"]) == "cudnn"
    assert resolve_implementation("auto", "gpu", pattern=pat["full"], packed=True) == "pallas_gpu"
    assert resolve_implementation("auto", "gpu", pattern=pat["full"],
                                  dtype=jnp.float32) == "pallas_gpu"
    assert resolve_implementation("auto", "gpu", pattern=pat["streaming"]) == "pallas_gpu"
    assert resolve_implementation("auto", "gpu", pattern=pat["cca"], head_dim=96) == "pallas_gpu"
    assert resolve_implementation("auto", "gpu", pattern=pat["cca"], head_dim=160) == "pallas_gpu"
    assert resolve_implementation("auto", "gpu", pattern=pat["cca"], head_dim=320) == "xla"
    assert resolve_implementation("auto", "tpu", pattern=pat["cca"]) == "pallas_tpu"
    with pytest.raises(ValueError, match="does not compute attention='streaming'"):
        resolve_implementation("cudnn", pattern=pat["streaming"])
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        run_attention(q, q, q, pat["full"], implementation="cudnn")
    with pytest.raises(ValueError, match="attention must be one of"):
        parse_option("local")


# ---- the model: no L x L array, transformers parity -------------------------------------------

def _max_long_dims(jaxpr, length: int) -> int:
    """The most dimensions >= `length` any value in `jaxpr` (and its sub-jaxprs) has."""
    worst = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            worst = max(worst, sum(int(s) >= length for s in shape))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (list, tuple)) else [param]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    worst = max(worst, _max_long_dims(inner, length))
    return worst


@pytest.mark.parametrize("kind", ["full", "cca", *[pytest.param(k, marks=pytest.mark.slow)
                                                   for k in ("sliding", "streaming")]])
def test_model_builds_no_length_squared_array(kind):
    """At L = 16384 the dispatch (auto) never materializes an L x L array, forward or grad."""
    length = 16384
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, dtype="float32",
                      param_dtype="float32", max_position_embeddings=length,
                      attention={"kind": kind, "group_size": 16, "window_size": 256})
    model = LlamaForCausalLM(cfg)
    from flax import nnx
    graphdef, params = nnx.split(model)

    def loss(params, ids):
        return jnp.mean(nnx.merge(graphdef, params)(ids, last_only=True))

    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, ids).jaxpr
    assert _max_long_dims(jaxpr, length) == 1


def test_streaming_matches_transformers_with_its_mask(tmp_path):
    """StreamingLLM = transformers' LLaMA (eager) given the same 4D additive mask."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convert.hf_to_flax import convert_hf_to_flax
    from tests import hf_fixtures as fx
    import cca_jax

    hf = fx.make_tiny_hf("llama2", tmp_path / "hf", attn_implementation="eager")
    convert_hf_to_flax(tmp_path / "hf", tmp_path / "ours", verbose=False)
    length = 40
    ids = np.random.default_rng(0).integers(0, 160, (2, length))
    mask = dense_mask("streaming", length)[0]
    additive = torch.where(torch.from_numpy(mask), 0.0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids), attention_mask=additive[None, None].expand(2, 1, -1, -1))
    model = cca_jax.from_pretrained(tmp_path / "ours", attention="streaming", window_size=W,
                                    sink_tokens=N, implementation="xla")
    got = np.asarray(model(jnp.asarray(ids)))
    err = np.abs(got - ref.logits.numpy()).max()
    print("streaming vs transformers: max abs logit difference", err)
    assert err < 5e-5, err   # float32 both sides; measured 6.9e-6


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """A Mistral checkpoint with sliding_window set converts, defaults to `sliding` with that
    window, and matches transformers beyond the window."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convert.hf_to_flax import convert_hf_to_flax
    from tests import hf_fixtures as fx
    import cca_jax

    hf = fx.make_tiny_hf("mistral", tmp_path / "hf", sliding_window=12)
    convert_hf_to_flax(tmp_path / "hf", tmp_path / "ours", verbose=False)
    ids = np.random.default_rng(1).integers(0, 160, (2, 40))
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    model = cca_jax.from_pretrained(tmp_path / "ours", implementation="xla")
    assert (model.config.attention.kind, model.config.attention.window_size) == ("sliding", 12)
    err = np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max()
    print("sliding vs transformers Mistral: max abs logit difference", err)
    assert err < 1e-4, err   # float32 both sides; measured 1.3e-5
    # Full attention differs beyond the window, so it is refused there.
    full = cca_jax.from_pretrained(tmp_path / "ours", attention="full")
    with pytest.raises(ValueError, match="sliding window of 12"):
        full(jnp.asarray(ids))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", NON_CCA)
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_auto_dispatch_matches_reference(kind, packed):
    """On the GPU, what 'auto' picks (cuDNN for unpacked full/sliding in bf16, the Pallas
    kernels otherwise) against the float64 reference: output and gradients."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU")
    length, pat = 1024, parse_option(kind, window_size=100, sink_tokens=4)
    q, k, v = _inputs(1, length, 4, 2, 128, seed=21)
    seg = np.repeat(np.array([0, 1, 0], np.int32), [300, 500, 224])[None] if packed else None
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    out = jax.jit(lambda q, k, v: run_attention(q, k, v, pat, segment_ids=seg))(*bf)
    ref = option_reference(*(np.asarray(x, np.float32) for x in bf), kind, seg, w=100, n=4)
    mask = dense_mask(kind, length, seg, w=100, n=4)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2, err     # bf16 inputs and outputs: expected 2e-3 to 5e-3
    cot = jax.random.normal(jax.random.PRNGKey(0), q.shape, jnp.float32)

    def grads(fn, args):
        return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot),
                        argnums=(0, 1, 2))(*args)

    got = grads(lambda q, k, v: run_attention(q, k, v, pat, segment_ids=seg), bf)
    want = grads(lambda q, k, v: dense_attention(q, k, v, mask),
                 [x.astype(jnp.float32) for x in bf])
    for g, w in zip(got, want):
        rel = float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
        assert rel < 2e-2, rel
