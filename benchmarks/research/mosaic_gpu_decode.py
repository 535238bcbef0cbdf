"""On the H200: the Mosaic GPU decode kernel against the Triton-lowered one, per layer call.

    python benchmarks/research/mosaic_gpu_decode.py [--batch 1,16] [--hkv 32,8] \\
        [--mosaic-tilings '[{}, {"block": 64, "stages": 4}]']

LLaMA-2-7B's decode step at 128K of context: Hq = 32, D = 128 (`--d`), bf16, CCA g = 16, s = 1024
(ring R = s + g = 1040), slots C = 131072 / 16 = 8192, the cache stacked over --layers (32)
layers and read in place at `layer=i`. Rows of a batch sit at positions
`context - 1 - 37 * row` (every row sees ~8128 slots and the whole window); with `--active N`
rows N.. attend at position 0, as `decode_step` runs a batch's inactive (idle) rows.
Timing models the decode step's layer scan: one jit calls the attention for every layer in
turn, each call's query taking the previous output (no call can be skipped or overlapped);
all programs are compiled first, then timed round-robin (one jit of each per round; median
over --rounds), so clock and power drift hit every kernel alike; ms per layer call =
median / layers. `mosaic_gpu` times the whole call (kernel + XLA merge); `mosaic_gpu/kernel`
the kernel alone (its partials, no merge), to place the merge. GB/s count the bytes of the
visible ring entries and slots (keys and values) of one layer call.
Writes `<out>.json` (records stamped with commit, device, jax, date, command) and `<out>.md`.
A kernel that fails to compile or run is recorded with its error; the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax, pallas_kernels
from benchmarks.measure import (claim_output, round_robin, row_error, stamp,  # noqa: E402
                                write_results)
from cca_jax import blocks  # noqa: E402

DTYPE = jnp.bfloat16


def _tiling_name(prefix: str, tiling: dict) -> str:
    return prefix + (f"[{','.join(f'{k}={v}' for k, v in sorted(tiling.items()))}]"
                     if tiling else "")


def _kernels(mosaic_tilings: list, interpret: bool = False) -> dict:
    """name -> attend(q, layer, k, v, ck, cv, bounds) -> output (or, `/kernel`, a piece of
    the partials). `interpret`: both in their CPU interpreters (a smoke test of the script:
    tiny --hq, --layers, --context, --max-len)."""
    from pallas_kernels.gpu import decode_attention_pallas_gpu
    from pallas_kernels.mosaic_gpu import decode as mdecode
    from pallas_kernels.mosaic_gpu.decode_config import decode_config
    from pallas_kernels.mosaic_gpu.interpret import interpret_params
    kernels = {"triton": lambda q, i, k, v, ck, cv, b: decode_attention_pallas_gpu(
        q, k, v, ck, cv, b, layer=i, out_dtype=q.dtype, interpret=interpret)}
    params = interpret_params(interpret)
    # jitted once per tiling: inside the layer sweep, one kernel lowered and reused (an
    # un-jitted call would lower and compile the Mosaic kernel once per layer: 30-40 s)
    partials = jax.jit(mdecode.decode_partials, static_argnums=(7, 8, 9))
    for tiling in mosaic_tilings:
        def whole(q, i, k, v, ck, cv, b, tiling=tiling):
            return mdecode.decode_attention_mosaic_gpu(q, k, v, ck, cv, b, layer=i,
                                                       out_dtype=q.dtype, interpret=params,
                                                       **tiling)

        def kernel_only(q, i, k, v, ck, cv, b, tiling=tiling):
            groups = q.shape[1] // k.shape[-2]
            cfg = decode_config(groups=groups, **tiling)
            acc, _ = partials(q, k, v, ck, cv, i, b, cfg, True, params)
            piece = acc[:, :, 0]
            if cfg.keys_along_rows:                 # [B, Hkv, D, 16]
                piece = jnp.swapaxes(piece, -1, -2)[:, :, :groups]
            return piece.reshape(q.shape)           # a query-shaped piece of the partials
        kernels[_tiling_name("mosaic_gpu", tiling)] = whole
        kernels[_tiling_name("mosaic_gpu/kernel", tiling)] = kernel_only
    return kernels


def make_cache(key, layers: int, batch: int, hq: int, hkv: int, ring: int, slots: int, d: int):
    """Random bf16 stacked cache (ring `[L, B, R, Hkv, D]`, slots `[L, B, C, Hq, D]`), drawn
    a layer at a time into the stacked buffers (no second copy of the 70 GB)."""
    shapes = [(batch, ring, hkv, d)] * 2 + [(batch, slots, hq, d)] * 2

    @jax.jit
    def gen(key):
        def body(i, bufs):
            ks = jax.random.split(jax.random.fold_in(key, i), 4)
            return tuple(lax_update(buf, jax.random.normal(k, s, DTYPE), i)
                         for buf, k, s in zip(bufs, ks, shapes))
        bufs = tuple(jnp.zeros((layers, *s), DTYPE) for s in shapes)
        return jax.lax.fori_loop(0, layers, body, bufs)
    return gen(key)


def lax_update(buf, x, i):
    return jax.lax.dynamic_update_index_in_dim(buf, x, i, 0)


def chained(attend, layers: int):
    """jit of one sweep over the layers; each call's query takes the previous output."""
    def run(q, *rest):
        out = jnp.zeros(q.shape, jnp.float32)
        for i in range(layers):
            out = attend((q + 1e-3 * out).astype(q.dtype), i, *rest).astype(jnp.float32)
        return out
    return jax.jit(run)


def run_case(args, base: dict, kernels: dict, batch: int, hkv: int, active: int) -> list:
    pattern = blocks.CCA(args.g, args.s)
    ring, slots = blocks.ring_size(pattern, args.max_len), pattern.max_slots(args.max_len)
    key = jax.random.PRNGKey(batch * 1000 + hkv)
    cache = make_cache(key, args.layers, batch, args.hq, hkv, ring, slots, args.d)
    q = jax.random.normal(jax.random.fold_in(key, 7), (batch, args.hq, args.d), DTYPE)
    t = np.where(np.arange(batch) < active, args.context - 1 - 37 * np.arange(batch), 0)
    bounds = blocks.decode_bounds(pattern, jnp.asarray(t, jnp.int32), ring, slots)
    visible = 2 * args.d * 2 * (int(np.sum(np.asarray(bounds.ring_count))) * hkv
                           + int(np.sum(np.asarray(bounds.num_slots))) * args.hq)
    inputs = (q, *cache, bounds)
    case = dict(base, batch=batch, active=active, q_heads=args.hq, kv_heads=hkv, head_dim=args.d, dtype="bfloat16",
                context=args.context, max_len=args.max_len, ring=ring, slots=slots,
                layers=args.layers, visible_bytes_per_layer=visible)
    records, calls, outputs = [], {}, {}
    for name, attend in kernels.items():
        rec = dict(case, kernel=name)
        start = time.perf_counter()
        try:   # compile everything before timing anything
            fn = chained(attend, args.layers).lower(*inputs).compile()
            calls[name] = (fn, inputs)
            one = jax.jit(attend, static_argnums=1)
            outputs[name] = np.asarray(one(q, args.layers - 1, *cache, bounds), np.float32)
        except Exception as e:  # noqa: BLE001  (record and go on)
            rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
        rec["compile_s"] = round(time.perf_counter() - start, 1)
        print(rec.get("error", f"compiled {name} B={batch} Hkv={hkv} in {rec['compile_s']} s"),
              flush=True)
        records.append(rec)
    medians = round_robin(calls, args.rounds, warmups=1)
    for rec in records:
        name = rec["kernel"]
        if name in medians:
            rec["ms_per_layer"] = medians[name] / args.layers
            rec["gbps_visible"] = visible / (rec["ms_per_layer"] * 1e-3) / 1e9
            if not name.startswith("mosaic_gpu/kernel") and name != "triton" \
                    and "triton" in outputs:
                rec["row_error_vs_triton"] = row_error(outputs[name], outputs["triton"])
    del cache, inputs, calls
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--hkv", default="32,8")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--d", type=int, default=128, help="head dim (80 and 96: the Triton "
                    "kernel reads them at 128 wide, masked; the Mosaic one at their width)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--active", default=None,
                    help="comma-separated counts of rows at the context (the rest idle, at "
                         "position 0 as in the serving decode step); default: every row")
    ap.add_argument("--mosaic-tilings", default="[{}]",
                    help='JSON list of MosaicDecodeConfig overrides, each timed, e.g. '
                         '\'[{}, {"block": 64, "stages": 4}, {"stages": 3}, {"splits": 8}]\'')
    ap.add_argument("--interpret", action="store_true",
                    help="CPU smoke test of this script (both kernels interpreted)")
    ap.add_argument("--out", default="benchmarks/results/research/mosaic_gpu_decode_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    kernels = _kernels(json.loads(args.mosaic_tilings), args.interpret)
    base = stamp(argv)
    records = []
    for batch in map(int, args.batch.split(",")):
        actives = [batch] if args.active is None else \
            [min(int(a), batch) for a in args.active.split(",")]
        for hkv in map(int, args.hkv.split(",")):
            for active in actives:
                records += run_case(args, base, kernels, batch, hkv, active)
                _write(args, base, records)   # after every case: a time limit keeps the rest


def _write(args, base: dict, records: list) -> None:
    rows = ["| B | active | Hkv | kernel | ms / layer | GB/s visible | x Triton | "
            "row error vs Triton |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    triton = {(r["batch"], r["active"], r["kv_heads"]): r.get("ms_per_layer") for r in records
              if r["kernel"] == "triton"}
    for r in records:
        if "ms_per_layer" in r:
            ref = triton.get((r["batch"], r["active"], r["kv_heads"]))
            speed = f"{ref / r['ms_per_layer']:.2f}" if ref else ""
            err = r.get("row_error_vs_triton")
            rows.append(f"| {r['batch']} | {r['active']} | {r['kv_heads']} | {r['kernel']} | "
                        f"{r['ms_per_layer']:.4f} | {r['gbps_visible']:.0f} | {speed} | "
                        f"{'' if err is None else f'{err:.1e}'} |")
        else:
            rows.append(f"| {r['batch']} | {r['active']} | {r['kv_heads']} | {r['kernel']} | error | | | "
                        f"{r.get('error', '')[:80]} |")
    header = (f"Mosaic GPU vs Triton decode attention per layer call (7B: Hq = {args.hq}, D = {args.d}, "
              f"bf16, R = {records[0]['ring']}, C = {records[0]['slots']}, context "
              f"{args.context}, {args.layers} stacked layers), {base['device']}, jax "
              f"{base['jax']}, {base['date']}, commit {base['commit']}\n"
              f"Command: `{base['command']}`\n\n")
    write_results(args.out, records, header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
