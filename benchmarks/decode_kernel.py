"""Decode attention micro-benchmark: the Pallas GPU decode kernel against XLA's cached_attention.

LLaMA-2-7B shape (Hq = 32, D = 128, bf16), CCA with g = 16, s = 1024 (ring R = s + g = 1040),
slots C = ceil(max_len / 16). Cases: batch in --batch, KV heads in --kv-heads (32; 8 = GQA),
and (context, max_len) in 32K/32K, 128K/128K and 32K/128K (a 128K-sized cache a quarter full:
the kernel reads only the visible slots, XLA's masked einsums read all C). Rows of a batch
sit at positions context - 1 - 37 * row.

Timing models the decode step's layer scan: the cache is stacked over --layers layers (more
than the 50 MB L2 in all but the smallest case), one jit calls the attention for every layer
in turn (--passes times, each call's query depending on the previous output), and the
median of --runs wall times is divided by the number of calls. The kernel reads layer i of
the stacked cache in place (`layer=i`); XLA slices it inside its fusions.
Reported: ms per call, and GB/s counting the bytes of the *visible* ring entries and slots.
A short sweep of kernel tilings (and the [B, Hq, C, D] slot layout) follows for a few cases
while the time budget lasts.

    python benchmarks/decode_kernel.py --out benchmarks/results/decode_kernel_h200.json

The case of a 128K-sized cache a quarter full (32K of context, B = 1, Hkv = 32) is also the
claim the kernel exists for: it reads only the visible quarter of the slots, XLA all of
them. It was a timing assertion in the test suite; it is a measurement here, printed after
the table ("mostly empty cache: ...") and stored in the JSON as `mostly_empty_cache`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.measure import claim_output  # noqa: E402
from cca_jax import blocks  # noqa: E402
from cca_jax.decode import cached_attention  # noqa: E402
from pallas_kernels.gpu import decode_attention_pallas_gpu  # noqa: E402
from pallas_kernels.gpu.decode import DecodeConfig, resolve_splits  # noqa: E402

PATTERN = blocks.CCA(16, 1024)
HQ, D, DTYPE = 32, 128, jnp.bfloat16
CONTEXTS = [(32768, 32768), (131072, 131072), (32768, 131072)]   # (context, max_len)
# Tilings tried on top of the defaults (DecodeConfig) in the sweep; splits "x2" / "/2" scale
# the automatic slot split count.
SWEEP = [dict(dots=False), dict(block=32), dict(block=128), dict(warps=8), dict(stages=3),
         dict(splits="x2"), dict(splits="/2"), dict(slot_layout="bhcd")]


def make_cache(key, layers, batch, hkv, ring, slots):
    """Random bf16 stacked cache: ring `[L, B, R, Hkv, D]`, slots `[L, B, C, Hq, D]` (drawn
    per layer: under 2**31 elements per draw)."""
    @jax.jit
    def gen(key):
        ks = jax.random.split(key, (4, layers))
        shapes = [(batch, ring, hkv, D)] * 2 + [(batch, slots, HQ, D)] * 2
        return tuple(jnp.stack([jax.random.normal(k, shape, DTYPE) for k in row])
                     for row, shape in zip(ks, shapes))
    return gen(key)


def chained(attend, layers: int, passes: int):
    """jit of `passes` sweeps over the layers; each call's query takes the previous output."""
    def run(q, *rest):
        out = jnp.zeros(q.shape, jnp.float32)
        for _ in range(passes):
            for i in range(layers):
                out = attend((q + 1e-3 * out).astype(q.dtype), i, *rest)
        return out
    return jax.jit(run)


def time_per_call(fn, args, calls: int, runs: int) -> float:
    jax.block_until_ready(fn(*args))           # compile
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) / calls


def resolve_tiling(tiling, batch, hkv, ring, slots):
    """Replace "x2" / "/2" split settings by multiples of the automatic count."""
    fixed = {k: v for k, v in tiling.items() if v not in ("x2", "/2")}
    auto = resolve_splits(DecodeConfig(**fixed), batch, HQ, ring, slots)
    scaled = {k: 2 * auto if v == "x2" else max(1, auto // 2)
              for k, v in tiling.items() if k not in fixed}
    return {**fixed, **scaled}


def visible_bytes(bounds, hkv):
    """Bytes of the visible ring entries and slots of one layer (keys and values)."""
    ring = int(np.sum(np.asarray(bounds.ring_count))) * hkv
    slots = int(np.sum(np.asarray(bounds.num_slots))) * HQ
    return 2 * D * jnp.dtype(DTYPE).itemsize * (ring + slots)


def run_case(args, batch, hkv, context, max_len, tilings, deadline: float | None = None):
    """Records of XLA and of the kernel with each of `tilings` (until `deadline`)."""
    ring, slots = PATTERN.window_size + PATTERN.group_size, -(-max_len // PATTERN.group_size)
    key = jax.random.PRNGKey(batch * 1000 + hkv + context // 1024)
    k, v, ck, cv = make_cache(key, args.layers, batch, hkv, ring, slots)
    q = jax.random.normal(jax.random.fold_in(key, 7), (batch, HQ, D), DTYPE)
    t = jnp.asarray(context - 1 - 37 * np.arange(batch), jnp.int32)
    raw_vis = blocks.cache_raw_visible(PATTERN, t, ring)
    slot_vis = blocks.cache_slot_visible(PATTERN, t, slots)
    bounds = blocks.decode_bounds(PATTERN, t, ring, slots)
    calls = args.layers * args.passes
    case = dict(batch=batch, q_heads=HQ, kv_heads=hkv, head_dim=D, context=context,
                max_len=max_len, ring=ring, slots=slots,
                visible_slots=int(np.max(np.asarray(bounds.num_slots))),
                visible_bytes_per_layer=visible_bytes(bounds, hkv))

    def xla(qi, i, k, v, ck, cv, raw_vis, slot_vis):
        return cached_attention(qi, k[i], v[i], ck[i], cv[i], raw_vis, slot_vis)

    xla_ms = time_per_call(chained(xla, args.layers, args.passes),
                           (q, k, v, ck, cv, raw_vis, slot_vis), calls, args.runs)
    ref = jax.jit(xla, static_argnums=1)(q, 0, k, v, ck, cv, raw_vis, slot_vis)
    records = [dict(case, impl="xla", tiling=None, ms=xla_ms)]
    swapped = None
    for tiling in tilings:
        if deadline is not None and time.perf_counter() > deadline:
            print(f"  (time budget spent: sweep stopped before {tiling})")
            break
        tiling = resolve_tiling(tiling, batch, hkv, ring, slots)
        ck_in, cv_in = ck, cv
        if tiling.get("slot_layout") == "bhcd":
            swapped = swapped or tuple(jnp.swapaxes(x, 2, 3) for x in (ck, cv))
            ck_in, cv_in = swapped

        def attend(qi, i, k, v, ck, cv, bounds, tiling=tiling):
            return decode_attention_pallas_gpu(qi, k, v, ck, cv, bounds, layer=i, **tiling)
        ms = time_per_call(chained(attend, args.layers, args.passes),
                           (q, k, v, ck_in, cv_in, bounds), calls, args.runs)
        out = jax.jit(attend, static_argnums=1)(q, 0, k, v, ck_in, cv_in, bounds)
        splits = resolve_splits(DecodeConfig(**tiling), batch, HQ, ring, slots)
        records.append(dict(case, impl="pallas", tiling=dict(tiling, splits=splits),
                            ms=ms, max_abs_err_vs_xla=float(jnp.max(jnp.abs(out - ref)))))
    for r in records:
        r["gbps_visible"] = r["visible_bytes_per_layer"] / (r["ms"] * 1e-3) / 1e9
    return records


def table(records) -> str:
    lines = ["| B | Hkv | context | max_len | xla ms | pallas ms | speedup | best tiling ms "
             "| best tiling | pallas GB/s (visible) | max abs err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["batch"], r["kv_heads"], r["context"], r["max_len"]) for r in records})
    for key in keys:
        rs = [r for r in records if (r["batch"], r["kv_heads"], r["context"], r["max_len"])
              == key]
        xla = next(r for r in rs if r["impl"] == "xla")
        pallas = [r for r in rs if r["impl"] == "pallas"]
        default, best = pallas[0], min(pallas, key=lambda r: r["ms"])
        changed = {k: v for k, v in best["tiling"].items()
                   if k != "splits" or v != default["tiling"][k]}
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2] // 1024}K | {key[3] // 1024}K | {xla['ms']:.4f} "
            f"| {default['ms']:.4f} | {xla['ms'] / default['ms']:.2f}x | {best['ms']:.4f} "
            f"| {changed or 'default'} | {default['gbps_visible']:.0f} "
            f"| {max(r['max_abs_err_vs_xla'] for r in pallas):.1e} |")
    return "\n".join(lines)


def mostly_empty_cache(records) -> dict | None:
    """XLA and the default kernel tiling at B = 1, Hkv = 32, 32K of context in a 128K cache
    (None when that case was not run)."""
    rs = [r for r in records if (r["batch"], r["kv_heads"], r["context"], r["max_len"])
          == (1, 32, 32768, 131072)]
    xla = [r for r in rs if r["impl"] == "xla"]
    pallas = [r for r in rs if r["impl"] == "pallas"]
    if not xla or not pallas:
        return None
    return dict(xla_ms=xla[0]["ms"], pallas_ms=pallas[0]["ms"],
                speedup=xla[0]["ms"] / pallas[0]["ms"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the records")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--layers", type=int, default=4, help="stacked layers (L2 flushing)")
    ap.add_argument("--passes", type=int, default=2, help="sweeps over the layers per jit")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sweep-cases", default="1x32x131072x131072,16x32x131072x131072,"
                    "1x32x32768x131072,1x8x131072x131072",
                    help="BxHkvxcontextxmax_len cases that also get the tiling sweep")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="start no sweep tiling after this many seconds of the run")
    args = ap.parse_args()
    claim_output(args.out, suffixes=("",))
    if jax.default_backend() != "gpu":
        raise SystemExit("decode_kernel.py times the compiled kernel: run it on an NVIDIA GPU.")
    start = time.perf_counter()
    deadline = start + args.budget_s
    sweep_cases = [tuple(int(x) for x in c.split("x")) for c in args.sweep_cases.split(",")
                   if c]
    # Only cases of the main table (its XLA row is the sweep's reference).
    sweep_cases = [c for c in sweep_cases if c[0] in args.batch and c[1] in args.kv_heads
                   and tuple(c[2:]) in CONTEXTS]
    records = []
    for batch in args.batch:          # every case: XLA and the default tiling
        for hkv in args.kv_heads:
            for context, max_len in CONTEXTS:
                recs = run_case(args, batch, hkv, context, max_len, [{}])
                records += recs
                print(f"B={batch} Hkv={hkv} ctx={context} max_len={max_len}: xla "
                      f"{recs[0]['ms']:.4f} ms, pallas {recs[1]['ms']:.4f} ms "
                      f"(err {recs[1]['max_abs_err_vs_xla']:.1e}) "
                      f"[{time.perf_counter() - start:.0f} s]", flush=True)
    for batch, hkv, context, max_len in sweep_cases:   # then tilings, while time lasts
        if time.perf_counter() > deadline:
            break
        recs = run_case(args, batch, hkv, context, max_len, SWEEP, deadline)
        records += [r for r in recs if r["impl"] == "pallas"]
        print(f"sweep B={batch} Hkv={hkv} ctx={context} max_len={max_len}: "
              + ", ".join(f"{r['tiling']} {r['ms']:.4f}" for r in recs[1:])
              + f" [{time.perf_counter() - start:.0f} s]", flush=True)
    text = table(records)
    print(text)
    mostly_empty = mostly_empty_cache(records)
    if mostly_empty:
        print(f"mostly empty cache (B=1, Hkv=32, 32K of context in a 128K cache): xla "
              f"{mostly_empty['xla_ms']:.4f} ms, pallas {mostly_empty['pallas_ms']:.4f} ms: "
              f"the kernel is {mostly_empty['speedup']:.2f}x "
              f"{'faster' if mostly_empty['speedup'] > 1 else 'SLOWER'}")
    from benchmarks.measure import stamp
    meta = dict(stamp(), layers=args.layers,
                mostly_empty_cache=mostly_empty,
                passes=args.passes, runs=args.runs, wall_s=time.perf_counter() - start,
                pattern=dict(group_size=PATTERN.group_size, window_size=PATTERN.window_size))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=records, table=text), f, indent=1)
    print(f"wrote {args.out} ({meta['wall_s']:.0f} s)")
    if not all(math.isfinite(r["ms"]) for r in records):
        raise SystemExit("non-finite timing")


if __name__ == "__main__":
    main()
