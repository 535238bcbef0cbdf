"""The server engine's two programs timed alone, at its shapes: why is an inter-token time
about 46 ms on the H200 (`benchmarks/results/serve_trace_long_cca_h200.md`: a decode step
of 12.18 ms with 1.27 rows busy, a prefill chunk of 37.77 ms) when one row's decode step
alone is 5.3 ms?

    python benchmarks/research/serve_programs.py [--shape llama2-7b] [--batch 17]
        [--max-len 131072] [--chunks 256,2048] [--decoding 1] [--context 131072]
        [--profile DIR] --out OUT

One cache of `--batch` rows x `--max-len` (as `cca_jax.serve.engine` holds it); row 0 is
being prefilled at position `--context` - 2 x chunk, rows 1..`--decoding` decode at
`--context` - 64, the others are idle. Times (median of `--rounds`, each call synchronised
as the engine does) `_prefill_and_sample` for one chunk of each size into row 0 (`rows` =
[0] with the engine's `prefill_rows` = 1, the layers unrolled where the engine unrolls them)
and `_decode_and_sample` (the step without pooling). `--profile DIR`: one more call of each
under `jax.profiler`, its GPU kernels by time. Writes `OUT.json` and `OUT.md`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.inference import SHAPES  # noqa: E402
from benchmarks.measure import PAPER_PATTERNS, stamp, write_results  # noqa: E402


def _timed(call, rounds: int) -> float:
    """Median ms of `call()` (which returns something to wait for)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--batch", type=int, default=17)
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--context", type=int, default=131072,
                    help="where the prefilled row's chunks end and the decoding rows sit")
    ap.add_argument("--chunks", default="256,2048")
    ap.add_argument("--decoding", type=int, default=1, help="rows that decode (1 .. B-1)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not 1 <= args.decoding < args.batch:
        ap.error("--decoding must lie in [1, --batch - 1]")

    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.kv_cache import init_cache
    from cca_jax.model import LlamaForCausalLM
    from cca_jax.serve.engine import EngineConfig, _decode_and_sample, _prefill_and_sample

    p = PAPER_PATTERNS["cca"]
    cfg = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=args.max_len,
                      attention=dict(kind="cca", group_size=p.group_size,
                                     window_size=p.window_size))
    model_state = nnx.split(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    b, chunks = args.batch, [int(c) for c in args.chunks.split(",")]
    cache = init_cache(cfg, b, args.max_len)
    decoding = np.zeros(b, bool)
    decoding[1:1 + args.decoding] = True
    base = dict(stamp(argv), shape=args.shape, batch=b, max_len=args.max_len,
                context=args.context, decoding_rows=args.decoding)
    records, programs = [], {}
    greedy = (np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32))
    rows = np.zeros(1, np.int32)

    def lengths(prefill_at: int):
        out = np.zeros(b, np.int32)
        out[0] = prefill_at
        out[decoding] = args.context - 64
        return jnp.asarray(out)

    state = {"cache": cache}
    for chunk in chunks:
        at = args.context - 2 * chunk
        ids = np.ones((1, chunk), np.int32)
        n_valid = np.full(1, chunk, np.int32)
        unroll = EngineConfig(max_batch=b, max_len=args.max_len, chunk_size=chunk).unrolls(chunk)

        def prefill(ids=ids, n_valid=n_valid, at=at, unroll=unroll):
            state["cache"] = state["cache"].replace(lengths=lengths(at))
            tokens, _, state["cache"] = _prefill_and_sample(
                model_state, state["cache"], rows, ids, n_valid, np.zeros(1, np.int32),
                *greedy, unroll=unroll)
            return tokens
        programs[f"prefill chunk {chunk}{' (unrolled)' if unroll else ''}"] = prefill
    zeros = np.zeros(b, np.int32)
    sampling = (np.zeros(b, np.float32), zeros, np.ones(b, np.float32))

    def decode():
        state["cache"] = state["cache"].replace(lengths=lengths(0))
        tokens, _, state["cache"] = _decode_and_sample(
            model_state, state["cache"], zeros, decoding, zeros, zeros, *sampling,
            pool_slots=False)
        return tokens
    programs[f"decode step ({args.decoding} of {b} rows)"] = decode

    for name, call in programs.items():
        start = time.perf_counter()
        jax.block_until_ready(call())   # compiles
        rec = dict(base, program=name, compile_s=round(time.perf_counter() - start, 1))
        rec["ms"] = _timed(call, args.rounds)
        print(f"{name}: {rec['ms']:.2f} ms (first call {rec['compile_s']} s)", flush=True)
        if args.profile:
            from benchmarks.research.profile_inference import kernel_table
            where = os.path.join(args.profile, name.split()[0] + name.split()[-1].strip(")"))
            with jax.profiler.trace(where):
                jax.block_until_ready(call())
            table = kernel_table(where, 12)
            table.pop("events", None)
            rec["kernels"] = table
        records.append(rec)

    rows_md = ["| program | ms | first call s | kernel ms | longest kernels (ms) |",
               "| --- | --- | --- | --- | --- |"]
    for rec in records:
        top = rec.get("kernels", {})
        longest = "; ".join(f"{k['name'][:40]} x{k['count']} {k['ms']:.2f}"
                            for k in top.get("top", [])[:6])
        rows_md.append(f"| {rec['program']} | {rec['ms']:.2f} | {rec['compile_s']} | "
                       f"{top.get('kernel_ms', float('nan')):.2f} | {longest} |")
    header = (f"The serve engine's programs alone: {args.shape}, cache {b} rows x "
              f"{args.max_len}, row 0 prefilled at {args.context} - 2 x chunk, "
              f"{args.decoding} rows decoding at {args.context} - 64; {base['device']}, jax "
              f"{base['jax']}, {base['date']}, commit {base['commit']}\n"
              f"Command: `{base['command']}`\n\n")
    write_results(args.out, records, header + "\n".join(rows_md) + "\n")


if __name__ == "__main__":
    main()
