"""Probe: can one decode token read the 7B shape's weights faster than XLA's products do?

    python benchmarks/research/decode_gemv_probe.py
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/research/decode_gemv_probe.py

One token (B = 1 and 16) through 32 layers of the LLaMA-2-7B projections and MLP (bf16,
separate arrays per layer, a Python loop) as
  xla-separate:     one product per weight (q, k, v, o, gate, up, down);
  pallas:           the same with a Pallas split-K GEMV (Triton lowering) for every product,
                    a few tilings;
  xla-fusedweights: q/k/v and gate/up concatenated once beforehand, one product each;
and prints ms and GB/s of weight bytes. Needs an NVIDIA GPU.
"""
import functools
import os
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

L, H, F = 32, 4096, 11008


def gemv_kernel(x_ref, w_ref, o_ref, *, bk, steps):
    k0 = pl.program_id(1) * bk * steps
    def body(i, acc):
        x = x_ref[:, pl.ds(k0 + i * bk, bk)]
        w = w_ref[pl.ds(k0 + i * bk, bk), :]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("bn", "bk", "splitk", "warps", "stages"))
def gemv(x, w, bn=128, bk=128, splitk=8, warps=4, stages=3):
    m, k = x.shape
    n = w.shape[1]
    xp = jnp.pad(x, ((0, 16 - m), (0, 0)))
    steps = k // (bk * splitk)
    assert steps * bk * splitk == k, (k, bk, splitk)
    out = pl.pallas_call(
        functools.partial(gemv_kernel, bk=bk, steps=steps),
        grid=(n // bn, splitk),
        in_specs=[pl.BlockSpec((16, k), lambda j, s: (0, 0)),
                  pl.BlockSpec((k, bn), lambda j, s: (0, j))],
        out_specs=pl.BlockSpec((None, 16, bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splitk, 16, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
    )(xp, w)
    return out.sum(0)[:m].astype(x.dtype)


def layer(x, w, mm):
    q = mm(x, w["wq"]) + mm(x, w["wk"]) + mm(x, w["wv"])
    x = x + mm(q, w["wo"]) * 1e-3
    h = jax.nn.silu(mm(x, w["w1"])) * mm(x, w["w3"])
    return x + mm(h, w["w2"]) * 1e-3


def layer_fused(x, w, mm):
    qkv = mm(x, w["wqkv"])
    q = qkv[:, :H] + qkv[:, H:2 * H] + qkv[:, 2 * H:]
    x = x + mm(q, w["wo"]) * 1e-3
    gu = mm(x, w["w13"])
    h = jax.nn.silu(gu[:, :F]) * gu[:, F:]
    return x + mm(h, w["w2"]) * 1e-3


def timed(fn, *args, iters=20):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def main():
    if jax.default_backend() != "gpu":
        raise SystemExit("decode_gemv_probe.py times 13 GB of weights on an NVIDIA GPU.")
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 400))
    shapes = dict(wq=(H, H), wk=(H, H), wv=(H, H), wo=(H, H), w1=(H, F), w3=(H, F), w2=(F, H))
    layers = [{k: jax.random.normal(next(keys), s, jnp.bfloat16) * 0.01 for k, s in shapes.items()}
              for _ in range(L)]
    nbytes = sum(v.nbytes for w in layers for v in w.values())
    xla = lambda a, b: a @ b
    tag = os.environ.get("XLA_FLAGS", "default")
    for b in (1, 16):
        x = jnp.ones((b, H), jnp.bfloat16)
        def run(x, layers, mm=xla, lay=layer):
            for w in layers:
                x = lay(x, w, mm)
            return x
        ms = timed(jax.jit(run), x, layers)
        print(f"[{tag}] B={b} xla-separate {ms:7.3f} ms {nbytes/ms/1e6:6.0f} GB/s", flush=True)
        if b == 1 and "triton" not in tag:
            for cfg in [dict(bn=128, bk=128, splitk=8, stages=3), dict(bn=64, bk=128, splitk=4, stages=4),
                        dict(bn=128, bk=64, splitk=16, stages=3), dict(bn=256, bk=64, splitk=16, stages=3),
                        dict(bn=64, bk=256, splitk=8, stages=3)]:
                def mm(a, w, cfg=cfg):
                    kk = w.shape[0]
                    c = dict(cfg)
                    while kk % (c["bk"] * c["splitk"]):
                        if c["splitk"] > 1 and kk % c["bk"] == 0 and (kk // c["bk"]) % c["splitk"]:
                            # 11008 = 43 * 256: splits of 43 * 2^j rows
                            c["splitk"] = 43 if kk % (43 * c["bk"]) == 0 else 1
                        elif c["bk"] > 16:
                            c["bk"] //= 2
                        else:
                            break
                    return gemv(a, w, **c)
                try:
                    ms = timed(jax.jit(functools.partial(run, mm=mm)), x, layers)
                    ref = jax.jit(run)(x, layers)
                    err = float(jnp.max(jnp.abs(jax.jit(functools.partial(run, mm=mm))(x, layers).astype(jnp.float32) - ref.astype(jnp.float32))))
                    print(f"[{tag}] B={b} pallas {cfg} {ms:7.3f} ms {nbytes/ms/1e6:6.0f} GB/s err {err:.2e}", flush=True)
                except Exception as e:
                    print(f"[{tag}] pallas {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    fused = [dict(wqkv=jnp.concatenate([w["wq"], w["wk"], w["wv"]], 1), wo=w["wo"],
                  w13=jnp.concatenate([w["w1"], w["w3"]], 1), w2=w["w2"]) for w in layers]
    del layers
    for b in (1, 16):
        x = jnp.ones((b, H), jnp.bfloat16)
        def runf(x, layers):
            for w in layers:
                x = layer_fused(x, w, xla)
            return x
        ms = timed(jax.jit(runf), x, fused)
        print(f"[{tag}] B={b} xla-fusedweights {ms:7.3f} ms {nbytes/ms/1e6:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
