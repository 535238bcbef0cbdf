"""The Flax LLaMA: swappable attention, scan/remat equivalence, packing, dtypes, long CCA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM

TINY = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, 
                   dtype="float32", param_dtype="float32",
                   attention={"kind": "cca", "group_size": 4, "window_size": 8,
                              "implementation": "xla"})


def build(cfg=TINY, seed=0):
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))


def same_params(model, cfg):
    """A model for `cfg` holding `model`'s parameters (attention choice adds none)."""
    other = build(cfg, seed=123)
    nnx.update(other, nnx.state(model))
    return other


def ids(b=2, length=40, seed=0, vocab=97):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, length)), jnp.int32)


def test_logits_shape_dtype_and_last_only():
    model = build()
    x = ids()
    logits = model(x)
    assert logits.shape == (2, 40, 97) and logits.dtype == jnp.float32
    np.testing.assert_allclose(model(x, last_only=True)[:, 0], logits[:, -1], atol=1e-5)


@pytest.mark.parametrize("change", [dict(group_size=1), dict(window_size=40),
                                    dict(window_size=64)])
def test_cca_reduces_to_full_attention(change):
    """SPEC properties 1 and 2 at the model level."""
    model = build(TINY.replace(**change))
    full = same_params(model, TINY.replace(attention="full"))
    np.testing.assert_allclose(model(ids()), full(ids()), atol=2e-5, rtol=2e-5)


def test_cca_differs_from_full_attention_when_it_should():
    model = build()
    full = same_params(model, TINY.replace(attention="full"))
    assert np.abs(np.asarray(model(ids()) - full(ids()))).max() > 1e-3


def _loss_and_grads(model, x):
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(x)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, x[..., None], -1)[..., 0])

    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("change", [
    dict(remat="full"),
    pytest.param(dict(scan_layers=False), marks=pytest.mark.slow),
    dict(remat="save_attention"),
    pytest.param(dict(remat="save_dots"), marks=pytest.mark.slow)])
def test_scan_and_remat_do_not_change_results(change):
    model = build()
    other = same_params(model, TINY.replace(**change))
    x = ids()
    (l1, g1), (l2, g2) = _loss_and_grads(model, x), _loss_and_grads(other, x)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas_gpu"])
def test_save_attention_keeps_the_kernels_output(implementation, capsys):
    """`remat="save_attention"` saves the attention forward's output and log-sum-exp (named
    in each kernel's vjp forward rule), so the backward need not rerun the kernel; `full`
    saves only the inputs. (Tracing only: the Triton kernels are never run here.)"""
    from cca_jax.attention import cca_attention
    from cca_jax.config import REMAT_POLICIES
    q, k = jnp.ones((1, 256, 4, 64), jnp.bfloat16), jnp.ones((1, 256, 2, 64), jnp.bfloat16)
    saved = {}
    for policy in ("full", "save_attention"):
        layer = jax.checkpoint(lambda q, k, v: jnp.tanh(cca_attention(
            q, k, v, group_size=4, window_size=64, implementation=implementation)),
            policy=REMAT_POLICIES[policy])
        jax.ad_checkpoint.print_saved_residuals(layer, q, k, k)
        saved[policy] = capsys.readouterr().out
    assert "attention_out" not in saved["full"] and "attention_lse" not in saved["full"]
    assert "bf16[1,256,4,64] named 'attention_out'" in saved["save_attention"]
    assert "named 'attention_lse'" in saved["save_attention"]


@pytest.mark.parametrize("attention", [pytest.param("full", marks=pytest.mark.slow), "cca"])
def test_packed_documents_equal_separate_runs(attention):
    """segment_ids + per-document positions reproduce each document run on its own."""
    model = build(TINY.replace(attention=attention))
    a, b = ids(1, 23, seed=1), ids(1, 30, seed=2)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.asarray([[1] * 23 + [2] * 30], jnp.int32)
    pos = jnp.asarray([list(range(23)) + list(range(30))], jnp.int32)
    out = model(packed, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(out[:, :23], model(a), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out[:, 23:], model(b), atol=2e-5, rtol=2e-5)


def test_bfloat16_parameters_and_float32_logits():
    """bf16 parameters and activations (the hidden states are bf16: a model that silently
    computed in float32 fails here), float32 logits, and per logit row within bf16 rounding
    of the float32 computation on the same (bf16-valued) weights: measured 2.1e-2 of the
    row's spread (full attention instead of cca moves rows by 1.45)."""
    cfg = TINY.replace(dtype="bfloat16", param_dtype="bfloat16")
    model = build(cfg)
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    x = ids()
    assert jax.eval_shape(model.hidden_states, x).dtype == jnp.bfloat16
    logits = model(x)
    assert logits.dtype == jnp.float32
    ref = np.asarray(same_params(model, TINY)(x))  # float32 compute on the same (bf16) weights
    err = np.abs(np.asarray(logits) - ref).max(-1) / ref.std(-1)
    assert 0 < err.max() < 0.06, err.max()


def test_tied_embeddings_and_qkv_bias():
    """Layout and use of the options; their values are checked against transformers (Qwen2:
    tied embeddings and random q/k/v biases) in tests/test_convert.py."""
    cfg = TINY.replace(tie_word_embeddings=True, qkv_bias=True)
    model = build(cfg)
    state = nnx.state(model, nnx.Param)
    assert "lm_head" not in state
    attn = state["layers"]["self_attn"]
    assert attn["q_proj"]["bias"].shape == (2, 64)
    assert "bias" not in attn["o_proj"]
    np.testing.assert_array_equal(model.output_weight(), model.embed_tokens.embedding[...].T)
    before = np.asarray(model(ids()))
    bias = model.layers.self_attn.k_proj.bias
    bias[...] = jax.random.normal(jax.random.PRNGKey(1), bias.shape)
    assert np.abs(np.asarray(model(ids())) - before).max() > 1e-3, "k bias unused"


@pytest.mark.parametrize("bad,match", [
    (dict(input_ids=jnp.zeros((40,), jnp.int32)), "input_ids"),
    (dict(input_ids=jnp.zeros((2, 40), jnp.float32)), "input_ids"),
    (dict(input_ids=jnp.zeros((2, 40), jnp.int32), segment_ids=jnp.zeros((2, 39), jnp.int32)),
     "segment_ids"),
    (dict(input_ids=jnp.zeros((2, 40), jnp.int32), positions=jnp.zeros((1, 40), jnp.int32)),
     "positions"),
    (dict(input_ids=[[1, 2, 3]]), "not a list"),
    (dict(input_ids=jnp.full((1, 8), 97, jnp.int32)), r"\[0, 97\)"),      # id == vocab_size
    (dict(input_ids=jnp.full((1, 8), -1, jnp.int32)), r"\[0, 97\)"),      # would wrap around
    (dict(input_ids=jnp.zeros((1, 600), jnp.int32)), "max_position_embeddings=512"),
    (dict(input_ids=jnp.zeros((1, 8), jnp.int32), positions=jnp.full((1, 8), 600)),
     "max_position_embeddings=512"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=match):
        _SHORT_MODEL(**bad)


_SHORT_MODEL = build(TINY.replace(max_position_embeddings=512))


@pytest.mark.slow   # 35 s; tests/test_options.py checks the jaxpr for L x L arrays by default
def test_cca_training_step_at_32k_is_memory_linear():
    """Forward+backward of a tiny CCA model at L = 32768 on CPU; memory linear in L."""
    cfg = TINY.replace(num_hidden_layers=2, vocab_size=256, remat="full",
                       group_size=16, window_size=256, max_position_embeddings=32768)
    model = build(cfg)
    graphdef, params = nnx.split(model)

    def loss(params, x):
        logits = nnx.merge(graphdef, params)(x[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], -1))

    step = jax.jit(jax.value_and_grad(loss))
    temp = {}
    for length in (8192, 16384, 32768):
        spec = jax.ShapeDtypeStruct((1, length + 1), jnp.int32)
        temp[length] = step.lower(params, spec).compile().memory_analysis().temp_size_in_bytes
    # Quadratic would give ratios of 4; linear gives 2 (plus constants).
    assert temp[16384] / temp[8192] < 2.2 and temp[32768] / temp[16384] < 2.2, temp
    # An L x L float32 score matrix for one head alone would be 4 GiB at 32K.
    assert temp[32768] < 1 << 30, temp
    value, grads = step(params, ids(1, 32769, vocab=256))
    assert np.isfinite(float(value)) and abs(float(value) - np.log(256)) < 0.5
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
@pytest.mark.parametrize("attention", ["full", pytest.param("cca", marks=pytest.mark.slow)])
def test_zigzag_sequence_sharding_keeps_logits(attention):
    """`model.sequence_sharding` with the zigzag layout on a sequence axis of 2: inputs and
    logits are in zigzag row order, positions default to it, and the logits are the
    unsharded model's. cca runs the halo path; full (unbounded window) the plain path with
    rows put back in natural order around it."""
    from cca_jax.attention import SequenceSharding
    from cca_jax.sharding import make_mesh

    model = build(TINY.replace(attention=attention))
    x = ids()
    want = np.asarray(model(x))
    mesh = make_mesh({"sequence": 2}, devices=jax.devices()[:2])
    model.sequence_sharding = SequenceSharding(mesh, "sequence", "zigzag")
    order = model.sequence_sharding.row_order(x.shape[1])
    got = jax.jit(lambda m, x: m(x))(model, x[:, order])
    np.testing.assert_allclose(np.asarray(got), want[:, order], atol=2e-5, rtol=1e-5)
