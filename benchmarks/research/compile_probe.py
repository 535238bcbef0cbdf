"""Where XLA's GPU compile time goes at long L: lower and compile (no run) one program.

    python benchmarks/research/compile_probe.py --what cca_xla_fwd,pooling_fwd \
        --lengths 32768,131072

Prints one JSON line per (program, L): seconds to trace+lower and to compile. Run it with
`XLA_FLAGS=--xla_dump_to=DIR` and/or `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=...` to see
which compiler phase is slow (file times of the dump, log timestamps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from cca_jax.attention import cca_attention  # noqa: E402
from cca_jax.attention.pooling import core_tokens_and_bounds  # noqa: E402

G, S = 16, 1024


def _loss(fn):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def _programs():
    xla = lambda q, k, v: cca_attention(q, k, v, group_size=G, window_size=S,  # noqa: E731
                                        implementation="xla")
    pallas = lambda q, k, v: cca_attention(q, k, v, group_size=G, window_size=S,  # noqa: E731
                                           implementation="pallas_gpu")
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="cudnn")
    pool = lambda q, k, v: core_tokens_and_bounds(  # noqa: E731
        q, k, v, group_size=G, window_size=S, pooling="cca")[:2]
    pool_sum = lambda q, k, v: sum(jnp.sum(x.astype(jnp.float32)) for x in pool(q, k, v))  # noqa: E731
    return {"cca_xla_fwd": xla, "cca_xla_fwd_bwd": _loss(xla),
            "cca_pallas_gpu_fwd": pallas, "cca_pallas_gpu_fwd_bwd": _loss(pallas),
            "full_cudnn_fwd": cudnn, "full_cudnn_fwd_bwd": _loss(cudnn),
            "pooling_fwd": pool,
            "pooling_fwd_bwd": jax.grad(pool_sum, argnums=(0, 1, 2))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", default="cca_xla_fwd")
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    args = ap.parse_args(argv)
    programs = _programs()
    for length in map(int, args.lengths.split(",")):
        q = jax.ShapeDtypeStruct((1, length, args.hq, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, length, args.hkv, 128), jnp.bfloat16)
        for name in args.what.split(","):
            start = time.perf_counter()
            lowered = jax.jit(programs[name]).lower(q, kv, kv)
            lower_s = time.perf_counter() - start
            lowered.compile()
            rec = {"program": name, "L": length, "hkv": args.hkv,
                   "lower_s": round(lower_s, 2),
                   "compile_s": round(time.perf_counter() - start - lower_s, 2),
                   "xla_flags": os.environ.get("XLA_FLAGS", "")}
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
