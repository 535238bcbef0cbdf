"""Where CCA's sinks cost time in the Pallas GPU path: pooling vs kernel, forward and backward.

    python benchmarks/research/sinks_overhead.py [--length 131072] [--hkv 8,32]
        [--out benchmarks/results/research/sinks_overhead_h200.json]

For N = 0 and N = 4 sinks (g = 16, s = 1024, Hq = 32, D = 128, bf16, B = 1): the median
milliseconds of the slot pooling + bounds alone, of the kernel alone on prepared inputs, of
the two together, and of their gradients; and the visible scores each N implies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.measure import claim_output, median_ms  # noqa: E402
from cca_jax.attention.pooling import core_tokens_and_bounds  # noqa: E402
from cca_jax.blocks import CCA  # noqa: E402
from pallas_kernels.gpu import blocked_attention_pallas_gpu  # noqa: E402


def _sum(x, ct):
    return jnp.sum(x.astype(jnp.float32) * ct)


def measure(length, hq, hkv, d, g, s, n, iters):
    keys = jax.random.split(jax.random.key(length + hkv), 4)
    q = jax.random.normal(keys[0], (1, length, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, length, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, length, hkv, d), jnp.bfloat16)
    ct = jax.random.normal(keys[3], q.shape, jnp.float32)

    def prepare(q, k, v):
        return core_tokens_and_bounds(q, k, v, group_size=g, window_size=s, sink_tokens=n,
                                      pooling="cca")

    def kernel(q, k, v, ck, cv, *bounds):
        return blocked_attention_pallas_gpu(q, k, v, ck, cv, *bounds)

    def whole(q, k, v):
        return kernel(q, k, v, *prepare(q, k, v))

    prepared = jax.jit(prepare)(q, k, v)
    ck_ct = jax.random.normal(keys[3], prepared[0].shape, jnp.float32)
    progs = {
        "pool_fwd": (jax.jit(prepare), (q, k, v)),
        "kernel_fwd": (jax.jit(kernel), (q, k, v, *prepared)),
        "whole_fwd": (jax.jit(whole), (q, k, v)),
        "pool_fwd_bwd": (jax.jit(jax.grad(lambda q, k, v, c: _sum(prepare(q, k, v)[0], c)
                                          + _sum(prepare(q, k, v)[1], c),
                                          argnums=(0, 1, 2))), (q, k, v, ck_ct)),
        "kernel_fwd_bwd": (jax.jit(jax.grad(lambda q, k, v, ck, cv, lo, clo, chi, c:
                                            _sum(kernel(q, k, v, ck, cv, lo, clo, chi), c),
                                            argnums=(0, 1, 2, 3, 4))), (q, k, v, *prepared, ct)),
        "whole_fwd_bwd": (jax.jit(jax.grad(lambda q, k, v, c: _sum(whole(q, k, v), c),
                                           argnums=(0, 1, 2))), (q, k, v, ct)),
    }
    rec = {"L": length, "hq": hq, "hkv": hkv, "d": d, "g": g, "s": s, "sink_tokens": n,
           "slots": int(prepared[0].shape[1]),
           "visible_scores": CCA(g, s, n).visible_scores(length)}
    for name, (fn, args) in progs.items():
        rec[name + "_ms"] = median_ms(fn, args, warmup=2, iters=iters)
        print(f"  N={n} hkv={hkv} {name}: {rec[name + '_ms']:.3f} ms", flush=True)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--hkv", default="8,32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/research/sinks_overhead_h200.json")
    args = ap.parse_args(argv)
    claim_output(args.out, suffixes=("",))
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/research/sinks_overhead.py "
                       + " ".join(argv or sys.argv[1:])}
    records = []
    for hkv in map(int, args.hkv.split(",")):
        for n in (0, 4, 0, 4):    # twice each, interleaved: drift shows as a repeat's spread
            records.append({**measure(args.length, 32, hkv, 128, 16, 1024, n, args.iters),
                            **meta})
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
