"""Generation with the KV cache sharded over devices (8 simulated CPU devices): the cache's
KV heads over a `tensor` axis and its rows over `data` give the unsharded cache's logits and
tokens, and the cache stays sharded through prefill and decode (what a multi-GPU host needs
for contexts one device cannot hold)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cca_jax.config import LlamaConfig
from cca_jax.decode import decode_step
from cca_jax.prefill import prefill
from cca_jax.kv_cache import KVCache, init_cache
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import make_mesh

CFG = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                  dtype="float32", param_dtype="float32",
                  attention=dict(kind="cca", group_size=4, window_size=6, implementation="xla"))
MAX_LEN, PROMPT, STEPS = 40, 13, 6


def _run(cache):
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, PROMPT)).astype(np.int32)
    cache, logits = prefill(model, cache, ids, [PROMPT, 9], chunk_size=5)
    state = nnx.split(model)
    out = [np.asarray(logits)]
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(STEPS):
        logits, cache = decode_step(state, cache, token, None)
        out.append(np.asarray(logits))
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    return cache, np.stack(out)


def test_sharded_cache_generates_what_one_device_does():
    mesh = make_mesh({"data": 2, "tensor": 4})
    heads = NamedSharding(mesh, P(None, "data", None, "tensor", None))
    shardings = KVCache(heads, heads, heads, heads, NamedSharding(mesh, P("data")),
                        pattern=CFG.attention.pattern, max_len=MAX_LEN)
    sharded_cache, sharded = _run(init_cache(CFG, 2, MAX_LEN, sharding=shardings))
    plain_cache, plain = _run(init_cache(CFG, 2, MAX_LEN))
    np.testing.assert_allclose(sharded, plain, atol=2e-5)
    assert sharded_cache.k.sharding.is_equivalent_to(heads, 5)
    for name in ("k", "v", "ck", "cv"):
        np.testing.assert_allclose(np.asarray(getattr(sharded_cache, name)),
                                   np.asarray(getattr(plain_cache, name)), atol=2e-5)
        per_device = {s.data.shape for s in getattr(sharded_cache, name).addressable_shards}
        full = getattr(sharded_cache, name).shape
        assert per_device == {(full[0], 1, full[2], full[3] // 4, full[4])}
