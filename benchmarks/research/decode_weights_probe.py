"""Probe: how fast does XLA stream a 7B model's stacked weights for one token per layer?

    python benchmarks/research/decode_weights_probe.py

A decode step is bound by reading the weights (13 GB at LLaMA-2-7B). This times one token
through 32 layers of the 7B projections and MLP (bf16, B = 1 and 16) with the weights
  scan:      stacked [32, ...], `lax.scan` over layers (`LlamaForCausalLM.decode_layers`
             without unroll);
  unrolled:  stacked [32, ...], a Python loop with static layer indices;
  separate:  32 separate arrays per weight, a Python loop,
and prints ms and GB/s of weight bytes for each.
"""
import time

import jax
import jax.numpy as jnp

L, H, F = 32, 4096, 11008
SHAPES = dict(wq=(H, H), wk=(H, H), wv=(H, H), wo=(H, H), w1=(H, F), w3=(H, F), w2=(F, H))


def layer(x, w):
    q = x @ w["wq"] + x @ w["wk"] + x @ w["wv"]
    x = x + (q @ w["wo"]) * 1e-3
    h = jax.nn.silu(x @ w["w1"]) * (x @ w["w3"])
    return x + (h @ w["w2"]) * 1e-3


def scan_fwd(x, stacked):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]


def unrolled_fwd(x, stacked):
    for i in range(L):
        x = layer(x, {k: v[i] for k, v in stacked.items()})
    return x


def separate_fwd(x, layers):
    for w in layers:
        x = layer(x, w)
    return x


def timed(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3


def main():
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    stacked = {k: jax.random.normal(next(keys), (L, *s), jnp.bfloat16) * 0.01
               for k, s in SHAPES.items()}
    nbytes = sum(v.nbytes for v in stacked.values())
    for b in (1, 16):
        x = jnp.ones((b, H), jnp.bfloat16)
        for name, fn in (("scan", scan_fwd), ("unrolled", unrolled_fwd)):
            ms = timed(jax.jit(fn), x, stacked)
            print(f"B={b} {name:9s} {ms:7.2f} ms  {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
    layers = [{k: v[i] for k, v in stacked.items()} for i in range(L)]
    del stacked
    for b in (1, 16):
        x = jnp.ones((b, H), jnp.bfloat16)
        ms = timed(jax.jit(separate_fwd), x, layers)
        print(f"B={b} separate  {ms:7.2f} ms  {nbytes / ms / 1e6:7.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
