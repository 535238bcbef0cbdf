"""Does the server start faster compiling its programs in threads at once? Time to ready of
the engine (`cca_jax.serve.engine`) with `parallel_compile` off and on, alternating, jit's
caches cleared before each start (no persistent compilation cache: cold starts).

    python benchmarks/research/serve_parallel_compile.py [--layers 16] [--hidden 256]
        [--starts 2] [--out benchmarks/results/research/serve_parallel_compile_cpu]

A random-weight float32 LLaMA of the given size (4 heads, 2 KV heads, CCA g 4 s 6), max_batch
4, max_len 256, prefill chunks of 32 and 8 tokens: 2 prefill and 2 decode programs. Writes
`<out>.json` (stamped records: seconds to ready, compilations at start-up) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.measure import claim_output, stamp, write_results  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--starts", type=int, default=2, help="starts of each setting")
    ap.add_argument("--out", default="benchmarks/results/research/serve_parallel_compile_cpu")
    args = ap.parse_args(argv)
    claim_output(args.out)
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM
    from cca_jax.serve.engine import Engine
    from cca_jax.serve.engine_config import EngineConfig
    cfg = LlamaConfig(vocab_size=97, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, dtype="float32",
                      param_dtype="float32", eos_token_id=None,
                      attention={"kind": "cca", "group_size": 4, "window_size": 6})
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    base = stamp(argv)
    records = []
    for _ in range(args.starts):
        for parallel in (False, True):
            jax.clear_caches()
            engine = Engine(model, EngineConfig(max_batch=4, max_len=256, chunk_size=32,
                                                decode_chunk_size=8,
                                                parallel_compile=parallel))
            engine.start()
            if not engine.ready.wait(1800):
                raise RuntimeError("the engine did not get ready in 30 minutes")
            stats = engine.stats()
            engine.shutdown()
            records.append(dict(base, parallel_compile=parallel, layers=args.layers,
                                hidden=args.hidden, ready_s=stats["startup_seconds"],
                                compilations=stats["compilations_at_startup"]))
            print(records[-1], flush=True)
    rows = ["| parallel_compile | starts | ready s (median) | each | compilations |",
            "| --- | --- | --- | --- | --- |"]
    for parallel in (False, True):
        mine = [r for r in records if r["parallel_compile"] == parallel]
        times = [r["ready_s"] for r in mine]
        rows.append(f"| {parallel} | {len(mine)} | {statistics.median(times):.2f} | "
                    f"{', '.join(f'{t:.2f}' for t in times)} | {mine[0]['compilations']} |")
    header = (f"Engine cold start, programs compiled one after another or at once: LLaMA "
              f"{args.layers} layers x {args.hidden}, float32, random weights; "
              f"{base['device']} ({os.cpu_count()} cores), jax {base['jax']}, {base['date']}, "
              f"commit {base['commit']}\nCommand: `{base['command']}`\n\n")
    write_results(args.out, records, header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
