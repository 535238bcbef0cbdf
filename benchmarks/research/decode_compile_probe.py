"""Where the decode step's compile time goes (the server and `generate` compile two step
programs: with and without pooling): lower and compile; no weights allocated unless
`--steps` asks for step times.

    python benchmarks/research/decode_compile_probe.py [--shape llama2-7b] [--batch 16]
        [--max-len 131072] [--variants base,no_autotune,xla_attention,no_pool] [--steps N]

Prints one JSON line per variant: seconds to trace+lower and to compile, the count of
Pallas kernels and fusions in the optimised program, and with `--steps N` the median ms of a
decode step on random weights (does a variant that compiles faster read weights slower?).
`--parallel` compiles the variants at once instead, one thread each, and prints the wall time
against each one's own (the server's start-up compiles its programs: can they overlap?).
Variants:
  base           the decode step as `decode_step` compiles it (pool_slots=True)
  no_pool        the step without pooling (the other program)
  no_autotune    base with XLA's GEMM autotuning off (xla_gpu_autotune_level=0)
  autotune_1     base tuned without checking the candidates' results (level 1; default 4)
  no_remat       base without XLA's rematerialization pass (xla_disable_hlo_passes): at
                 the 7B shape it counts a serving program's memory at twice what runs and
                 removes nothing (research/h200_2026-12-05c.md); is it the slow part?
                 (Since 2026-12-06 the cache programs' options turn it off: base is this.)
  remat_on       base with that pass back on (what the programs compiled before)
  xla_attention  base with the XLA decode attention in place of the Pallas kernel
  scan           base with the layers scanned (`unroll_layers=False`): one compiled layer
  scan_dsf       scan, with XLA's dynamic-slice fusion on (cuBLAS reading each layer's
                 weights in place out of the stack instead of a copy, where XLA can)
  scan_cublas    scan with the matmuls on cuBLAS (xla_gpu_enable_triton_gemm off)
  scan_dsf_cublas  both: the fusion folds slices into cuBLAS calls, not Triton fusions
  cublas         base (unrolled) with the matmuls on cuBLAS: one call per layer, alike but
                 for its operands, so is each tuned once, not per layer?
  cublas_dsf     cublas with dynamic-slice fusion (the static slices of the stacked weights
                 folded into the calls' operand addresses, not copied?)
  unstacked      base on the layers as inference holds them on a GPU (`model.unstack_layers`:
                 one array per layer and weight, each GEMM shape tuned once); with --steps
                 it runs after the stacked variants (the real weights are unstacked in place)
A variant that fails to compile prints its error and the probe goes on. Variants in one
process share XLA's tuned GEMM configurations: one compiled after another with alike fusions
finds them tuned (autotune_1 after base: 6.6 s against 37.0, research/h100_2026-12-06g.md),
and an untuned one (`no_autotune`) then runs them too, so untuned variants compile first;
name one variant a run for its own compile time.
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

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.inference import SHAPES  # noqa: E402
from benchmarks.measure import PAPER_PATTERNS  # noqa: E402
from benchmarks.research.autotune_dedup_probe import untuned_first  # noqa: E402

VARIANTS = {
    "base": dict(pool_slots=True),
    "no_pool": dict(pool_slots=False),
    "no_autotune": dict(pool_slots=True, options={"xla_gpu_autotune_level": 0}),
    "autotune_1": dict(pool_slots=True, options={"xla_gpu_autotune_level": 1}),
    "no_remat": dict(pool_slots=True, options={"xla_disable_hlo_passes": "rematerialization"}),
    "remat_on": dict(pool_slots=True, options={"xla_disable_hlo_passes": ""}),
    "xla_attention": dict(pool_slots=True, implementation="xla"),
    "scan": dict(pool_slots=True, unroll_layers=False),
    "scan_dsf": dict(pool_slots=True, unroll_layers=False,
                     options={"xla_gpu_enable_dynamic_slice_fusion": True}),
    # the matmuls on cuBLAS instead of XLA's Triton GEMM fusions: dynamic-slice fusion folds a
    # layer's slice of the stacked weights into a cuBLAS call's operand address, not into a
    # Triton fusion (does the scan then read the weights in place?)
    "scan_cublas": dict(pool_slots=True, unroll_layers=False,
                        options={"xla_gpu_enable_triton_gemm": False}),
    "scan_dsf_cublas": dict(pool_slots=True, unroll_layers=False,
                            options={"xla_gpu_enable_dynamic_slice_fusion": True,
                                     "xla_gpu_enable_triton_gemm": False}),
    "unstacked": dict(pool_slots=True, unstacked=True),
    "cublas": dict(pool_slots=True, options={"xla_gpu_enable_triton_gemm": False}),
    "cublas_dsf": dict(pool_slots=True, options={"xla_gpu_enable_dynamic_slice_fusion": True,
                                                 "xla_gpu_enable_triton_gemm": False}),
}


def model_config(shape: str, max_len: int):
    from cca_jax.config import LlamaConfig
    p = PAPER_PATTERNS["cca"]
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len,
                       attention=dict(kind="cca", group_size=p.group_size,
                                      window_size=p.window_size, sink_tokens=p.sink_tokens))


def step_ms(compiled, real, batch: int, steps: int) -> float:
    """Median ms of `steps` decode steps of `compiled` on random weights and a fresh cache
    (`real` = (model_state, config, max_len); every row active from position 0: the step
    is bound by reading the weights, which is what the layer loop's form changes)."""
    from cca_jax.kv_cache import init_cache
    state, cfg, max_len = real
    cache = init_cache(cfg, batch, max_len)
    tokens, active = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        logits, cache = compiled(state, cache, tokens, active)
        jax.block_until_ready(logits)
        times.append(1e3 * (time.perf_counter() - start))
    del cache
    return round(statistics.median(times[2:]), 3)


def lower(shape: str, batch: int, max_len: int, name: str):
    """(the variant's lowered decode step, seconds to trace and lower, its implementation)."""
    from flax import nnx

    from cca_jax.decode import DECODE_COMPILER_OPTIONS, decode_implementation, decode_step_traced
    from cca_jax.kv_cache import cache_shapes
    from cca_jax.model import LlamaForCausalLM, unstack_layers

    cfg = model_config(shape, max_len)
    variant = VARIANTS[name]
    layout = unstack_layers if variant.get("unstacked") else (lambda model: model)
    model = nnx.eval_shape(lambda: layout(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))))
    state = nnx.split(model)
    cache = cache_shapes(cfg, batch, max_len)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    active = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    impl = variant.get("implementation") or decode_implementation(cfg)
    options = dict(DECODE_COMPILER_OPTIONS, **variant.get("options", {}))
    if jax.default_backend() != "gpu":
        options = {}   # GPU passes' options: other backends reject them
    step = jax.jit(decode_step_traced, donate_argnames=("cache",),
                   static_argnames=("implementation", "pool_slots", "unroll_layers"),
                   compiler_options=options)
    start = time.perf_counter()
    lowered = step.trace(state, cache, tokens, active, implementation=impl,
                         pool_slots=variant["pool_slots"],
                         unroll_layers=variant.get("unroll_layers", True)).lower()
    return lowered, time.perf_counter() - start, impl


def probe(shape: str, batch: int, max_len: int, name: str, real=None, steps: int = 0) -> dict:
    lowered, lowered_s, impl = lower(shape, batch, max_len, name)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text() or ""
    timed = dict(step_ms=step_ms(compiled, real, batch, steps)) if steps else {}
    return dict(variant=name, shape=shape, batch=batch, max_len=max_len, implementation=impl,
                backend=jax.default_backend(), jax=jax.__version__, **timed,
                lower_s=round(lowered_s, 2), compile_s=round(compile_s, 2),
                pallas_kernels=text.count("__gpu$xla.gpu.triton") + text.count("mosaic_gpu"),
                fusions=text.count(" fusion("))


def parallel_compile(shape: str, batch: int, max_len: int, names: list) -> dict:
    """Lower each variant, then compile all of them in threads at once: the wall time
    against each compile's own."""
    import concurrent.futures
    lowered = [lower(shape, batch, max_len, name)[0] for name in names]

    def timed(one):
        start = time.perf_counter()
        one.compile()
        return round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        each = list(pool.map(timed, lowered))
    return dict(parallel=names, shape=shape, batch=batch, max_len=max_len,
                backend=jax.default_backend(), jax=jax.__version__,
                wall_s=round(time.perf_counter() - start, 2), each_s=dict(zip(names, each)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=0,
                    help="also time this many decode steps of each variant on random weights")
    ap.add_argument("--parallel", action="store_true",
                    help="instead: compile the variants at once, one thread each (a server "
                         "compiles its two decode programs: does their wall time overlap?)")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(VARIANTS)}")
    if args.parallel:
        print(json.dumps(parallel_compile(args.shape, args.batch, args.max_len, names)))
        return
    names = untuned_first(names, lambda name: VARIANTS[name].get("options", {}).get(
        "xla_gpu_autotune_level"))
    real = model = None
    if args.steps:   # the stacked variants first: the weights are unstacked once, in place
        from flax import nnx

        from cca_jax.model import LlamaForCausalLM, unstack_layers
        names.sort(key=lambda name: VARIANTS[name].get("unstacked", False))
        cfg = model_config(args.shape, args.max_len)
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    for name in names:
        if model is not None:
            if VARIANTS[name].get("unstacked") and not model.layers_unstacked:
                model = unstack_layers(model, consume=True)
            real = (nnx.split(model), model.config, args.max_len)
        try:
            record = probe(args.shape, args.batch, args.max_len, name, real, args.steps)
        except Exception as e:  # noqa: BLE001  (a variant XLA rejects: report, go on)
            record = dict(variant=name, error=f"{type(e).__name__}: {str(e)[:500]}")
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
