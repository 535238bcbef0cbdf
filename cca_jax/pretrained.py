"""Checkpoints of our parameter tree: orbax save/restore (streaming) and `from_pretrained`.

A converted model directory holds `config.json` (HF format from `LlamaConfig.to_hf_dict`, CCA
settings under `CCA_CONFIG_KEY`), `params/` (a standard orbax PyTree checkpoint of
`nnx.to_pure_dict(nnx.state(model, nnx.Param))`) and any tokenizer files.

Streaming save: leaves may be `LazyArray`s (shape, dtype, and a function that builds the
array). A dedicated orbax type handler materializes them ONE AT A TIME inside orbax's save
and writes each with orbax's own numpy writer before building the next, so the peak host
memory of a save is the largest single leaf (plus tensorstore's write buffer), not the tree.
The result is an ordinary `np.ndarray` entry, readable by any orbax restore.

Restore accepts a params tree saved here, a train state with the params nested inside
(`{"params": ..., "opt_state": ..., "step": ...}`, orbax `CheckpointManager` step dirs, nnx
`{"value": ...}` leaves), and reads only the parameter leaves (orbax partial restore).
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp

from cca_jax.config import DTYPES, LlamaConfig

PARAMS_DIR = "params"
_ROOT_PARAM_KEY = "embed_tokens"   # a subtree holding this key is our parameter tree


class LazyArray:
    """A leaf that is built only when orbax is ready to write it."""

    def __init__(self, shape: Iterable[int], dtype, build: Callable[[], np.ndarray]):
        self.shape, self.dtype, self._build = tuple(shape), np.dtype(dtype), build

    def build(self) -> np.ndarray:
        arr = np.asarray(self._build())
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"LazyArray built {arr.shape} {arr.dtype}, promised "
                             f"{self.shape} {self.dtype}.")
        return arr


class _LazyArrayHandler(ocp.type_handlers.NumpyHandler):
    """Builds and writes LazyArrays sequentially; records them as plain `np.ndarray`."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)

        async def write_one_by_one():
            for value, info, arg in zip(values, infos, args):
                arr = value.build()
                await self._background_serialize([arr], [info], [arg])
                del arr
                release_freed_memory()

        return [ocp.future.CommitFutureAwaitingContractedSignals(write_one_by_one(),
                                                                 name="lazy_array_handler")]


def release_freed_memory() -> None:
    """Give freed heap back to the OS (glibc keeps big freed blocks in tensorstore's thread
    arenas otherwise, which would add up to a leaf's size to the converter's RSS)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _lazy_registry():
    th = ocp.type_handlers
    return th.create_type_handler_registry(
        (LazyArray, _LazyArrayHandler()), (int, th.ScalarHandler()), (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()), (jax.Array, th.ArrayHandler()),
        (str, th.StringHandler()))


def save_tree(directory: str | os.PathLike, tree: Any) -> None:
    """Save a pytree (numpy / jax / LazyArray leaves) as an orbax checkpoint, leaf by leaf.

    numpy leaves are written one at a time too; `jax.Array` leaves go through orbax's array
    handler. `directory` must not exist.
    """
    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"{directory} exists; orbax will not overwrite it.")
    tree = jax.tree.map(
        lambda x: LazyArray(x.shape, x.dtype, lambda x=x: x) if isinstance(x, np.ndarray) else x,
        tree)
    save_args = jax.tree.map(_save_args, tree)
    # use_ocdbt=False: OCDBT buffers a whole array's encoded chunks in memory before its
    # commit (measured: +2 GB for a 2.9 GB leaf); plain zarr writes chunk by chunk.
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_lazy_registry(),
                                          use_ocdbt=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(directory, args=ocp.args.PyTreeSave(tree, save_args=save_args))


def _save_args(leaf) -> ocp.SaveArgs:
    """Chunks along the leading axis: one layer per chunk for stacked parameters (at least
    16 MB), so tensorstore encodes chunk by chunk and a layer can be read alone."""
    shape = getattr(leaf, "shape", ())
    if len(shape) < 2 or shape[0] < 2:
        return ocp.SaveArgs()
    nbytes = int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return ocp.SaveArgs(chunk_byte_size=max(nbytes // shape[0], 16 * 2**20), shard_axes=(0,))


def save_pretrained(directory: str | os.PathLike, params: Any, config: LlamaConfig) -> None:
    """`directory/config.json` + `directory/params/` (orbax). `directory` may exist (empty)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    save_tree(directory / PARAMS_DIR, params)


# ---- restore -------------------------------------------------------------------------------
def locate_checkpoint(path: str | os.PathLike) -> Path:
    """The orbax PyTree directory under `path` (model dir, train dir, step dir or itself)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"No checkpoint at {p}.")
    if (p / "_METADATA").exists():
        return p
    if (p / PARAMS_DIR).is_dir():
        return locate_checkpoint(p / PARAMS_DIR)
    steps = sorted((c for c in p.iterdir() if c.is_dir() and c.name.isdigit()),
                   key=lambda c: int(c.name))
    if steps:
        return locate_checkpoint(steps[-1])
    items = [c for c in sorted(p.iterdir()) if c.is_dir() and (c / "_METADATA").exists()]
    if items:
        preferred = [c for c in items if c.name in ("params", "state", "train_state", "default")]
        return (preferred or items)[0]
    if any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin")):
        raise FileNotFoundError(
            f"{p} looks like a Hugging Face checkpoint, not ours: convert it first with "
            f"`python -m convert.hf_to_flax --hf {p} --out OUT`.")
    raise FileNotFoundError(f"No orbax checkpoint (_METADATA) in {p} or its params/ or step "
                            "subdirectories.")


def _find_params(tree: Any, prefix: tuple = ()) -> tuple | None:
    """Key path of the subtree that is our parameter tree (prefers a "params" key)."""
    if not isinstance(tree, dict):
        return None
    if _ROOT_PARAM_KEY in tree:
        return prefix
    keys = sorted(tree, key=lambda k: (k != "params", k != "model", str(k)))
    for k in keys:
        found = _find_params(tree[k], prefix + (k,))
        if found is not None:
            return found
    return None


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _nest(path, value):
    for k in reversed(path):
        value = {k: value}
    return value


def _strip_value(tree):
    """nnx State saved as a pytree keeps `{"value": array}` per Variable: drop that level."""
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return tree["value"]
        return {k: _strip_value(v) for k, v in tree.items()}
    return tree


class CheckpointReader:
    """Reads our parameter leaves from an orbax checkpoint, whole tree or one leaf at a time."""

    def __init__(self, path: str | os.PathLike):
        self.dir = locate_checkpoint(path)
        self._ckptr = ocp.PyTreeCheckpointer()
        meta = self._ckptr.metadata(self.dir)
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
        tree = jax.tree.map(lambda x: x, tree)  # plain dicts
        self.prefix = _find_params(tree)
        if self.prefix is None:
            raise ValueError(f"{self.dir} holds no parameter tree (no {_ROOT_PARAM_KEY!r} key "
                             "at any level); is it a cca_jax / train checkpoint?")
        self.meta = _get(tree, self.prefix)

    def leaves(self) -> list[tuple[tuple, Any]]:
        """(key path inside the params tree, metadata with .shape/.dtype) per leaf."""
        out = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.meta)[0]:
            keys = tuple(str(k.key) for k in path)
            if keys and keys[-1] == "value":
                keys = keys[:-1]
            out.append((keys, leaf))
        return out

    def _restore(self, sub_item, dtype):
        def args(leaf):
            return ocp.RestoreArgs(restore_type=np.ndarray,
                                   dtype=None if dtype is None else np.dtype(dtype))
        item = _nest(self.prefix, sub_item)
        restore_args = jax.tree.map(args, item)
        out = self._ckptr.restore(self.dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True))
        return _get(out, self.prefix)

    def read_all(self, dtype=None) -> dict:
        return _strip_value(self._restore(jax.tree.map(lambda x: 0, self.meta), dtype))

    def read(self, keys: tuple, dtype=None) -> np.ndarray:
        node = self.meta
        for k in keys:
            node = node[k]
        suffix = ("value",) if isinstance(node, dict) and "value" in node else ()
        out = self._restore(_nest(keys + suffix, 0), dtype)
        return _get(out, keys + suffix)


def restore_params(path: str | os.PathLike, dtype=None) -> dict:
    """Our parameter tree (numpy) from a model dir, params dir or train-state checkpoint."""
    return CheckpointReader(path).read_all(dtype)


def find_config(path: str | os.PathLike, levels: int = 3) -> Path:
    """`config.json` in `path` or up to `levels` parents (train dirs keep it at the top)."""
    p = Path(path).absolute()
    for d in [p, *p.parents][: levels + 1]:
        if (d / "config.json").is_file():
            return d / "config.json"
    raise FileNotFoundError(f"No config.json in {p} or its {levels} parent directories.")


def from_pretrained(path: str | os.PathLike, *, attention: str = "cca",
                    group_size: int | None = None, window_size: int | None = None,
                    dtype: str | None = None, **overrides):
    """A ready `LlamaForCausalLM` from a directory written by `convert.hf_to_flax` (or train/).

    `attention`: "cca" or "full". `group_size` / `window_size` override the CCA settings
    stored in config.json. `dtype` sets parameter and activation dtype (default: the stored
    parameter dtype). Other keyword arguments override `LlamaConfig` fields.
    """
    from flax import nnx

    from cca_jax.model import LlamaForCausalLM

    reader = CheckpointReader(path)
    if dtype is None:
        stored = {str(np.dtype(m.dtype)) for _, m in reader.leaves()}
        dtype = next((d for d in DTYPES if d in stored), "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
    if group_size is not None:
        overrides["cca_group_size"] = group_size
    if window_size is not None:
        overrides["cca_window_size"] = window_size
    cfg = LlamaConfig.from_pretrained_dir(find_config(path), attention=attention, dtype=dtype,
                                          param_dtype=dtype, **overrides)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = {k: tuple(v.shape) for k, v in _flat(expected)}
    got = {k: tuple(m.shape) for k, m in reader.leaves()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:6]
        raise ValueError(f"Checkpoint {reader.dir} does not match its config.json: differing "
                         f"(param, shape) pairs {diff}.")
    # Leaf by leaf: host memory holds one numpy leaf besides the arrays already placed.
    params = {}
    for keys in want:
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = jax.numpy.asarray(reader.read(keys, dtype))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _flat(tree) -> list[tuple[tuple, Any]]:
    return [(tuple(str(k.key) for k in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
