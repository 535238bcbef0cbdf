"""What the inference command lines share (`python -m cca_jax.generate`, `python -m
cca_jax.eval`): the usage error, the checkpoint argument and the model flags."""

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
    """The flags that change how a checkpoint runs: its attention option, its dtype and the
    devices it runs on."""
    add_attention_args(ap)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="parameter and activation dtype (default: the checkpoint's)")
    ap.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                    help="run over several devices: a mesh of axis=size pairs over data, "
                    "fsdp, tensor, sequence (e.g. data=2,tensor=4; one size may be -1); "
                    "parameters and the KV cache are sharded by cca_jax.sharding's "
                    "logical-axis table (default: one device)")


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
