"""`model.unstack_layers`: the layers held one array per layer (inference on a GPU, where XLA
then tunes each GEMM once) give the stacked model's results (bit for bit on the CPU; a GPU may
pick other GEMM algorithms for unsliced weights), share every other parameter, shard by the
same table, and are never saved."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cca_jax.checkpoint import save_pretrained
from cca_jax.decode import decode_step
from cca_jax.kv_cache import init_cache
from cca_jax.model import inference_layers, unstack_layers
from cca_jax.prefill import prefill_chunk
from cca_jax.sharding import make_mesh, parse_mesh, shard_model, tree_shardings, unnamed_params
from tests.test_model import TINY, build, ids

MAX_LEN = 48


def assert_same(got, want):
    """Bit-equal on the CPU; elsewhere within float32 GEMM-algorithm differences."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want)


def assert_close(got, want):
    """Equal up to float summation order (on a GPU also TF32-rounded float32 GEMMs)."""
    tol = 1e-5 if jax.default_backend() == "cpu" else 2e-3
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def models():
    """(stacked, unstacked) over the same weights; the stacked one loops over static slices
    (`scan_layers=False`), as the unstacked one runs."""
    stacked = build(TINY.replace(scan_layers=False))
    return stacked, unstack_layers(stacked)


def test_layout_and_shared_parameters(models):
    stacked, unstacked = models
    assert not stacked.layers_unstacked and unstacked.layers_unstacked
    assert len(unstacked.layers) == TINY.num_hidden_layers
    q = nnx.state(stacked.layers)["self_attn"]["q_proj"]["kernel"][...]
    for i, layer in enumerate(unstacked.layers):
        np.testing.assert_array_equal(np.asarray(layer.self_attn.q_proj.kernel[...]), q[i])
    assert unstacked.embed_tokens.embedding[...] is stacked.embed_tokens.embedding[...]
    assert unstack_layers(unstacked) is unstacked


def test_forward_equals_the_stacked_model(models):
    """The layers looped (`scan_layers=False`) or scanned: the stacked model's logits."""
    stacked, unstacked = models
    assert_same(np.asarray(unstacked(ids())), np.asarray(stacked(ids())))
    scanned = build()   # the same seed: the same weights, layers scanned
    scanned_unstacked = unstack_layers(scanned)
    assert_same(np.asarray(scanned_unstacked(ids())), np.asarray(scanned(ids())))
    assert_close(np.asarray(unstacked(ids())), np.asarray(scanned(ids())))


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned"])
def test_prefill_chunk_and_decode_step_equal_the_stacked_model(models, unroll):
    """A prefill chunk (unrolled, as a GPU runs small chunks, or scanned, as large ones) and
    then decode steps leave the stacked model's logits and cache."""
    x = np.asarray(ids(b=2, length=20))
    n_valid = jnp.asarray([20, 13], jnp.int32)
    results = []
    for model in models:
        state = nnx.split(model)
        cache, logits = prefill_chunk(state, init_cache(TINY, 2, MAX_LEN), jnp.asarray(x),
                                      n_valid, first=True, unroll_layers=unroll)
        steps = []
        for t in range(3):
            out, cache = decode_step(state, cache, jnp.asarray(x[:, t]))
            steps.append(np.asarray(out))
        results.append((np.asarray(logits), steps, jax.tree.map(np.asarray, cache)))
    got, want = results
    assert_same(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert_same(a, b)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        assert_same(a, b)


def test_a_scanned_chunk_over_unstacked_layers_never_builds_the_stack():
    """Scanned, unstacked layers are picked one a step (`lax.switch`): the program's
    temporaries hold about one layer's weights (as the stack's scan does), not all. (On the
    H100 unstacked's were 3.8 MB against stacked's 3.2, of 3.3 MB a layer: the bound is
    fewer than two layers', not the stack's own count.)"""
    layers = 4
    cfg = TINY.replace(hidden_size=256, intermediate_size=1024, num_hidden_layers=layers)
    stacked = build(cfg)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(stacked.layers))) / layers
    temp = {}
    for name, model in (("stacked", stacked), ("unstacked", unstack_layers(stacked))):
        compiled = prefill_chunk.lower(nnx.split(model), init_cache(cfg, 1, MAX_LEN),
                                       jnp.zeros((1, 4), jnp.int32),
                                       jnp.asarray([4], jnp.int32)).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["unstacked"] < 2 * layer_bytes, (temp, layer_bytes)


def test_consume_deletes_the_stack_and_keeps_the_rest():
    stacked = build()
    want = np.asarray(stacked(ids()))
    leaves = jax.tree.leaves(nnx.state(stacked.layers))
    unstacked = unstack_layers(stacked, consume=True)
    assert all(leaf.is_deleted() for leaf in leaves)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(nnx.state(unstacked)))
    assert_close(np.asarray(unstacked(ids())), want)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (the CPU suite forces 8)")
def test_unstacked_parameters_shard_by_the_table(models):
    """Every per-layer parameter is named by the sharding table, with the stacked one's
    placement less the layer axis, and the sharded model computes the same logits."""
    stacked, unstacked = models
    mesh = make_mesh(parse_mesh("data=-1,tensor=2"))
    assert unnamed_params(nnx.state(unstacked)) == []
    stacked_specs = tree_shardings(nnx.state(stacked.layers), mesh)
    layer_specs = tree_shardings(nnx.state(unstacked.layers[1]), mesh)
    for want, got in zip(jax.tree.leaves(stacked_specs), jax.tree.leaves(layer_specs)):
        assert tuple(got.spec) == tuple(want.spec)[1:] or \
            (tuple(want.spec) == () and tuple(got.spec) == ()), (want.spec, got.spec)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(layer_specs))
    sharded = shard_model(unstack_layers(build(TINY.replace(scan_layers=False))), mesh)
    assert_close(np.asarray(sharded(ids())), np.asarray(stacked(ids())))


def test_saving_unstacked_parameters_is_refused(models, tmp_path):
    params = nnx.to_pure_dict(nnx.state(models[1], nnx.Param))
    with pytest.raises(ValueError, match="save the stacked model"):
        save_pretrained(tmp_path / "out", params, TINY)
    assert not (tmp_path / "out").exists()


def test_inference_layers_unstack_on_a_gpu_only(models, monkeypatch):
    stacked = models[0]
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert inference_layers(stacked) is stacked
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert inference_layers(stacked).layers_unstacked


def test_gradients_through_unstacked_layers_equal_the_stacked_ones():
    """Scanned (`lax.switch` picks each layer) and differentiated, each layer's gradient is
    the stacked gradient's slice."""
    stacked = build()
    unstacked = unstack_layers(stacked)
    x = ids(b=1, length=12)

    def grads(model):
        graphdef, state = nnx.split(model, nnx.Param)

        def loss(params):
            return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)
        return jax.grad(loss)(state)
    want, got = grads(stacked), grads(unstacked)
    stacked_layers = jax.tree.leaves(want["layers"])
    for i in range(TINY.num_hidden_layers):
        for a, b in zip(jax.tree.leaves(got["layers"][i]), stacked_layers, strict=True):
            assert_close(np.asarray(a), np.asarray(b)[i])
    assert_same(np.asarray(got["embed_tokens"]["embedding"][...]),
                np.asarray(want["embed_tokens"]["embedding"][...]))
