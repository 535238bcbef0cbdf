"""Attention options through the model's own dispatch, and the 7B-shape model's 128K prefill.

    python benchmarks/baselines.py [--lengths 32768,131072] [--hkv 32,8]
        [--kinds full,sliding,streaming,cca] [--packed 0,1] [--iters 5]
        [--out benchmarks/results/baselines_h200]
    python benchmarks/baselines.py --prefill 131072 --kinds full,cca
        [--out benchmarks/results/prefill_7b_h200]

Attention table: for every (L, Hkv, packed, option), forward and forward+backward
milliseconds of `cca_jax.run_attention(..., implementation="auto")` (what the model calls),
B = 1, Hq = 32, D = 128, bf16; sliding W = 1024, streaming N = 4 + W = 1024, cca g = 16,
s = 1024; packed = 4 documents of L/4 (segment_ids). Records the implementation "auto" chose,
compile seconds, and (L <= 32768) the forward's relative L2 error against `xla`.

Prefill: a LLaMA-2-7B-shaped model (random bf16 weights) runs `model(ids, last_only=True)`
over one sequence of `--prefill` tokens for each option: seconds (median of timed runs after
a warm-up), the compiled program's memory (XLA's analysis: weights, temporaries, output) and
the device's peak memory in this process (run one option per process for per-option peaks;
`--merge` combines their JSON files).

Writes `<out>.json` (records) and `<out>.md` (a table with device, versions, date, command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import (PAPER_PATTERNS, claim_output, median_ms, read_records,  # noqa: E402
                                rel_l2, stamp, write_results)
from cca_jax import run_attention  # noqa: E402
from cca_jax.attention import resolve_implementation  # noqa: E402



def _where() -> dict:
    """Commit, device, jax version, date and command: every record carries them."""
    return stamp()


def _packed_ids(length: int, docs: int = 4):
    return jnp.repeat(jnp.arange(docs, dtype=jnp.int32), length // docs)[None]


def bench_attention(kind, length, hkv, packed, iters, hq=32, d=128):
    keys = jax.random.split(jax.random.PRNGKey(length + hkv), 4)
    q = jax.random.normal(keys[0], (1, length, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, length, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, length, hkv, d), jnp.bfloat16)
    ct = jax.random.normal(keys[3], (1, length, hq, d), jnp.bfloat16)
    seg = _packed_ids(length) if packed else None
    pattern = PAPER_PATTERNS[kind]
    impl = resolve_implementation("auto", pattern=pattern, head_dim=d, dtype=q.dtype,
                                  packed=packed)

    def attend(q, k, v, seg, implementation="auto"):
        return run_attention(q, k, v, pattern, segment_ids=seg, implementation=implementation)

    def loss(q, k, v, seg, ct):
        return jnp.sum(attend(q, k, v, seg).astype(jnp.float32) * ct.astype(jnp.float32))

    start = time.perf_counter()
    fwd = jax.jit(attend).lower(q, k, v, seg).compile()
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg, ct).compile()
    rec = dict(attention=kind, L=length, hkv=hkv, packed=bool(packed), impl=impl, **_where(),
               compile_s=round(time.perf_counter() - start, 2))
    rec["fwd_ms"] = median_ms(fwd, (q, k, v, seg), warmup=2, iters=iters)
    rec["fwd_bwd_ms"] = median_ms(fwd_bwd, (q, k, v, seg, ct), warmup=2, iters=iters)
    if length <= 32768 and impl != "xla":
        ref = jax.jit(lambda q, k, v, seg: attend(q, k, v, seg, "xla"))(q, k, v, seg)
        rec["fwd_rel_l2_vs_xla"] = rel_l2(fwd(q, k, v, seg), ref)
    return rec


def bench_prefill(kind, length, iters):
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM

    p = PAPER_PATTERNS[kind]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=length,
                      attention=dict(kind=kind, group_size=p.group_size,
                                     window_size=p.window_size, sink_tokens=p.sink_tokens))
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    prefill = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids, last_only=True))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, length), 0, cfg.vocab_size)
    start = time.perf_counter()
    compiled = prefill.lower(params, ids).compile()
    compile_s = time.perf_counter() - start
    seconds = median_ms(compiled, (params, ids), warmup=1, iters=iters) / 1e3
    stats = jax.devices()[0].memory_stats() or {}
    mem = compiled.memory_analysis()
    program = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
               - mem.alias_size_in_bytes)
    rec = dict(model="llama2-7b-shape", attention=kind, L=length, prefill_s=round(seconds, 3),
               **_where(),
               compile_s=round(compile_s, 1), program_gib=round(program / 2**30, 2),
               peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
               impl=resolve_implementation("auto", pattern=cfg.attention.pattern))
    del model, params, compiled
    return rec


def _table(records, prefill: bool) -> list[str]:
    if prefill:
        lines = ["| attention | L | implementation | prefill s | x full | program GiB | "
                 "device peak GiB | compile s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        full = {r["L"]: r["prefill_s"] for r in records if r["attention"] == "full"}
        for r in records:
            ratio = f"{full[r['L']] / r['prefill_s']:.2f}x" if r["L"] in full else "-"
            lines.append(f"| {r['attention']} | {r['L']} | {r['impl']} | {r['prefill_s']:.2f} | "
                         f"{ratio} | {r['program_gib']:.1f} | {r['peak_gib']:.1f} | "
                         f"{r['compile_s']:.0f} |")
        return lines
    lines = ["| L | Hkv | packed | attention | implementation | fwd ms | fwd+bwd ms | "
             "x full fwd / fwd+bwd |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    full = {(r["L"], r["hkv"], r["packed"]): r for r in records if r["attention"] == "full"}
    for r in records:
        f = full.get((r["L"], r["hkv"], r["packed"]))
        ratio = (f"{f['fwd_ms'] / r['fwd_ms']:.1f}x / {f['fwd_bwd_ms'] / r['fwd_bwd_ms']:.1f}x"
                 if f else "-")
        lines.append(f"| {r['L']} | {r['hkv']} | {'4 docs' if r['packed'] else 'no'} | "
                     f"{r['attention']} | {r['impl']} | {r['fwd_ms']:.2f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {ratio} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--hkv", default="32,8")
    ap.add_argument("--kinds", default="full,sliding,streaming,cca")
    ap.add_argument("--packed", default="0,1")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=0,
                    help="run the 7B-shape model prefill at this length instead of the table")
    ap.add_argument("--out", default="benchmarks/results/baselines_h200")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="instead of measuring, combine earlier --out JSON files into --out")
    args = ap.parse_args(argv)
    claim_output(args.out)
    kinds = args.kinds.split(",")
    records = []
    if args.merge:
        records = read_records(args.merge)
        args.prefill = args.prefill or int("prefill_s" in records[0])
    elif args.prefill:
        for kind in kinds:
            records.append(bench_prefill(kind, args.prefill, args.iters))
            print(json.dumps(records[-1]), flush=True)
    else:
        for length in map(int, args.lengths.split(",")):
            for hkv in map(int, args.hkv.split(",")):
                for packed in map(int, args.packed.split(",")):
                    for kind in kinds:
                        records.append(bench_attention(kind, length, hkv, packed, args.iters))
                        print(json.dumps(records[-1]), flush=True)
    first = records[0]
    commands = sorted({r["command"] for r in records})
    header = [f"# {'7B-shape prefill' if args.prefill else 'Attention options'} on "
              f"{first['device']}", "",
              f"- date: {first['date']}; jax {first['jax']}",
              *[f"- command: `{c}`" for c in commands],
              "- B = 1, Hq = 32, D = 128, bf16; sliding W = 1024; streaming N = 4, W = 1024; "
              "cca g = 16, s = 1024; implementation 'auto' (what the model runs)", ""]
    write_results(args.out, records, "\n".join(header + _table(records, bool(args.prefill))) + "\n")


if __name__ == "__main__":
    main()
