"""How long a serving program takes to trace and lower for CUDA, on any machine (no GPU needed):
the host's share of a cold start, and the size of the module XLA then compiles.

    python benchmarks/research/lowering_probe.py [--layers 32] [--programs chunk256,decode8]
        [--kernel-jit both] [--out benchmarks/results/research/lowering_probe_cpu]

Builds the LLaMA-2-7B-shaped CCA model abstractly (no weights), its layers unstacked as
inference holds them on a GPU, and a cache of 8 rows x 131072; then traces and lowers for
`cuda` (the backend checks are told this is a Hopper GPU):
  chunkN     one N-token prefill chunk into one row, layers unrolled (the engine's small chunks)
  chunkN_scan  the same, layers scanned
  decodeB    the decode step of all B rows (unrolled)
`--kernel-jit on|off|both`: the Mosaic forward kernel called through its own jit (the
library's way: one trace and lowering for alike calls) or directly (each layer's call traced
and lowered apart, as before). Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.inference import SHAPES  # noqa: E402
from benchmarks.measure import (PAPER_PATTERNS, claim_output, stamp, table_heading,  # noqa: E402
                                write_results)

BATCH, MAX_LEN = 8, 131072


@contextlib.contextmanager
def as_hopper(kernel_jit: bool):
    """The backend checks see a Hopper GPU; without `kernel_jit` the Mosaic forward is called
    unjitted."""
    import cca_jax.attention.pallas_mosaic_gpu as backend
    import pallas_kernels.mosaic_gpu.forward as forward_module
    saved = jax.default_backend, backend.gpu_capability, forward_module.forward
    jax.default_backend, backend.gpu_capability = (lambda: "gpu"), (lambda: 9.0)
    if not kernel_jit:
        forward_module.forward = forward_module.forward.__wrapped__
    try:
        yield
    finally:
        jax.default_backend, backend.gpu_capability, forward_module.forward = saved


def lower(program: str, layers: int) -> dict:
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.decode import decode_step_traced
    from cca_jax.kv_cache import cache_shapes
    from cca_jax.model import LlamaForCausalLM, unstack_layers
    from cca_jax.prefill import prefill_chunk_traced

    p = PAPER_PATTERNS["cca"]
    cfg = LlamaConfig(**{**SHAPES["llama2-7b"], "num_hidden_layers": layers},
                      max_position_embeddings=MAX_LEN,
                      attention=dict(kind="cca", group_size=p.group_size,
                                     window_size=p.window_size, implementation="mosaic_gpu"))
    model = nnx.eval_shape(lambda: unstack_layers(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    state, cache = nnx.split(model), cache_shapes(cfg, BATCH, MAX_LEN)
    jax.clear_caches()   # nothing traced or lowered before counts
    start = time.perf_counter()
    if program.startswith("chunk"):
        size = int(re.match(r"chunk(\d+)", program).group(1))
        one = jax.ShapeDtypeStruct((1,), jnp.int32)
        traced = jax.jit(prefill_chunk_traced, static_argnames=("unroll_layers",)).trace(
            state, cache, jax.ShapeDtypeStruct((1, size), jnp.int32), one, rows=one,
            unroll_layers=not program.endswith("_scan"))
    else:
        rows = int(program.removeprefix("decode"))
        traced = jax.jit(decode_step_traced).trace(
            state, cache, jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.bool_))
    traced_at = time.perf_counter()
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    return dict(program=program, layers=layers, trace_s=round(traced_at - start, 2),
                lower_s=round(time.perf_counter() - traced_at, 2),
                module_mb=round(len(text) / 1e6, 2),
                mosaic_calls=len(re.findall(r"kernel_hash = ", text)))


def table(records: list) -> str:
    lines = table_heading("Tracing and lowering serving programs for CUDA (7B shape, CCA, "
                          f"{BATCH} rows x {MAX_LEN})", records[0]) + [
        "| program | layers | kernel jit | trace s | lower s | module MB | Mosaic calls |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['program']} | {r['layers']} | {r['kernel_jit']} | {r['trace_s']} | "
              f"{r['lower_s']} | {r['module_mb']} | {r['mosaic_calls']} |" for r in records]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--programs", default="chunk256,chunk256_scan,decode8")
    ap.add_argument("--kernel-jit", choices=("on", "off", "both"), default="both")
    ap.add_argument("--out", default="benchmarks/results/research/lowering_probe_cpu")
    args = ap.parse_args(argv)
    claim_output(args.out)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.kernel_jit]
    base, records = stamp(argv), []
    for program in args.programs.split(","):
        if not re.fullmatch(r"chunk\d+(_scan)?|decode\d+", program):
            raise SystemExit(f"--programs: {program!r} is not chunkN, chunkN_scan or decodeB")
        for kernel_jit in modes:
            with as_hopper(kernel_jit):
                record = dict(base, **lower(program, args.layers), kernel_jit=kernel_jit)
            print(record, flush=True)
            records.append(record)
    write_results(args.out, records, table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
