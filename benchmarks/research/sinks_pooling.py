"""Where CCA's sinks cost time outside the kernels: the slots' pooling, in ways to compute it.

    python benchmarks/research/sinks_pooling.py [--length 131072] [--hkv 8] [--sinks 4]
        [--rounds 20] [--small] [--out benchmarks/results/research/sinks_pooling_h200]

A profile of the 128K forward on an H100 (`research/sinks_profile_h100_5d74f32.md`) put the
cost of 4 or 8 sinks outside the attention kernel: two `input_concatenate_fusion`s of
0.27 ms each where CCA alone has a `loop_reduce_fusion` of 0.25 ms. Those are the slots'
assembly in `pooling.slots_and_bounds` (`_pool_mixed`: every slot pooled both as a group and
as a single token, then a select). Unpacked rows have their sinks in the first N slots
only, so cheaper forms are possible. Each variant computes the same `ck, cv` as the library
(checked: the largest difference is in the record), pooled to whole slot blocks as the
Mosaic path does, timed round-robin with the no-sink pooling (`fwd`, and `fwd+bwd`: the
gradients of sum(ck * ct + cv * ct) w.r.t. q, k, v):
  library        `slots_and_bounds` (what runs today)
  no_sinks       the same with N = 0 (what sinks cost is the difference)
  slice_concat   the sinks from the first N rows, the groups from rows N.. by reshape,
                 concatenated (`pool_pattern_slots` without group starts)
  groups_dus     the groups at their starts for every slot (as the library), then the N
                 sink slots written over the first N (one small update in place)
Writes `<out>.json` (stamped records) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.measure import (add_cca_shape_args, claim_output, paired_ratio,  # noqa: E402
                                round_robin_times, stamp, table_heading, write_results)
from cca_jax.attention.pooling import (pool_core_tokens, pool_pattern_slots,  # noqa: E402
                                       slots_and_bounds)
from cca_jax.blocks import CCA  # noqa: E402


def variants(pattern, slots: int) -> dict:
    """name -> f(q, k, v) -> (ck, cv) `[B, slots, Hq, D]`."""
    n, g = pattern.sink_tokens, pattern.group_size
    plain = CCA(g, pattern.window_size)

    def library(q, k, v):
        return tuple(slots_and_bounds(q, k, v, pattern, min_slots=slots)[:2])

    def no_sinks(q, k, v):
        return tuple(slots_and_bounds(q, k, v, plain, min_slots=slots)[:2])

    def slice_concat(q, k, v):
        return pool_pattern_slots(q, k, v, pattern, slots)

    def groups_dus(q, k, v):
        length = q.shape[1]
        start = jnp.clip(n + g * (jnp.arange(slots) - n), 0, length - g)[None]
        ck, cv = pool_core_tokens(q, k, v, group_size=g, num_groups=slots, group_start=start)
        sk, sv = pool_core_tokens(q, k, v, group_size=1, num_groups=n)
        return ck.at[:, :n].set(sk), cv.at[:, :n].set(sv)

    return dict(library=library, no_sinks=no_sinks, slice_concat=slice_concat,
                groups_dus=groups_dus)


def program(fn, mode: str):
    if mode == "fwd":
        return jax.jit(fn)

    def grads(q, k, v):
        def loss(q, k, v):
            ck, cv = fn(q, k, v)
            return jnp.sum(ck.astype(jnp.float32)) + jnp.sum(cv.astype(jnp.float32) * 0.5)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(grads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cca_shape_args(ap)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--slot-multiple", type=int, default=128,
                    help="pool whole blocks of this many slots (the Mosaic forward's)")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--small", action="store_true",
                    help="a CPU check: L 256, 2/1 heads of 64, g 4, s 32, float32")
    ap.add_argument("--out", default="benchmarks/results/research/sinks_pooling_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    if args.small:
        args.length, args.hq, args.hkv, args.d, args.g, args.s = 256, 2, 1, 64, 4, 32
        args.slot_multiple, args.rounds = 16, min(args.rounds, 3)
    dtype = jnp.float32 if args.small else jnp.bfloat16
    pattern = CCA(args.g, args.s, args.sinks)
    need = pattern.max_slots(args.length)
    slots = -(-need // args.slot_multiple) * args.slot_multiple
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, args.length, args.hq, args.d), dtype)
    k = jax.random.normal(kk, (1, args.length, args.hkv, args.d), dtype)
    v = jax.random.normal(kv, (1, args.length, args.hkv, args.d), dtype)
    fns = variants(pattern, slots)
    reference = jax.jit(fns["library"])(q, k, v)
    records = []
    for mode in args.modes.split(","):
        calls = {name: (program(fn, mode), (q, k, v)) for name, fn in fns.items()}
        times = round_robin_times(calls, args.rounds)
        for name, fn in fns.items():
            diff = None
            if name != "no_sinks":
                got = jax.jit(fn)(q, k, v)
                diff = max(float(jnp.max(jnp.abs(a[:, :need].astype(jnp.float32)
                                                 - b[:, :need].astype(jnp.float32))))
                           for a, b in zip(got, reference))
            ratio = paired_ratio(times[name], times["no_sinks"])
            records.append(dict(variant=name, mode=mode, length=args.length, hq=args.hq,
                                hkv=args.hkv, d=args.d, group_size=args.g,
                                window_size=args.s, sink_tokens=args.sinks, slots=slots,
                                ms=round(sorted(times[name])[len(times[name]) // 2], 4),
                                x_no_sinks_paired=ratio, max_abs_diff_vs_library=diff,
                                **stamp()))
            print(f"{mode} {name}: {records[-1]['ms']:.3f} ms, x no sinks "
                  f"{ratio['median']:.3f} (p10 {ratio['p10']:.3f}, p90 {ratio['p90']:.3f}), "
                  f"max |diff| vs library {diff}", flush=True)
    write_results(args.out, records, table(records))
    return 0


def table(records) -> str:
    r0 = records[0]
    lines = table_heading(
        f"The slots' pooling with and without sinks: L = {r0['length']}, Hq = {r0['hq']}, "
        f"Hkv = {r0['hkv']}, D = {r0['d']}, g = {r0['group_size']}, s = {r0['window_size']}, "
        f"N = {r0['sink_tokens']}, {r0['slots']} slots", r0) + [
        "| mode | variant | ms | x no sinks (paired median, p10-p90) | max abs diff vs library |",
        "| --- | --- | --- | --- | --- |"]
    for r in records:
        p = r["x_no_sinks_paired"]
        diff = "" if r["max_abs_diff_vs_library"] is None else f"{r['max_abs_diff_vs_library']:.3g}"
        lines.append(f"| {r['mode']} | {r['variant']} | {r['ms']:.3f} | {p['median']:.3f} "
                     f"({p['p10']:.3f}-{p['p90']:.3f}) | {diff} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
