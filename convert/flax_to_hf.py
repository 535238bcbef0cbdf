"""cca_jax checkpoint (converted model dir, or a train/ checkpoint) -> Hugging Face checkpoint.

    python -m convert.flax_to_hf --ckpt DIR --out OUT_DIR [--config CONFIG_JSON]
        [--max-shard-size-gb 5] [--force] [--quiet]

`DIR` is a directory written by `convert.hf_to_flax`, its `params/`, or a train checkpoint
(params nested in a train state, CheckpointManager step dirs: the latest step is used);
`config.json` is looked up in DIR and up to three parents unless `--config` is given.
Output: sharded safetensors (+ index) in the stored dtype, `config.json` of the original
family (LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM) with CCA settings under
"cca_attention" (transformers ignores that key), tokenizer files found next to the config.

Streaming: every shard header is planned from the checkpoint metadata, then each stacked
parameter is restored alone (orbax partial restore), split into per-layer tensors, transposed
and written at its offset. Peak memory ~ the largest stacked parameter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from cca_jax.config import LlamaConfig
from cca_jax.pretrained import CheckpointReader, find_config, release_freed_memory
from convert.hf_io import (AtomicOutputDir, ConversionError, Progress, SafetensorsShardWriter,
                           copy_tokenizer_files)
from convert.layout import iter_hf_tensors, param_specs


def convert_flax_to_hf(ckpt, out_dir, *, config: str | None = None, force: bool = False,
                       max_shard_bytes: int = 5 * 2**30, verbose: bool = True) -> Path:
    reader = CheckpointReader(ckpt)
    config_path = Path(config) if config else find_config(ckpt)
    stored = {".".join(k): m for k, m in reader.leaves()}
    dtypes = {np.dtype(m.dtype) for m in stored.values()}
    if len(dtypes) != 1:
        raise ConversionError(f"Parameters in {reader.dir} have mixed dtypes {dtypes}; expected "
                              "one.")
    dtype = dtypes.pop()
    cfg = LlamaConfig.from_pretrained_dir(config_path, param_dtype=str(dtype), dtype=str(dtype))
    specs = param_specs(cfg)
    want = {s.name: s.shape for s in specs}
    got = {k: tuple(m.shape) for k, m in stored.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:6]
        raise ConversionError(f"Checkpoint {reader.dir} does not match {config_path}: differing "
                              f"(param, shape) pairs {diff}.")
    hf_order = [(name, shape, dtype) for name, shape in iter_hf_tensors(specs)]
    progress = Progress(len(hf_order), verbose)
    with AtomicOutputDir(out_dir, force) as tmp:
        writer = SafetensorsShardWriter(tmp, hf_order, max_shard_bytes)
        for spec in specs:
            ours = reader.read(spec.path)
            names = spec.hf_names()
            for i, name in enumerate(names):
                part = ours if spec.num_layers is None else ours[i]
                hf = spec.to_hf(part)
                writer.write(name, hf)
                progress.step(name, hf.shape, hf.nbytes)
            del ours, part, hf
            release_freed_memory()
        writer.close()
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        copied = copy_tokenizer_files(config_path.parent, tmp)
    if verbose:
        print(f"wrote {out_dir}: {len(hf_order)} tensors in {len(writer.files)} shard(s), "
              f"{writer.total_bytes / 1e9:.2f} GB {dtype}; tokenizer files: {copied or 'none'}",
              file=sys.stderr)
    return Path(out_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m convert.flax_to_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="our model dir, params dir or train checkpoint")
    ap.add_argument("--out", required=True, help="output HF directory (must not exist)")
    ap.add_argument("--config", default=None, help="config.json (default: found near --ckpt)")
    ap.add_argument("--max-shard-size-gb", type=float, default=5.0)
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    a = ap.parse_args(argv)
    try:
        convert_flax_to_hf(a.ckpt, a.out, config=a.config, force=a.force,
                           max_shard_bytes=int(a.max_shard_size_gb * 2**30), verbose=not a.quiet)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
