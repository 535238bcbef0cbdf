"""Conversion time and peak host RSS for a large LLaMA-architecture checkpoint.

    python -m benchmarks.convert_bench --size 1b --workdir /work/tmp_convert_bench [--keep]

1. Builds a HF LLaMA checkpoint with random bf16 weights (N(0, 0.02)), tensor by tensor:
   `SafetensorsShardWriter` plans all shard headers (2 GB shards + index), then each tensor
   is generated and written at its offset, so the whole model is never in RAM.
2. Runs `python -m convert.hf_to_flax` (bf16) and then `python -m convert.flax_to_hf` as
   child processes; wall time and the child's peak RSS (`getrusage(RUSAGE_CHILDREN)`).
3. Writes benchmarks/results/convert_<size>.json; deletes the big files unless --keep.
All files go into a new folder `<workdir>/<size>-XXXXXXXX` made for this run: nothing already
under `--workdir` is written over or deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from cca_jax.config import LlamaConfig
from convert.hf_io import SafetensorsShardWriter, open_hf_weights
from convert.layout import iter_hf_tensors, param_specs

SIZES = {  # TinyLlama-1.1B and LLaMA-2-7B shapes
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
}
RESULTS = Path(__file__).resolve().parent / "results"


def make_random_checkpoint(out: Path, size: str, seed: int = 0) -> dict:
    arch = SIZES[size]
    cfg = LlamaConfig(**arch, max_position_embeddings=4096, rms_norm_eps=1e-5)
    out.mkdir(parents=True, exist_ok=True)
    hf = dict(cfg.to_hf_dict(), dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    tensors = [(n, s, bf16) for n, s in iter_hf_tensors(param_specs(cfg))]
    writer = SafetensorsShardWriter(out, tensors, max_shard_bytes=2 * 2**30)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for name, shape, _ in tensors:
        if name.endswith("norm.weight"):
            arr = np.ones(shape, bf16)
        else:
            arr = (rng.standard_normal(shape, np.float32) * 0.02).astype(bf16)
        writer.write(name, arr)
        del arr
    writer.close()
    n_params = sum(int(np.prod(s)) for _, s, _ in tensors)
    return {"params": n_params, "bytes": writer.total_bytes, "shards": len(writer.files),
            "make_seconds": round(time.perf_counter() - t0, 1),
            "largest_stacked_bytes": max(int(np.prod(s.shape)) * 2 for s in param_specs(cfg))}


def measure(cmd: list[str]) -> dict:
    """Runs `cmd` in a fresh Python that reports its child's peak RSS (isolated rusage)."""
    probe = ("import json, resource, subprocess, sys, time; t=time.perf_counter(); "
             "p=subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "w=time.perf_counter()-t; "
             "print(json.dumps({'rc': p.returncode, 'seconds': round(w, 1), "
             "'peak_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024, "
             "'stderr_tail': p.stderr[-1500:]}))")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if res["rc"] != 0:
        raise RuntimeError(f"{cmd} failed:\n{res['stderr_tail']}")
    return res


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--workdir", default="/work/tmp_convert_bench")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    from benchmarks.measure import claim_output
    claim_output(str(RESULTS / f"convert_{a.size}"), suffixes=(".json",))
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{a.size}-", dir=a.workdir))
    print(f"working in {work}", flush=True)
    hf, ours, back = work / "hf", work / "ours", work / "back"
    try:
        made = make_random_checkpoint(hf, a.size)
        print(f"made {made}", flush=True)
        py = sys.executable
        to_flax = measure([py, "-m", "convert.hf_to_flax", "--hf", str(hf), "--out", str(ours),
                           "--dtype", "bfloat16"])
        print(f"hf_to_flax {to_flax['seconds']} s, peak RSS {to_flax['peak_rss_mb']} MB",
              flush=True)
        to_hf = measure([py, "-m", "convert.flax_to_hf", "--ckpt", str(ours), "--out", str(back)])
        print(f"flax_to_hf {to_hf['seconds']} s, peak RSS {to_hf['peak_rss_mb']} MB", flush=True)
        src, dst = open_hf_weights(hf), open_hf_weights(back)
        same = sorted(src.names()) == sorted(dst.names()) and all(
            np.array_equal(src.read(n).view(np.uint16), dst.read(n).view(np.uint16))
            for n in src.names())
        from benchmarks.measure import stamp
        result = {
            **stamp(), "size": a.size, "architecture": SIZES[a.size], "checkpoint": made,
            "orbax_bytes": du(ours), "hf_to_flax": to_flax, "flax_to_hf": to_hf,
            "round_trip_files_identical": same,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "mem_gb": round(os.sysconf("SC_PAGE_SIZE")
                                        * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        }
        for r in (to_flax, to_hf):
            r.pop("stderr_tail", None)
            r.pop("rc", None)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"convert_{a.size}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
