"""Narrow edge blocks vs none, per kernel, for CCA with and without sinks, in one process.

    python benchmarks/research/sinks_narrow.py [--length 131072] [--hkv 8] [--rounds 3]
        [--out benchmarks/results/research/sinks_narrow_h200.json]

The kernels alone on prepared inputs (g = 16, s = 1024, Hq = 32, D = 128, bf16, B = 1),
forward and forward+backward, for N = 0 and 4 sinks and each narrow setting
(`KernelConfig.narrow_block` / `dq_narrow_block` / `dkv_narrow_block`). Every program is
compiled first, then timed round-robin `--rounds` times (the median of each round's median),
so machine drift hits every setting alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.measure import claim_output, median_ms  # noqa: E402
from cca_jax.attention.pooling import core_tokens_and_bounds  # noqa: E402
from pallas_kernels.gpu import blocked_attention_pallas_gpu  # noqa: E402

# name: (forward, dq, dk/dv) narrow block
SETTINGS = {"none": (0, 0, 0), "fwd": (16, 0, 0), "fwd_dq": (16, 16, 0), "all": (16, 16, 16)}


def programs(length, hkv, n, hq=32, d=128, g=16, s=1024):
    keys = jax.random.split(jax.random.key(length + hkv), 4)
    q = jax.random.normal(keys[0], (1, length, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, length, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, length, hkv, d), jnp.bfloat16)
    ct = jax.random.normal(keys[3], q.shape, jnp.float32)
    prepared = jax.jit(lambda q, k, v: core_tokens_and_bounds(
        q, k, v, group_size=g, window_size=s, sink_tokens=n, pooling="cca"))(q, k, v)
    out = {}
    for name, (fwd, dq, dkv) in SETTINGS.items():
        def kernel(q, k, v, ck, cv, *bounds, fwd=fwd, dq=dq, dkv=dkv):
            return blocked_attention_pallas_gpu(q, k, v, ck, cv, *bounds, narrow_block=fwd,
                                                dq_narrow_block=dq, dkv_narrow_block=dkv)

        def loss(q, k, v, ck, cv, lo, clo, chi, c, kernel=kernel):
            return jnp.sum(kernel(q, k, v, ck, cv, lo, clo, chi).astype(jnp.float32) * c)
        out[(n, name, "fwd")] = (jax.jit(kernel), (q, k, v, *prepared))
        out[(n, name, "fwd_bwd")] = (jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))),
                                     (q, k, v, *prepared, ct))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/research/sinks_narrow_h200.json")
    args = ap.parse_args(argv)
    claim_output(args.out, suffixes=("",))
    progs = {**programs(args.length, args.hkv, 0), **programs(args.length, args.hkv, 4)}
    for fn, a in progs.values():             # compile everything before any clock runs
        jax.block_until_ready(fn(*a))
    times = {key: [] for key in progs}
    for r in range(args.rounds):
        for key, (fn, a) in progs.items():
            times[key].append(median_ms(fn, a, warmup=1, iters=args.iters))
        print(f"round {r} done", flush=True)
    records = [{"sink_tokens": n, "narrow": name, "narrow_blocks": SETTINGS[name],
                "pass": what, "ms": statistics.median(ms), "rounds_ms": ms,
                "L": args.length, "hkv": args.hkv, "hq": 32, "d": 128, "g": 16, "s": 1024,
                "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "date": datetime.date.today().isoformat(),
                "command": "python benchmarks/research/sinks_narrow.py "
                           + " ".join(argv or sys.argv[1:])}
               for (n, name, what), ms in times.items()]
    base = {r["pass"]: r["ms"] for r in records
            if r["sink_tokens"] == 0 and r["narrow"] == "none"}
    print("| N | narrow (fwd, dq, dkv) | pass | ms | vs N=0 none |\n|---|---|---|---|---|")
    for r in records:
        print(f"| {r['sink_tokens']} | {r['narrow']} {r['narrow_blocks']} | {r['pass']} | "
              f"{r['ms']:.2f} | {r['ms'] / base[r['pass']] - 1:+.2%} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
