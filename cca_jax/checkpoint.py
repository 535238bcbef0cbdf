"""Reading and writing checkpoints of our parameter tree (orbax), leaf by leaf.

A converted model directory holds `config.json` (HF format, from `LlamaConfig.to_hf_dict`),
`params/` (a standard orbax PyTree checkpoint of `nnx.to_pure_dict(nnx.state(model,
nnx.Param))`) and any tokenizer files. Building a model from one is `cca_jax.pretrained`.

Writing (`save_tree`): leaves may be `LazyArray`s (shape, dtype and a function that builds
the array). A type handler builds them ONE AT A TIME inside orbax's save and hands each to
orbax's own numpy handler (its public `serialize`), waiting for that write to finish before
building the next, so the peak host memory of a save is about the largest leaf, not the tree
(plus tensorstore's encoded chunks in flight: measured for a 512 MiB float32 leaf of random
data in 8 chunks, 0.83 GiB over the baseline). Every leaf is recorded as a plain
`np.ndarray`: any orbax restore reads the result.

That bound needs orbax-checkpoint >= 0.12.5, whose numpy handler can be told not to copy the
array it is given (`deepcopy_host_arrays=False`). Older orbax (0.11.17 .. 0.12.4, also
supported) always deep-copies it, so the peak is about TWICE the largest leaf (the built array
and its copy, for that one leaf only; the same leaf: 1.03 GiB with 0.11.17).
`ORBAX_COPIES_LEAVES` says which case applies, and `save_tree` warns once per process when it
does.

Format: zarr without OCDBT. OCDBT keeps a whole array's encoded chunks in memory until its
commit (measured: +0.7 GB over zarr for a 1.6 GB leaf of incompressible float32; the
converter's peak RSS is set by that one leaf). Each zarr chunk is one file, so the chunk
shape is chosen to keep the file count small (`save_args_for`): one chunk per array, except
large arrays with a short leading axis (stacked layers, `[num_layers, ...]`), which get one
chunk per layer so a layer can be read alone and tensorstore encodes one layer at a time.

Reading (`CheckpointReader`): a params tree saved here, or a train state with the params
nested inside (`{"params": ..., "opt_state": ..., "step": ...}`, orbax `CheckpointManager`
step dirs, nnx `{"value": ...}` leaves). Only the parameter leaves are read (orbax partial
restore); `find_params_path` says which subtree they are, deterministically.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from cca_jax.config import LlamaConfig
from cca_jax.host_memory import release_freed_memory

PARAMS_DIR = "params"
PARAM_TREE_KEY = "embed_tokens"       # a dict holding this key is a parameter tree
PARAM_TREE_NAMES = ("params", "model")  # names a train state gives its parameter tree

# Chunking (see the module docstring): arrays up to SPLIT_BYTES are one chunk (one file);
# larger ones with a leading axis of 2..MAX_LEADING_CHUNKS get one chunk per leading index
# when each is at least MIN_CHUNK_BYTES. Files per array <= MAX_LEADING_CHUNKS.
SPLIT_BYTES = 64 * 2**20
MIN_CHUNK_BYTES = 2**20
MAX_LEADING_CHUNKS = 256


def _numpy_handler_copies(handler_cls=ocp.type_handlers.NumpyHandler) -> bool:
    """orbax-checkpoint < 0.12.5: `NumpyHandler` has no `deepcopy_host_arrays`, and its
    `serialize` deep-copies every array it writes (see the module docstring)."""
    return "deepcopy_host_arrays" not in inspect.signature(handler_cls.__init__).parameters


ORBAX_COPIES_LEAVES = _numpy_handler_copies()


# ---- writing -------------------------------------------------------------------------------
class LazyArray:
    """A leaf that is built only when orbax is ready to write it.

    `shape`, `dtype`, `size` and `nbytes` describe it as an array would: orbax sizes the
    leaves of a save from them before any is built (`NumpyHandler.memory_size` reads
    `.size`, orbax 0.12's I/O metrics `.nbytes`).
    """

    def __init__(self, shape: Iterable[int], dtype, build: Callable[[], np.ndarray]):
        self.shape, self.dtype, self._build = tuple(shape), np.dtype(dtype), build
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize

    def build(self) -> np.ndarray:
        arr = np.asarray(self._build())
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"LazyArray built {arr.shape} {arr.dtype}, promised "
                             f"{self.shape} {self.dtype}.")
        return arr


def _wait(futures: Sequence[ocp.future.Future]) -> None:
    for f in futures:
        f.result()


class _LazyArrayHandler(ocp.type_handlers.NumpyHandler):
    """Builds LazyArrays one at a time and writes each with orbax's numpy handler."""

    def __init__(self):
        if ORBAX_COPIES_LEAVES:
            super().__init__()
        else:
            super().__init__(deepcopy_host_arrays=False)   # the array is ours alone: no copy

    async def serialize(self, values, infos, args=None):
        args = list(args or [ocp.SaveArgs()] * len(values))
        write = super().serialize

        async def one_at_a_time():
            for value, info, arg in zip(values, infos, args):
                futures = await write([value.build()], [info], [arg])
                await asyncio.to_thread(_wait, futures)   # this leaf is on disk and freed
                del futures
                release_freed_memory()

        return [ocp.future.CommitFutureAwaitingContractedSignals(one_at_a_time(),
                                                                 name="lazy_array_handler")]


class _HostArrayPyTreeHandler(ocp.PyTreeCheckpointHandler):
    """`PyTreeCheckpointHandler` for zarr checkpoints of host (numpy) leaves.

    orbax 0.12's `finalize` does two things: merge per-process OCDBT files, and validate the
    array metadata that its `jax.Array` handler records. Here OCDBT is off (nothing to merge:
    orbax would log "Skipping merge of OCDBT checkpoints" on every save) and every leaf is
    written by the numpy or scalar handler (no array metadata), so there is nothing to do.
    """

    def finalize(self, directory) -> None:
        del directory


# orbax maps argument classes to handler classes; a handler needs its own save and restore
# argument classes (restore is never used: reading goes through the standard handler).
@ocp.args.register_with_handler(_HostArrayPyTreeHandler, for_save=True)
@dataclasses.dataclass
class _HostArraySave(ocp.args.PyTreeSave):
    pass


@ocp.args.register_with_handler(_HostArrayPyTreeHandler, for_restore=True)
@dataclasses.dataclass
class _HostArrayRestore(ocp.args.PyTreeRestore):
    pass


@functools.cache
def _warn_copies_once() -> None:
    """Warn (once a process: the cache holds the one call) that this orbax copies arrays."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        installed = f"orbax-checkpoint {version('orbax-checkpoint')}"
    except PackageNotFoundError:
        installed = "this orbax-checkpoint"
    warnings.warn(f"{installed} copies each array before writing it, so a save's peak host "
                  "memory is about twice the largest array; orbax-checkpoint >= 0.12.5 writes "
                  "it without the copy.", stacklevel=3)


def _registry():
    th = ocp.type_handlers
    scalar = th.ScalarHandler()
    # jax.Array leaves become LazyArrays in save_tree; the ArrayHandler entry only keeps
    # orbax from warning that array metadata persistence is off.
    return th.create_type_handler_registry(
        (LazyArray, _LazyArrayHandler()), (int, scalar), (float, scalar), (np.number, scalar),
        (str, th.StringHandler()), (jax.Array, th.ArrayHandler()))


def save_args_for(shape: Sequence[int], dtype) -> ocp.SaveArgs:
    """How `save_tree` chunks an array (see SPLIT_BYTES)."""
    shape = tuple(shape)
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if len(shape) < 2 or nbytes <= SPLIT_BYTES or not 2 <= shape[0] <= MAX_LEADING_CHUNKS:
        return ocp.SaveArgs()
    per_slice = nbytes // shape[0]
    if per_slice < MIN_CHUNK_BYTES:
        return ocp.SaveArgs()
    # shard_axes=(0,) makes orbax split axis 0 down to 1; a target of one slice's bytes then
    # stops it there: exactly shape[0] chunks.
    return ocp.SaveArgs(chunk_byte_size=per_slice, shard_axes=(0,))


def _as_lazy(leaf):
    if isinstance(leaf, LazyArray):
        return leaf
    if isinstance(leaf, (np.ndarray, jax.Array)):
        return LazyArray(leaf.shape, leaf.dtype, lambda x=leaf: np.asarray(x))
    return leaf


def save_tree(directory: str | os.PathLike, tree: Any) -> None:
    """Save a pytree of numpy / jax / LazyArray leaves (and scalars, strings) leaf by leaf.

    Arrays are written one at a time as host (numpy) arrays: `jax.Array`s are fetched to the
    host when their turn comes (for sharded training state, use orbax's own handlers).
    `directory` must not exist.
    """
    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"{directory} exists; orbax will not overwrite it.")
    if ORBAX_COPIES_LEAVES:
        _warn_copies_once()
    tree = jax.tree.map(_as_lazy, tree)
    save_args = jax.tree.map(
        lambda x: save_args_for(x.shape, x.dtype) if isinstance(x, LazyArray) else ocp.SaveArgs(),
        tree)
    handler = _HostArrayPyTreeHandler(type_handler_registry=_registry(), use_ocdbt=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(directory, args=_HostArraySave(tree, save_args=save_args))


def save_pretrained(directory: str | os.PathLike, params: Any, config: LlamaConfig) -> None:
    """`directory/config.json` + `directory/params/` (orbax). `directory` may exist (empty).
    Parameters are stored stacked (`layers.<...>` `[L, ...]`), the layout every loader reads."""
    layers = params.get("layers") if isinstance(params, Mapping) else None
    if isinstance(layers, Mapping) and any(str(k).isdigit() for k in layers):
        raise ValueError("these parameters hold the layers one per layer (an inference copy "
                         "from model.unstack_layers); save the stacked model they came from.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    save_tree(directory / PARAMS_DIR, params)


# ---- finding things ------------------------------------------------------------------------
def locate_checkpoint(path: str | os.PathLike) -> Path:
    """The orbax PyTree directory under `path` (model dir, train dir, step dir or itself).

    Order: `path` itself (has `_METADATA`); its `params/`; its numeric step directories (the
    highest step); its item directories with `_METADATA` (one named params / state /
    train_state / default first, else the only one; several others are ambiguous).
    """
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
    items = sorted(c for c in p.iterdir() if c.is_dir() and (c / "_METADATA").exists())
    for name in (PARAMS_DIR, "state", "train_state", "default"):
        if p / name in items:
            return p / name
    if len(items) == 1:
        return items[0]
    if items:
        raise FileNotFoundError(f"{p} holds several orbax items {[c.name for c in items]}; "
                                "pass the one with the parameters.")
    if any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin")):
        raise FileNotFoundError(
            f"{p} looks like a Hugging Face checkpoint, not ours: convert it first with "
            f"`python -m convert.hf_to_flax --hf {p} --out OUT`.")
    raise FileNotFoundError(f"No orbax checkpoint (_METADATA) in {p} or its params/ or step "
                            "subdirectories.")


def find_config(path: str | os.PathLike, levels: int = 3) -> Path:
    """`config.json` in `path` or up to `levels` parents (train dirs keep it at the top)."""
    p = Path(path).absolute()
    for d in [p, *p.parents][: levels + 1]:
        if (d / "config.json").is_file():
            return d / "config.json"
    raise FileNotFoundError(f"No config.json in {p} or its {levels} parent directories.")


def _param_subtrees(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Key paths of every dict that holds PARAM_TREE_KEY (not looking inside those)."""
    if isinstance(tree, dict):
        if PARAM_TREE_KEY in tree:
            return [prefix]
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [p for k, v in items for p in _param_subtrees(v, prefix + (k,))]


def find_params_path(tree: Any) -> tuple:
    """Key path of the parameter tree inside a saved tree (`()`: the tree itself).

    Train states may hold other subtrees with the same keys (optimizer moments `mu`/`nu`
    mirror the parameters), so the choice is by name, not by the first match: the tree
    itself if it holds `embed_tokens`; else a top-level "params"; else the one candidate
    whose last key is "params" or "model"; else the only candidate. Anything else is
    ambiguous and raises.
    """
    found = _param_subtrees(tree)
    if () in found:
        return ()
    if ("params",) in found:
        return ("params",)
    named = [p for p in found if p[-1] in PARAM_TREE_NAMES]
    if len(named) == 1:
        return named[0]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"No parameter tree (no {PARAM_TREE_KEY!r} key at any level); is it "
                         "a cca_jax / train checkpoint?")
    shown = sorted("/".join(map(str, p)) for p in (named or found))
    raise ValueError(f"Ambiguous checkpoint: several subtrees look like parameters: {shown}. "
                     "Pass params_path=(...) with the key path of the parameters.")


# ---- reading -------------------------------------------------------------------------------
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
    """Reads our parameter leaves from an orbax checkpoint, whole tree or one leaf at a time.

    `params_path`: key path of the parameters inside the saved tree (default: found by
    `find_params_path`).
    """

    def __init__(self, path: str | os.PathLike, params_path: Sequence | None = None):
        self.dir = locate_checkpoint(path)
        self._ckptr = ocp.PyTreeCheckpointer()
        meta = self._ckptr.metadata(self.dir)
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
        tree = jax.tree.map(lambda x: x, tree)  # plain containers
        try:
            self.prefix = (find_params_path(tree) if params_path is None
                           else tuple(params_path))
            self.meta = _get(tree, self.prefix)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{self.dir}: {e}") from None

    def leaves(self) -> list[tuple[tuple, Any]]:
        """(key path inside the params tree, metadata with .shape/.dtype) per leaf."""
        out = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.meta)[0]:
            keys = tuple(str(k.key) for k in path)
            if keys and keys[-1] == "value":
                keys = keys[:-1]
            out.append((keys, leaf))
        return out

    def stored_dtype(self) -> str | None:
        """The parameters' dtype name if they share one, else None."""
        dtypes = {np.dtype(m.dtype).name for _, m in self.leaves()}
        return dtypes.pop() if len(dtypes) == 1 else None

    def _restore(self, sub_item, dtype):
        def args(_):
            return ocp.RestoreArgs(restore_type=np.ndarray,
                                   dtype=None if dtype is None else np.dtype(dtype))
        item = _nest(self.prefix, sub_item)
        out = self._ckptr.restore(self.dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=jax.tree.map(args, item), partial_restore=True))
        return _get(out, self.prefix)

    def read_all(self, dtype=None) -> dict:
        return _strip_value(self._restore(jax.tree.map(lambda x: 0, self.meta), dtype))

    def read(self, keys: tuple, dtype=None) -> np.ndarray:
        node = _get(self.meta, keys)
        suffix = ("value",) if isinstance(node, dict) and "value" in node else ()
        out = self._restore(_nest(tuple(keys) + suffix, 0), dtype)
        return _get(out, tuple(keys) + suffix)


def restore_params(path: str | os.PathLike, dtype=None, params_path: Sequence | None = None
                   ) -> dict:
    """Our parameter tree (numpy) from a model dir, params dir or train-state checkpoint."""
    return CheckpointReader(path, params_path).read_all(dtype)
