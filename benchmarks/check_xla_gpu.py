"""On an accelerator: the blocked XLA CCA against the dense reference (outputs and grads)."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cca_jax.attention import cca_attention_naive, cca_attention_xla  # noqa: E402


def main():
    for dtype in (jnp.float32, jnp.bfloat16):
        for (length, hq, hkv, d, g, s) in [(2048, 4, 2, 128, 16, 256), (3001, 4, 1, 64, 16, 1024)]:
            ks = jax.random.split(jax.random.key(length), 4)
            q = jax.random.normal(ks[0], (1, length, hq, d), dtype)
            k = jax.random.normal(ks[1], (1, length, hkv, d), dtype)
            v = jax.random.normal(ks[2], (1, length, hkv, d), dtype)
            ct = jax.random.normal(ks[3], q.shape, jnp.float32)

            def grads(fn):
                return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(
                    q, k, v, group_size=g, window_size=s).astype(jnp.float32) * ct),
                    argnums=(0, 1, 2)))(q, k, v)

            o_ref = cca_attention_naive(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), group_size=g, window_size=s)
            o = jax.jit(lambda q, k, v: cca_attention_xla(q, k, v, group_size=g,
                                                          window_size=s))(q, k, v)
            rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(  # noqa
                jnp.float32)).ravel()) / jnp.linalg.norm(b.astype(jnp.float32).ravel()))
            g_ref, g_x = grads(cca_attention_naive), grads(cca_attention_xla)
            print(f"{jnp.dtype(dtype).name} L={length} Hq={hq} Hkv={hkv} D={d}: out rel err "
                  f"{rel(o, o_ref):.2e}; grad rel err q/k/v "
                  + " ".join(f"{rel(a, b):.2e}" for a, b in zip(g_x, g_ref)), flush=True)


if __name__ == "__main__":
    main()
