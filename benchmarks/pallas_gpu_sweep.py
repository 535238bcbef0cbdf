"""On the H200: check the Pallas GPU CCA kernels against `xla` and tune their tiling.

    python benchmarks/pallas_gpu_sweep.py [--out DIR] [--budget-s 300] [--small]

1. correctness: pallas_gpu vs cca_xla (outputs and q/k/v grads; relative L2 and max abs)
   at several shapes up to L = 131072, packed segment_ids and a ragged L included;
2. forward sweep at L=131072, Hq=Hkv=32, D=128, g=16, s=1024 over (block_q, block_k, warps,
   stages); per-loop times (raw loop alone: the same kernel with no core token visible);
3. backward sweep: each backward kernel (dq, dk/dv, dck/dcv) timed alone per config;
4. forward+backward with the best of each; writes DIR/pallas_gpu_best.json (KernelConfig
   overrides) and DIR/pallas_gpu_sweep.json (every measurement).
Every step is guarded by the time budget; a failing config is recorded and skipped.
`--small` runs tiny shapes (CPU, interpret mode) to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import claim_output, median_ms, rel_l2, stamp  # noqa: E402
from cca_jax.attention import cca_attention_xla  # noqa: E402
from cca_jax.attention.pooling import core_tokens_and_bounds  # noqa: E402
from cca_jax import blocks  # noqa: E402
from cca_jax.padding import softmax_delta  # noqa: E402
from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu  # noqa: E402
from pallas_kernels.gpu import kernel_config  # noqa: E402
from pallas_kernels.gpu import kernels as K  # noqa: E402

T0 = time.time()
RECORDS: list[dict] = []


def log(rec: dict) -> None:
    rec["t"] = round(time.time() - T0, 1)
    RECORDS.append(rec)
    print(json.dumps(rec), flush=True)


def raw_scores(length: int, g: int, s: int) -> int:
    t = np.arange(length, dtype=np.int64)
    return int(np.sum(t - g * blocks.n_core(t, g, s) + 1))


def inputs(seed, b, length, hq, hkv, d, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, length, hq, d), dtype)
    k = jax.random.normal(ks[1], (b, length, hkv, d), dtype)
    v = jax.random.normal(ks[2], (b, length, hkv, d), dtype)
    ct = jax.random.normal(ks[3], (b, length, hq, d), dtype)
    return q, k, v, ct


def rel(a, b):
    """(relative L2, max abs) of a against b."""
    return rel_l2(a, b), float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def grads_fn(fn, ct):
    """jit(grad) of sum(fn(q, k, v) * ct); ct goes in as an argument: closed over, XLA would
    embed it as a constant of L * Hq * D elements (minutes of GPU compile at 128K)."""
    grad = jax.jit(jax.grad(lambda q, k, v, ct: jnp.sum(fn(q, k, v).astype(jnp.float32)
                                                        * ct.astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    return lambda q, k, v: grad(q, k, v, ct)


# ---- 1. correctness --------------------------------------------------------------------------

def check(shapes, interpret, budget):
    for (b, length, hq, hkv, d, g, s, packed) in shapes:
        if time.time() - T0 > budget:
            log({"step": "check", "skipped": "budget", "L": length})
            continue
        q, k, v, ct = inputs(length + hkv, b, length, hq, hkv, d)
        seg = None
        if packed:
            seg = jnp.asarray(np.repeat(np.arange(3), [length // 3, length // 2,
                                                       length - length // 3 - length // 2]
                                        )[None].repeat(b, 0), jnp.int32)
        kw = dict(group_size=g, window_size=s, segment_ids=seg)
        pal = lambda q, k, v: cca_attention_pallas_gpu(q, k, v, interpret=interpret, **kw)  # noqa: E731
        xla = lambda q, k, v: cca_attention_xla(q, k, v, **kw)  # noqa: E731
        rec = {"step": "check", "b": b, "L": length, "hq": hq, "hkv": hkv, "d": d, "g": g,
               "s": s, "packed": packed}
        try:
            o1 = jax.jit(pal)(q, k, v)
            o2 = jax.jit(xla)(q, k, v)
            rec["out_rel"], rec["out_max"] = rel(o1, o2)
            rec["out_finite"] = bool(jnp.all(jnp.isfinite(o1.astype(jnp.float32))))
            del o1, o2
            g1 = grads_fn(pal, ct)(q, k, v)
            g2 = grads_fn(xla, ct)(q, k, v)
            for name, a, bb in zip("qkv", g1, g2):
                rec[f"d{name}_rel"], rec[f"d{name}_max"] = rel(a, bb)
            del g1, g2
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        log(rec)


# ---- 2./3. per-kernel timing -------------------------------------------------------------------

def kernel_inputs(length, hq, hkv, d, g, s, cfg):
    q, k, v, ct = inputs(1, 1, length, hq, hkv, d)
    prepared = core_tokens_and_bounds(q, k, v, group_size=g, window_size=s, pooling="cca")
    return K._padded(q, k, v, *prepared, cfg), ct


def backward_kernels(padded, ct, cfg):
    """{"dq" | "dkv" | "dc": (kernel, its inputs)}: each backward kernel's arguments (all
    but the config) from the padded forward inputs, the forward's lse and cotangent `ct`."""
    qp, kp, vp, ckp, cvp, rlo, clo, chi = padded
    out, lse = jax.jit(lambda *a: K._forward(*a, cfg))(*padded)
    do = ct.astype(qp.dtype)
    delta = softmax_delta(do, out)
    last_row = blocks.raw_key_rows(rlo)
    first_row, end_row = blocks.core_slot_rows(clo, chi, ckp.shape[1])
    return {"dq": (K._dq, (qp, kp, vp, ckp, cvp, do, lse, delta, rlo, clo, chi)),
            "dkv": (K._dkv, (qp, kp, vp, do, lse, delta, rlo, last_row)),
            "dc": (K._dcore, (qp, ckp, cvp, do, lse, delta, clo, chi, first_row, end_row))}


def sweep(length, hq, hkv, d, g, s, interpret, budget, fwd_cfgs, bwd_cfgs):
    scores = blocks.CCA(g, s).visible_scores(length)
    raw = raw_scores(length, g, s)
    flop = 4 * d * hq
    best_fwd, best = None, {}
    base = kernel_config(interpret=interpret)
    padded, ct = kernel_inputs(length, hq, hkv, d, g, s, base)
    qp, kp, vp, ckp, cvp, rlo, clo, chi = padded
    no_core = jnp.zeros_like(clo)
    for (bq, bk, w, st) in fwd_cfgs:
        if time.time() - T0 > budget:
            log({"step": "fwd", "skipped": "budget", "cfg": [bq, bk, w, st]})
            continue
        cfg = base._replace(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
        rec = {"step": "fwd", "L": length, "hkv": hkv, "cfg": [bq, bk, w, st]}
        try:
            f = jax.jit(lambda *a, cfg=cfg: K._forward(*a, cfg))
            rec["ms"] = median_ms(f, padded)
            rec["raw_only_ms"] = median_ms(f, (qp, kp, vp, ckp, cvp, rlo, no_core, no_core))
            rec["core_ms"] = rec["ms"] - rec["raw_only_ms"]
            rec["tflops"] = flop * scores / rec["ms"] / 1e9
            rec["raw_tflops"] = flop * raw / rec["raw_only_ms"] / 1e9
            rec["core_tflops"] = flop * (scores - raw) / max(rec["core_ms"], 1e-3) / 1e9
            if best_fwd is None or rec["ms"] < best_fwd[1]:
                best_fwd = ((bq, bk, w, st), rec["ms"])
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        log(rec)
    if best_fwd is not None:
        bq, bk, w, st = best_fwd[0]
        best.update(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
    # Backward kernels alone, on the forward's lse.
    cfg0 = base._replace(**best) if best else base
    n_scores_of = {"dq": scores, "dkv": raw, "dc": scores - raw}
    prefix = {"dq": "dq_", "dkv": "dkv_", "dc": "dc_"}
    for name, (kernel, args) in backward_kernels(padded, ct, cfg0).items():
        n_scores = n_scores_of[name]
        best_k = None
        for (b1, b2, w, st) in bwd_cfgs[name]:
            if time.time() - T0 > budget:
                log({"step": name, "skipped": "budget", "cfg": [b1, b2, w, st]})
                continue
            p = prefix[name]
            if name == "dq":
                fields = {p + "block_q": b1, p + "block_k": b2}
            else:
                fields = {p + "block_k": b1, p + "block_q": b2}
            fields.update({p + "num_warps": w, p + "num_stages": st})
            cfg = cfg0._replace(**fields)
            rec = {"step": name, "L": length, "hkv": hkv, "cfg": [b1, b2, w, st]}
            try:
                rec["ms"] = median_ms(jax.jit(lambda *a, cfg=cfg: kernel(*a, cfg)), args)
                # dq: 3 matmuls per score; dk/dv and dck/dcv: 4 (s, dp recomputed, dv, dk).
                mm = 3 if name == "dq" else 4
                rec["tflops"] = 2 * d * hq * mm * n_scores / rec["ms"] / 1e9
                if best_k is None or rec["ms"] < best_k[1]:
                    best_k = (fields, rec["ms"])
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(rec)
        if best_k is not None:
            best.update(best_k[0])
    return best


def end_to_end(length, hq, hkv, d, g, s, interpret, best, budget):
    if time.time() - T0 > budget:
        log({"step": "e2e", "skipped": "budget"})
        return None
    q, k, v, ct = inputs(2, 1, length, hq, hkv, d)
    kw = dict(group_size=g, window_size=s, interpret=interpret, **best)
    fn = lambda q, k, v: cca_attention_pallas_gpu(q, k, v, **kw)  # noqa: E731
    rec = {"step": "e2e", "L": length, "hkv": hkv, "cfg": best}
    try:
        rec["fwd_ms"] = median_ms(jax.jit(fn), (q, k, v))
        rec["fwd_bwd_ms"] = median_ms(grads_fn(fn, ct), (q, k, v))
        flop = 4 * d * hq * blocks.CCA(g, s).visible_scores(length)
        rec["fwd_tflops"] = flop / rec["fwd_ms"] / 1e9
        rec["fwd_bwd_tflops"] = 3.5 * flop / rec["fwd_bwd_ms"] / 1e9
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    log(rec)
    return rec.get("fwd_bwd_ms")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--small", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--tune-only", action="store_true",
                    help="stop after writing the best config (no end-to-end, no L=131072 check)")
    args = ap.parse_args(argv)
    for name in ("pallas_gpu_best", "pallas_gpu_sweep"):
        claim_output(os.path.join(args.out, name), suffixes=(".json",))
    interpret = jax.default_backend() == "cpu"
    budget = args.budget_s
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    if args.small:
        shapes = [(1, 300, 4, 2, 64, 4, 40, False), (2, 257, 2, 1, 64, 4, 30, True)]
        sweep_shape = (256, 2, 2, 64, 4, 40)
        fwd_cfgs = [(32, 16, 4, 2), (64, 32, 4, 2)]
        bwd = [(32, 16, 4, 2), (16, 32, 4, 2)]
    else:
        shapes = [(1, 8192, 32, 8, 128, 16, 1024, False),
                  (2, 5000, 8, 2, 64, 16, 1000, True),
                  (1, 131072, 32, 8, 128, 16, 1024, False)]
        sweep_shape = (131072, 32, 32, 128, 16, 1024)
        # Only configs that compile without spills within 227 KiB (offline ptxas check).
        fwd_cfgs = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 8, 2)]
        bwd = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 8, 2), (128, 32, 8, 3)]
    bwd_cfgs = {"dq": bwd, "dkv": bwd, "dc": bwd}
    if not args.skip_check:
        check(shapes[:-1], interpret, budget * 0.3)
    best = sweep(*sweep_shape, interpret, budget * 0.75, fwd_cfgs, bwd_cfgs)
    log({"step": "best", "cfg": best})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pallas_gpu_best.json"), "w") as f:
        json.dump(best, f, indent=1)
    length, hq, hkv, d, g, s = sweep_shape
    if args.tune_only:
        budget = 0.0
    end_to_end(length, hq, hkv, d, g, s, interpret, best, budget * 0.85)
    end_to_end(length, hq, 8 if hq % 8 == 0 else 1, d, g, s, interpret, best, budget * 0.85)
    if not args.skip_check:
        check(shapes[-1:], interpret, budget * 0.9)
    with open(os.path.join(args.out, "pallas_gpu_sweep.json"), "w") as f:
        json.dump({**stamp(), "records": RECORDS}, f, indent=1)
    print("\nstep  L  hkv  cfg  ms  TFLOP/s  (extra)")
    for r in RECORDS:
        if r["step"] in ("fwd", "dq", "dkv", "dc", "e2e", "best"):
            print(r["step"], r.get("L", ""), r.get("hkv", ""), r.get("cfg", ""),
                  *(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in r.items() if k not in ("step", "L", "hkv", "cfg", "t")))


if __name__ == "__main__":
    main()
