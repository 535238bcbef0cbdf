"""Serving a trace of long-context requests with continuous batching: CCA against full attention.

    python benchmarks/serve_trace.py --out benchmarks/results/serve_trace_h200
    python benchmarks/serve_trace.py --small --out /tmp/serve_small      # a CPU smoke run

The engine behind `python -m cca_jax.serve` (`cca_jax.serve.engine.Engine`, in-process: what
is timed is the scheduler and the device, not HTTP) serves one request trace per attention
option (`--attention cca,full`, the same `--max-len`): `--requests` requests whose prompts
are random tokens of lengths drawn uniformly from `--prompt-lengths` (default 8K-128K),
`--new-tokens` greedy tokens each (EOS ignored), arriving at a fixed rate (`--rate` per
second), on a LLaMA-2-7B-shaped model with random bf16 weights (`--small`: a tiny float32
model and a short trace). Rows per option: `--max-batch`, by default as many as the device's
memory fits beside the weights (`rows_fit`: KV cache bytes per row against the free memory;
at least 1, at most 64).

Each record: throughput (generated tokens / wall time from the first arrival to the last
token), decode throughput (tokens after each request's first / the same wall time), time to
first token p50/p95 (from arrival, queueing included), inter-token latency p50/p95 (the gaps
between a request's consecutive tokens, other rows' prefill chunks included), the most rows
busy at once, KV cache bytes, the device's peak memory, the engine's own step times (mean
ms per decode step and per prefill chunk, rows per decode step, and the decode steps'
throughput: tokens they produced / seconds they took, the batch's decode rate without the
prefill chunks between steps), and the start time: seconds from an
empty process to the engine ready (programs compiled) with an empty persistent compilation
cache (cold), again with the cache it filled (warm), and with that cache at a slightly
shorter `--max-len` (`other_len_start_s`: every program compiles anew, its GEMM tunings
found in the cache), each in a fresh child process.
Writes `<out>.json` and `<out>.md` with device, versions, shapes, date and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import PAPER_PATTERNS, claim_output, write_results  # noqa: E402

SHAPES = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      dtype="bfloat16", param_dtype="bfloat16"),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, dtype="float32",
                 param_dtype="float32"),
}
SMALL_PATTERNS = {"cca": dict(group_size=4, window_size=16), "full": {}}


@dataclasses.dataclass(frozen=True)
class Trace:
    """The request trace and the engine's shapes."""
    shape: str = "llama2-7b"
    requests: int = 64
    prompt_lengths: tuple[int, int] = (8192, 131072 - 256)
    new_tokens: int = 256
    rate: float = 0.5               # arrivals per second
    max_len: int = 131072
    # A prefill chunk runs between two decode steps: its time adds to the inter-token gap of
    # every running row (at 7B about 7 ms per 512 tokens of MLP alone, on an H200).
    chunk_size: int = 1024
    decode_chunk_size: int | None = None   # the chunk while rows decode (None: chunk_size)
    itl_target_ms: float | None = None     # EngineConfig.itl_target_ms
    prefill_rows: int = 1
    max_batch: int = 0              # cache rows; 0: as many as the device's memory fits
    seed: int = 0
    # the layers as training holds them (one stacked array a weight), each layer's GEMMs
    # tuned apart, instead of `model.inference_layers`'s: a comparison
    stacked_layers: bool = False


SMALL = Trace(shape="tiny", requests=8, prompt_lengths=(16, 96), new_tokens=8, rate=500.0,
              max_len=128, chunk_size=32, max_batch=4)


def build_model(trace: Trace, kind: str, layers: int | None = None):
    """The trace's model with `kind` attention (random weights); `layers`: that many layers
    instead of the shape's (a quick probe of one layer's programs and memory)."""
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM, inference_layers

    if trace.shape == "tiny":
        settings = SMALL_PATTERNS[kind]
    else:
        p = PAPER_PATTERNS[kind]
        settings = {k: getattr(p, k) for k in ("group_size", "window_size", "sink_tokens")
                    if hasattr(p, k)}
    shape = dict(SHAPES[trace.shape])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    cfg = LlamaConfig(**shape, max_position_embeddings=trace.max_len,
                      attention=dict(kind=kind, **settings))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    return model if trace.stacked_layers else inference_layers(model, consume=True)


def rows_fit(model, trace: Trace) -> int:
    """How many cache rows of `max_len` fit in the device's memory beside the weights (and a
    prefill chunk's headroom): 1 when the device reports no limit (CPU)."""
    import jax
    from flax import nnx

    from cca_jax.kv_cache import cache_bytes, cache_shapes

    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return 1
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    per_row = cache_bytes(cache_shapes(model.config, 1, trace.max_len))
    headroom = 0.15 * limit
    return int(max(1, min(64, (limit - weights - headroom) // per_row)))


def make_requests(trace: Trace, vocab: int):
    """(arrival_s, prompt ids, max_tokens) per request."""
    import numpy as np

    rng = np.random.default_rng(trace.seed)
    lo, hi = trace.prompt_lengths
    return [(i / trace.rate, rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist(),
             trace.new_tokens) for i in range(trace.requests)]


def percentile(values, q):
    import numpy as np
    return float(np.percentile(values, q)) if values else None


def serve_trace(engine, requests, deadline_s: float | None = None) -> dict:
    """Submit `requests` at their arrival times; token timestamps per request -> metrics.

    `deadline_s`: stop waiting that many seconds after the first arrival and report what was
    served by then (`partial`, `completed` requests; the caller's shutdown cancels the
    rest), so a run cut short by a time limit still leaves its measurements."""
    from cca_jax.serve.engine import QueueFull, Request

    times = [[] for _ in requests]
    ends = []
    done = threading.Event()

    def listener(i):
        def on_event(token, reason):
            now = time.perf_counter()
            if token is not None:
                times[i].append(now)
            else:
                ends.append(reason)
                if len(ends) == len(requests):
                    done.set()
        return on_event

    start = time.perf_counter()
    end_by = None if deadline_s is None else start + deadline_s
    arrivals = []
    for i, (at, prompt, max_tokens) in enumerate(requests):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        arrivals.append(time.perf_counter())
        while True:
            try:
                engine.submit(Request(prompt, max_tokens=max_tokens, stop_at_eos=False),
                              listener(i))
                break
            except QueueFull:
                time.sleep(0.01)
    partial = not done.wait(None if end_by is None else max(0.0, end_by - time.perf_counter()))
    times, ends = [list(t) for t in times], list(ends)   # a snapshot: the engine may go on
    wall = max((t[-1] for t in times if t), default=arrivals[0]) - arrivals[0]
    generated = sum(len(t) for t in times)
    ttft = [t[0] - a for t, a in zip(times, arrivals) if t]
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    counts = dict(requests=len(requests), partial=partial, completed=len(ends),
                  errors=sum(r != "length" for r in ends), generated_tokens=generated)
    if not generated:
        return counts
    return dict(counts, wall_s=round(wall, 3),
                tokens_per_s=round(generated / wall, 1),
                decode_tokens_per_s=round((generated - len(ttft)) / wall, 1),
                ttft_p50_s=round(percentile(ttft, 50), 4),
                ttft_p95_s=round(percentile(ttft, 95), 4),
                itl_p50_ms=round(1e3 * percentile(gaps, 50), 2) if gaps else None,
                itl_p95_ms=round(1e3 * percentile(gaps, 95), 2) if gaps else None)


def start_time(kind: str, args, cache_dir: str, max_len: int | None = None) -> float:
    """Seconds from a fresh process to the engine ready, with `cache_dir` as the persistent
    compilation cache (a child process: `--start-only`); `max_len` overrides the trace's."""
    cmd = [sys.executable, os.path.abspath(__file__), "--start-only", "--attention", kind,
           "--compile-cache", cache_dir]
    cmd += ["--small"] if args.small else []
    cmd += ["--stacked-layers"] if args.stacked_layers else []
    given = dict(vars(args), max_len=max_len or args.max_len)
    for name in ("requests", "new_tokens", "rate", "max_len", "chunk_size",
                 "decode_chunk_size", "itl_target_ms", "prefill_rows", "max_batch",
                 "prompt_lengths"):
        if given[name] is not None:
            cmd += [f"--{name.replace('_', '-')}", str(given[name])]
    begin = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    json.loads(out.strip().splitlines()[-1])
    return round(time.perf_counter() - begin, 2)


def other_max_len(trace: Trace) -> int:
    """A `max_len` a little shorter than the trace's: every program of the engine changes
    (the cache is their argument) while its matrix products keep their shapes, so a start
    with the cache another `max_len` filled compiles every program anew but finds the
    GEMM fusions' autotuning results (JAX keeps XLA's per-fusion autotune cache beside the
    compiled programs by default: `jax_persistent_cache_enable_xla_caches`)."""
    return trace.max_len - max(64, trace.max_len // 128)


def make_engine(model, trace: Trace, max_batch: int, requests: int):
    from cca_jax.serve.engine import Engine
    from cca_jax.serve.engine_config import EngineConfig

    engine = Engine(model, EngineConfig(max_batch=max_batch, max_len=trace.max_len,
                                        chunk_size=trace.chunk_size,
                                        decode_chunk_size=trace.decode_chunk_size,
                                        itl_target_ms=trace.itl_target_ms,
                                        prefill_rows=trace.prefill_rows, max_queue=requests),
                    eos=())
    engine.start()
    engine.ready.wait()
    if engine.error is not None:
        raise engine.error
    print(f"engine ready in {engine.startup_seconds:.1f} s (programs compiled or loaded)",
          flush=True)
    return engine


def bench(kind: str, trace: Trace, args) -> dict:
    import jax

    from benchmarks.measure import stamp

    model = build_model(trace, kind)
    batch = trace.max_batch or rows_fit(model, trace)
    engine = make_engine(model, trace, batch, trace.requests)
    try:
        metrics = serve_trace(engine, make_requests(trace, model.config.vocab_size),
                              args.deadline)
        stats = engine.stats()
    finally:
        engine.shutdown()
    mem = jax.devices()[0].memory_stats() or {}
    cfg = model.config
    rec = dict(attention=kind, shape=trace.shape, max_len=trace.max_len, max_batch=batch,
               chunk_size=trace.chunk_size, decode_chunk_size=trace.decode_chunk_size,
               itl_target_ms=trace.itl_target_ms, program_ms=stats["program_ms"],
               prefill_rows=trace.prefill_rows,
               prompt_lengths=list(trace.prompt_lengths), new_tokens=trace.new_tokens,
               rate=trace.rate, max_rows_busy=stats["max_rows_busy"],
               compilations_since_ready=stats["compilations_since_ready"],
               kv_cache_bytes=engine.kv_cache_bytes,
               kv_cache_gib=round(engine.kv_cache_bytes / 2**30, 3),
               startup_s=round(engine.startup_seconds, 1),
               peak_gib=round(mem.get("peak_bytes_in_use", 0) / 2**30, 2),
               layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, **metrics,
               **step_metrics(stats["step_times"]))
    return dict(rec, **stamp(), fastapi=_version("fastapi"), uvicorn=_version("uvicorn"))


def _version(package: str) -> str:
    """An installed package's version, read from its metadata (importing fastapi pulls in
    optional telemetry packages a bare machine may lack), or "absent"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def step_metrics(times: dict) -> dict:
    """The engine's `StepTimes` -> per-step means and the decode steps' throughput."""
    def ratio(a, b, scale=1.0):
        return round(scale * a / b, 2) if b else None
    return dict(decode_step_ms=ratio(times["decode_seconds"], times["decode_steps"], 1e3),
                rows_per_step=ratio(times["decode_tokens"], times["decode_steps"]),
                step_decode_tokens_per_s=ratio(times["decode_tokens"], times["decode_seconds"]),
                prefill_chunk_ms=ratio(times["prefill_seconds"], times["prefill_chunks"], 1e3),
                prefill_tokens_per_s=ratio(times["prefill_tokens"], times["prefill_seconds"]),
                interleaved_chunk_ms=ratio(times.get("interleaved_seconds", 0),
                                           times.get("interleaved_chunks", 0), 1e3),
                host_ms_per_turn=ratio(times.get("turn_seconds", 0) - times["prefill_seconds"]
                                       - times["decode_seconds"], times.get("turns", 0), 1e3),
                step_times=times)


def table(records) -> str:
    cols = ["attention", "max_batch", "max_rows_busy", "tokens_per_s", "decode_tokens_per_s",
            "ttft_p50_s", "ttft_p95_s", "itl_p50_ms", "itl_p95_ms", "decode_step_ms",
            "rows_per_step", "step_decode_tokens_per_s", "prefill_chunk_ms",
            "interleaved_chunk_ms", "host_ms_per_turn", "kv_cache_gib",
            "peak_gib", "startup_s", "cold_start_s", "warm_start_s", "other_len_start_s",
            "completed", "errors"]
    first = records[0]
    lines = [f"# Serving a request trace on {first['device']}", "",
             f"- date: {first['date']}; jax {first['jax']}; fastapi {first['fastapi']}; "
             f"uvicorn {first['uvicorn']}; commit {first['commit']}",
             f"- command: `{first['command']}`",
             f"- model: {first['shape']} shape ({first['layers']} layers, hidden "
             f"{first['hidden']}), random weights; max_len {first['max_len']}; "
             f"{first['requests']} requests, prompts of {first['prompt_lengths'][0]}-"
             f"{first['prompt_lengths'][1]} tokens, {first['new_tokens']} new tokens each, "
             f"{first['rate']} arrivals/s; prefill chunk {first['chunk_size']} "
             f"({first.get('decode_chunk_size') or first['chunk_size']} while rows decode"
             + (f", up to {first['chunk_size']} within an inter-token target of "
                f"{first['itl_target_ms']} ms" if first.get("itl_target_ms") else "") + ")",
             "",
             "| " + " | ".join(cols) + " |", "| --- " * len(cols) + "|"]
    for r in records:
        cells = (r.get(c) for c in cols)
        lines.append("| " + " | ".join("-" if x is None else str(x) for x in cells) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command line (also the start-time children's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attention", default="cca,full", help="comma-separated options")
    ap.add_argument("--small", action="store_true", help="a tiny model and a short trace "
                    "(a CPU smoke run of a few seconds)")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt-lengths", default=None, metavar="LO,HI")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second")
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--decode-chunk-size", type=int, default=None)
    ap.add_argument("--itl-target-ms", type=float, default=None,
                    help="the engine's inter-token target (EngineConfig.itl_target_ms)")
    ap.add_argument("--prefill-rows", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=None,
                    help="cache rows (default: as many as the device's memory fits; 4 with "
                    "--small)")
    ap.add_argument("--no-start-times", action="store_true",
                    help="skip the start-time measurements (three child processes each)")
    ap.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                    help="stop each trace this long after its first arrival and record what "
                    "was served by then (marked partial)")
    ap.add_argument("--stacked-layers", action="store_true",
                    help="keep the layers stacked as training does (a comparison)")
    ap.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/serve_trace_h200")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    claim_output(args.out)
    trace = SMALL if args.small else Trace()
    changes = {k: getattr(args, k) for k in ("requests", "new_tokens", "rate", "max_len",
                                             "chunk_size", "decode_chunk_size",
                                             "itl_target_ms", "prefill_rows", "max_batch")
               if getattr(args, k) is not None}
    if args.prompt_lengths:
        changes["prompt_lengths"] = tuple(int(x) for x in args.prompt_lengths.split(","))
    trace = dataclasses.replace(trace, **changes, stacked_layers=args.stacked_layers)
    if args.start_only:   # a child of start_time(): build, compile, report, exit
        from cca_jax.cli import enable_compile_cache
        enable_compile_cache(argparse.Namespace(compile_cache=args.compile_cache,
                                                no_compile_cache=False))
        model = build_model(trace, args.attention)
        engine = make_engine(model, trace, trace.max_batch or rows_fit(model, trace), 1)
        engine.shutdown()
        print(json.dumps(engine.stats()))
        return 0
    kinds = args.attention.split(",")
    starts = {}
    if not args.no_start_times:   # first: the children need the device to themselves
        for kind in kinds:
            with tempfile.TemporaryDirectory() as cache_dir:
                starts[kind] = dict(cold_start_s=start_time(kind, args, cache_dir),
                                    warm_start_s=start_time(kind, args, cache_dir),
                                    other_len_start_s=start_time(kind, args, cache_dir,
                                                                 other_max_len(trace)))
    records = [dict(bench(kind, trace, args), **starts.get(kind, {})) for kind in kinds]
    for r in records:
        print(json.dumps(r), flush=True)
    write_results(args.out, records, table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
