"""Offline resource check of the Pallas GPU kernels for sm_90 (H100/H200), no GPU needed.

    python benchmarks/research/pallas_gpu_ptxas.py --triton-python /tmp/tenv/bin/python \
        [--configs '{"dkv_block_q": 32}' ...] [--dtype bfloat16] [--d 128] [--hkv 32]

1. Cross-lowers fwd+bwd for CUDA with the current jax (works on a CPU-only machine) and
   captures the Triton IR (TTIR) Pallas emits for each kernel;
2. in a second Python that has pip's `triton` (e.g. `python -m venv /tmp/tenv &&
   /tmp/tenv/bin/pip install triton==3.6.0`), runs Triton's TTIR passes and compiles for
   sm_90 with the kernel's num_warps/num_stages, then ptxas -v: shared memory (limit 227 KiB
   per block), registers, spills, and whether wgmma is used.
XLA's own Triton (on the H200) is a different build than pip's, so these are leads, not the
exact numbers, but configs over the shared-memory limit or spilling heavily show up here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_COMPILE = r'''
import json, os, re, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
from triton._C.libtriton import ir
from triton.backends.nvidia.compiler import CUDABackend
path, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
opts = backend.parse_options({"num_warps": nw, "num_stages": ns})
ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
mod = ir.parse_mlir_module(path, ctx)
mod.context = ctx
mod = backend.make_ttir(mod, {}, opts, 90)
pre = path + f".w{nw}s{ns}.ttir"
open(pre, "w").write(str(mod))
k = triton.compile(pre, target=target, options={"num_warps": nw, "num_stages": ns})
ptx = k.asm["ptx"]
open(pre + ".ptx", "w").write(ptx)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", pre + ".ptx", "-o", pre + ".cubin"],
                   capture_output=True, text=True)
regs = re.search(r"Used (\d+) registers", r.stderr)
spill = re.search(r"(\d+) bytes spill stores", r.stderr)
print(json.dumps({"shared_kib": k.metadata.shared / 1024, "regs": int(regs.group(1)),
                  "spill_store_bytes": int(spill.group(1)) if spill else 0,
                  "wgmma": ptx.count("wgmma.mma_async") > 0}))
'''

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_KERNELS = {"cca_fwd": ("num_warps", "num_stages"),
            "cca_bwd_dq": ("dq_num_warps", "dq_num_stages"),
            "cca_bwd_dkv": ("dkv_num_warps", "dkv_num_stages"),
            "cca_bwd_dcore": ("dc_num_warps", "dc_num_stages")}


def dump_ttir(overrides: dict, dtype: str, d: int, hkv: int, out_dir: str) -> dict:
    """Cross-lower for CUDA; write one TTIR file per kernel; return {kernel: path}."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg

    sys.path.insert(0, _REPO)
    from cca_jax.attention.pallas_gpu import cca_attention_pallas_gpu

    paths = {}
    original = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        name = str(result.module.body.operations[0].attributes["sym_name"]).strip('"')
        paths[name] = os.path.join(out_dir, name + ".ttir")
        with open(paths[name], "w") as f:
            f.write(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        q = jax.ShapeDtypeStruct((1, 8192, 32, d), jnp.dtype(dtype))
        kv = jax.ShapeDtypeStruct((1, 8192, hkv, d), jnp.dtype(dtype))

        def loss(q, k, v):
            return jnp.sum(cca_attention_pallas_gpu(q, k, v, group_size=16, window_size=1024,
                                                    interpret=False, **overrides
                                                    ).astype(jnp.float32))
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton-python", required=True, help="a python with pip's triton")
    ap.add_argument("--configs", nargs="*", default=["{}"],
                    help="JSON KernelConfig overrides, one per config to check")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    args = ap.parse_args(argv)
    sys.path.insert(0, _REPO)
    if args.out:
        from benchmarks.measure import claim_output
        claim_output(args.out, suffixes=("",))
    import jax.numpy as jnp
    from pallas_kernels.gpu import kernel_config, padded_head_dim

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "compile.py")
        with open(script, "w") as f:
            f.write(_COMPILE)
        for i, text in enumerate(args.configs):
            overrides = json.loads(text)
            cfg = kernel_config(jnp.dtype(args.dtype), head_dim=padded_head_dim(args.d),
                                **overrides)
            sub = os.path.join(tmp, str(i))
            os.makedirs(sub)
            paths = dump_ttir(overrides, args.dtype, args.d, args.hkv, sub)
            for name, path in sorted(paths.items()):
                warps, stages = (getattr(cfg, f) for f in _KERNELS[name])
                r = subprocess.run([args.triton_python, script, path, str(warps), str(stages)],
                                   capture_output=True, text=True)
                rec = {"kernel": name, "dtype": args.dtype, "d": args.d, "hkv": args.hkv,
                       "overrides": overrides, "num_warps": warps, "num_stages": stages}
                try:
                    rec.update(json.loads(r.stdout.strip().splitlines()[-1]))
                except (IndexError, json.JSONDecodeError):
                    rec["error"] = r.stderr.strip()[-300:]
                rec["over_smem_limit"] = rec.get("shared_kib", 0) > 227
                records.append(rec)
                print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
