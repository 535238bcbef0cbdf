"""Attention benchmark: CCA implementations against causal full attention, one run.

    python benchmarks/attention.py [--impls cca_mosaic_gpu,cca_pallas_gpu,cca_xla,full_cudnn]
        [--lengths 8192,32768,131072] [--hkv 32,8] [--out benchmarks/results/attention_h200]

For every (L, Hkv) and implementation: forward and forward+backward milliseconds (median of
timed runs after warm-up), useful TFLOP/s (only scores that are really visible count), the
compiled program's memory (XLA memory analysis: temporaries + arguments + outputs), compile
seconds, and the errors of output and gradients against `cca_xla`. Writes `<out>.json` (a
list of records) and `<out>.md` (a table with device, versions, date and this command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import (check_not_older, claim_output, commit, median_ms,  # noqa: E402
                                rel_l2)
from cca_jax.attention import cca_attention  # noqa: E402
from cca_jax.blocks import CCA  # noqa: E402


def _cca(impl):
    def run(q, k, v, g, s, n):
        return cca_attention(q, k, v, group_size=g, window_size=s, sink_tokens=n,
                             implementation=impl)
    return run


PALLAS_CONFIG: dict = {}   # KernelConfig overrides for cca_pallas_gpu (--pallas-config)


def _cca_pallas_gpu(q, k, v, g, s, n):
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu
    return cca_attention_pallas_gpu(q, k, v, group_size=g, window_size=s, sink_tokens=n,
                                    **PALLAS_CONFIG)


def _full_cudnn(q, k, v, g, s, n):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _cca_mosaic_gpu_fused_dq(q, k, v, g, s, n):
    """The Mosaic kernels with the fused backward (`MosaicBackwardConfig.fused_dq`): no dq
    kernel, dQ reduce-added by the key-side kernels."""
    from cca_jax.attention.pallas_mosaic_gpu import attention_mosaic_gpu
    return attention_mosaic_gpu(q, k, v, CCA(g, s, n), backward_tiling={"fused_dq": True})


IMPLS = {"cca_xla": _cca("xla"), "cca_pallas_gpu": _cca_pallas_gpu,
         "cca_mosaic_gpu": _cca("mosaic_gpu"), "cca_mosaic_gpu_fused_dq": _cca_mosaic_gpu_fused_dq,
         "full_cudnn": _full_cudnn}


def _memory_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
               + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def bench_one(name, q, k, v, g, s, n, ct, iters):
    impl = IMPLS[name]
    fwd = jax.jit(lambda q, k, v: impl(q, k, v, g, s, n))

    def loss(q, k, v, ct):   # ct an argument: closed over it would be a 2 GiB HLO constant
        return jnp.sum(impl(q, k, v, g, s, n).astype(jnp.float32) * ct.astype(jnp.float32))

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    rec = {}
    start = time.perf_counter()
    fwd_c = fwd.lower(q, k, v).compile()
    rec["fwd_compile_s"] = time.perf_counter() - start
    bwd_c = fwd_bwd.lower(q, k, v, ct).compile()
    rec["compile_s"] = time.perf_counter() - start
    print(f"  {name}: compiled in {rec['compile_s']:.1f} s (forward {rec['fwd_compile_s']:.1f})",
          flush=True)
    rec["fwd_mem_gib"] = (_memory_bytes(fwd_c) or 0) / 2**30
    rec["fwd_bwd_mem_gib"] = (_memory_bytes(bwd_c) or 0) / 2**30
    rec["fwd_ms"] = median_ms(fwd_c, (q, k, v), warmup=2, iters=iters)
    rec["fwd_bwd_ms"] = median_ms(bwd_c, (q, k, v, ct), warmup=2, iters=iters)
    return rec, fwd_c(q, k, v), bwd_c(q, k, v, ct)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="cca_mosaic_gpu,cca_pallas_gpu,cca_xla,full_cudnn")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--hkv", default="32,8")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--sink-tokens", type=int, default=0,
                    help="CCA's raw sink tokens (SPEC 6); 0 is the paper's CCA")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/attention_h200")
    ap.add_argument("--pallas-config", default=None,
                    help="JSON file of KernelConfig overrides for cca_pallas_gpu")
    args = ap.parse_args(argv)
    claim_output(args.out)
    if args.pallas_config:
        with open(args.pallas_config) as f:
            PALLAS_CONFIG.update(json.load(f))
    impls = args.impls.split(",")
    records = []
    for length in map(int, args.lengths.split(",")):
        for hkv in map(int, args.hkv.split(",")):
            key = jax.random.split(jax.random.key(length + hkv), 4)
            shape_q, shape_kv = (1, length, args.hq, args.d), (1, length, hkv, args.d)
            q = jax.random.normal(key[0], shape_q, jnp.bfloat16)
            k = jax.random.normal(key[1], shape_kv, jnp.bfloat16)
            v = jax.random.normal(key[2], shape_kv, jnp.bfloat16)
            # the output's cotangent in the output's dtype, as a model's o_proj hands it back
            # (float32 cost every backward here a 2 GiB conversion at 128K: 1 ms on the H100)
            ct = jax.random.normal(key[3], shape_q, jnp.bfloat16)
            cca_scores = CCA(args.g, args.s, args.sink_tokens).visible_scores(length)
            results = {}
            for name in impls:
                scores = length * (length + 1) // 2 if name.startswith("full") else cca_scores
                flops = 4 * scores * args.d * args.hq
                rec = {"impl": name, "L": length, "hq": args.hq, "hkv": hkv, "d": args.d,
                       "g": args.g, "s": args.s,
                       "sink_tokens": 0 if name.startswith("full") else args.sink_tokens,
                       "b": 1, "dtype": "bfloat16", "max_err": None}
                try:
                    timing, out, grads = bench_one(name, q, k, v, args.g, args.s,
                                                   args.sink_tokens, ct, args.iters)
                except Exception as e:  # record and go on: one failure must not lose the rest
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{name} L={length} hkv={hkv}: {rec['error']}", flush=True)
                    records.append(rec)
                    write_results(records, args, argv, quiet=True)
                    continue
                rec.update(timing)
                rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
                rec["fwd_bwd_tflops"] = 3.5 * flops / rec["fwd_bwd_ms"] / 1e9
                if name.startswith("cca"):
                    results[name] = (rec, out, grads)
                records.append(rec)
                print(json.dumps(rec), flush=True)
                write_results(records, args, argv, quiet=True)  # keep what is done so far
            _add_errors(results)
            write_results(records, args, argv, quiet=True)
    write_results(records, args, argv)


def _add_errors(results) -> None:
    """Errors of every CCA implementation against `cca_xla` (the reference), in place."""
    if "cca_xla" not in results:
        return
    _, ref_out, ref_grads = results["cca_xla"]
    for rec, out, grads in results.values():
        rec["max_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                               - ref_out.astype(jnp.float32))))
        rec["out_rel_l2_err"] = rel_l2(out, ref_out)
        # Largest |dx - dx_xla| over q, k, v, relative to max |dx_xla|; and relative L2.
        rec["max_grad_rel_err"] = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                  / jnp.max(jnp.abs(b.astype(jnp.float32))))
            for a, b in zip(grads, ref_grads))
        rec["grad_rel_l2_err"] = max(rel_l2(a, b) for a, b in zip(grads, ref_grads))
        print(f"  {rec['impl']} L={rec['L']} hkv={rec['hkv']}: max err {rec['max_err']:.3g}, "
              f"rel L2 {rec['out_rel_l2_err']:.3g}, grads rel L2 {rec['grad_rel_l2_err']:.3g}",
              flush=True)


def write_results(records, args, argv, quiet=False):
    dev = jax.devices()[0]
    meta = {"commit": commit(), "device": getattr(dev, "device_kind", str(dev)),
            "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/attention.py " + " ".join(argv or sys.argv[1:])}
    check_not_older(args.out)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump([{**r, **meta} for r in records], f, indent=1)
    lines = [f"# Attention benchmark ({meta['device']}, jax {meta['jax']}, {meta['date']})", "",
             f"Command: `{meta['command']}`" + (f" with `XLA_FLAGS={meta['xla_flags']}`"
                                                if meta["xla_flags"] else ""), "",
             f"B=1, D={args.d}, g={args.g}, s={args.s}, CCA sink tokens {args.sink_tokens}, "
             "bf16 (the output's cotangent too), causal. TFLOP/s count only visible scores "
             "(fwd+bwd = 3.5x fwd); x cuDNN = full_cudnn time / this time, same shape, same "
             "run; errors against cca_xla (output: max abs and relative L2; gradients of q, "
             "k, v: largest relative L2).", "",
             "| impl | L | Hq | Hkv | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s "
             "| x cuDNN fwd | x cuDNN fwd+bwd | fwd mem GiB | fwd+bwd mem GiB | max err "
             "| out rel L2 | grad rel L2 |",
             "|" + "---|" * 15]
    cudnn = {(r["L"], r["hkv"]): r for r in records
             if r["impl"] == "full_cudnn" and "error" not in r}

    def num(value, fmt):
        return "" if value is None else format(value, fmt)

    for r in records:
        head = f"| {r['impl']} | {r['L']} | {r['hq']} | {r['hkv']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:80]} |" + " |" * 10)
            continue
        base = cudnn.get((r["L"], r["hkv"]))
        lines.append(
            f"{head} {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['fwd_tflops']:.1f}"
            f" | {r['fwd_bwd_tflops']:.1f}"
            f" | {num(base and base['fwd_ms'] / r['fwd_ms'], '.2f')}"
            f" | {num(base and base['fwd_bwd_ms'] / r['fwd_bwd_ms'], '.2f')}"
            f" | {r['fwd_mem_gib']:.2f} | {r['fwd_bwd_mem_gib']:.2f}"
            f" | {num(r.get('max_err'), '.2e')} | {num(r.get('out_rel_l2_err'), '.2e')}"
            f" | {num(r.get('grad_rel_l2_err'), '.2e')} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
