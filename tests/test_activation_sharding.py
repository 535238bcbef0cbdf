"""The model pins its activations to `sharding.ACTIVATION_AXES` under a mesh (`constrain`).

A jitted forward of a one-layer model, lowered under `mesh_context` (what the trainer and
generation do), carries one Shardy `sharding_constraint` per boundary (embeddings, the
layer's output, q, k, v, logits) with the table's spec; without a mesh, on a one-device
mesh and inside `shard_map` it carries none. Lowering only (no compile): ~2 s a program on
CPU. Results under these constraints equal one device's in tests/test_train_sharded.py and
tests/test_generate_sharded.py.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import constrain, make_mesh, mesh_context
from train import step as steps

needs_4 = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

# Every activation shape differs: hidden [4, 32, 64], q [4, 32, 4, 16], k / v [4, 32, 2, 16],
# logits [4, 32, 96]. cca g=4, s=6 on sequence=2 (zigzag): 4 chunks of 8 rows, halo 8.
B, L = 4, 32
CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L,
                  dtype="float32", param_dtype="float32",
                  attention=dict(kind="cca", group_size=4, window_size=6, implementation="xla"))

_CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ <@\w+, \[(.*?)\]>\s*:\s*"
                         r"tensor<([0-9x]+)x[a-z0-9]+>")


def constraints(text: str) -> collections.Counter:
    """Counter of (shape, spec) of every `sdy.sharding_constraint` in lowered StableHLO; a
    spec is one tuple of mesh axes per dimension."""
    found = collections.Counter()
    for dims, shape in _CONSTRAINT.findall(text):
        spec = tuple(tuple(re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{[^}]*\}", dims))
        found[tuple(int(n) for n in shape.split("x")), spec] += 1
    return found


def lowered_forward(mesh=None, sequence: bool = False) -> str:
    """StableHLO of the jitted forward (logits), traced under `mesh` when given; `sequence`:
    with the trainer's zigzag sequence sharding (attention in `shard_map`)."""
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    if sequence:
        model.sequence_sharding = steps.sequence_sharding_for(mesh, CFG.attention.pattern)
        assert model.sequence_sharding is not None
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    with mesh_context(mesh):
        return forward.lower(state, jnp.zeros((B, L), jnp.int32)).as_text()


def _mesh(shape):
    return make_mesh(shape, devices=jax.devices()[:4])


@needs_4
def test_data_tensor_mesh_pins_every_boundary_to_the_table():
    """data=2, tensor=2: rows over data everywhere, heads and vocab over tensor, the model
    dimension whole (hidden: embeddings and the layer's output)."""
    found = constraints(lowered_forward(_mesh({"data": 2, "tensor": 2})))
    heads = (("data",), (), ("tensor",), ())
    assert found == {
        ((B, L, 64), (("data",), (), ())): 2,             # embeddings, layer output
        ((B, L, 4, 16), heads): 1,                         # q
        ((B, L, 2, 16), heads): 2,                         # k, v
        ((B, L, 96), (("data",), (), ("tensor",))): 1,     # logits
    }


@needs_4
def test_sequence_mesh_pins_rows_and_leaves_the_shard_map_alone():
    """data=2, sequence=2 with cca sequence-sharded (zigzag, attention inside `shard_map`):
    the sequence over `sequence` at every boundary outside it, none inside."""
    text = lowered_forward(_mesh({"data": 2, "sequence": 2}), sequence=True)
    assert "sdy.manual_computation" in text          # sequence_parallel's shard_map
    rows = (("data",), ("sequence",))
    assert constraints(text) == {
        ((B, L, 64), (*rows, ())): 2,
        ((B, L, 4, 16), (*rows, (), ())): 1,
        ((B, L, 2, 16), (*rows, (), ())): 2,
        ((B, L, 96), (*rows, ())): 1,
    }


def test_no_mesh_or_one_device_adds_nothing():
    for mesh in (None, make_mesh({}, devices=jax.devices()[:1])):
        text = lowered_forward(mesh)
        assert "sharding_constraint" not in text and "mhlo.sharding" not in text


@needs_4
def test_constrain_is_a_no_op_inside_shard_map():
    mesh = _mesh({"data": 4})

    def body(x):
        return constrain(x, "hidden") * 2

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    with mesh_context(mesh):
        text = fn.lower(jnp.zeros((B, L, 64))).as_text()
    assert "sdy.manual_computation" in text and "sharding_constraint" not in text


def test_constrain_names_the_fix():
    x = jnp.zeros((B, L, 64))
    with pytest.raises(ValueError, match="unknown activation 'hiden'"):
        constrain(x, "hiden")
    with pytest.raises(ValueError, match="logical axes"):
        constrain(x, "q")
    if jax.device_count() >= 2:
        other = jax.sharding.Mesh(jax.devices()[:2], ("x",))
        with mesh_context(other), pytest.raises(ValueError, match="make_mesh"):
            jax.jit(lambda x: constrain(x, "hidden")).lower(x)


@needs_4
def test_perplexity_over_a_mesh_equals_one_device():
    """`perplexity(..., mesh=)`: parameters over the mesh, the forward under it (constraints
    in), the one-device result."""
    from cca_jax.eval.ppl import perplexity

    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 150)
    kw = dict(seq_len=L, stride=16, batch_size=4, chunk=16, progress=False)
    plain = perplexity(LlamaForCausalLM(CFG, rngs=nnx.Rngs(0)), ids, **kw)
    sharded = perplexity(LlamaForCausalLM(CFG, rngs=nnx.Rngs(0)), ids,
                         mesh=_mesh({"data": 2, "tensor": 2}), **kw)
    assert sharded.scored_tokens == plain.scored_tokens
    np.testing.assert_allclose(sharded.mean_nll, plain.mean_nll, rtol=1e-6)
