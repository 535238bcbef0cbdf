"""Probe: cca vs full attention decode at 128K in ONE process, interleaved.

    python benchmarks/research/decode_ratio_probe.py --rounds 3

Full attention's decode moved 20.07-21.32 ms per token between processes of
`benchmarks/inference.py` (cca's 5.24-5.29), so a ratio of two processes is uncertain by 6%.
Here one LLaMA-2-7B-shaped model (random bf16 weights) decodes with cca (g = 16, s = 1024)
and with full attention (the same weights), each on a cache whose lengths are set to the
context (as `inference.py --no-prefill`), through `generate.decode_loop`, in alternating
rounds: the mean time between tokens over `--tokens` steps after 20 warm-up steps, per
round. Prints one line per round and the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WARMUP = 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--shape", default="llama2-7b")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.inference import SHAPES, _max_len, decode_times
    from benchmarks.measure import PAPER_PATTERNS
    from cca_jax.config import LlamaConfig
    from cca_jax.kv_cache import init_cache
    from cca_jax.model import LlamaForCausalLM

    max_len = _max_len(args.context, WARMUP + args.tokens)
    models = {}
    for kind in ("cca", "full"):
        p = PAPER_PATTERNS[kind]
        cfg = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max_len,
                          attention=dict(kind=kind, group_size=p.group_size,
                                         window_size=p.window_size, sink_tokens=p.sink_tokens))
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
        if models:   # the same weights
            nnx.update(model, nnx.state(models["cca"], nnx.Param))
        models[kind] = model

    def one_round(kind):
        model = models[kind]
        cache = init_cache(model.config, 1, max_len)
        cache = cache.replace(lengths=jnp.full((1,), args.context, jnp.int32))
        times = decode_times(model, cache, jnp.zeros((1,), jnp.int32), args.context,
                             WARMUP + args.tokens)
        return statistics.mean(times[WARMUP:])

    results = {"cca": [], "full": []}
    for r in range(args.rounds):
        for kind in ("cca", "full"):
            results[kind].append(one_round(kind))
            print(f"round {r} {kind:4s} {results[kind][-1]:7.3f} ms/token", flush=True)
    ratios = [f / c for c, f in zip(results["cca"], results["full"])]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, context {args.context}: "
          f"cca {min(results['cca']):.3f}-{max(results['cca']):.3f} ms, full "
          f"{min(results['full']):.3f}-{max(results['full']):.3f} ms, full / cca per round "
          + ", ".join(f"{x:.2f}x" for x in ratios))


if __name__ == "__main__":
    main()
