"""On the H200: split loops vs one loop with a branched edge mask, per Pallas GPU kernel.

    python benchmarks/research/pallas_gpu_loop_styles.py [--lengths 32768,131072] > records.jsonl

Each kernel walks its key (or query) blocks either as three loops (masked edge, unmasked
middle, masked edge: loop style "split") or as one loop whose edge iterations mask behind a
uniform branch ("cond"; `kernels.LOOP_STYLES`, chosen per kernel by the KernelConfig fields
`forward_loop_style`, `dq_loop_style`, `key_loop_style`). For both styles, applied to every
kernel, this times the forward (and its raw-window loop alone) and each backward kernel at
Hq = Hkv = 32, D = 128, g = 16, s = 1024, bf16, with the default tiling; at L < 131072 also a
few other forward tilings (split loops). One JSON record per line; on a CPU a tiny smoke run in
interpret mode. The KernelConfig defaults follow it.
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
from pallas_kernels.gpu import kernel_config  # noqa: E402
from pallas_kernels.gpu import kernels as K  # noqa: E402

OTHER_FORWARD_TILINGS = [(128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 128, 4, 2)]


def _styled(cfg, style: str, tiling):
    """cfg with every kernel walking its blocks in `style`, the forward tiled as `tiling`."""
    bq, bk, w, st = tiling
    return cfg._replace(block_q=bq, block_k=bk, num_warps=w, num_stages=st,
                        forward_loop_style=style, dq_loop_style=style, key_loop_style=style)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    args = ap.parse_args(argv)
    cpu = jax.default_backend() == "cpu"     # interpret mode: a tiny smoke run of the script
    start = time.time()
    for length in ([512] if cpu else map(int, args.lengths.split(","))):
        hq, hkv, d, g, s = (2, 2, 64, 4, 40) if cpu else (32, 32, 128, 16, 1024)
        base = kernel_config(interpret=cpu)
        padded, ct = S.kernel_inputs(length, hq, hkv, d, g, s, base)
        qp, kp, vp, ckp, cvp, rlo, clo, chi = padded
        no_core = jnp.zeros_like(clo)
        scores = blocks.CCA(g, s).visible_scores(length)
        raw = S.raw_scores(length, g, s)
        out = jax.jit(lambda *a: K._forward(*a, base))(*padded)[0]
        backward = S.backward_kernels(padded, ct, base)   # inputs only: styles read at trace
        default_tiling = (128, 128, 8, 3)
        runs = [("split", default_tiling), ("cond", default_tiling)]
        if length < 131072:
            runs += [("split", c)
                     for c in (OTHER_FORWARD_TILINGS[:1] if cpu else OTHER_FORWARD_TILINGS)]
        for style, tiling in runs:
            cfg = _styled(base, style, tiling)
            rec = {"L": length, "loops": style, "cfg": list(tiling)}
            try:
                f = jax.jit(lambda *a, cfg=cfg: K._forward(*a, cfg))
                rec["max_diff"] = float(jnp.max(jnp.abs(f(*padded)[0].astype(jnp.float32)
                                                        - out.astype(jnp.float32))))
                rec["ms"] = median_ms(f, padded)
                rec["raw_only_ms"] = median_ms(f, (qp, kp, vp, ckp, cvp, rlo, no_core,
                                                     no_core))
                rec["tflops"] = 4 * d * hq * scores / rec["ms"] / 1e9
                rec["raw_tflops"] = 4 * d * hq * raw / rec["raw_only_ms"] / 1e9
                if tiling == default_tiling:
                    for name, (fn, fn_args) in backward.items():
                        rec[name + "_ms"] = median_ms(
                            jax.jit(lambda *a, fn=fn, cfg=cfg: fn(*a, cfg)), fn_args)
            except Exception as e:  # noqa: BLE001  (record and go on)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rec["t"] = round(time.time() - start, 1)
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
