"""On a GPU: the blocked XLA CCA against float64 (outputs and q/k/v gradients).

Was `benchmarks/check_xla_gpu.py` (its H200 record against the float32 `naive`:
benchmarks/results/check_xla_gpu_h200.log). On the GPU, float32 matmuls run as TF32 by
default, so float32 is not much tighter than bf16.
Run with `python -m pytest -m gpu tests/test_gpu_xla.py` on a machine with an NVIDIA GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax.attention import cca_attention_naive, cca_attention_xla
from tests.reference import cca_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")]

# Relative L2 error against float64 on the H200 (jax 0.11.2), largest over the two shapes,
# measured -> x3 margin.
REL_TOL = {
    # outputs 3.9e-4, gradients 5.3e-4 (TF32 matmuls)
    "float32": dict(out=1.2e-3, grad=1.6e-3),
    # outputs 2.1e-3, gradients 3.4e-3
    "bfloat16": dict(out=6.3e-3, grad=1e-2),
}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("length,hq,hkv,d,g,s", [(2048, 4, 2, 128, 16, 256),
                                                (3001, 4, 1, 64, 16, 1024)])
def test_xla_matches_float64_on_gpu(dtype, length, hq, hkv, d, g, s):
    ks = jax.random.split(jax.random.key(length), 4)
    q, k, v = (jax.random.normal(key, (1, length, h, d), jnp.float32).astype(dtype)
               for key, h in zip(ks[:3], (hq, hkv, hkv)))
    ct = jax.random.normal(ks[3], q.shape, jnp.float32)

    def grads(fn):
        def loss(q, k, v, ct):
            return jnp.sum(fn(q, k, v, group_size=g, window_size=s).astype(ct.dtype) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    out = jax.jit(lambda q, k, v: cca_attention_xla(q, k, v, group_size=g, window_size=s))(
        q, k, v)
    got = grads(cca_attention_xla)(q, k, v, ct)
    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, ct)]
        want = [np.asarray(x) for x in grads(cca_attention_naive)(*x64)]
    tol = REL_TOL[dtype]
    assert _rel(out, cca_reference(q, k, v, g, s)) < tol["out"]
    for name, a, b in zip("qkv", got, want):
        assert _rel(a, b) < tol["grad"], (name, _rel(a, b))
