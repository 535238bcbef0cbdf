"""Generation over devices (8 simulated CPU devices), sharded by the logical-axis table of
`cca_jax.sharding`: the cache's rows over `data` and its heads over `tensor` (and the
parameters' heads and MLP columns over `tensor`) give the one-device logits and tokens, and
the cache stays sharded through prefill and decode (what a multi-GPU host needs for contexts
one device cannot hold)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cca_jax.config import LlamaConfig
from cca_jax.decode import decode_step
from cca_jax.generate import generate
from cca_jax.kv_cache import cache_shapes, init_cache
from cca_jax.model import LlamaForCausalLM
from cca_jax.prefill import prefill
from cca_jax.sharding import activation_sharding, cache_shardings, make_mesh, shard_model

CFG = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                  dtype="float32", param_dtype="float32",
                  attention=dict(kind="cca", group_size=4, window_size=6, implementation="xla"))
MAX_LEN, PROMPT, STEPS = 40, 13, 6


def _prompts():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, PROMPT)).astype(np.int32)


def _run(cache, mesh=None):
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    if mesh is not None:
        shard_model(model, mesh)
    cache, logits = prefill(model, cache, _prompts(), [PROMPT, 9], chunk_size=5)
    state = nnx.split(model)
    out = [np.asarray(logits)]
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(STEPS):
        logits, cache = decode_step(state, cache, token, None)
        out.append(np.asarray(logits))
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    return cache, np.stack(out)


def test_cache_shardings_follow_the_table():
    """Rows over data (x fsdp), KV heads and the slots' query heads over tensor, the rest
    whole: what `init_cache(sharding=cache_shardings(...))` creates."""
    mesh = make_mesh({"data": 2, "tensor": 4})
    shardings = cache_shardings(cache_shapes(CFG, 2, MAX_LEN), mesh)
    heads = P(None, "data", None, "tensor", None)
    for name in ("k", "v", "ck", "cv"):
        assert getattr(shardings, name).spec == heads, name
    assert shardings.lengths.spec == P("data")
    hidden = activation_sharding("hidden", (2, PROMPT, CFG.hidden_size), mesh)
    assert hidden.spec == P("data", None, None)   # the model dimension whole on each device
    assert activation_sharding("q", (2, PROMPT, 8, 8), mesh).spec == P("data", None, "tensor",
                                                                       None)


def test_sharded_cache_and_params_generate_what_one_device_does():
    mesh = make_mesh({"data": 2, "tensor": 4})
    heads = NamedSharding(mesh, P(None, "data", None, "tensor", None))
    shardings = cache_shardings(cache_shapes(CFG, 2, MAX_LEN), mesh)
    sharded_cache, sharded = _run(init_cache(CFG, 2, MAX_LEN, sharding=shardings), mesh)
    plain_cache, plain = _run(init_cache(CFG, 2, MAX_LEN))
    np.testing.assert_allclose(sharded, plain, atol=2e-5)
    np.testing.assert_array_equal(sharded.argmax(-1), plain.argmax(-1))
    assert sharded_cache.k.sharding.is_equivalent_to(heads, 5)
    for name in ("k", "v", "ck", "cv"):
        np.testing.assert_allclose(np.asarray(getattr(sharded_cache, name)),
                                   np.asarray(getattr(plain_cache, name)), atol=2e-5)
        per_device = {s.data.shape for s in getattr(sharded_cache, name).addressable_shards}
        full = getattr(sharded_cache, name).shape
        assert per_device == {(full[0], 1, full[2], full[3] // 4, full[4])}


def test_generate_over_a_mesh_gives_the_one_device_tokens():
    """`generate(..., mesh=)` on 8 devices: parameters (heads, MLP columns) over tensor, the
    cache by the table; greedy tokens identical to one device's."""
    mesh = make_mesh({"data": 2, "tensor": 4})
    prompts = [_prompts()[0].tolist(), _prompts()[1, :9].tolist()]
    kw = dict(max_new_tokens=8, chunk_size=5, stop_at_eos=False)
    plain = generate(LlamaForCausalLM(CFG, rngs=nnx.Rngs(0)), prompts, **kw)
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    sharded = generate(model, prompts, mesh=mesh, **kw)
    assert sharded == plain
    q_kernel = model.layers.self_attn.q_proj.kernel[...]
    assert q_kernel.sharding.spec == P(None, None, "tensor")
    assert len(q_kernel.addressable_shards) == 8


def test_mesh_flag_builds_the_mesh_or_names_the_fix():
    """`--mesh` of the generate and eval CLIs: axis=size pairs, checked against the devices."""
    from argparse import Namespace

    import pytest

    from cca_jax.cli import UsageError, mesh_from_args

    assert mesh_from_args(Namespace(mesh=None)) is None
    mesh = mesh_from_args(Namespace(mesh="data=2,tensor=-1"))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4, "sequence": 1}
    for bad in ("data=3", "dat=2", "tensor=x"):
        with pytest.raises(UsageError, match="mesh"):
            mesh_from_args(Namespace(mesh=bad))
