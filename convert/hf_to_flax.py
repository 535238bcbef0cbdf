"""Hugging Face LLaMA / Mistral / Qwen2 checkpoint -> cca_jax model directory (orbax).

    python -m convert.hf_to_flax --hf HF_DIR --out OUT_DIR [--dtype bfloat16|float32|float16]
        [--attention cca|full|sliding|streaming --group-size 16 --window-size 1024
         --sink-tokens 4] [--force] [--quiet]

Output: `OUT/config.json` (HF format + our attention settings), `OUT/params/` (orbax PyTree
of our stacked parameter tree, see `cca_jax.checkpoint`), tokenizer files copied from HF_DIR.

dtype: by default the checkpoint's own (`dtype`, or the older `torch_dtype`, in its
config.json; else the dtype of most of its weights), so the default round trip is exact;
`--dtype` converts (float32 -> bfloat16 rounds to nearest even, as torch does). The choice is
printed.

Streaming design (peak host memory ~ the largest STACKED parameter, not the model):
each parameter of our tree is a `cca_jax.checkpoint.LazyArray`; orbax's save builds them one
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

Checks before anything is written: the output is not, does not contain and is not inside
the input (refused even with --force); the config is a supported family; every expected
tensor exists with the expected shape; no unexpected tensors remain (they would mean an
unsupported variant). Output goes to a temporary sibling directory renamed into place at the
end.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np

from cca_jax.checkpoint import LazyArray, save_pretrained
from cca_jax.blocks import ATTENTION_KINDS, default_sink_tokens
from cca_jax.config import AttentionConfig, LlamaConfig, hf_weights_dtype, read_hf_config
from convert.hf_io import (AtomicOutputDir, ConversionError, WeightReader, check_output_dir,
                           copy_tokenizer_files, open_hf_weights, progress_bar, run_cli,
                           cli_parser)
from convert.layout import ParamSpec, family_layout, param_specs

OUT_DTYPES = types.MappingProxyType({"bfloat16": np.dtype(ml_dtypes.bfloat16),
                                    "float32": np.dtype(np.float32),
                                    "float16": np.dtype(np.float16)})


def check_dtype(dtype: str) -> np.dtype:
    if dtype not in OUT_DTYPES:
        raise ConversionError(f"Unknown dtype {dtype!r}; supported: {sorted(OUT_DTYPES)}.")
    return OUT_DTYPES[dtype]


def source_dtype(hf_dir: Path, reader: WeightReader) -> tuple[str, str]:
    """(dtype name, where it was found) of a HF checkpoint: config.json's `dtype` /
    `torch_dtype`, else the floating dtype that holds most of the weights' elements."""
    try:
        named = hf_weights_dtype(read_hf_config(hf_dir))
    except (OSError, ValueError):
        named = None
    if named is not None:
        return named[0], f"config.json {named[1]!r}"
    elements: dict[str, int] = {}
    for name, dt in reader.dtypes.items():
        if dt is not None and (np.issubdtype(dt, np.floating) or dt.name in OUT_DTYPES):
            n = int(np.prod(reader.shapes[name], dtype=np.int64))
            elements[np.dtype(dt).name] = elements.get(np.dtype(dt).name, 0) + n
    if not elements:
        raise ConversionError(f"{reader.description}: no floating-point weights; pass --dtype.")
    name = max(elements, key=elements.get)
    if name not in OUT_DTYPES:
        raise ConversionError(f"{reader.description} stores {name} weights, which cca_jax does "
                              f"not use; pass --dtype (one of {sorted(OUT_DTYPES)}).")
    return name, "the weights"


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
                progress=None) -> np.ndarray:
    """Our array for one parameter, filled one HF tensor at a time."""
    out = np.empty(spec.shape, dtype)
    for i, name in enumerate(spec.hf_names()):
        hf = reader.read(name)
        if tuple(hf.shape) != spec.hf_shape():
            raise ConversionError(f"Shape mismatch for {name}: expected {spec.hf_shape()}, "
                                  f"read {hf.shape}.")
        target = out if spec.num_layers is None else out[i]
        target[...] = spec.to_ours(hf).astype(dtype)
        if progress is not None:
            progress.set_postfix_str(name, refresh=False)
            progress.update(target.nbytes)
        del hf
    return out


def lazy_params(reader: WeightReader, specs: list[ParamSpec], dtype: np.dtype,
                progress=None) -> dict:
    tree: dict = {}
    for spec in specs:
        node = tree
        for k in spec.path[:-1]:
            node = node.setdefault(k, {})
        node[spec.path[-1]] = LazyArray(
            spec.shape, dtype, lambda s=spec: build_param(reader, s, dtype, progress))
    return tree


def convert_hf_to_flax(hf_dir, out_dir, *, dtype: str | None = None,
                       attention: str | None = None, group_size: int | None = None,
                       window_size: int | None = None, sink_tokens: int | None = None,
                       force: bool = False, verbose: bool = True) -> Path:
    """Convert; returns the output directory. Raises before writing on bad input.

    `dtype`: default the checkpoint's own (see the module docstring). The attention settings
    default to those recorded in config.json (a checkpoint exported by flax_to_hf keeps them;
    a sliding-window checkpoint its window), else to LlamaConfig's defaults.
    """
    hf_dir = Path(hf_dir)
    if dtype is not None:
        check_dtype(dtype)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"--hf {hf_dir} is not a directory.")
    check_output_dir(out_dir, [hf_dir], force)
    settings = {k: v for k, v in (("attention", attention), ("group_size", group_size),
                                  ("window_size", window_size), ("sink_tokens", sink_tokens))
                if v is not None}
    cfg = LlamaConfig.from_pretrained_dir(hf_dir, **settings)
    reader = open_hf_weights(hf_dir)
    if dtype is None:
        dtype, found_in = source_dtype(hf_dir, reader)
    else:
        found_in = "--dtype"
    np_dtype = check_dtype(dtype)
    cfg = cfg.replace(param_dtype=dtype, dtype=dtype)
    specs = param_specs(cfg)
    validate(reader, specs, cfg)
    if verbose:
        print(f"dtype: {dtype} (from {found_in})", file=sys.stderr)
    n_tensors = sum(len(s.hf_names()) for s in specs)
    total = sum(int(np.prod(s.shape, dtype=np.int64)) for s in specs) * np_dtype.itemsize
    with AtomicOutputDir(out_dir, [hf_dir], force) as tmp, \
            progress_bar(total, "hf_to_flax", verbose) as bar:
        save_pretrained(tmp, lazy_params(reader, specs, np_dtype, bar), cfg)
        copied = copy_tokenizer_files(hf_dir, tmp)
    if verbose:
        print(f"wrote {out_dir}: {n_tensors} HF tensors -> {len(specs)} parameters ({dtype}), "
              f"{total / 1e6:.1f} MB; tokenizer files: {copied or 'none'}", file=sys.stderr)
    return Path(out_dir)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every flag with what it does, its default and its choices."""
    ap = cli_parser("python -m convert.hf_to_flax", __doc__,
                    "output directory, written whole or not at all (required; must not exist "
                    "unless --force)")
    ap.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face checkpoint "
                    "directory: config.json, safetensors or pytorch_model*.bin weights, "
                    "tokenizer files (required)")
    ap.add_argument("--dtype", default=None, choices=sorted(OUT_DTYPES),
                    help="parameter dtype of the output (default: the checkpoint's own)")
    ap.add_argument("--attention", default=None, choices=sorted(ATTENTION_KINDS),
                    help="attention option recorded in config.json; from_pretrained and the "
                    "CLIs can still override it (default: the checkpoint's, else cca; a "
                    "sliding-window checkpoint: sliding)")
    defaults = AttentionConfig()
    ap.add_argument("--group-size", type=int, default=None, metavar="G",
                    help="CCA group size g (default: the checkpoint's, else "
                    f"{defaults.group_size})")
    ap.add_argument("--window-size", type=int, default=None, metavar="W",
                    help="CCA local window s, or the sliding / streaming window W (default: "
                    f"the checkpoint's, else {defaults.window_size})")
    ap.add_argument("--sink-tokens", type=int, default=None, metavar="N",
                    help="attention sinks N, the first tokens every later query sees raw: "
                    "streaming's, or cca's (SPEC 6) (default: the checkpoint's, else "
                    f"{default_sink_tokens('streaming')} for streaming, "
                    f"{default_sink_tokens('cca')} for cca)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    return run_cli(ap, argv, lambda a: convert_hf_to_flax(
        a.hf, a.out, dtype=a.dtype, attention=a.attention, group_size=a.group_size,
        window_size=a.window_size, sink_tokens=a.sink_tokens, force=a.force,
        verbose=not a.quiet))


if __name__ == "__main__":
    sys.exit(main())
