"""On the H200: split loops vs one loop with a branched edge mask, per Pallas GPU kernel.

    python benchmarks/pallas_gpu_loop_styles.py [--lengths 32768,131072] > records.jsonl

Each kernel walks its key (or query) blocks either as three loops (masked edge, unmasked
middle, masked edge: `_split_loops`) or as one loop whose edge iterations mask behind a
uniform branch (`_cond_loops`). For both styles, applied to every kernel, this times the
forward (and its raw-window loop alone) and each backward kernel at Hq = Hkv = 32, D = 128,
g = 16, s = 1024, bf16, with the default tiling; at L < 131072 also a few other forward
tilings (split loops). One JSON record per line. The defaults in `kernels.py` follow it.
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
from benchmarks import pallas_gpu_sweep as S  # noqa: E402
from benchmarks.measure import median_ms  # noqa: E402
from cca_jax import blocks  # noqa: E402
from pallas_kernels.gpu import kernel_config  # noqa: E402
from pallas_kernels.gpu import kernels as K  # noqa: E402

OTHER_FORWARD_TILINGS = [(128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 128, 4, 2)]


def _use(loops) -> None:
    K._FORWARD_LOOPS = K._DQ_LOOPS = K._KEY_LOOPS = loops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    args = ap.parse_args(argv)
    cpu = jax.default_backend() == "cpu"     # interpret mode: a tiny smoke run of the script
    defaults = (K._FORWARD_LOOPS, K._DQ_LOOPS, K._KEY_LOOPS)
    start = time.time()
    for length in ([512] if cpu else map(int, args.lengths.split(","))):
        hq, hkv, d, g, s = (2, 2, 64, 4, 40) if cpu else (32, 32, 128, 16, 1024)
        base = kernel_config(g, s, d, interpret=cpu)
        padded, ct = S.kernel_inputs(length, hq, hkv, d, g, s, base)
        qp, kp, vp, ckp, cvp, rlo, clo, chi = padded
        no_core = jnp.zeros_like(clo)
        scores = blocks.visible_score_count(length, g, s)
        raw = S.raw_scores(length, g, s)
        out = jax.jit(lambda *a: K._forward(*a, base))(*padded)[0]
        backward = S.backward_kernels(padded, ct, base)
        runs = [("split", K._split_loops, (128, 128, 8, 3)),
                ("cond", K._cond_loops, (128, 128, 8, 3))]
        if length < 131072:
            runs += [("split", K._split_loops, c)
                     for c in (OTHER_FORWARD_TILINGS[:1] if cpu else OTHER_FORWARD_TILINGS)]
        for style, loops, (bq, bk, w, st) in runs:
            _use(loops)
            cfg = base._replace(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
            rec = {"L": length, "loops": style, "cfg": [bq, bk, w, st]}
            try:
                f = jax.jit(lambda *a, cfg=cfg: K._forward(*a, cfg))
                rec["max_diff"] = float(jnp.max(jnp.abs(f(*padded)[0].astype(jnp.float32)
                                                        - out.astype(jnp.float32))))
                rec["ms"] = median_ms(f, padded)
                rec["raw_only_ms"] = median_ms(f, (qp, kp, vp, ckp, cvp, rlo, no_core,
                                                     no_core))
                rec["tflops"] = 4 * d * hq * scores / rec["ms"] / 1e9
                rec["raw_tflops"] = 4 * d * hq * raw / rec["raw_only_ms"] / 1e9
                if cfg == base:
                    for name, (fn, fn_args) in backward.items():
                        rec[name + "_ms"] = median_ms(
                            jax.jit(lambda *a, fn=fn: fn(*a, base)), fn_args)
            except Exception as e:  # noqa: BLE001  (record and go on)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rec["t"] = round(time.time() - start, 1)
            print(json.dumps(rec), flush=True)
    K._FORWARD_LOOPS, K._DQ_LOOPS, K._KEY_LOOPS = defaults


if __name__ == "__main__":
    main()
