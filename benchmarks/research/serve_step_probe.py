"""Where a serving turn's time goes: the engine's programs timed alone, in one process.

    python benchmarks/research/serve_step_probe.py [--attention cca] [--max-batch 17]
        [--max-len 131072] [--contexts 32768,126976] [--chunks 256,2048] [--active 1,4,16]
        [--rounds 5] [--profile DIR] [--compile-profile DIR] [--hlo DIR] [--no-direct]
        [--layers N] [--small]
        [--out benchmarks/results/research/serve_step_probe_h200]

The serve trace (`benchmarks/serve_trace.py`) reports means over a whole trace; this takes its
turn apart on the model it serves (the 7B shape, random bf16 weights; `--small`: a tiny
float32 model on the CPU). One cache of `--max-batch` rows x `--max-len`, every row's length
set to the context (entries zero: the bytes read are those of a full cache), then, per context:
  chunk C      `programs.prefill_and_sample` of one C-token chunk into row 0 (P = 1: the engine's
               default, read and written in place; layers unrolled on a GPU
               up to `EngineConfig.unroll_chunk_tokens`), and the same chunk through `prefill_chunk`
               with its layers "scanned" (each layer's weights copied out of the stack
               first) and "unrolled" (weights read in place);
  decode A     `programs.decode_and_sample` with A rows active at the context, the rest idle.
Every program is compiled first, then all are timed round-robin `--rounds` times (median), so
drift hits each alike; each record has the program's memory from XLA (temporaries: a copy of
the cache shows there). `--profile DIR`: one more call of each under the profiler, with its
40 longest kernels (`profile_inference.kernel_table`) and where the GPU sat idle between
kernels (`gaps`: the sum, the 12 longest) in the record; `--hlo DIR`: each
program's optimized HLO; `--variants`: each program compiled once per named XLA option set
(`VARIANTS`: e.g. without GPU command buffers, or GEMM autotuning) and timed in the same
round-robin; every record has its program's compile seconds and GEMM fusions (all, and how
many distinct: XLA tunes each distinct one); `--compile-profile DIR`: each compile traced,
its longest host events (XLA's passes, autotuning, LLVM, ptxas) in the record. Writes
`<out>.json` (one record per program and context, stamped) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.research.autotune_dedup_probe import gemm_fusions, untuned_first  # noqa: E402
from benchmarks.research.profile_inference import host_event_table  # noqa: E402
from benchmarks.measure import (claim_output, round_robin, stamp, table_heading,  # noqa: E402
                                write_results)
from benchmarks.serve_trace import SMALL, Trace, build_model  # noqa: E402


class Program:
    """A donated-cache program called over and over on one cache: every call first puts the
    rows back at the context (lengths only: the entries stay). Compiled once, ahead of time
    (`compile`), so its memory analysis and optimized HLO are those of the program timed.

    jitted: the jitted function; args(cache): its dynamic (args, kwargs); static: its static
    kwargs; it returns (cache, out), or (out..., cache) where `cache_first` is False."""

    def __init__(self, holder: dict, context: int, jitted, args, static: dict,
                 cache_first: bool, options: dict | None = None):
        self.holder, self.context, self.jitted, self.args = holder, context, jitted, args
        self.static, self.cache_first, self.compiled = static, cache_first, None
        self.options = options or None   # XLA options on top of the jitted function's own

    def _cache(self):
        cache = self.holder["cache"]
        return cache.replace(lengths=jnp.full_like(cache.lengths, self.context))

    def compile(self, trace_dir: str | None = None) -> dict:
        """Compiles; returns the program's memory in bytes (XLA's temporaries, arguments,
        outputs, and the output bytes that alias an argument: the donated cache), and with
        `trace_dir` the compile traced there, its longest host events (`compile_events`)."""
        args, kwargs = self.args(self._cache())
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext():
            self.compiled = self.jitted.lower(*args, **kwargs, **self.static).compile(
                self.options)
        compile_s = round(time.perf_counter() - start, 1)   # trace, lower and XLA's compile
        self._hlo = self.compiled.as_text()   # read twice (recomputed ops, --hlo): megabytes
        m = self.compiled.memory_analysis()
        # XLA's rematerialization (a pass that recomputes values, the gemms included, when it
        # thinks the program exceeds the card's memory) names what it recomputed `*_remat*`
        remat = sum(1 for line in self.hlo_text().splitlines()
                    if "_remat" in line.split("=")[0])
        # XLA tunes each distinct GEMM fusion: alike layers' fusions are tuned once
        gemms, distinct = gemm_fusions(self._hlo)
        facts = dict(remat_ops=remat, compile_s=compile_s, gemm_fusions=gemms,
                     distinct_gemm_fusions=distinct)
        if trace_dir:
            facts["compile_events"] = host_event_table(trace_dir, COMPILE_EVENTS)
        return facts if m is None else dict(
            temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
            output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
            **facts)

    def hlo_text(self) -> str:
        return self._hlo

    def __call__(self):
        if self.compiled is None:
            self.compile()
        args, kwargs = self.args(self._cache())
        result = self.compiled(*args, **kwargs)
        if self.cache_first:
            self.holder["cache"], out = result
        else:
            *out, self.holder["cache"] = result
        return out


COMPILE_EVENTS = 25   # the longest host events of a traced compile kept (--compile-profile)

# XLA option sets a program can be compiled with besides its own (`--variants`): GPU command
# buffers (CUDA graphs) record a program's kernels and replay them, updated when its buffers
# move; XLA's GEMM autotuning off (`no_autotune`: a quicker compile, each GEMM fusion at an
# untuned default tiling) or at a given level. Variants in one process share XLA's tuned
# configurations (decode_compile_probe.py), and an untuned variant compiled after a tuned one
# looked free: a 256-token chunk ran 16.01 ms in session 23 (research/h100_2026-12-06i.md),
# 256.90 compiled first (research/serve_step_probe_h100_6a645d8.md). So untuned variants
# compile first.
VARIANTS = {"default": {}, "no_command_buffer": {"xla_gpu_enable_command_buffer": ""},
            "no_autotune": {"xla_gpu_autotune_level": 0},
            "autotune": {"xla_gpu_autotune_level": 4},
            "autotune_1": {"xla_gpu_autotune_level": 1},   # tuned, candidates' results unchecked
            "cublas": {"xla_gpu_enable_triton_gemm": False}}  # matmuls on cuBLAS: no Triton tuning


def programs(model, holder: dict, batch: int, context: int, chunks, actives,
             direct: bool = True, options: dict | None = None) -> dict:
    from flax import nnx

    from cca_jax.prefill import prefill_chunk
    from cca_jax.serve.engine_config import EngineConfig
    from cca_jax.serve.programs import decode_and_sample, prefill_and_sample
    state = nnx.split(model)
    zeros = jnp.zeros((batch,), jnp.int32)
    greedy = (jnp.zeros((batch,), jnp.float32), zeros, jnp.ones((batch,), jnp.float32))
    row = jnp.zeros((1,), jnp.int32)
    calls = {}
    for chunk in chunks:
        ids, n_valid = jnp.zeros((1, chunk), jnp.int32), jnp.full((1,), chunk, jnp.int32)
        sampled = (row, ids, n_valid, zeros[:1], *(x[:1] for x in greedy))
        calls[f"chunk {chunk}"] = Program(
            holder, context, prefill_and_sample,
            lambda cache, sampled=sampled: ((state, cache, *sampled), {}),
            dict(unroll=EngineConfig().unrolls(chunk)), cache_first=False, options=options)
        for unroll in (False, True) if direct else ():   # scanned: weights copied out first
            name = f"chunk {chunk} {'unrolled' if unroll else 'scanned'}"
            calls[name] = Program(
                holder, context, prefill_chunk,
                lambda cache, ids=ids, n_valid=n_valid: ((state, cache, ids, n_valid),
                                                         dict(rows=row)),
                dict(unroll_layers=unroll), cache_first=True, options=options)
    for active in actives:
        args = (zeros, jnp.arange(batch) < active, zeros, zeros, *greedy)
        calls[f"decode {active}"] = Program(
            holder, context, decode_and_sample,
            lambda cache, args=args: ((state, cache, *args), {}), dict(pool_slots=False),
            cache_first=False, options=options)
    return calls


def file_name(program: str) -> str:
    """"decode 1 [no_command_buffer]" -> "decode_1_no_command_buffer"."""
    return "_".join(program.replace("[", " ").replace("]", " ").split())


def profile(calls: dict, out_dir: str) -> dict:
    from benchmarks.research.profile_inference import (kernel_table, largest_gaps,
                                                       last_run_sequence)
    tables = {}
    for name, call in calls.items():
        where = os.path.join(out_dir, file_name(name))
        jax.block_until_ready(call())
        with jax.profiler.trace(where):
            jax.block_until_ready(call())
        table = kernel_table(where, 40)
        table["gaps"] = largest_gaps(last_run_sequence(table, 1), 12)   # pops the events
        tables[name] = table
    return tables


def table(records) -> str:
    first = records[0]
    lines = table_heading(
        f"Serving turn, program by program ({first['attention']}, {first['shape']} with "
        f"{first['layers']} layers, {first['max_batch']} rows x {first['max_len']})", first) + [
        "| context | program | XLA options | compile s | ms | tokens | kernel ms (profiled) "
        "| GPU idle ms (profiled) | temp MiB | aliased MiB | recomputed ops "
        "| GEMM fusions (distinct) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        kernels = r.get("kernels", {}).get("kernel_ms")
        idle = r.get("kernels", {}).get("gaps", {}).get("total_ms")
        mem = r.get("memory", {})
        mib = lambda key: f"{mem[key] / 2**20:.1f}" if key in mem else ""  # noqa: E731
        ms = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {r['context']} | {r['program']} | {r.get('variant', 'default')} | "
                     f"{mem.get('compile_s', '')} | {r['ms']:.2f} | {r['tokens']} | "
                     f"{ms(kernels)} | {ms(idle)} | {mib('temp_bytes')} | "
                     f"{mib('alias_bytes')} | {mem.get('remat_ops', '')} | "
                     f"{mem.get('gemm_fusions', '')} ({mem.get('distinct_gemm_fusions', '')}) |")
    for r in records:   # --compile-profile: where the compile's time goes
        events = r.get("memory", {}).get("compile_events")
        if events:
            lines += ["", f"Compile of {r['program']} ({r.get('variant', 'default')}, context "
                      f"{r['context']}), its longest host events (nested ones each whole):", "",
                      "| event | count | ms |", "| --- | --- | --- |"]
            lines += [f"| {e['name']} | {e['count']} | {e['ms']} |" for e in events]
    for r in records:   # profiled: what kind of work the kernel time is
        families = r.get("kernels", {}).get("families")
        if families:
            lines += ["", f"Kernel families of {r['program']} ({r.get('variant', 'default')}, "
                      f"context {r['context']}), profiled:", "",
                      "| kernels (XLA's numbering dropped) | count | ms |", "| --- | --- | --- |"]
            lines += [f"| {f['name']} | {f['count']} | {f['ms']:.3f} |" for f in families[:15]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", default="cca")
    ap.add_argument("--max-batch", type=int, help="17 (--small: 4)")
    ap.add_argument("--max-len", type=int, help="131072 (--small: 128)")
    ap.add_argument("--contexts", help="32768,126976 (--small: 32,64)")
    ap.add_argument("--chunks", help="256,2048 (--small: 8,16)")
    ap.add_argument("--active", help="1,4,16 (--small: 1,3)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-direct", action="store_true",
                    help="only the engine's programs: not the chunk through `prefill_chunk` "
                    "scanned and unrolled (each a long compile at the 7B shape)")
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--compile-profile", default=None, metavar="DIR",
                    help="trace each compile there; record its longest host events (XLA's "
                    "passes, autotuning, LLVM, ptxas)")
    ap.add_argument("--hlo", default=None, metavar="DIR",
                    help="write each program's optimized HLO there (<context>_<program>.hlo.gz)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the model with this many layers (memory and HLO of a quick compile)")
    ap.add_argument("--variants", default="default",
                    help=f"compile every program once per XLA option set, timed side by side: "
                    f"comma-separated names from {sorted(VARIANTS)}")
    ap.add_argument("--small", action="store_true",
                    help="a tiny float32 model (CPU check); the other flags still apply")
    ap.add_argument("--stacked-layers", action="store_true",
                    help="keep the layers stacked as training does (a comparison)")
    ap.add_argument("--out", default="benchmarks/results/research/serve_step_probe_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    from cca_jax.kv_cache import init_cache
    defaults = (dict(max_batch=4, max_len=SMALL.max_len, contexts="32,64", chunks="8,16",
                     active="1,3") if args.small else
                dict(max_batch=17, max_len=131072, contexts="32768,126976", chunks="256,2048",
                     active="1,4,16"))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    trace = dataclasses.replace(SMALL if args.small else Trace(), max_len=args.max_len,
                                stacked_layers=args.stacked_layers)
    batch = args.max_batch
    contexts, chunks, actives = ([int(x) for x in value.split(",")]
                                 for value in (args.contexts, args.chunks, args.active))
    if max(contexts) + max(chunks) > trace.max_len:
        raise SystemExit(f"--contexts + --chunks must stay within --max-len {trace.max_len}")
    variants = untuned_first(args.variants.split(","),   # see VARIANTS
                             lambda name: VARIANTS.get(name, {}).get("xla_gpu_autotune_level"))
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    model = build_model(trace, args.attention, args.layers)
    holder = {"cache": init_cache(model.config, batch, trace.max_len)}
    records = []
    for context in contexts:
        calls = {}
        for variant in variants:   # names: "decode 1", "decode 1 [no_command_buffer]"
            suffix = "" if variant == "default" else f" [{variant}]"
            calls.update({name + suffix: call for name, call in programs(
                model, holder, batch, context, chunks, actives, direct=not args.no_direct,
                options=VARIANTS[variant]).items()})
        memory = {}
        for name, call in calls.items():
            memory[name] = call.compile(os.path.join(args.compile_profile, str(context),
                                                     file_name(name))
                                        if args.compile_profile else None)
            print(f"context {context}: {name}: compiled; memory (bytes) {memory[name]}",
                  flush=True)
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            for name, call in calls.items():
                where = os.path.join(args.hlo, f"{context}_{file_name(name)}.hlo.gz")
                with gzip.open(where, "wt") as f:
                    f.write(call.hlo_text())
        times = round_robin({name: (call, ()) for name, call in calls.items()}, args.rounds)
        kernels = profile(calls, os.path.join(args.profile, str(context))) \
            if args.profile else {}
        for name, ms in times.items():
            kind, *size = name.split(" [")[0].split()
            tokens = int(size[0]) if kind in ("chunk", "decode") else 0
            records.append(dict(attention=args.attention, shape=trace.shape,
                                layers=model.config.num_hidden_layers,
                                stacked_layers=trace.stacked_layers,
                                max_batch=batch, max_len=trace.max_len, context=context,
                                program=name.split(" [")[0],
                                variant=name.split(" [")[1][:-1] if " [" in name else "default",
                                ms=round(ms, 3), tokens=tokens,
                                memory=memory[name], kernels=kernels.get(name, {}),
                                **stamp()))
            print(f"context {context}: {name}: {ms:.2f} ms", flush=True)
    write_results(args.out, records, table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
