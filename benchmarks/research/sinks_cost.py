"""What CCA's sink tokens cost: CCA with and without sinks, timed in one process, round-robin.

    python benchmarks/research/sinks_cost.py [--impls mosaic_gpu,pallas_gpu] [--length 131072]
        [--hkv 8] [--sinks 0,4]

Separate runs of `benchmarks/attention.py --sink-tokens N` differ by 1-2% from clock and power
drift alone, about what sinks are expected to cost (N raw keys become N more slots of each
row: ~N more visited keys out of ~5000 at 128K). Here every (implementation, sinks, mode)
program is compiled first, then all are timed one call each per round (median over
--rounds), so drift hits every one alike. A call is the whole backend (`run_attention`:
pooling, bounds and the kernels), bf16, B = 1, Hq = 32, D = 128, CCA g = 16, s = 1024;
`fwd+bwd` is jax.grad of sum(out * ct) w.r.t. q, k, v (ct in the inputs' dtype). Writes
`<out>.json` (records stamped with commit, device, jax, date, command) and `<out>.md` (each
time and its ratio to the same implementation and mode without sinks: of the medians, and
paired round by round, whose 10th-90th percentiles say how far the noise reaches; the largest
relative L2 of its output (fwd) or gradients (fwd+bwd) against the first implementation's
at the same sinks). `--profile DIR`: one more call of each program under `jax.profiler`, its
GPU kernels by time in the record (`kernels`) and in a second table: which kernel the
sinks' time goes to; each program's optimized HLO is written beside (`<out>_<impl>_<sinks>_<mode>
.hlo.txt.gz`), to read what a fusion of the profile computes.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.measure import (add_cca_shape_args, claim_output, paired_ratio,  # noqa: E402
                                rel_l2, round_robin_times, stamp, write_results)
from cca_jax.attention import run_attention  # noqa: E402
from cca_jax.blocks import CCA  # noqa: E402


def _program(impl: str, pattern, mode: str):
    """jit of one backend call (`fwd`) or of its q/k/v gradients (`fwd+bwd`)."""
    def fwd(q, k, v, ct):
        return run_attention(q, k, v, pattern, implementation=impl)

    def grads(q, k, v, ct):
        def loss(q, k, v):
            return jnp.sum(fwd(q, k, v, ct).astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(fwd if mode == "fwd" else grads)


def _profile(call, inputs, out_dir: str, key) -> dict:
    """One call of a compiled program under the profiler: its kernels by time."""
    from benchmarks.research.profile_inference import kernel_table
    where = os.path.join(out_dir, "_".join(str(x) for x in key).replace("+", "_"))
    jax.block_until_ready(call(*inputs))
    with jax.profiler.trace(where):
        jax.block_until_ready(call(*inputs))
    table = kernel_table(where, 14)
    table.pop("events", None)
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="mosaic_gpu,pallas_gpu")
    add_cca_shape_args(ap)
    ap.add_argument("--sinks", default="0,4")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also profile each program once (traces under DIR)")
    ap.add_argument("--out", default="benchmarks/results/research/sinks_cost_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, args.length, args.hq, args.d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, args.length, args.hkv, args.d), jnp.bfloat16)
            for x in keys[1:3])
    ct = jax.random.normal(keys[3], q.shape, q.dtype)   # as a model's o_proj hands it back
    inputs = jax.block_until_ready((q, k, v, ct))
    base = stamp(argv)
    records, calls = [], {}
    for impl in args.impls.split(","):
        for sinks in map(int, args.sinks.split(",")):
            for mode in args.modes.split(","):
                rec = dict(base, impl=impl, sink_tokens=sinks, mode=mode, L=args.length,
                           hq=args.hq, hkv=args.hkv, d=args.d, g=args.g, s=args.s, b=1,
                           dtype="bfloat16")
                start = time.perf_counter()
                try:   # compile everything before timing anything
                    fn = _program(impl, CCA(args.g, args.s, sinks), mode)
                    calls[(impl, sinks, mode)] = fn.lower(*inputs).compile()
                except Exception as e:  # noqa: BLE001  (record and go on)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                rec["compile_s"] = round(time.perf_counter() - start, 1)
                print(rec.get("error", f"compiled {impl} sinks={sinks} {mode} in "
                                       f"{rec['compile_s']} s"), flush=True)
                records.append(rec)
    times = round_robin_times({key: (fn, inputs) for key, fn in calls.items()}, args.rounds)
    medians = {key: statistics.median(t) for key, t in times.items()}
    # The implementations' outputs against the first one's (same sinks, mode): a numerics
    # check of the timed programs themselves (the narrow heads run only with sinks).
    impls = args.impls.split(",")
    for rec in records:
        key, ref = (rec["impl"], rec["sink_tokens"], rec["mode"]), (impls[0],) + \
            (rec["sink_tokens"], rec["mode"])
        if rec["impl"] != impls[0] and key in calls and ref in calls:
            got, want = calls[key](*inputs), calls[ref](*inputs)
            rec[f"rel_l2_vs_{impls[0]}"] = max(
                rel_l2(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    rows = [f"| impl | mode | sinks | ms | x no sinks | paired x no sinks: median [p10, p90] "
            f"| rel L2 vs {impls[0]} |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for rec in records:
        key = (rec["impl"], rec["sink_tokens"], rec["mode"])
        if key not in medians:
            rows.append(f"| {key[0]} | {key[2]} | {key[1]} | error | | | |")
            continue
        rec["ms"] = medians[key]
        plain = medians.get((rec["impl"], 0, rec["mode"]))
        rec["x_no_sinks"] = rec["ms"] / plain if plain else None
        ratio = "" if plain is None else f"{rec['x_no_sinks']:.4f}"
        paired = ""
        if plain is not None:   # per round against the same round's no-sink call
            rec["x_no_sinks_paired"] = paired_ratio(times[key], times[(key[0], 0, key[2])])
            p = rec["x_no_sinks_paired"]
            paired = f"{p['median']:.4f} [{p['p10']:.4f}, {p['p90']:.4f}]"
        err = rec.get(f"rel_l2_vs_{impls[0]}")
        rows.append(f"| {key[0]} | {key[2]} | {key[1]} | {rec['ms']:.2f} | {ratio} | {paired} | "
                    f"{'' if err is None else f'{err:.1e}'} |")
    if args.profile:
        rows += ["", "Kernels by time, one profiled call each (ms; the 8 longest; the record "
                 "holds 14):", "",
                 "| impl | mode | sinks | kernel ms | kernels | longest |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for rec in records:
            key = (rec["impl"], rec["sink_tokens"], rec["mode"])
            if key in calls:
                rec["kernels"] = _profile(calls[key], inputs, args.profile, key)
                # The optimized HLO beside the results: what each profiled fusion computes.
                hlo = f"{args.out}_{'_'.join(map(str, key)).replace('+', '_')}.hlo.txt.gz"
                with gzip.open(hlo, "wt") as f:
                    f.write(calls[key].as_text())
                longest = "; ".join(f"{k['name'][:48]} x{k['count']} {k['ms']:.2f}"
                                    for k in rec["kernels"]["top"][:8])
                rows.append(f"| {key[0]} | {key[2]} | {key[1]} | "
                            f"{rec['kernels']['kernel_ms']:.2f} | {rec['kernels']['kernels']} "
                            f"| {longest} |")
    header = (f"CCA with and without sinks, round-robin in one process: L = {args.length}, "
              f"Hq = {args.hq}, Hkv = {args.hkv}, D = {args.d}, g = {args.g}, s = {args.s}, "
              f"bf16; {base['device']}, jax {base['jax']}, {base['date']}, commit "
              f"{base['commit']}\nCommand: `{base['command']}`\n\n")
    write_results(args.out, records, header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
