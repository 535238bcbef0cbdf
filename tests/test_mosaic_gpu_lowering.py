"""A program that calls the Mosaic GPU forward kernel once a layer (an unrolled prefill chunk)
traces and lowers the kernel once, not once a layer: at the 7B shape, 32 layers' copies took
23.9 s of a 256-token chunk's host time on a 2-core CPU and 27 MB of module, against 3.1 s and
3.0 MB once (benchmarks/results/research/lowering_probe_cpu.md). Lowered here for CUDA on the
CPU (the backend checks told it is a Hopper GPU)."""

import re

import jax
import jax.numpy as jnp
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.kv_cache import cache_shapes
from cca_jax.model import LlamaForCausalLM, unstack_layers
from cca_jax.prefill import prefill_chunk_traced

LAYERS = 4


def test_an_unrolled_chunk_lowers_each_distinct_kernel_once(monkeypatch):
    import cca_jax.attention.pallas_mosaic_gpu as mosaic_backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_backend, "gpu_capability", lambda: 9.0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256,
                      num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=128, max_position_embeddings=4096, dtype="bfloat16",
                      param_dtype="bfloat16",
                      attention=dict(kind="cca", group_size=16, window_size=256,
                                     implementation="mosaic_gpu"))
    model = nnx.eval_shape(lambda: unstack_layers(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    lowered = jax.jit(prefill_chunk_traced, static_argnames=("unroll_layers",)).trace(
        nnx.split(model), cache_shapes(cfg, 2, 4096), jax.ShapeDtypeStruct((1, 64), jnp.int32),
        one, rows=one, unroll_layers=True).lower(lowering_platforms=("cuda",))
    hashes = re.findall(r'kernel_hash = "([^"]*)"', lowered.as_text())
    # the layers before the last share one kernel; the last (its last row only) has its own
    assert len(set(hashes)) == 2, len(set(hashes))
    assert len(hashes) == len(set(hashes)), f"{len(hashes)} kernels lowered for {LAYERS} layers"
