"""On the H200: how fast jax's own Mosaic GPU (FA3-style) flash attention runs here.

    python benchmarks/research/mosaic_gpu_probe.py [--lengths 32768,131072] > records.jsonl

Not a CCA kernel: a measurement behind "what would close the gap" in
`results/pallas_gpu_h200_notes.md`. It times `jax.experimental.pallas.ops.gpu.attention_mgpu`
(warp-specialized: TMA loads, two consumer warpgroups) forward, causal and not, against
cuDNN's full attention on the same inputs, B = 1, Hq = Hkv = 32, D = 128, float16 (the
jax kernel casts P to float16, so bf16 inputs fail there; the tensor cores' rate is the same); TFLOP/s
count the scores each computes (causal: half). The jax kernel applies no softmax scale, so
cuDNN runs with scale=1 (same speed). One JSON record per line; needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.measure import median_ms, rel_l2  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args(argv)
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}),
          flush=True)
    d, h = 128, args.heads
    for length in map(int, args.lengths.split(",")):
        keys = jax.random.split(jax.random.key(length), 3)
        q, k, v = (jax.random.normal(kk, (1, length, h, d), jnp.float16) for kk in keys)
        for causal in (True, False):
            flops = 4 * length * length * d * h // (2 if causal else 1)
            cudnn = jax.jit(lambda q, k, v, causal=causal: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, scale=1.0, implementation="cudnn"))
            ref = cudnn(q, k, v)
            rec = {"L": length, "causal": causal, "impl": "full_cudnn",
                   "ms": median_ms(cudnn, (q, k, v), warmup=2, iters=5)}
            rec["tflops"] = flops / rec["ms"] / 1e9
            print(json.dumps(rec), flush=True)
            for block_kv in (128, 64):
                cfg = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                        causal=causal)
                rec = {"L": length, "causal": causal, "impl": "attention_mgpu",
                       "block_q": 64, "block_kv": block_kv}
                try:
                    fn = jax.jit(lambda q, k, v, cfg=cfg: mgpu.attention(q, k, v, cfg))
                    rec["rel_l2_vs_cudnn"] = rel_l2(fn(q, k, v), ref)
                    rec["ms"] = median_ms(fn, (q, k, v), warmup=2, iters=5)
                    rec["tflops"] = flops / rec["ms"] / 1e9
                except Exception as e:  # noqa: BLE001  (record and go on)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
