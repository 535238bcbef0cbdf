"""Ahead-of-time compilation of the Pallas TPU kernels for real TPU topologies, on a CPU machine.

    /work/tpu-venv/bin/python benchmarks/tpu_aot.py [--topologies v5e:2x2 ...]
        [--shapes ...] [--kernels ...] [--tiling block_q=1024 ...]
        [--out benchmarks/results/tpu_aot]

(or, as a test: `/work/tpu-venv/bin/python -m pytest tests/test_pallas_tpu.py -m tpu_aot`).
Needs libtpu: `python -m venv --system-site-packages /work/tpu-venv &&
/work/tpu-venv/bin/pip install 'jax[tpu]==0.10.2'` adds only libtpu 0.0.42.1 next to the
project's jax 0.10.2 (a separate venv, so other processes never see a TPU plugin).

For each topology (`jax.experimental.topologies.get_topology_desc`) it lowers and compiles,
inside `shard_map` over the slice's devices (inputs replicated: every chip runs the whole
kernel, which is what a sequence- or data-parallel step runs per chip), the forward, the
backward (a VJP: forward kernel plus dq, dk/dv and dck/dcv) and the decode kernel, at
  * L = 131072, Hq = 32, Hkv in {32, 8}, D = 128, g = 16, s = 1024, B = 1, bf16 (decode: a
    cache of max_len = 131072, ring 1040, 8128 slots, B = 8, every row at the last position),
  * a ragged small shape: L = 1000 (not a multiple of g = 16 nor of the 512-row blocks),
    s = 100 (not a multiple of g), Hq = 8, Hkv = 2, B = 2 with row 1 packed (two documents).
Compiling runs Mosaic, which checks what the TPU interpreter cannot (VMEM allocation, layouts,
tiling). Each record: topology, kernel, L, hkv, compiled, error, vmem_bytes (the largest
scoped VMEM any Pallas kernel of the program uses, from the compiled HLO's
`used_scoped_memory_configs`), vmem_by_kernel, and `memory_analysis()` in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

for _name, _value in (("TPU_ACCELERATOR_TYPE", "v6e-4"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                      ("TPU_WORKER_ID", "0")):
    os.environ.setdefault(_name, _value)   # quiets libtpu's host lookup; nothing is contacted

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cca_jax import blocks  # noqa: E402
from cca_jax.attention.pallas_tpu import attention_pallas_tpu  # noqa: E402
from pallas_kernels.tpu import decode_attention_pallas_tpu  # noqa: E402

# Topology name (as get_topology_desc takes it) -> chips per host.
TOPOLOGIES = {"v5e:2x2": (2, 2, 1), "v5p:2x2x1": (2, 2, 1), "v6e:2x2": (2, 2, 1)}
KERNELS = ("forward", "backward", "decode")
# name: (B, L, Hq, Hkv, D, g, s, packed, decode batch)
SHAPES = {
    "paper_mha": (1, 131072, 32, 32, 128, 16, 1024, False, 8),
    "paper_gqa": (1, 131072, 32, 8, 128, 16, 1024, False, 8),
    "ragged": (2, 1000, 8, 2, 128, 16, 100, True, 2),
}
_VMEM = re.compile(r'"memory_space":"1","offset":"\d+","size":"(\d+)"')


def topology_mesh(name: str) -> Mesh:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        chip_config_name="default",
                                        chips_per_host_bounds=TOPOLOGIES[name], num_slices=1,
                                        wrap=(False, False, False))
    return Mesh(np.asarray(topo.devices), ("chips",))


def _programs(shape_name: str, tiling: dict):
    """kernel -> (function, argument ShapeDtypeStructs without sharding); `tiling`:
    KernelConfig overrides."""
    b, length, hq, hkv, d, g, s, packed, decode_batch = SHAPES[shape_name]
    pattern = blocks.CCA(g, s)
    bf16 = jnp.bfloat16
    q = jax.ShapeDtypeStruct((b, length, hq, d), bf16)
    kv = jax.ShapeDtypeStruct((b, length, hkv, d), bf16)
    seg = None
    if packed:   # row 0 one document, the others two (cut at 40%)
        seg = np.zeros((b, length), np.int32)
        seg[1:, int(0.4 * length):] = 1
        seg = jnp.asarray(seg)

    def attend(q, k, v):
        return attention_pallas_tpu(q, k, v, pattern, segment_ids=seg, interpret=False,
                                    **tiling)

    def backward(q, k, v, do):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(do)

    ring, slots = blocks.ring_size(pattern, length), pattern.max_slots(length)
    positions = np.full((decode_batch,), length - 1)
    bounds = blocks.decode_bounds(pattern, positions, ring, slots)

    def decode(q1, k_ring, v_ring, ck, cv):
        return decode_attention_pallas_tpu(q1, k_ring, v_ring, ck, cv,
                                           tuple(jnp.asarray(x) for x in bounds),
                                           interpret=False, **tiling)

    cache = [jax.ShapeDtypeStruct((decode_batch, ring, hkv, d), bf16)] * 2
    cache += [jax.ShapeDtypeStruct((decode_batch, slots, hq, d), bf16)] * 2
    return {"forward": (attend, [q, kv, kv]),
            "backward": (backward, [q, kv, kv, q]),
            "decode": (decode, [jax.ShapeDtypeStruct((decode_batch, hq, d), bf16), *cache])}


def vmem_by_kernel(hlo_text: str) -> dict[str, int]:
    """Scoped VMEM (bytes) of each Pallas TPU kernel (`tpu_custom_call`) in compiled HLO."""
    found = {}
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = line.split("=", 1)[0].strip()
        name = re.search(r"cca_tpu_[a-z]+", name).group(0) if "cca_tpu_" in name else name
        sizes = [int(x) for x in _VMEM.findall(line)]
        found[name] = max(found.get(name, 0), max(sizes, default=0))
    return found


def compile_one(mesh: Mesh, fn, specs) -> dict:
    replicated = NamedSharding(mesh, PartitionSpec())
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for x in specs]
    n = len(specs)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(),) * n,
                           out_specs=PartitionSpec(), check_vma=False)
    start = time.perf_counter()
    compiled = jax.jit(mapped).lower(*specs).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    by_kernel = vmem_by_kernel(compiled.as_text())
    return {"compiled": True, "error": None, "vmem_bytes": max(by_kernel.values(), default=0),
            "vmem_by_kernel": by_kernel, "compile_s": round(seconds, 1),
            "memory": {k: int(getattr(mem, k)) for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes")}}


def run(topologies=tuple(TOPOLOGIES), shapes=tuple(SHAPES), kernels=KERNELS, out=None,
        log=print, tiling=None) -> list[dict]:
    """Compile every (topology, shape, kernel); write `<out>.json` after each record."""
    tiling = dict(tiling or {})
    records = []
    for topo in topologies:
        mesh = topology_mesh(topo)
        for shape in shapes:
            programs = _programs(shape, tiling)
            _, length, _, hkv, *_ = SHAPES[shape]
            for kernel in kernels:
                record = {"topology": topo, "kernel": kernel, "shape": shape, "L": length,
                          "hkv": hkv, "tiling": tiling}
                try:
                    record.update(compile_one(mesh, *programs[kernel]))
                except Exception as e:  # noqa: BLE001  the reason is the result
                    record.update(compiled=False, vmem_bytes=None,
                                  error=f"{type(e).__name__}: {e}"[:4000])
                    traceback.print_exc()
                records.append(record)
                log(json.dumps({k: record[k] for k in ("topology", "kernel", "shape",
                                                       "compiled", "vmem_bytes")}
                               | {"compile_s": record.get("compile_s")}))
                if out:
                    write(records, out)
    return records


def write(records, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from benchmarks.measure import stamp
    meta = {**stamp(), "libtpu": _libtpu_version()}
    with open(out + ".json", "w") as f:
        json.dump([{**r, **meta} for r in records], f, indent=1)


def _libtpu_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("libtpu")
    except Exception:  # noqa: BLE001
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES),
                        choices=list(TOPOLOGIES))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--tiling", nargs="*", default=[], metavar="FIELD=INT",
                        help="KernelConfig overrides, e.g. block_q=1024 block_c=2048")
    parser.add_argument("--out", default="benchmarks/results/tpu_aot")
    args = parser.parse_args(argv)
    from benchmarks.measure import claim_output
    claim_output(args.out, suffixes=(".json",))
    tiling = {}
    for item in args.tiling:
        field, _, value = item.partition("=")
        if not value.isdigit():
            parser.error(f"--tiling takes FIELD=INT, got {item!r}")
        tiling[field] = int(value)
    if _libtpu_version() is None:
        raise SystemExit("libtpu is not installed: pip install 'jax[tpu]==0.10.2' (into a "
                         "separate venv, see the module docstring).")
    records = run(args.topologies, args.shapes, args.kernels, args.out, tiling=tiling)
    return 0 if all(r["compiled"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
