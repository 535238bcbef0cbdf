"""Where a forward's wall time goes beyond its kernels: one call timed three ways.

    python benchmarks/research/call_overhead.py [--impls cca_mosaic_gpu,full_cudnn]
        [--length 131072] [--hkv 8] [--d 128] [--calls 10] [--out DIR/call_overhead]

At 128K on an H100 the Mosaic forward's kernels add up to 18.2 ms in a profile
(`sinks_profile_h100_5190599.md`: no gap between them), while `benchmarks/attention.py`
times the call at 19.98-20.66 ms. Per implementation this measures:
- `sync_ms`: one call, then wait for it (what `attention.py` reports);
- `back_to_back_ms`: `--calls` calls dispatched one after another, one wait at the end,
  divided by the count: what each costs when the host runs ahead (a model's layers);
- `in_program_ms`: the same count inside one jitted loop, divided by the count: no
  dispatch at all, only the GPU's time;
- `empty_sync_ms`: a program that does almost nothing, called and waited for: the fixed
  latency of one dispatch and one wait on this machine.
If `sync_ms - in_program_ms` is about `empty_sync_ms`, the gap is launch latency, and the
TFLOP/s of a forward inside a model are those of `in_program_ms`; if not, something in the
call itself (host work before the kernels) costs time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.attention import IMPLS  # noqa: E402
from benchmarks.measure import (add_cca_shape_args, claim_output, median_ms, stamp,  # noqa: E402
                                table_heading, write_results)


def _back_to_back_ms(fn, args, calls: int, rounds: int) -> float:
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - start) * 1e3 / calls)
        del outs
    return statistics.median(per_call)


def _looped(impl, g: int, s: int, calls: int):
    """`calls` forwards in one program. q, k, v and the output are the loop's carry, and each
    step writes one element of the last output into q, k and v (in place, one element): every
    call depends on the one before, so XLA can neither hoist any of its work out of the loop
    nor compute only part of its output. (An optimization barrier is not enough: on the CPU
    XLA hoisted the whole call past one.)"""
    def run(q, k, v):
        def body(_, carry):
            q, k, v, out = carry
            x = out[0, 0, 0, 0]
            q, k, v = (a.at[0, 0, 0, 0].set(x.astype(a.dtype)) for a in (q, k, v))
            return q, k, v, impl(q, k, v, g, s, 0)
        return jax.lax.fori_loop(0, calls, body, (q, k, v, jnp.zeros_like(q)))[3]
    return jax.jit(run)


def measure(name: str, q, k, v, g: int, s: int, calls: int, rounds: int) -> dict:
    impl = IMPLS[name]
    single = jax.jit(lambda q, k, v: impl(q, k, v, g, s, 0))
    looped = _looped(impl, g, s, calls)
    rec = {"impl": name, "sync_ms": median_ms(single, (q, k, v), warmup=2, iters=rounds),
           "back_to_back_ms": _back_to_back_ms(single, (q, k, v), calls, rounds)}
    rec["in_program_ms"] = median_ms(looped, (q, k, v), warmup=1, iters=rounds) / calls
    rec["sync_minus_in_program_ms"] = rec["sync_ms"] - rec["in_program_ms"]
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="cca_mosaic_gpu,full_cudnn")
    add_cca_shape_args(ap)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/research/call_overhead")
    args = ap.parse_args(argv)
    claim_output(args.out)
    names = args.impls.split(",")
    unknown = sorted(set(names) - set(IMPLS))
    if unknown:
        ap.error(f"unknown --impls {unknown}; choose from {sorted(IMPLS)}")
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (1, args.length)
    q = jax.random.normal(keys[0], (*shape, args.hq, args.d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (*shape, args.hkv, args.d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (*shape, args.hkv, args.d), jnp.bfloat16)
    tiny = jnp.ones((8,), jnp.float32)
    empty = jax.jit(lambda x: x + 1)
    base = {**stamp(argv), "L": args.length, "hq": args.hq, "hkv": args.hkv, "d": args.d,
            "g": args.g, "s": args.s, "calls": args.calls,
            "empty_sync_ms": median_ms(empty, (tiny,), warmup=3, iters=50)}
    records = []
    for name in names:
        rec = {**base, **measure(name, q, k, v, args.g, args.s, args.calls, args.rounds)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    cols = ("impl", "sync_ms", "back_to_back_ms", "in_program_ms", "sync_minus_in_program_ms",
            "empty_sync_ms")
    lines = table_heading(f"One forward timed three ways: L {args.length}, Hq {args.hq}, Hkv "
                          f"{args.hkv}, D {args.d}, g {args.g}, s {args.s}, bf16, {args.calls} "
                          "calls", base)
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(r[c] if isinstance(r[c], str) else f"{r[c]:.3f}"
                                for c in cols) + " |" for r in records]
    write_results(args.out, records, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
