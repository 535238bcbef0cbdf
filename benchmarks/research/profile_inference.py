"""Probe: where does the time of a prefill and of a decode step go, kernel by kernel?

    python benchmarks/research/profile_inference.py --impl cca --context 131072 --out DIR
        [--implementation mosaic_gpu]

Builds the LLaMA-2-7B-shaped model of `benchmarks/inference.py`, then
  decode:  a cache with every row's length set to the context (as `--no-prefill` there),
           `generate.decode_loop` (as generate runs), warm steps, then `--steps` steps under
           the profiler, then as many untraced;
  prefill: (with `--prefill`) one warm `prefill.prefill` of the context under the trace.
`--no-decode` skips the decode phase; `--clocks` samples the SM clock and power draw
(`nvidia-smi`, every 20 ms) during the traced prefill and prints their spread.
The trace (`.xplane.pb`) is read with `jax.profiler.ProfileData`: for each phase it prints the
wall time, the summed kernel time on the GPU streams, the kernel count, and the kernels that
take the most time (grouped by name). The gap between wall and kernel time is host and
launch overhead; XLA flags (command buffers, ...) can be compared by running this under
different `XLA_FLAGS`. Writes `<out>/<phase>.json`.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WARMUP = 20   # decode steps before timing: more than g = 16, so both step programs compile


def kernel_table(trace_dir: str, top: int) -> dict:
    """Summed GPU stream events of the newest trace under `trace_dir`, by name."""
    from jax.profiler import ProfileData

    path = max(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
    data = ProfileData.from_file(path)
    by_name = collections.defaultdict(lambda: [0, 0])
    first, last = None, None
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                events.append((ev.start_ns, ev.duration_ns, ev.name))
                by_name[ev.name][0] += 1
                by_name[ev.name][1] += ev.duration_ns
                first = ev.start_ns if first is None else min(first, ev.start_ns)
                end = ev.start_ns + ev.duration_ns
                last = end if last is None else max(last, end)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return dict(kernels=sum(c for c, _ in by_name.values()),
                families=kernel_families({n: tuple(v) for n, v in by_name.items()}, top),
                kernel_ms=sum(t for _, t in by_name.values()) / 1e6,
                span_ms=(last - first) / 1e6 if first is not None else 0.0,
                top=[dict(name=n[:120], count=c, ms=t / 1e6) for n, (c, t) in rows[:top]],
                events=sorted(events))


def host_event_table(trace_dir: str, top: int) -> list[dict]:
    """The host's traced events of the newest trace under `trace_dir` (XLA's compile passes,
    autotuning, LLVM and ptxas among them: where a compile's time goes), summed by name, the
    longest first; Python frames (`$file:line`) left out. Nested events each count whole."""
    from jax.profiler import ProfileData

    path = max(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
    by_name = collections.defaultdict(lambda: [0, 0])
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for ev in line.events:
                    if not ev.name.startswith("$"):
                        by_name[ev.name][0] += 1
                        by_name[ev.name][1] += ev.duration_ns
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(name=n[:120], count=c, ms=round(t / 1e6, 1)) for n, (c, t) in rows]


def kernel_families(by_name: dict, top: int) -> list[dict]:
    """{name: (count, ns)} summed over names that differ only in XLA's numbering
    (`gemm_fusion_dot_180`, `gemm_fusion_dot.12` -> `gemm_fusion_dot`), longest first: what
    kind of work a program of many small kernels spends its time on."""
    sums = collections.defaultdict(lambda: [0, 0])
    for name, (count, ns) in by_name.items():
        family = re.sub(r"([._]\d+)+$", "", name)[:120]
        sums[family][0] += count
        sums[family][1] += ns
    rows = sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(name=n, count=c, ms=t / 1e6) for n, (c, t) in rows]


def last_run_sequence(table: dict, per: int) -> list[dict]:
    """The kernels of the last of `per` equal runs, in order: name, us, gap before it (us)."""
    events = table.pop("events")
    mine = events[len(events) - len(events) // per:]
    out, end = [], None
    for start, dur, name in mine:
        out.append(dict(name=name[:80], us=round(dur / 1e3, 2),
                        gap_us=None if end is None else round((start - end) / 1e3, 2)))
        end = start + dur
    return out


def largest_gaps(sequence: list[dict], n: int) -> dict:
    """Where a run's GPU stream sat idle (`last_run_sequence`'s gaps): their sum in ms and the
    `n` longest, each with the kernels before and after it."""
    gaps = [dict(us=row["gap_us"], after=sequence[i - 1]["name"], before=row["name"])
            for i, row in enumerate(sequence) if row["gap_us"] is not None and i > 0]
    return dict(total_ms=round(sum(max(g["us"], 0.0) for g in gaps) / 1e3, 3),
                longest=sorted(gaps, key=lambda g: -g["us"])[:n])


def report(phase: str, wall_ms: float, per: int, table: dict, out: str) -> None:
    sequence = last_run_sequence(table, per)
    print(f"\n== {phase}: wall {wall_ms / per:.3f} ms, kernels {table['kernel_ms'] / per:.3f} ms "
          f"in {table['kernels'] / per:.0f} launches, GPU span {table['span_ms'] / per:.3f} ms "
          f"(per {'step' if per > 1 else 'run'})")
    for row in table["top"]:
        print(f"  {row['ms'] / per:9.4f} ms  x{row['count'] / per:6.1f}  {row['name']}")
    if per > 1:  # one layer's kernels from the middle of a step
        middle = len(sequence) // 2
        print("  kernels in order from the middle of the last step (us, gap before):")
        for row in sequence[middle:middle + 40]:
            print(f"    {row['us']:8.2f} {row['gap_us']:7.2f}  {row['name']}")
    with open(os.path.join(out, f"{phase}.json"), "w") as f:
        json.dump(dict(phase=phase, wall_ms=wall_ms / per, per=per,
                       xla_flags=os.environ.get("XLA_FLAGS", ""), **table,
                       sequence=sequence), f, indent=1)


class ClockSampler:
    """`nvidia-smi` samples of the SM clock (MHz) and power (W) while the block runs."""

    def __init__(self, period_ms: int = 20):
        self.period_ms, self.proc, self.samples = period_ms, None, []

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate()
        for line in out.splitlines():
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((mhz, watts))

    def summary(self) -> str:
        if not self.samples:
            return "clocks: no nvidia-smi samples"
        mhz, watts = zip(*self.samples)
        q = lambda xs: (min(xs), statistics.median(xs), max(xs))  # noqa: E731
        return ("clocks (min / median / max of %d samples): SM %.0f / %.0f / %.0f MHz, "
                "power %.0f / %.0f / %.0f W" % (len(mhz), *q(mhz), *q(watts)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="cca")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16, help="traced steps (one in g pools)")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--clocks", action="store_true", help="sample SM clock and power")
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--implementation", default="auto",
                    help="the model's attention implementation (e.g. mosaic_gpu)")
    ap.add_argument("--out", required=True, help="folder for <phase>.json")
    ap.add_argument("--trace-dir", default="/tmp/profile_inference",
                    help="where the profiler writes its traces")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.inference import SHAPES, _max_len
    from benchmarks.measure import PAPER_PATTERNS, claim_output
    from cca_jax.config import LlamaConfig
    from cca_jax.decode import decode_implementation
    from cca_jax.prefill import prefill
    from cca_jax.generate import decode_loop
    from cca_jax.kv_cache import init_cache
    from cca_jax.model import LlamaForCausalLM

    os.makedirs(args.out, exist_ok=True)
    phases = ["decode"] * (not args.no_decode) + ["prefill"] * args.prefill
    for phase in phases:
        claim_output(os.path.join(args.out, phase), (".json",))
    p = PAPER_PATTERNS[args.impl]
    cfg = LlamaConfig(**SHAPES[args.shape],
                      max_position_embeddings=_max_len(args.context, WARMUP + 2 * args.steps + 2),
                      attention=dict(kind=args.impl, group_size=p.group_size,
                                     window_size=p.window_size, sink_tokens=p.sink_tokens,
                                     implementation=args.implementation))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    impl = decode_implementation(cfg)
    max_len = _max_len(args.context, WARMUP + 2 * args.steps + 2)
    print(f"{args.impl} C={args.context} B={args.batch} decode={impl} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)

    if not args.no_decode:
        cache = init_cache(cfg, args.batch, max_len)
        cache = cache.replace(lengths=jnp.full((args.batch,), args.context, jnp.int32))
        # As generate runs: pipelined steps, pooling only where a slot completes. The warm-up
        # (more than g steps) compiles both step programs; traced and untraced runs follow.
        loop = decode_loop(model, cache, jnp.zeros((args.batch,), jnp.int32),
                           np.full(args.batch, args.context), key=jax.random.PRNGKey(0),
                           max_new_tokens=WARMUP + 2 * args.steps + 1, stop_at_eos=False)
        del cache
        start = time.perf_counter()
        for _ in range(WARMUP):
            next(loop)
        print(f"decode warm-up (compiles) {time.perf_counter() - start:.1f} s", flush=True)
        trace_dir = os.path.join(args.trace_dir, "decode")
        jax.profiler.start_trace(trace_dir)
        start = time.perf_counter()
        for _ in range(args.steps):
            next(loop)
        wall = (time.perf_counter() - start) * 1e3
        jax.profiler.stop_trace()
        start = time.perf_counter()
        for _ in range(args.steps):
            next(loop)
        print(f"untraced decode {(time.perf_counter() - start) * 1e3 / args.steps:.3f} ms/step")
        loop.close()
        report("decode", wall, args.steps, kernel_table(trace_dir, args.top), args.out)

    if args.prefill:
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.context))

        start = time.perf_counter()
        c, logits = prefill(model, init_cache(cfg, args.batch, max_len), ids,
                            chunk_size=args.context)
        jax.block_until_ready(logits)
        del c
        print(f"prefill compile + run {time.perf_counter() - start:.1f} s", flush=True)
        trace_dir = os.path.join(args.trace_dir, "prefill")
        clocks = ClockSampler() if args.clocks else contextlib.nullcontext()
        with jax.profiler.trace(trace_dir), clocks:
            start = time.perf_counter()
            c, logits = prefill(model, init_cache(cfg, args.batch, max_len), ids,
                                chunk_size=args.context)
            jax.block_until_ready(logits)
            wall = (time.perf_counter() - start) * 1e3
        del c
        if args.clocks:
            print(clocks.summary())
        report("prefill", wall, 1, kernel_table(trace_dir, args.top), args.out)


if __name__ == "__main__":
    main()
