"""Does XLA's GEMM autotuning run once per layer because each layer slices the stacked weights?

    python benchmarks/research/autotune_dedup_probe.py [--layers 32] [--rows 8,256]

The unrolled decode step compiles in 57.8 s on an H100, 8.9 s with autotuning off
(research/h100_2026-12-06f.md): every layer's GEMM fusion holds its own static slice
`[i:i+1]` of the stacked weights, so no two fusions are alike. This probe compiles one stack
of LLaMA-7B-shaped layers (`--layers` x: x + down(silu(gate(x)) * up(x)) + o(qkv(x)), the
decoder's matmuls, no attention) for `--rows` tokens, its weights held four ways:

  stacked      one `[L, ...]` array per weight, static slices (what `decode_layers` does)
  per_layer    one array per layer and weight, passed as separate arguments
  restacked    per_layer's arrays stacked inside the program, then sliced statically
               (does XLA fold slice(concatenate) back to the argument, with no copy?)
  no_autotune  stacked, with `xla_gpu_autotune_level=0`
  autotune_1   stacked, with `xla_gpu_autotune_level=1` (tuned, without the checks of the
               candidates' results that the default level 4 adds)

and prints/writes for each: seconds to compile, the median ms of a call, the GEMM fusions in
the optimized program and how many of them are distinct once parameter names are dropped,
and the bytes of XLA's temporaries (a copy of the weights would show there).
XLA keeps tuned GEMM configurations for the process: a way compiled after another with the
same fusions finds them tuned (autotune_1 after stacked; `--ways` one at a time for their own
compile time), and an untuned way after a tuned one would run their tiling, so `no_autotune`
compiles first (`untuned_first`).
Writes `<out>.json` (stamped records) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*
from benchmarks.measure import (claim_output, median_ms, stamp, table_heading,  # noqa: E402
                                write_results)

WAYS = ("stacked", "per_layer", "restacked", "no_autotune", "autotune_1")
AUTOTUNE_LEVEL = {"no_autotune": 0, "autotune_1": 1}


def weight_shapes(hidden: int, inner: int) -> dict:
    return dict(qkv=(hidden, 3 * hidden), o=(hidden, hidden), gate=(hidden, inner),
                up=(hidden, inner), down=(inner, hidden))


def layer(x, w: dict):
    """The decoder layer's matmuls on `x` `[rows, hidden]` (RMS norms, no attention): normed
    so that 32 layers of random weights stay finite and the ways' outputs can be compared."""
    q = (rms(x) @ w["qkv"])[:, : x.shape[1]]
    x = x + q @ w["o"]
    h = rms(x)
    return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def stacked_stack(x, stacked: dict, layers: int):
    for i in range(layers):
        x = layer(x, {k: v[i] for k, v in stacked.items()})
    return x


def per_layer_stack(x, per_layer: list):
    for w in per_layer:
        x = layer(x, w)
    return x


def restacked_stack(x, per_layer: list):
    stacked = {k: jnp.stack([w[k] for w in per_layer]) for k in per_layer[0]}
    return stacked_stack(x, stacked, len(per_layer))


def gemm_fusions(hlo: str) -> tuple[int, int]:
    """(GEMM fusion computations, distinct ones with names and numbering dropped)."""
    bodies, current = [], None
    for line in hlo.splitlines():
        if line.startswith("%") and "gemm_fusion" in line.split(" ", 1)[0] and \
                line.rstrip().endswith("{"):
            current = []
        elif current is not None:
            if line.startswith("}"):
                bodies.append("\n".join(current))
                current = None
            else:   # drop names, numbering and metadata: what the computation does remains
                text = re.sub(r"%[\w.\-]+", "%", line.split(", metadata=")[0])
                current.append(text.strip())
    return len(bodies), len(set(bodies))


def untuned_first(names, autotune_level) -> list:
    """`names` with those compiled without GEMM autotuning (`autotune_level(name) == 0`)
    first, the order kept otherwise. XLA keeps tuned GEMM configurations for the process, so
    an untuned program compiled after a tuned one with alike fusions runs their tiling: a
    256-token serving chunk at the 7B shape ran 16.01 ms that way on an H100, 256.90
    compiled first (research/h100_2026-12-06i.md, serve_step_probe_h100_6a645d8.md)."""
    return sorted(names, key=lambda name: autotune_level(name) != 0)


def probe(way: str, args, key) -> tuple[np.ndarray, dict]:
    """(the stack's output as float32, the record) for one way of holding the weights."""
    shapes = weight_shapes(args.hidden, args.inner)
    keys = iter(jax.random.split(key, args.layers * len(shapes) + 1))
    per_layer = [{k: (0.02 * jax.random.normal(next(keys), s)).astype(jnp.bfloat16)
                  for k, s in shapes.items()} for _ in range(args.layers)]
    x = jax.random.normal(next(keys), (args.rows, args.hidden)).astype(jnp.bfloat16)
    if way not in ("per_layer", "restacked"):
        weights = {k: jnp.stack([w[k] for w in per_layer]) for k in shapes}
        del per_layer
        fn = jax.jit(lambda x, w: stacked_stack(x, w, args.layers))
    else:
        weights = per_layer
        fn = jax.jit(per_layer_stack if way == "per_layer" else restacked_stack)
    options = {"xla_gpu_autotune_level": AUTOTUNE_LEVEL[way]} if way in AUTOTUNE_LEVEL \
        else None
    start = time.perf_counter()
    compiled = fn.lower(x, weights).compile(options)
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    fusions, distinct = gemm_fusions(compiled.as_text())
    ms = median_ms(compiled, (x, weights))
    out = np.asarray(compiled(x, weights), np.float32)
    return out, dict(way=way, rows=args.rows, layers=args.layers, hidden=args.hidden,
                     inner=args.inner, compile_s=round(compile_s, 2), ms=round(ms, 4),
                     gemm_fusions=fusions, distinct_gemm_fusions=distinct,
                     temp_bytes=None if memory is None else int(memory.temp_size_in_bytes))


def table(records: list) -> str:
    lines = table_heading("GEMM autotuning and the layers' weights: stacked or one array a "
                          "layer", records[0]) + [
        "| rows | way | compile s | ms | GEMM fusions (distinct) | temp MiB | max abs diff "
        "vs the first way |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
        lines.append(f"| {r['rows']} | {r['way']} | {r['compile_s']} | {r['ms']:.3f} | "
                     f"{r['gemm_fusions']} ({r['distinct_gemm_fusions']}) | {temp} | "
                     f"{r['max_abs_diff_vs_first']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inner", type=int, default=11008)
    ap.add_argument("--rows", default="8,256", help="comma-separated token counts")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--out", default="benchmarks/results/research/autotune_dedup_probe")
    args = ap.parse_args(argv)
    claim_output(args.out)
    ways = untuned_first(args.ways.split(","), lambda way: AUTOTUNE_LEVEL.get(way))
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        raise SystemExit(f"--ways: unknown {unknown}; choose from {list(WAYS)}")
    base, records = stamp(argv), []
    for rows in map(int, args.rows.split(",")):
        first = None
        for way in ways:
            out, record = probe(way, argparse.Namespace(**{**vars(args), "rows": rows}),
                                jax.random.PRNGKey(rows))
            first = out if first is None else first   # the same weights and input each way
            record = dict(base, **record,
                          max_abs_diff_vs_first=float(np.max(np.abs(out - first))))
            print(record, flush=True)
            records.append(record)
            write_results(args.out, records, table(records))   # a time limit keeps the rest
    return 0


if __name__ == "__main__":
    sys.exit(main())
