"""On the H200: launch order (heavy first or not) and two 2-CTA-per-SM forward tilings.

    python benchmarks/research/pallas_gpu_variants.py [--lengths 131072,32768] [--budget-s 240] \
        > records.jsonl

Per length (Hq = Hkv = 32, D = 128, g = 16, s = 1024, bf16, default tiling):
- the forward, dq and dck/dcv kernels alone with the heavy-first launch order off and on
  (KernelConfig `forward_heavy_first`, `dq_heavy_first`, `dcore_heavy_first`; the outputs
  must be bit-identical: only the order of the CTAs changes);
- the forward with 64 x 64 tiles, 4 warps, 3 and 2 stages (112 and 80 KiB of shared memory:
  two CTAs fit an SM, so one's softmax can overlap the other's matmuls);
- the XLA pooling alone, forward and forward+backward (what the end-to-end time adds).
One JSON record per line; on a CPU a tiny smoke run in interpret mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks import pallas_gpu_sweep as S  # noqa: E402
from benchmarks.measure import median_ms  # noqa: E402
from cca_jax import blocks  # noqa: E402
from cca_jax.attention.pooling import pool_core_tokens  # noqa: E402
from pallas_kernels.gpu import kernel_config  # noqa: E402
from pallas_kernels.gpu import kernels as K  # noqa: E402

TWO_PER_SM_TILINGS = [(64, 64, 4, 3), (64, 64, 4, 2)]


def _ordered(cfg, heavy_first: bool):
    return cfg._replace(forward_heavy_first=heavy_first, dq_heavy_first=heavy_first,
                        dcore_heavy_first=heavy_first)


def launch_order(length, hq, hkv, d, g, s, base):
    """Forward, dq and dck/dcv alone, heavy first off and on."""
    padded, ct = S.kernel_inputs(length, hq, hkv, d, g, s, base)
    backward = S.backward_kernels(padded, ct, base)   # the order is read when a kernel traces
    kernels = {"fwd": (K._forward, padded), "dq": backward["dq"], "dc": backward["dc"]}
    outputs = {}
    for heavy_first in (False, True):
        cfg = _ordered(base, heavy_first)
        for name, (fn, args) in kernels.items():
            rec = {"what": "launch_order", "L": length, "kernel": name,
                   "heavy_first": heavy_first}
            try:
                f = jax.jit(lambda *a, fn=fn, cfg=cfg: fn(*a, cfg))
                out = jax.block_until_ready(f(*args))
                if name in outputs:   # same math in another CTA order: bit-identical
                    rec["max_diff_vs_other_order"] = max(
                        S.rel(x, y)[1] for x, y in zip(jax.tree.leaves(out),
                                                       jax.tree.leaves(outputs[name])))
                outputs[name] = out
                rec["ms"] = median_ms(f, args)
            except Exception as e:  # noqa: BLE001  (record and go on)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            S.log(rec)
    return padded


def forward_tilings(length, hq, d, g, s, base, padded, tilings):
    scores = blocks.CCA(g, s).visible_scores(length)
    for bq, bk, w, st in tilings:
        cfg = base._replace(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
        rec = {"what": "forward_tiling", "L": length, "cfg": [bq, bk, w, st]}
        try:
            f = jax.jit(lambda *a, cfg=cfg: K._forward(*a, cfg))
            rec["ms"] = median_ms(f, padded)
            rec["tflops"] = 4 * d * hq * scores / rec["ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        S.log(rec)


def pooling(length, hq, hkv, d, g, s):
    q, k, v, _ = S.inputs(3, 1, length, hq, hkv, d)
    m = blocks.num_pooled_groups(length, g, s)

    def pool(q, k, v):
        return pool_core_tokens(q, k, v, group_size=g, num_groups=m)

    def loss(q, k, v):
        ck, cv = pool(q, k, v)
        return jnp.sum(ck.astype(jnp.float32)) + jnp.sum(cv.astype(jnp.float32))
    rec = {"what": "pooling", "L": length, "hkv": hkv}
    rec["fwd_ms"] = median_ms(jax.jit(pool), (q, k, v))
    rec["fwd_bwd_ms"] = median_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v))
    S.log(rec)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="131072,32768")
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args(argv)
    cpu = jax.default_backend() == "cpu"     # interpret mode: a tiny smoke run of the script
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}),
          flush=True)
    for length in ([512] if cpu else map(int, args.lengths.split(","))):
        if time.time() - S.T0 > args.budget_s:
            S.log({"L": length, "skipped": "budget"})
            continue
        hq, hkv, d, g, s = (2, 2, 64, 4, 40) if cpu else (32, 32, 128, 16, 1024)
        base = kernel_config(interpret=cpu)
        padded = launch_order(length, hq, hkv, d, g, s, base)
        tilings = [(32, 32, 4, 2)] if cpu else TWO_PER_SM_TILINGS
        forward_tilings(length, hq, d, g, s, base, padded, tilings)
        pooling(length, hq, hkv, d, g, s)


if __name__ == "__main__":
    main()
