"""Where the decode step's compile time goes (the server and `generate` compile two step
programs: with and without pooling): lower and compile, no run, no weights allocated.

    python benchmarks/research/decode_compile_probe.py [--shape llama2-7b] [--batch 16]
        [--max-len 131072] [--variants base,no_autotune,xla_attention,no_pool]

Prints one JSON line per variant: seconds to trace+lower and to compile, and the count of
Pallas kernels and fusions in the optimised program. Variants:
  base           the decode step as `decode_step` compiles it (pool_slots=True)
  no_pool        the step without pooling (the other program)
  no_autotune    base with XLA's GEMM autotuning off (xla_gpu_autotune_level=0)
  xla_attention  base with the XLA decode attention in place of the Pallas kernel
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.inference import SHAPES  # noqa: E402
from benchmarks.measure import PAPER_PATTERNS  # noqa: E402

VARIANTS = {
    "base": dict(pool_slots=True),
    "no_pool": dict(pool_slots=False),
    "no_autotune": dict(pool_slots=True, options={"xla_gpu_autotune_level": 0}),
    "xla_attention": dict(pool_slots=True, implementation="xla"),
}


def probe(shape: str, batch: int, max_len: int, name: str) -> dict:
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.decode import DECODE_COMPILER_OPTIONS, decode_implementation, decode_step_traced
    from cca_jax.kv_cache import cache_shapes
    from cca_jax.model import LlamaForCausalLM

    p = PAPER_PATTERNS["cca"]
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_len,
                      attention=dict(kind="cca", group_size=p.group_size,
                                     window_size=p.window_size, sink_tokens=p.sink_tokens))
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    state = nnx.split(model)
    cache = cache_shapes(cfg, batch, max_len)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    active = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    variant = VARIANTS[name]
    impl = variant.get("implementation") or decode_implementation(cfg)
    options = dict(DECODE_COMPILER_OPTIONS, **variant.get("options", {}))
    if jax.default_backend() != "gpu":
        options = {}   # GPU passes' options: other backends reject them
    step = jax.jit(decode_step_traced, donate_argnames=("cache",),
                   static_argnames=("implementation", "pool_slots"), compiler_options=options)
    start = time.perf_counter()
    lowered = step.trace(state, cache, tokens, active, implementation=impl,
                         pool_slots=variant["pool_slots"]).lower()
    lowered_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text() or ""
    return dict(variant=name, shape=shape, batch=batch, max_len=max_len, implementation=impl,
                backend=jax.default_backend(), jax=jax.__version__,
                lower_s=round(lowered_s, 2), compile_s=round(compile_s, 2),
                pallas_kernels=text.count("__gpu$xla.gpu.triton") + text.count("mosaic_gpu"),
                fusions=text.count(" fusion("))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(VARIANTS)}")
        print(json.dumps(probe(args.shape, args.batch, args.max_len, name)), flush=True)


if __name__ == "__main__":
    main()
