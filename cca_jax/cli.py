"""What the inference command lines share (`python -m cca_jax.generate`, `python -m
cca_jax.eval`, `python -m cca_jax.serve`): the usage error, the checkpoint argument and the
model flags."""

from __future__ import annotations

import argparse
from pathlib import Path


class UsageError(Exception):
    """Bad input the user can fix; printed as `error: ...` with exit status 2."""


def check_checkpoint(ckpt) -> Path:
    """The checkpoint directory `--ckpt` names, or a UsageError saying what to pass."""
    from cca_jax.checkpoint import find_config

    path = Path(ckpt)
    if not path.is_dir():
        raise UsageError(f"checkpoint directory {path} does not exist (--ckpt).")
    try:
        find_config(path)
    except FileNotFoundError as e:
        raise UsageError(f"{e} Is --ckpt a converted checkpoint "
                         "(python -m convert.hf_to_flax) or a train/ export?") from None
    return path


def add_checkpoint_arg(ap: argparse.ArgumentParser) -> None:
    """`--ckpt DIR`, required by every inference CLI (generate, eval, serve)."""
    ap.add_argument("--ckpt", required=True, metavar="DIR", help="converted checkpoint "
                    "directory (convert.hf_to_flax output, or a train.finetune export such as "
                    "OUT/final) with its tokenizer (required)")


ATTENTION_FLAGS = ("attention", "group_size", "window_size", "sink_tokens")


def add_attention_args(ap: argparse.ArgumentParser) -> None:
    """The attention flags every inference CLI shares (generate, cca_jax.eval)."""
    ap.add_argument("--attention", choices=("cca", "full", "sliding", "streaming"),
                    default=None, help="attention option: cca (core tokens plus a local "
                    "window), full, sliding (a window), streaming (sinks plus a window) "
                    "(default: the checkpoint's)")
    ap.add_argument("--group-size", type=int, default=None, metavar="G",
                    help="CCA group size g: one core token per G tokens (default: the "
                    "checkpoint's)")
    ap.add_argument("--window-size", type=int, default=None, metavar="W",
                    help="local window in tokens: CCA's s, sliding's and streaming's W "
                    "(default: the checkpoint's)")
    ap.add_argument("--sink-tokens", type=int, default=None, metavar="N",
                    help="attention sinks: the first N tokens stay visible, raw, to every "
                    "later query (streaming's sinks; cca's, SPEC 6, 0 = the paper's CCA) "
                    "(default: the checkpoint's)")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The flags that change how a checkpoint runs: its attention option, its dtype, the
    devices it runs on and where compiled programs are cached."""
    add_attention_args(ap)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="parameter and activation dtype (default: the checkpoint's)")
    ap.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                    help="run over several devices: a mesh of axis=size pairs over data, "
                    "fsdp, tensor, sequence (e.g. data=2,tensor=4; one size may be -1); "
                    "parameters and the KV cache are sharded by cca_jax.sharding's "
                    "logical-axis table (default: one device)")
    add_compile_cache_args(ap)


def mesh_from_args(a):
    """The `jax.sharding.Mesh` that `--mesh` asks for, or None; UsageError when the devices
    cannot make it."""
    text = getattr(a, "mesh", None)
    if text is None:
        return None
    from cca_jax.sharding import make_mesh, parse_mesh

    try:
        return make_mesh(parse_mesh(text))
    except ValueError as e:
        raise UsageError(str(e)) from None


def attention_overrides(a) -> dict:
    """`from_pretrained` overrides from parsed attention flags (the ones given)."""
    return {k: getattr(a, k) for k in ATTENTION_FLAGS if getattr(a, k) is not None}


# ---- the persistent compilation cache (on by default in every CLI) ----------------------

CACHE_ROOT_ENV = "CCA_JAX_CACHE_DIR"   # overrides ~/.cache/cca-jax (the tests point it away)


def default_compile_cache_dir() -> Path:
    """`$CCA_JAX_CACHE_DIR/jax-compile`, by default `~/.cache/cca-jax/jax-compile`."""
    import os

    root = os.environ.get(CACHE_ROOT_ENV) or Path.home() / ".cache" / "cca-jax"
    return Path(root) / "jax-compile"


def add_compile_cache_args(ap: argparse.ArgumentParser) -> None:
    """`--compile-cache DIR` / `--no-compile-cache`: JAX's persistent compilation cache, so a
    second run of the same programs loads them instead of compiling (on by default)."""
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="persistent compilation cache directory: a rerun with the same "
                       "shapes loads its compiled programs from there "
                       f"(default: {default_compile_cache_dir()}; ${CACHE_ROOT_ENV} moves it)")
    group.add_argument("--no-compile-cache", action="store_true",
                       help="compile everything afresh and store nothing (default: cache on)")


def enable_compile_cache(a) -> Path | None:
    """Turn on JAX's persistent compilation cache as `--compile-cache` / `--no-compile-cache`
    say (call before the first compilation). Returns the directory, or None when off.
    Every program is stored, however quick to compile (JAX's default skips those under a
    second: a server's start-up compiles many such programs)."""
    if getattr(a, "no_compile_cache", False):
        return None
    path = Path(getattr(a, "compile_cache", None) or default_compile_cache_dir()).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the compilation cache {path}: {e.strerror}; pass "
                         "--compile-cache DIR elsewhere or --no-compile-cache.") from None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
