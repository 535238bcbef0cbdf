"""On the H200: the Mosaic GPU CCA forward against the Triton-lowered one, on prepared inputs.

    python benchmarks/research/mosaic_gpu_cca.py [--lengths 8192,32768,131072] [--hkv 8,32]

Both kernels take the same prepared tensors (q, k, v, the pooled slots and the row bounds
of `slots_and_bounds`, B = 1, Hq = 32, D = 128, CCA g = 16, s = 1024, bf16), so only the
kernels are timed. Every program is compiled first, then all are timed round-robin (one call
of each per round; median over rounds), so clock and power drift hit every kernel alike.
TFLOP/s count the visited scores (`CCA(...).visible_scores(L)`, as benchmarks/attention.py).
Writes `<out>.json` (records stamped with commit, device, jax, date, command) and `<out>.md`.
A kernel that fails to compile or run is recorded with its error; the others go on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax, pallas_kernels
from benchmarks.measure import rel_l2, stamp, write_results  # noqa: E402
from cca_jax.attention.pooling import slots_and_bounds  # noqa: E402
from cca_jax.blocks import CCA  # noqa: E402


def _kernels(mosaic_tilings: list) -> dict:
    """name -> kernel: the Mosaic forward at each tiling (`mosaic_gpu` for the defaults,
    `mosaic_gpu[field=value,...]` otherwise), then the Triton one."""
    from pallas_kernels.gpu import blocked_attention_pallas_gpu
    from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu
    kernels = {}
    for tiling in mosaic_tilings:
        name = "mosaic_gpu" + (f"[{','.join(f'{k}={v}' for k, v in sorted(tiling.items()))}]"
                               if tiling else "")
        kernels[name] = functools.partial(blocked_attention_mosaic_gpu, **tiling)
    kernels["triton"] = blocked_attention_pallas_gpu
    return kernels


def _pooled_kernels(pattern) -> dict:
    """name -> the whole backend call (pooling, bounds and tables inside the program), fed
    the same inputs: shows what the set-up around each kernel costs."""
    from cca_jax.attention.pallas_gpu import attention_pallas_gpu
    from cca_jax.attention.pallas_mosaic_gpu import attention_mosaic_gpu
    return {f"{name}+pooling": (lambda fn: lambda q, k, v, *_: fn(q, k, v, pattern))(fn)
            for name, fn in (("mosaic_gpu", attention_mosaic_gpu),
                             ("triton", attention_pallas_gpu))}


def _prepared(length: int, hq: int, hkv: int, d: int, pattern):
    """bf16 q, k, v and their slots and bounds (computed once, outside the timing)."""
    keys = jax.random.split(jax.random.key(length + hkv), 3)
    q = jax.random.normal(keys[0], (1, length, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, length, hkv, d), jnp.bfloat16) for x in keys[1:])
    prepared = jax.jit(lambda q, k, v: slots_and_bounds(q, k, v, pattern))(q, k, v)
    return jax.block_until_ready((q, k, v, *prepared))


def _round_robin(calls: dict, rounds: int) -> dict:
    """name -> median ms over `rounds` rounds of one call of each (after two warm-ups)."""
    times = {name: [] for name in calls}
    for fn, args in calls.values():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    for _ in range(rounds):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--hkv", default="8,32")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mosaic-tilings", default="[{}]",
                    help='JSON list of MosaicConfig overrides, each timed, e.g. '
                         '\'[{}, {"compute_wgs": 1}, {"block_kv": 64, "stages": 4}]\'')
    ap.add_argument("--with-pooling", action="store_true",
                    help="also time the whole backend calls (pooling and set-up inside)")
    ap.add_argument("--out", default="benchmarks/results/research/mosaic_gpu_cca_h200")
    args = ap.parse_args(argv)
    pattern = CCA(args.g, args.s)
    kernels = _kernels(json.loads(args.mosaic_tilings))
    if args.with_pooling:
        kernels.update(_pooled_kernels(pattern))
    base = stamp(argv)
    records, calls, outputs = [], {}, {}
    for length in map(int, args.lengths.split(",")):
        for hkv in map(int, args.hkv.split(",")):
            inputs = _prepared(length, args.hq, hkv, args.d, pattern)
            flops = 4 * pattern.visible_scores(length) * args.d * args.hq
            for name, kernel in kernels.items():
                rec = dict(base, impl=name.split("[")[0], kernel=name, L=length, hq=args.hq,
                           hkv=hkv, d=args.d, g=args.g, s=args.s, b=1, dtype="bfloat16",
                           flops=flops)
                start = time.perf_counter()
                try:   # compile everything before timing anything
                    fn = jax.jit(kernel).lower(*inputs).compile()
                    outputs[(length, hkv, name)] = jax.block_until_ready(fn(*inputs))
                    calls[(length, hkv, name)] = (fn, inputs)
                except Exception as e:  # noqa: BLE001  (record and go on)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                rec["compile_s"] = round(time.perf_counter() - start, 1)
                print(rec.get("error", f"compiled {name} L={length} hkv={hkv} "
                                       f"in {rec['compile_s']} s"), flush=True)
                records.append(rec)
    medians = _round_robin(calls, args.rounds)
    for rec in records:
        key = (rec["L"], rec["hkv"], rec["kernel"])
        if key in medians:
            rec["fwd_ms"] = medians[key]
            rec["fwd_tflops"] = rec["flops"] / rec["fwd_ms"] / 1e9
            other = outputs.get((rec["L"], rec["hkv"], "triton"))
            if rec["kernel"] != "triton" and other is not None:
                rec["rel_l2_vs_triton"] = rel_l2(outputs[key], other)
    rows = ["| L | Hkv | kernel | fwd ms | TFLOP/s | rel L2 vs Triton |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if "fwd_ms" in r:
            rows.append(f"| {r['L']} | {r['hkv']} | {r['kernel']} | {r['fwd_ms']:.2f} | "
                        f"{r['fwd_tflops']:.0f} | {r.get('rel_l2_vs_triton', '')} |")
        else:
            rows.append(f"| {r['L']} | {r['hkv']} | {r['kernel']} | error | | "
                        f"{r.get('error', '')[:80]} |")
    header = (f"Mosaic GPU vs Triton CCA forward, {base['device']}, jax {base['jax']}, "
              f"{base['date']}, commit {base['commit']}\n\n")
    write_results(args.out, records, header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
