"""Where the Mosaic GPU backward's time goes: each of its kernels timed alone, round-robin.

    python benchmarks/research/mosaic_backward_parts.py [--length 131072] [--hkv 8,32]
        [--sinks 0] [--backward-tilings '[{}, {"paired_scores": false}]']

On prepared inputs (q, k, v, the pooled slots and row bounds of `slots_and_bounds`, the
Mosaic forward's output and log2-sum-exp, a fixed cotangent; B = 1, Hq = 32, D = 128, CCA
g = 16, s = 1024, bf16), per backward tiling: the forward kernel, the backward's host side
(padding, delta, tables: `backward.backward_operands`; also its stats and its tables
alone; delta as a multiply-sum and as an einsum; the key tables' binary searches
unrolled and as a while loop), the dq kernel, the dk/dv kernel
(raw keys), the dck/dcv kernel (slots), and the whole backward (`mosaic_backward`). With
`--sinks N` the kernels run in the frame after the sinks, as the backend runs them. Every
program is compiled first, then all are timed one call each per round (median over
--rounds). TFLOP/s count each kernel's products over the scores its rows see: forward 2
(S, PV), dq 3 (S, dP, dS K), dk/dv and dck/dcv 4 (S^T, P^T dO, V dO^T, dS^T Q), over the
raw (key side: raw keys) or slot (slots) scores of `raw_lo, core_lo, core_hi`; with
`{"fused_dq": true}` (no dq kernel) the key-side kernels also make dQ, "dk/dv+dq" and
"dck/dcv+dq", 5 products each, and the backward 10 per score instead of 14. Writes
`<out>.json` (stamped records) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax, pallas_kernels
from benchmarks.measure import claim_output, round_robin, stamp, write_results  # noqa: E402
from cca_jax.attention.pallas_mosaic_gpu import kernel_lead_rows  # noqa: E402
from cca_jax.attention.pooling import slots_and_bounds  # noqa: E402
from cca_jax.blocks import CCA, sinks_as_slots  # noqa: E402


def _visible(raw_lo, core_lo, core_hi) -> tuple[int, int]:
    """(raw, slot) scores the rows see, per query head and batch row."""
    rows = jnp.arange(raw_lo.shape[-1])
    raw = jnp.sum((rows - raw_lo + 1).astype(jnp.float32))
    core = jnp.sum((core_hi - core_lo).astype(jnp.float32))
    return int(raw), int(core)


def _pool_cca_einsum(q_last, k_members, v_members):
    """The library's pooling before 2026-12-05, as einsums (batched products of 16 x 128
    tiles, operands materialized): the baseline the multiply-sums replaced. -> [b, m, h, G, d]"""
    logits = jnp.einsum("bmhgd,bmuhd->bmhgu", q_last, k_members,
                        preferred_element_type=jnp.float32) / q_last.shape[-1] ** 0.5
    a = jax.nn.softmax(logits, axis=-1)
    return (jnp.einsum("bmhgu,bmuhd->bmhgd", a, k_members.astype(jnp.float32)),
            jnp.einsum("bmhgu,bmuhd->bmhgd", a, v_members.astype(jnp.float32)))


def _pooling_programs(pattern) -> dict:
    """part -> jitted fn of (q, k, v, dck, dcv): the slots of `slots_and_bounds` (`pooling`),
    and with their vjp to q, k, v (`pooling+vjp`), as the library pools them (multiply-sums,
    `mulsum`) and as einsums (`_pool_cca_einsum`; sinks: copies of the first rows, as the
    library's)."""
    from cca_jax.attention import pooling as pl_mod

    def slots(variant):
        def fn(q, k, v):
            if variant == "mulsum":
                return tuple(pl_mod.slots_and_bounds(q, k, v, pattern)[:2])
            lead, g = pattern.lead_slots, pattern.slot_size
            m = pattern.max_slots(q.shape[1], packed=False) - lead
            b, _, hq, d = q.shape
            hkv = k.shape[2]
            km, vm = (x[:, lead: lead + m * g].reshape(b, m, g, hkv, d) for x in (k, v))
            q_last = q[:, lead + g - 1: lead + m * g: g].reshape(b, m, hkv, hq // hkv, d)
            ck, cv = (x.reshape(b, m, hq, d) for x in _pool_cca_einsum(q_last, km, vm))
            if lead:
                groups = hq // hkv
                ck = jnp.concatenate([jnp.repeat(k[:, :lead], groups, axis=2), ck], axis=1)
                cv = jnp.concatenate([jnp.repeat(v[:, :lead], groups, axis=2), cv], axis=1)
            return ck.astype(k.dtype), cv.astype(v.dtype)
        return fn

    parts = {}
    for variant in ("einsum", "mulsum"):
        fn = slots(variant)
        parts[f"pooling[{variant}]"] = jax.jit(lambda q, k, v, dck, dcv, fn=fn: fn(q, k, v))

        def with_vjp(q, k, v, dck, dcv, fn=fn):
            out, pull = jax.vjp(fn, q, k, v)
            return out, pull((dck, dcv))
        parts[f"pooling+vjp[{variant}]"] = jax.jit(with_vjp)
    return parts


def _delta_programs() -> dict:
    """part -> jitted fn of the backward's inputs: delta = rowsum(dO * O) `[B, Hq, L]` as the
    library computes it (`padding.softmax_delta`, a multiply-sum then a transpose) and as the
    einsum it was before 2026-12-06 (a dot with one batch per row and head)."""
    from cca_jax.padding import softmax_delta

    def einsum(*a):
        out, dout = a[-3], a[-1]
        return jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    return {"delta[mulsum]": jax.jit(lambda *a: softmax_delta(a[-1], a[-3])),
            "delta[einsum]": jax.jit(einsum)}


def _search_programs(cfg) -> dict:
    """part -> jitted fn of the backward's inputs: the key-side tables' binary searches (the
    last row that sees each key block's first and last key, per CTA's keys) as the library
    runs them (`blocks.raw_key_rows`, unrolled) and as a while loop (jnp's default before
    2026-12-06)."""
    from cca_jax.blocks import raw_key_rows
    from pallas_kernels.mosaic_gpu.config import KEY_ROWS

    def block_edges(raw_lo):
        step = KEY_ROWS * cfg.compute_wgs
        x0 = jnp.arange(raw_lo.shape[1] // step, dtype=jnp.int32) * step
        return jnp.concatenate([x0, x0 + step - 1])

    def unrolled(*a):
        return raw_key_rows(a[5], block_edges(a[5]))

    def while_loop(*a):
        keys = block_edges(a[5])
        return jax.vmap(lambda lo: jnp.searchsorted(lo, keys, side="right") - 1)(a[5])
    return {"search[unrolled]": jax.jit(unrolled), "search[while]": jax.jit(while_loop)}


def _programs(cfg, interpret=None, lead: int = 0) -> dict:
    """part -> jitted fn of (q, k, v, ck, cv, raw_lo, core_lo, core_hi, out, lse, dout);
    `lead`: the forward's lead rows (CCA's sinks in the frame after them)."""
    from pallas_kernels.mosaic_gpu import backward as bw

    def operands(*a):
        return bw.backward_operands(*a, cfg, lead, interpret is not None)

    def host_part(*fields):
        """Only these fields of the host side (the rest is dead code to XLA)."""
        return lambda *a: tuple(getattr(operands(*a), f) for f in fields)
    parts = {
        "host": operands,
        "host[stats]": host_part("stats"),                 # delta = rowsum(dO O), with lse
        "host[query tables]": host_part("query_tables"),
        "host[key tables]": host_part("raw_tables", "slot_tables"),
        "dq": lambda *a: bw.query_grads(operands(*a), cfg, interpret, lead),
        "dk/dv": lambda *a: bw.keys_and_values(operands(*a), "raw", cfg, interpret, lead),
        "dck/dcv": lambda *a: bw.keys_and_values(operands(*a), "core", cfg, interpret, lead),
        "backward": lambda *a: bw.mosaic_backward(*a, cfg, interpret=interpret, lead=lead),
    }
    if cfg.fused_dq:   # no dq kernel: each key-side kernel adds dQ into a zeroed accumulator
        for part in ("dq", "dk/dv", "dck/dcv"):
            del parts[part]

        def fused(kind):
            def fn(*a):
                ops = operands(*a)
                return bw.keys_values_and_dq(ops, kind, jnp.zeros(ops.q.shape, jnp.float32),
                                             cfg, interpret, lead)
            return fn
        parts["dk/dv+dq"], parts["dck/dcv+dq"] = fused("raw"), fused("core")
    # Under the GPU interpreter the kernels run op by op: jitted with the host side in one
    # program (two consumer warpgroups) they hang on a 2-core CPU, their simulated threads
    # starving the program's thread pool (pallas_kernels/mosaic_gpu/NOTES.md).
    return {name: fn if interpret is not None and not name.startswith("host") else
            jax.jit(fn) for name, fn in parts.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--hkv", default="8,32")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backward-tilings", default='[{}, {"paired_scores": false}]',
                    help="JSON list of MosaicBackwardConfig overrides, each timed")
    ap.add_argument("--interpret", action="store_true",
                    help="run the kernels in jax's GPU interpreter (a CPU check; tiny shapes)")
    ap.add_argument("--out", default="benchmarks/results/research/mosaic_backward_parts_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    from pallas_kernels.mosaic_gpu.interpret import interpret_params
    interpret = interpret_params(args.interpret or None)
    from pallas_kernels.mosaic_gpu.api import _forward
    from pallas_kernels.mosaic_gpu.config import mosaic_backward_config, mosaic_config
    pattern = CCA(args.g, args.s, args.sinks)
    fwd_cfg = mosaic_config(head_dim=args.d)
    base = stamp(argv)
    records, calls, inputs_of = [], {}, {}
    for hkv in map(int, args.hkv.split(",")):
        keys = jax.random.split(jax.random.key(hkv), 4)
        q = jax.random.normal(keys[0], (1, args.length, args.hq, args.d), jnp.bfloat16)
        k, v = (jax.random.normal(x, (1, args.length, hkv, args.d), jnp.bfloat16)
                for x in keys[1:3])
        ck, cv, *bounds = jax.jit(lambda q, k, v: slots_and_bounds(q, k, v, pattern))(q, k, v)
        lead = kernel_lead_rows(pattern, args.length, False)   # as the backend
        if lead:
            bounds = sinks_as_slots(pattern, *bounds)
        bounds = [b.astype(jnp.int32) for b in bounds]
        forward = lambda *a: _forward(*a, fwd_cfg, interpret, lead)  # noqa: E731
        if interpret is None:   # op by op under the interpreter: see `_programs`
            forward = jax.jit(forward)
        fwd_inputs = (q, k, v, ck, cv, *bounds)
        out, lse = forward(*fwd_inputs)
        dout = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
        bwd_inputs = jax.block_until_ready((q, k, v, ck, cv, *bounds, out, lse, dout))
        raw, core = _visible(*(b[0] for b in bounds))
        flops = {"forward": 4 * (raw + core), "dq": 6 * (raw + core), "dk/dv": 8 * raw,
                 "dck/dcv": 8 * core, "backward": 14 * (raw + core),
                 "dk/dv+dq": 10 * raw, "dck/dcv+dq": 10 * core,
                 "backward[fused]": 10 * (raw + core)}
        tilings = [("forward", "", forward, fwd_inputs)]
        dck, dcv = (jax.random.normal(x, ck.shape, ck.dtype)
                    for x in jax.random.split(keys[3], 2))
        tilings += [(part, "", fn, (q, k, v, dck, dcv))
                    for part, fn in _pooling_programs(pattern).items()]
        tilings += [(part, "", fn, bwd_inputs) for part, fn in _delta_programs().items()]
        tilings += [(part, "", fn, bwd_inputs) for part, fn in
                    _search_programs(mosaic_backward_config(head_dim=args.d)).items()]
        for tiling in json.loads(args.backward_tilings):
            cfg = mosaic_backward_config(head_dim=args.d, **tiling)
            label = ",".join(f"{k}={v}" for k, v in sorted(tiling.items()))
            tilings += [(part, label, fn, bwd_inputs)
                        for part, fn in _programs(cfg, interpret, lead).items()]
        for part, label, fn, inputs in tilings:
            key = (hkv, part, label)
            rec = dict(base, part=part, backward_tiling=label, L=args.length, hq=args.hq,
                       hkv=hkv, d=args.d, g=args.g, s=args.s, sink_tokens=args.sinks, b=1,
                       dtype="bfloat16")
            counted = "backward[fused]" if part == "backward" and "fused_dq=True" in label \
                else part
            rec["flops"] = flops.get(counted, 0) * args.d * args.hq
            try:
                calls[key] = (fn.lower(*inputs).compile() if hasattr(fn, "lower") else fn,
                              inputs)
            except Exception as e:  # noqa: BLE001  (record and go on)
                rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"{key}: {rec['error']}", flush=True)
            records.append(rec)
    medians = round_robin(calls, args.rounds)
    rows = ["| Hkv | part | backward tiling | ms | TFLOP/s |", "| --- | --- | --- | --- | --- |"]
    for rec in records:
        key = (rec["hkv"], rec["part"], rec["backward_tiling"])
        if key not in medians:
            rows.append(f"| {key[0]} | {key[1]} | {key[2]} | error | |")
            continue
        rec["ms"] = medians[key]
        rec["tflops"] = rec["flops"] / rec["ms"] / 1e9 if rec["flops"] else None
        tf = f"{rec['tflops']:.0f}" if rec["tflops"] else ""
        rows.append(f"| {key[0]} | {key[1]} | {key[2] or 'defaults'} | {rec['ms']:.2f} | {tf} |")
    header = (f"The Mosaic GPU backward by kernel, round-robin in one process: L = {args.length}, "
              f"Hq = {args.hq}, D = {args.d}, CCA g = {args.g}, s = {args.s}, "
              f"sinks = {args.sinks}, bf16, B = 1; {base['device']}, jax {base['jax']}, "
              f"{base['date']}, commit {base['commit']}\nCommand: `{base['command']}`\n\n")
    write_results(args.out, records, header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
