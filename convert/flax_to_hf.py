"""cca_jax checkpoint (converted model dir, or a train/ checkpoint) -> Hugging Face checkpoint.

    python -m convert.flax_to_hf --ckpt DIR --out OUT_DIR [--config CONFIG_JSON]
        [--max-shard-size-gb 5] [--force] [--quiet]

`DIR` is a directory written by `convert.hf_to_flax`, its `params/`, or a train checkpoint
(params nested in a train state, CheckpointManager step dirs: the latest step is used);
`config.json` is looked up in DIR and up to three parents unless `--config` is given.
Output: sharded safetensors (+ index) in the stored dtype, `config.json` of the original
family (LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM) with CCA settings under
"cca_attention" (transformers ignores that key), tokenizer files found next to the config.

The output must not be, contain or lie inside the checkpoint (nor contain its config.json):
that is refused even with --force, which only replaces an unrelated existing output.

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

from cca_jax.checkpoint import CheckpointReader, find_config
from cca_jax.config import LlamaConfig
from cca_jax.host_memory import release_freed_memory
from convert.hf_io import (AtomicOutputDir, ConversionError, SafetensorsShardWriter,
                           check_output_dir, copy_tokenizer_files, progress_bar, run_cli,
                           cli_parser)
from convert.layout import iter_hf_tensors, param_specs


def convert_flax_to_hf(ckpt, out_dir, *, config: str | None = None, force: bool = False,
                       max_shard_bytes: int = 5 * 2**30, verbose: bool = True) -> Path:
    check_output_dir(out_dir, [ckpt], force)
    reader = CheckpointReader(ckpt)
    config_path = Path(config) if config else find_config(ckpt)
    inputs = [ckpt, reader.dir, config_path]
    check_output_dir(out_dir, inputs, force)
    stored = {".".join(k): m for k, m in reader.leaves()}
    dtype = reader.stored_dtype()
    if dtype is None:
        dtypes = sorted({np.dtype(m.dtype).name for m in stored.values()})
        raise ConversionError(f"Parameters in {reader.dir} have mixed dtypes {dtypes}; expected "
                              "one.")
    cfg = LlamaConfig.from_pretrained_dir(config_path, param_dtype=dtype, dtype=dtype)
    specs = param_specs(cfg)
    want = {s.name: s.shape for s in specs}
    got = {k: tuple(m.shape) for k, m in stored.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:6]
        raise ConversionError(f"Checkpoint {reader.dir} does not match {config_path}: differing "
                              f"(param, shape) pairs {diff}.")
    np_dtype = np.dtype(next(iter(stored.values())).dtype)
    hf_order = [(name, shape, np_dtype) for name, shape in iter_hf_tensors(specs)]
    with AtomicOutputDir(out_dir, inputs, force) as tmp:
        writer = SafetensorsShardWriter(tmp, hf_order, max_shard_bytes)
        with progress_bar(writer.total_bytes, "flax_to_hf", verbose) as bar:
            for spec in specs:
                ours = reader.read(spec.path)
                for i, name in enumerate(spec.hf_names()):
                    hf = spec.to_hf(ours if spec.num_layers is None else ours[i])
                    writer.write(name, hf)
                    bar.set_postfix_str(name, refresh=False)
                    bar.update(hf.nbytes)
                    del hf
                del ours
                release_freed_memory()
        writer.close()
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        copied = copy_tokenizer_files(config_path.parent, tmp)
    if verbose:
        print(f"wrote {out_dir}: {len(hf_order)} tensors in {len(writer.files)} shard(s), "
              f"{writer.total_bytes / 1e6:.1f} MB {dtype}; tokenizer files: {copied or 'none'}",
              file=sys.stderr)
    return Path(out_dir)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every flag with what it does, its default and its choices."""
    ap = cli_parser("python -m convert.flax_to_hf", __doc__,
                    "output Hugging Face directory, written whole or not at all (required; "
                    "must not exist unless --force)")
    ap.add_argument("--ckpt", required=True, metavar="DIR", help="our checkpoint: a model "
                    "directory (convert.hf_to_flax output, train.finetune's OUT/final), its "
                    "params directory, or a train checkpoint step (required)")
    ap.add_argument("--config", default=None, metavar="FILE", help="the model's config.json "
                    "(default: the one found in or above --ckpt)")
    ap.add_argument("--max-shard-size-gb", type=float, default=5.0, metavar="GB",
                    help="largest safetensors shard in GiB; bigger models are split into "
                    "model-0000K-of-0000N.safetensors with an index (default: 5)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    return run_cli(ap, argv, lambda a: convert_flax_to_hf(
        a.ckpt, a.out, config=a.config, force=a.force,
        max_shard_bytes=int(a.max_shard_size_gb * 2**30), verbose=not a.quiet))


if __name__ == "__main__":
    sys.exit(main())
