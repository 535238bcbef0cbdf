"""On the H200: the Mosaic GPU CCA forward against the Triton-lowered one, on prepared inputs.

    python benchmarks/research/mosaic_gpu_cca.py [--lengths 8192,32768,131072] [--hkv 8,32]
        [--with-pooling] [--backward [--backward-tilings '[{}, {"compute_wgs": 1}]']]

Both kernels take the same prepared tensors (q, k, v, the pooled slots and the row bounds
of `slots_and_bounds`, B = 1, Hq = 32, D = 128, CCA g = 16, s = 1024, bf16), so only the
kernels are timed. Every program is compiled first, then all are timed round-robin (one call
of each per round; median over rounds), so clock and power drift hit every kernel alike.
TFLOP/s count the visited scores (`CCA(...).visible_scores(L)`, as benchmarks/attention.py).
`--backward` also times forward + backward (jax.grad of sum(out * ct), a fixed float32
cotangent, w.r.t. q, k, v and the slots) in the same round-robin: the Mosaic forward with
the Mosaic backward (`+bwd=mosaic`, at each `--backward-tilings` entry) and with the Triton
one (`+bwd=triton`), and the Triton kernels' own forward + backward (`triton`); their
TFLOP/s count 3.5x the forward's FLOPs (the forward's two products plus the backward's five).
Writes `<out>.json` (records stamped with commit, device, jax, date, command) and `<out>.md`.
A kernel that fails to compile or run is recorded with its error; the others go on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax, pallas_kernels
from benchmarks.measure import claim_output, rel_l2, round_robin, stamp, write_results  # noqa: E402
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


def _grad_kernels(mosaic_tilings: list, backward_tilings: list) -> dict:
    """name -> (q, k, v, ck, cv, *bounds, ct) -> the five gradients of sum(out * ct): the
    Mosaic forward (default tiling, or each `mosaic_tilings` entry) with the Mosaic backward
    at each `backward_tilings` entry and with the Triton backward; then the Triton kernels'
    forward and backward."""
    from pallas_kernels.gpu import blocked_attention_pallas_gpu
    from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu

    def label(tiling):
        return f"[{','.join(f'{k}={v}' for k, v in sorted(tiling.items()))}]" if tiling else ""

    def grads(kernel):
        def run(q, k, v, ck, cv, raw_lo, core_lo, core_hi, ct):
            def loss(q, k, v, ck, cv):
                out = kernel(q, k, v, ck, cv, raw_lo, core_lo, core_hi)
                return jnp.sum(out.astype(jnp.float32) * ct)
            return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, ck, cv)
        return run
    kernels = {}
    for tiling in mosaic_tilings:
        for bwd in backward_tilings:
            kernels[f"mosaic_gpu{label(tiling)}+bwd=mosaic{label(bwd)}"] = grads(
                functools.partial(blocked_attention_mosaic_gpu, backward="mosaic",
                                  backward_tiling=bwd or None, **tiling))
        kernels[f"mosaic_gpu{label(tiling)}+bwd=triton"] = grads(
            functools.partial(blocked_attention_mosaic_gpu, backward="triton", **tiling))
    kernels["triton"] = grads(blocked_attention_pallas_gpu)
    return kernels


def _prepared(length: int, hq: int, hkv: int, d: int, pattern):
    """bf16 q, k, v and their slots and bounds (computed once, outside the timing)."""
    keys = jax.random.split(jax.random.key(length + hkv), 3)
    q = jax.random.normal(keys[0], (1, length, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, length, hkv, d), jnp.bfloat16) for x in keys[1:])
    prepared = jax.jit(lambda q, k, v: slots_and_bounds(q, k, v, pattern))(q, k, v)
    return jax.block_until_ready((q, k, v, *prepared))


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
    ap.add_argument("--backward", action="store_true",
                    help="also time forward + backward (Mosaic vs Triton backward)")
    ap.add_argument("--backward-tilings", default="[{}]",
                    help='JSON list of MosaicBackwardConfig overrides, each timed with '
                         '--backward, e.g. \'[{}, {"compute_wgs": 1}, {"stages": 3}]\'')
    ap.add_argument("--out", default="benchmarks/results/research/mosaic_gpu_cca_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    pattern = CCA(args.g, args.s)
    kernels = {(name, "fwd"): fn for name, fn in
               _kernels(json.loads(args.mosaic_tilings)).items()}
    if args.with_pooling:
        kernels.update({(name, "fwd"): fn for name, fn in _pooled_kernels(pattern).items()})
    if args.backward:
        kernels.update({(name, "fwd+bwd"): fn for name, fn in _grad_kernels(
            json.loads(args.mosaic_tilings), json.loads(args.backward_tilings)).items()})
    base = stamp(argv)
    records, calls, outputs = [], {}, {}
    for length in map(int, args.lengths.split(",")):
        for hkv in map(int, args.hkv.split(",")):
            inputs = _prepared(length, args.hq, hkv, args.d, pattern)
            flops = 4 * pattern.visible_scores(length) * args.d * args.hq
            cotangent = jax.random.normal(jax.random.key(7), inputs[0].shape, jnp.float32)
            for (name, mode), kernel in kernels.items():
                rec = dict(base, impl=name.split("[")[0].split("+")[0], kernel=name, mode=mode,
                           L=length, hq=args.hq, hkv=hkv, d=args.d, g=args.g, s=args.s, b=1,
                           dtype="bfloat16",
                           flops=flops if mode == "fwd" else int(flops * 3.5))
                args_ = inputs if mode == "fwd" else (*inputs, cotangent)
                key = (length, hkv, name, mode)
                start = time.perf_counter()
                try:   # compile everything before timing anything
                    fn = jax.jit(kernel).lower(*args_).compile()
                    outputs[key] = jax.block_until_ready(fn(*args_))
                    calls[key] = (fn, args_)
                except Exception as e:  # noqa: BLE001  (record and go on)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                rec["compile_s"] = round(time.perf_counter() - start, 1)
                print(rec.get("error", f"compiled {name} ({mode}) L={length} hkv={hkv} "
                                       f"in {rec['compile_s']} s"), flush=True)
                records.append(rec)
    medians = round_robin(calls, args.rounds)
    for rec in records:
        key = (rec["L"], rec["hkv"], rec["kernel"], rec["mode"])
        field = "fwd" if rec["mode"] == "fwd" else "fwd_bwd"   # fwd_ms / fwd_bwd_ms
        if key in medians:
            rec[f"{field}_ms"] = medians[key]
            rec[f"{field}_tflops"] = rec["flops"] / medians[key] / 1e9
            other = outputs.get((rec["L"], rec["hkv"], "triton", rec["mode"]))
            if rec["kernel"] != "triton" and other is not None:
                if rec["mode"] == "fwd":
                    rec["rel_l2_vs_triton"] = rel_l2(outputs[key], other)
                else:   # per gradient: dq, dk, dv, dck, dcv
                    rec["rel_l2_vs_triton"] = {
                        n: rel_l2(g, t) for n, g, t in zip(("dq", "dk", "dv", "dck", "dcv"),
                                                           outputs[key], other)}
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        rows += [f"\n{mode}:\n", f"| L | Hkv | kernel | {mode} ms | TFLOP/s | rel L2 vs Triton |",
                 "| --- | --- | --- | --- | --- | --- |"]
        field = "fwd" if mode == "fwd" else "fwd_bwd"
        for r in (r for r in records if r["mode"] == mode):
            if f"{field}_ms" in r:
                rel = r.get("rel_l2_vs_triton", "")
                if isinstance(rel, dict):
                    rel = ", ".join(f"{n} {x:.1e}" for n, x in rel.items())
                rows.append(f"| {r['L']} | {r['hkv']} | {r['kernel']} | {r[field + '_ms']:.2f} "
                            f"| {r[field + '_tflops']:.0f} | {rel} |")
            else:
                rows.append(f"| {r['L']} | {r['hkv']} | {r['kernel']} | error | | "
                            f"{r.get('error', '')[:80]} |")
    header = (f"Mosaic GPU vs Triton CCA forward (and backward), {base['device']}, "
              f"jax {base['jax']}, {base['date']}, commit {base['commit']}\n\n")
    write_results(args.out, records, header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
