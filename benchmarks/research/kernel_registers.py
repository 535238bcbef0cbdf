"""What ptxas says of each Mosaic GPU kernel: registers per thread, spills, stack (sm_90).

    python benchmarks/research/kernel_registers.py \\
        [--tiling '{"persistent": true, "backward_tiling": {"persistent": true}}'] \\
        [--out benchmarks/results/research/kernel_registers_h200] [--reparse]

Issue 26 asks, where a target is missed, what limits each kernel: issue rate, shared memory,
registers or the power cap. This answers the register part. In a child process with
`MOSAIC_GPU_DUMP_PTXAS=1` (Mosaic GPU's compiler then prints ptxas's report of every kernel
it builds), it compiles and runs once, at the 7B attention shape (Hq 32, Hkv 8, D 128, bf16,
CCA g 16, s 1024) on 4096 tokens (the kernels' code does not depend on the length):
the forward and the backward's dq, dk/dv and dck/dcv kernels (`jax.grad` of the backend),
and the decode kernel, each at its default tiling, or the attention kernels at `--tiling` (the
forward's `attention_mosaic_gpu` keyword arguments; `backward_tiling` the backward's). Then
it parses the report: per kernel function, registers per thread, spill stores and loads
(bytes), stack frame (bytes), with the shared memory each kernel's tiling allocates (from the
config functions) beside it. The register ceiling a warp-specialised kernel asks for
(`setmaxnreg`: 232 for its consumers, 40 for its producer) is what the consumers may use;
ptxas reports the function's count before it.
Writes `<out>.json` (records stamped), `<out>.md`, and `<out>.log` (ptxas's own lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax, pallas_kernels
from benchmarks.measure import claim_output, stamp, table_heading, write_results  # noqa: E402

HQ, HKV, D, LENGTH, G, S = 32, 8, 128, 4096, 16, 1024
_FUNCTION = re.compile(r"Compiling entry function '([^']+)'")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def run_kernels(tiling: dict) -> None:
    """Compile and run each kernel once (in the child with the dump on); the attention
    kernels at `tiling`."""
    import jax
    import jax.numpy as jnp

    from cca_jax.attention.pallas_mosaic_gpu import attention_mosaic_gpu
    from cca_jax.blocks import decode_bounds, parse_option
    from pallas_kernels.mosaic_gpu.decode import decode_attention_mosaic_gpu

    pattern = parse_option("cca", group_size=G, window_size=S)
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    q = jax.random.normal(keys[0], (1, LENGTH, HQ, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, LENGTH, HKV, D), jnp.bfloat16) for x in keys[1:3])

    def loss(q, k, v):
        return jnp.sum(attention_mosaic_gpu(q, k, v, pattern, **tiling).astype(jnp.float32))
    print("fwd+bwd", float(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)[0].sum()),
          flush=True)
    ring, slots = S + G, 256
    qd = jax.random.normal(keys[3], (1, HQ, D), jnp.bfloat16)
    k_ring, v_ring = (jax.random.normal(x, (1, ring, HKV, D), jnp.bfloat16) for x in keys[4:6])
    ck, cv = (jax.random.normal(x, (1, slots, HQ, D), jnp.bfloat16) for x in keys[6:8])
    bounds = decode_bounds(pattern, jnp.full((1,), 4000, jnp.int32), ring, slots)
    out = decode_attention_mosaic_gpu(qd, k_ring, v_ring, ck, cv, bounds)
    print("decode", float(out.astype(jnp.float32).sum()), flush=True)


def parse(text: str) -> list[dict]:
    """ptxas's report -> one record per kernel function, in order. Its counts are the lines
    after "Compiling entry function"; a "ptxas warning" about spills comes before the
    function it names (and repeats its counts), so warnings are skipped."""
    records, current = [], None
    for line in text.splitlines():
        if "ptxas warning" in line:
            continue
        if m := _FUNCTION.search(line):
            current = {"function": m.group(1)}
            records.append(current)
        elif current is not None:
            if m := _USED.search(line):
                current["registers"] = int(m.group(1))
            if m := _SPILL.search(line):
                current["spill_store_bytes"], current["spill_load_bytes"] = map(int, m.groups())
            if m := _STACK.search(line):
                current["stack_bytes"] = int(m.group(1))
    return records


def shared_memory(tiling: dict | None = None) -> dict:
    """KiB of shared memory each kernel allocates at `tiling` (`run_kernels`'), by kernel
    name."""
    from pallas_kernels.mosaic_gpu import config
    from pallas_kernels.mosaic_gpu import decode_config as decode
    forward = dict(tiling or {})
    backward_fields = forward.pop("backward_tiling", None) or {}
    backward = config.backward_shared_memory_bytes(
        config.mosaic_backward_config(head_dim=D, **backward_fields), D)
    kib = {"cca_forward": config.shared_memory_bytes(
               config.mosaic_config(head_dim=D, **forward), D),
           "cca_dq": backward["dq"], "cca_dk_dv": backward["keys"],
           "cca_dck_dcv": backward["keys"],
           "cca_decode": decode.shared_memory_bytes(
               decode.decode_config(head_dim=D, groups=HQ // HKV), D)}
    return {name: round(b / 1024, 1) for name, b in kib.items()}


def table(records: list[dict], tiling: dict | None = None) -> str:
    tilings = f"attention tiling {json.dumps(tiling)}" if tiling else "default tilings"
    lines = table_heading(f"ptxas's report of the Mosaic GPU kernels ({tilings}; Hq 32, "
                          "Hkv 8, D 128, bf16, CCA g 16, s 1024)", records[0]) + [
        "| function | registers / thread | spill stores / loads (bytes) | stack (bytes) "
        "| shared memory KiB |", "| --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['function']} | {r.get('registers', '')} | "
                     f"{r.get('spill_store_bytes', '')} / {r.get('spill_load_bytes', '')} | "
                     f"{r.get('stack_bytes', '')} | {r.get('smem_kib', '')} |")
    return "\n".join(lines) + "\n"


def reparse(out: str) -> int:
    """Rewrite `<out>.json` and `<out>.md` from the run's own `<out>.log`, keeping its stamps
    (device, commit, date, command) and its shared memory column."""
    with open(out + ".json") as f:
        old = json.load(f)
    with open(out + ".log") as f:
        records = parse(f.read())
    keep = {k: old[0][k] for k in ("commit", "device", "jax", "date", "command")}
    script = "benchmarks/research/kernel_registers.py"   # stamped twice before the fix
    keep["command"] = keep["command"].replace(f"{script} {script}", script)
    smem = {r["function"]: r.get("smem_kib") for r in old}
    records = [dict(keep, **r, smem_kib=smem.get(r["function"]), reparsed=True)
               for r in records]
    with open(out + ".json", "w") as f:
        json.dump(records, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(table(records) + "\n(Rebuilt from the run's log by `--reparse` after a parser fix: "
                "a spill warning had been counted to the function before the one it names.)\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reparse", action="store_true",
                    help="rebuild <out>.json and <out>.md from <out>.log and the stamps of "
                    "<out>.json (a parser fix; no GPU)")
    ap.add_argument("--tiling", type=json.loads, default={},
                    help="JSON: the attention kernels' tiling (attention_mosaic_gpu's keyword "
                    "arguments, backward_tiling for the backward's); default tilings if absent")
    ap.add_argument("--out", default="benchmarks/results/research/kernel_registers_h200")
    args = ap.parse_args(argv)
    if args.child:
        run_kernels(args.tiling)
        return 0
    if args.reparse:
        return reparse(args.out)
    claim_output(args.out)
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                           "--tiling", json.dumps(args.tiling)], env=env,
                          capture_output=True, text=True)
    log = done.stdout + done.stderr
    with open(args.out + ".log", "w") as f:
        f.write(log)
    if done.returncode:
        print(log[-4000:], file=sys.stderr)
        return done.returncode
    smem = shared_memory(args.tiling)
    records = [dict(stamp(argv), tiling=args.tiling, **r,
                    smem_kib=next((v for k, v in smem.items() if k in r["function"]), None))
               for r in parse(log)]
    if not records:
        print("ptxas printed no report (is MOSAIC_GPU_DUMP_PTXAS honoured by this jax?)",
              file=sys.stderr)
        return 1
    for r in records:
        print(json.dumps(r), flush=True)
    write_results(args.out, records, table(records, args.tiling))
    return 0


if __name__ == "__main__":
    sys.exit(main())
