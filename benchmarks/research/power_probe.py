"""Probe: does the CCA forward kernel run slower next to matrix products (power, clocks)?

    python benchmarks/research/power_probe.py

At 128K the kernel takes ~25-27 ms alone (benchmarks/attention.py) but ~32 ms per layer
inside a 7B prefill (research/profile_inference.py). This times, on one H200, 8 iterations
each of: the CCA forward alone (Hq = Hkv = 32, D = 128, g = 16, s = 1024, N(0, 1) inputs);
an MLP-sized pair of matrix products (131072 x 4096 x 11008 and back) alone; and both in
turn; with the SM clock and power draw sampled by `nvidia-smi` meanwhile
(`profile_inference.ClockSampler`). Prints ms per iteration and the clock/power spread.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

L, H, D, HIDDEN, FFN = 131072, 32, 128, 4096, 11008
ITERS = 8


def main():
    import jax
    import jax.numpy as jnp

    from benchmarks.research.profile_inference import ClockSampler
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu

    if jax.default_backend() != "gpu":
        sys.exit("power_probe needs an NVIDIA GPU.")
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    q, k, v = (jax.random.normal(keys[i], (1, L, H, D), jnp.bfloat16) for i in range(3))
    x = jax.random.normal(keys[3], (L, HIDDEN), jnp.bfloat16) * 0.05
    w_up = jax.random.normal(keys[4], (HIDDEN, FFN), jnp.bfloat16) * 0.02
    w_down = jax.random.normal(keys[5], (FFN, HIDDEN), jnp.bfloat16) * 0.02

    def attention(q):
        return cca_attention_pallas_gpu(q, k, v, group_size=16, window_size=1024)

    def products(x):
        return ((x @ w_up) @ w_down).astype(x.dtype)

    def repeat(step):
        return jax.jit(lambda c: jax.lax.scan(lambda c, _: (step(c), None), c, None,
                                              length=ITERS)[0])

    def both(c):
        x, q = c
        return products(x), attention(q).astype(q.dtype)

    cases = [("attention", repeat(lambda q: attention(q).astype(q.dtype)), q),
             ("products", repeat(products), x), ("both", repeat(both), (x, q))]
    for name, fn, arg in cases:
        jax.block_until_ready(fn(arg))
        clocks = ClockSampler()
        with clocks:
            start = time.perf_counter()
            for _ in range(4):
                out = fn(arg)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - start) / 4 / ITERS * 1e3
        print(f"{name:10s} {ms:8.2f} ms per iteration  {clocks.summary()}", flush=True)


if __name__ == "__main__":
    main()
