"""Hugging Face LLaMA / Mistral / Qwen2 checkpoint -> cca_jax model directory (orbax).

    python -m convert.hf_to_flax --hf HF_DIR --out OUT_DIR [--dtype bfloat16|float32]
        [--group-size 16 --window-size 1024] [--force] [--quiet]

Output: `OUT/config.json` (HF format + CCA settings under "cca_attention"), `OUT/params/`
(orbax PyTree of our stacked parameter tree), tokenizer files copied from HF_DIR.

Streaming design (peak host memory ~ the largest STACKED parameter, not the model):
each parameter of our tree is a `cca_jax.pretrained.LazyArray`; orbax's save builds them one
at a time. Building a stacked parameter (e.g. `layers.mlp.gate_proj.kernel [N, H, I]`)
allocates the `[N, ...]` array in the target dtype and fills it layer by layer, reading ONE
HF tensor at a time (`seek` + `readinto`, no mmap), transposing and casting it into its slot;
the array is then written by orbax (plain zarr, one chunk per layer, no OCDBT: OCDBT buffers
a whole array's encoded chunks) and freed before the next parameter is built. Peak RSS is
therefore about 0.27 GB (Python/JAX) + the largest stacked parameter + ~0.3 GB (one HF tensor,
its cast copy, tensorstore chunk buffers). Measured (benchmarks/results/convert_llama.md):
1.1B bf16 in 28 s / 0.98 GB peak RSS, LLaMA-2-7B shapes in 105 s / 3.44 GB on 2 cores.
Alternative considered: writing each layer straight into its slice of the stacked array
(peak = one layer); not needed below ~70B, where one stacked MLP exceeds host RAM.

Checks before anything is written: the config is a supported family; every expected tensor
exists with the expected shape; no unexpected tensors remain (they would mean an unsupported
variant). Output goes to a temporary sibling directory renamed into place at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from cca_jax.config import LlamaConfig
from cca_jax.pretrained import LazyArray, save_pretrained
from convert.hf_io import (AtomicOutputDir, ConversionError, Progress, WeightReader,
                           copy_tokenizer_files, open_hf_weights)
from convert.layout import ParamSpec, family_layout, param_specs

OUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def check_dtype(dtype: str) -> np.dtype:
    if dtype not in OUT_DTYPES:
        raise ConversionError(f"Unknown dtype {dtype!r}; supported: {sorted(OUT_DTYPES)}.")
    return OUT_DTYPES[dtype]


def validate(reader: WeightReader, specs: list[ParamSpec], cfg: LlamaConfig) -> None:
    """Every expected HF tensor is present with the right shape; nothing unexpected remains."""
    expected = {}
    for s in specs:
        for name in s.hf_names():
            expected[name] = s.hf_shape()
    missing = [n for n in expected if n not in reader.shapes]
    if missing:
        raise ConversionError(f"{reader.description} lacks {len(missing)} tensors this config "
                              f"needs, e.g. {missing[:4]}.")
    for name, shape in expected.items():
        if tuple(reader.shapes[name]) != shape:
            raise ConversionError(f"Shape mismatch for {name}: config.json implies {shape}, the "
                                  f"checkpoint has {tuple(reader.shapes[name])}.")
    layout = family_layout(cfg)
    extra = [n for n in reader.shapes if n not in expected
             and not n.endswith(layout.ignored)
             and not (cfg.tie_word_embeddings and n == layout.entries["lm_head.kernel"].hf_name)]
    if extra:
        raise ConversionError(f"{reader.description} has {len(extra)} tensors that a "
                              f"{cfg.model_type} model with this config.json does not use, e.g. "
                              f"{extra[:4]}; the checkpoint is not a supported variant.")


def build_param(reader: WeightReader, spec: ParamSpec, dtype: np.dtype,
                progress: Progress | None = None) -> np.ndarray:
    """Our array for one parameter, filled one HF tensor at a time."""
    out = np.empty(spec.shape, dtype)
    for i, name in enumerate(spec.hf_names()):
        hf = reader.read(name)
        if tuple(hf.shape) != spec.hf_shape():
            raise ConversionError(f"Shape mismatch for {name}: expected {spec.hf_shape()}, "
                                  f"read {hf.shape}.")
        target = out if spec.num_layers is None else out[i]
        target[...] = spec.to_ours(hf).astype(dtype)
        if progress:
            progress.step(name, hf.shape, hf.nbytes)
        del hf
    return out


def lazy_params(reader: WeightReader, specs: list[ParamSpec], dtype: np.dtype,
                progress: Progress | None = None) -> dict:
    tree: dict = {}
    for spec in specs:
        node = tree
        for k in spec.path[:-1]:
            node = node.setdefault(k, {})
        node[spec.path[-1]] = LazyArray(
            spec.shape, dtype, lambda s=spec: build_param(reader, s, dtype, progress))
    return tree


def convert_hf_to_flax(hf_dir, out_dir, *, dtype: str = "bfloat16",
                       group_size: int | None = None, window_size: int | None = None,
                       force: bool = False, verbose: bool = True) -> Path:
    """Convert; returns the output directory. Raises before writing on bad input.

    `group_size` / `window_size` default to the CCA settings recorded in config.json (a
    checkpoint exported by flax_to_hf keeps them), else to 16 / 1024.
    """
    hf_dir = Path(hf_dir)
    np_dtype = check_dtype(dtype)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"--hf {hf_dir} is not a directory.")
    cca = {f"cca_{k}": v for k, v in (("group_size", group_size), ("window_size", window_size))
           if v is not None}
    cfg = LlamaConfig.from_pretrained_dir(hf_dir, param_dtype=dtype, dtype=dtype, **cca)
    reader = open_hf_weights(hf_dir)
    specs = param_specs(cfg)
    validate(reader, specs, cfg)
    total = sum(len(s.hf_names()) for s in specs)
    progress = Progress(total, verbose)
    with AtomicOutputDir(out_dir, force) as tmp:
        save_pretrained(tmp, lazy_params(reader, specs, np_dtype, progress), cfg)
        copied = copy_tokenizer_files(hf_dir, tmp)
    if verbose:
        print(f"wrote {out_dir}: {total} HF tensors -> {len(specs)} parameters ({dtype}), "
              f"{progress.bytes / 1e9:.2f} GB read; tokenizer files: {copied or 'none'}",
              file=sys.stderr)
    return Path(out_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m convert.hf_to_flax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (must not exist)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    ap.add_argument("--group-size", type=int, default=None,
                    help="CCA group size g (default: config.json's, else 16)")
    ap.add_argument("--window-size", type=int, default=None,
                    help="CCA local window s (default: config.json's, else 1024)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    a = ap.parse_args(argv)
    try:
        convert_hf_to_flax(a.hf, a.out, dtype=a.dtype, group_size=a.group_size,
                           window_size=a.window_size, force=a.force, verbose=not a.quiet)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
