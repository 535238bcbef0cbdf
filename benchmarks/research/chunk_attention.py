"""A prefill chunk's attention at the 7B shape: the slots sliced out of the cache, or read in
place, with the keys of each row block split over CTAs or not.

    python benchmarks/research/chunk_attention.py [--chunks 128,256,512,2048]
        [--context 126976] [--max-len 131072] [--hq 32] [--hkv 32] [--d 128] [--g 16]
        [--s 1024] [--splits 1,2,4] [--rounds 20] [--small]
        [--out benchmarks/results/research/chunk_attention_h200]

The serving chunk (`serve_step_probe.py`, chunk 256 into one row at context 126976) spent
0.1 ms a layer slicing the row's slots out of the stacked cache and padding them to whole
key blocks (`loop_pad_fusion`s, H100), and its attention kernel ran 0.15 ms a layer on 64
CTAs (32 heads x 2 row blocks) of an H100's 132 SMs. One layer's attention of one chunk into
row 3 of an 8-row cache (2 layers stacked; the layer read is 1), the bounds those of
`prefill` (the ring's rows in front of the chunk's, `chunk_blocking`), timed round-robin:
  sliced          the layer's slots of the row sliced out, then `blocked_attention_mosaic_gpu`
                  (pads them to whole blocks): the path before the slots were read in place
  in_place_sS     `blocked_attention_in_cache_mosaic_gpu` with key_splits S
  default         what prefill runs now (`prefill_key_splits` picks S)
Each record has the largest row error against `sliced` (relative to the row's norm).
`--small`: tiny shapes in the GPU interpreter (a CPU check). Writes `<out>.json`, `<out>.md`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.measure import (claim_output, round_robin, row_error, stamp,  # noqa: E402
                                table_heading, write_results)
from cca_jax import blocks  # noqa: E402
from cca_jax.blocks import ring_size  # noqa: E402
from cca_jax.attention.pallas_mosaic_gpu import prefill_key_splits  # noqa: E402
from cca_jax.kv_cache import slot_capacity  # noqa: E402
from cca_jax.prefill import chunk_blocking  # noqa: E402
from pallas_kernels.mosaic_gpu.config import gpu_core_count  # noqa: E402

LAYER, ROW, LAYERS, ROWS = 1, 3, 2, 8


def chunk_inputs(chunk: int, context: int, max_len: int, hq: int, hkv: int, d: int,
                 pattern, dtype):
    """q, k, v of the chunk's rows (ring rows in front), the stacked slots, the bounds, and
    `front` (where the chunk's rows start)."""
    ring, slots = ring_size(pattern, max_len), slot_capacity(pattern, max_len)
    front, _ = chunk_blocking(chunk, ring, slots, d)
    p0 = jnp.full((1,), context, jnp.int32)
    bounds = blocks.chunk_ranges(pattern, p0, chunk, front, slots)
    keys = jax.random.split(jax.random.key(0), 5)
    total = front + chunk
    q = jax.random.normal(keys[0], (1, total, hq, d), dtype)
    k, v = (jax.random.normal(x, (1, total, hkv, d), dtype) for x in keys[1:3])
    ck, cv = (jax.random.normal(x, (LAYERS, ROWS, slots, hq, d), dtype) for x in keys[3:5])
    return q, k, v, ck, cv, tuple(x.astype(jnp.int32) for x in bounds), front


def variants(front: int, splits, default_splits: int, interpret, tiling: dict) -> dict:
    from pallas_kernels.mosaic_gpu import (blocked_attention_in_cache_mosaic_gpu,
                                           blocked_attention_mosaic_gpu)
    rows = jnp.array([ROW], jnp.int32)

    def sliced(q, k, v, ck, cv, *bounds):
        one = (jax.lax.dynamic_slice_in_dim(x[LAYER], ROW, 1) for x in (ck, cv))
        return blocked_attention_mosaic_gpu(q, k, v, *one, *bounds, narrow_block=0,
                                            interpret=interpret, **tiling)[:, front:]

    def in_place(key_splits):
        def fn(q, k, v, ck, cv, *bounds):
            return blocked_attention_in_cache_mosaic_gpu(
                q, k, v, ck, cv, jnp.int32(LAYER), rows, *bounds, first_row=front,
                key_splits=key_splits, interpret=interpret, **tiling)
        return fn
    fns = {"sliced": sliced}
    fns.update({f"in_place_s{s}": in_place(s) for s in splits})
    fns["default"] = in_place(default_splits)
    return {name: jax.jit(fn) for name, fn in fns.items()}


def table(records) -> str:
    r0 = records[0]
    lines = table_heading(
        f"One layer's attention of a prefill chunk into row {ROW} of an {ROWS}-row cache "
        f"(Hq {r0['hq']}, Hkv {r0['hkv']}, D {r0['d']}, g {r0['group_size']}, "
        f"s {r0['window_size']}, context {r0['context']}, max_len {r0['max_len']})", r0) + [
        "| chunk | rows in front | variant | key splits | ms | x sliced | row error vs sliced |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        err = "" if r["row_error_vs_sliced"] is None else f"{r['row_error_vs_sliced']:.1e}"
        lines.append(f"| {r['chunk']} | {r['front']} | {r['variant']} | {r['key_splits']} | "
                     f"{r['ms']:.4f} | {r['x_sliced']:.3f} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="128,256,512,2048")
    ap.add_argument("--context", type=int, default=126976)
    ap.add_argument("--max-len", type=int, default=131072)
    for flag, default in (("--hq", 32), ("--hkv", 32), ("--d", 128), ("--g", 16),
                          ("--s", 1024)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--small", action="store_true",
                    help="CPU check in the GPU interpreter: chunk 16 at context 96 of 128, "
                    "2/1 heads of 64, g 4, s 16")
    ap.add_argument("--out", default="benchmarks/results/research/chunk_attention_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    interpret, tiling = None, {}
    if args.small:   # one consumer warpgroup: the interpreter runs a thread per warpgroup
        tiling = dict(compute_wgs=1, block_kv=64)
        args.chunks, args.context, args.max_len = "16", 96, 128
        args.hq, args.hkv, args.d, args.g, args.s = 2, 1, 64, 4, 16
        args.rounds, interpret = min(args.rounds, 2), True
    pattern = blocks.CCA(args.g, args.s)
    splits = [int(x) for x in args.splits.split(",")]
    records = []
    for chunk in (int(x) for x in args.chunks.split(",")):
        if args.context + chunk > args.max_len:
            raise SystemExit(f"--context {args.context} + chunk {chunk} passes --max-len")
        q, k, v, ck, cv, bounds, front = chunk_inputs(chunk, args.context, args.max_len,
                                                      args.hq, args.hkv, args.d, pattern,
                                                      jnp.bfloat16)
        from pallas_kernels.mosaic_gpu import mosaic_config
        default = prefill_key_splits(chunk, mosaic_config(head_dim=args.d, **tiling).cta_rows,
                                     args.hq, 1, gpu_core_count())
        fns = variants(front, splits, default, interpret, tiling)
        operands = (q, k, v, ck, cv, *bounds)
        outs = {name: fn(*operands) for name, fn in fns.items()}
        times = round_robin({name: (fn, operands) for name, fn in fns.items()}, args.rounds)
        for name, ms in times.items():
            key_splits = default if name == "default" else (
                int(name.rsplit("s", 1)[1]) if name.startswith("in_place") else 1)
            records.append(dict(
                chunk=chunk, front=front, variant=name, key_splits=key_splits, ms=round(ms, 4),
                x_sliced=round(ms / times["sliced"], 4),
                row_error_vs_sliced=None if name == "sliced" else row_error(
                    outs[name], outs["sliced"]),
                context=args.context, max_len=args.max_len, hq=args.hq, hkv=args.hkv,
                d=args.d, group_size=args.g, window_size=args.s, **stamp(argv)))
            print(f"chunk {chunk}: {name}: {ms:.4f} ms", flush=True)
    write_results(args.out, records, table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
