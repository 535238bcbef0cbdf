"""The device mesh and THE table of logical axis -> mesh axis rules.

Every array the model, the trainer or generation shards is described by logical axes
("batch", "seq", "embed", "heads", "mlp", "vocab", "kv_heads", "cache_ring", ...).
`LOGICAL_RULES` maps each to mesh axes; nothing else in the project names mesh axes for an
array. Parameters carry their logical axes through `PARAM_AXES`, keyed by the parameter's own
name in the tree (the same names in params, gradients and optimizer moments), so one function
shards all three. Activations have theirs in `ACTIVATION_AXES`, the KV cache's arrays in
`CACHE_AXES`.

The model pins its activations to the table at layer boundaries (`constrain`: embeddings,
each layer's output, q / k / v, logits) whenever it is traced under a mesh set with
`jax.set_mesh` (`mesh_context`), as the trainer and generation do; without one (a single
device, tests) it adds nothing.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters and optimizer
state sharded), `tensor` (heads / MLP columns), `sequence` (activations along the sequence).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "sequence")

# THE table: logical axis -> mesh axes (None: replicated). Read-only.
LOGICAL_RULES: Mapping[str, Any] = types.MappingProxyType({
    "batch": ("data", "fsdp"),
    "seq": "sequence",
    "embed": "fsdp",        # parameters' model dimension
    "vocab": "tensor",
    "heads": "tensor",      # q/k/v output features, o input features (heads x head_dim)
    "mlp": "tensor",
    "layers": None,         # the stacked-layer axis of scanned parameters and of the cache
    "norm": None,
    # activations
    "act_embed": None,      # the model dimension of activations (whole on every device)
    "q_heads": "tensor",    # query heads of q, attention outputs and the cache's slots
    "kv_heads": "tensor",   # key/value heads of k, v and the cache's ring
    "head_dim": None,
    # the KV cache
    "cache_ring": None,     # ring entries (raw keys/values of the recent positions)
    "cache_slots": None,    # slots (core tokens, sinks)
})

# Activation name -> logical axes.
ACTIVATION_AXES: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "tokens": ("batch", "seq"),
    "hidden": ("batch", "seq", "act_embed"),
    "q": ("batch", "seq", "q_heads", "head_dim"),
    "kv": ("batch", "seq", "kv_heads", "head_dim"),
    "logits": ("batch", "seq", "vocab"),
    "last_logits": ("batch", "vocab"),   # one position per row (prefill's last, decode steps)
})

# KVCache field -> logical axes (`cca_jax.kv_cache.KVCache`: k, v `[L, B, R, Hkv, D]`,
# ck, cv `[L, B, C, Hq, D]`, lengths `[B]`).
CACHE_AXES: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "k": ("layers", "batch", "cache_ring", "kv_heads", "head_dim"),
    "v": ("layers", "batch", "cache_ring", "kv_heads", "head_dim"),
    "ck": ("layers", "batch", "cache_slots", "q_heads", "head_dim"),
    "cv": ("layers", "batch", "cache_slots", "q_heads", "head_dim"),
    "lengths": ("batch",),
})

# Parameter name (the last keys of its path) -> logical axes of one layer's array; scanned
# parameters get "layers" in front.
PARAM_AXES: Mapping[tuple[str, ...], tuple[str, ...]] = types.MappingProxyType({
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "heads"),
    ("v_proj", "kernel"): ("embed", "heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("heads",),
    ("v_proj", "bias"): ("heads",),
    ("o_proj", "bias"): ("norm",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "bias"): ("norm",),
    ("weight",): ("norm",),   # RMSNorm scales
})


def parse_mesh(text: str) -> dict[str, int]:
    """`"fsdp=4,sequence=2"` -> `{"fsdp": 4, "sequence": 2}` (the `--mesh` flag's format;
    `make_mesh` checks the sizes against the devices)."""
    shape = {}
    for part in filter(None, str(text).split(",")):
        name, _, size = part.strip().partition("=")
        if name not in MESH_AXES or not size.lstrip("-").isdigit():
            raise ValueError(f"--mesh {text!r}: expected axis=size pairs over "
                             f"{MESH_AXES}, e.g. 'fsdp=4,sequence=2' (one size may be -1).")
        shape[name] = int(size)
    return shape


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes MESH_AXES.

    `shape` maps axis names to sizes; missing axes are 1 and one axis may be -1 (the rest of
    the devices). Default: everything on `fsdp`.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = dict(shape or {"fsdp": -1})
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axes {unknown}; the axes are {MESH_AXES}.")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    free = [a for a, n in sizes.items() if n == -1]
    if len(free) > 1 or any(n == 0 or n < -1 for n in sizes.values()):
        raise ValueError(f"mesh sizes must be positive, with at most one -1; got {shape}.")
    known = math.prod(n for n in sizes.values() if n != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"mesh {shape}: {len(devices)} devices are not a multiple of "
                             f"{known}; choose sizes that divide the device count.")
        sizes[free[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, but "
                         f"{len(devices)} are visible; make the sizes multiply to "
                         f"{len(devices)} (or use -1 for one axis).")
    grid = np.asarray(devices).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def logical_spec(axes: Sequence[str | None], shape: Sequence[int],
                 mesh: Mesh | AbstractMesh) -> PartitionSpec:
    """PartitionSpec of an array with logical `axes` on `mesh` (concrete or abstract). A mesh
    axis that does not divide its dimension (or is already used) is dropped for that
    dimension: replication is always correct, only less sharded."""
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape):
        rule = LOGICAL_RULES.get(name) if name is not None else None
        mesh_axes = [rule] if isinstance(rule, str) else list(rule or ())
        chosen = []
        for axis in mesh_axes:
            n = mesh.shape[axis]
            if axis in used or n == 1 or size % (n * math.prod(mesh.shape[a] for a in chosen)):
                continue
            chosen.append(axis)
        used.update(chosen)
        spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, name: str) -> jax.Array:
    """`x` pinned to the sharding of activation `name` (an `ACTIVATION_AXES` key) on the mesh
    set by `jax.set_mesh` (`mesh_context`), so XLA keeps activations where the table puts
    them instead of guessing. Unchanged with no mesh set, on a one-device mesh, and where
    some mesh axis is not Auto (inside `shard_map`, or explicit sharding: there the types
    already carry the shardings)."""
    axes = ACTIVATION_AXES.get(name)
    if axes is None:
        raise ValueError(f"unknown activation {name!r}; the activations are "
                         f"{sorted(ACTIVATION_AXES)} (add it to ACTIVATION_AXES).")
    if len(axes) != x.ndim:
        raise ValueError(f"activation {name!r} has the logical axes {axes}, but the array "
                         f"has shape {tuple(x.shape)}; pass a {len(axes)}-d array or "
                         "another name.")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or not mesh.are_all_axes_auto:
        return x
    missing = [a for a in MESH_AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"the mesh set with jax.set_mesh lacks the axes {missing}; build it "
                         f"with cca_jax.sharding.make_mesh (axes {MESH_AXES}).")
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh))


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)` as a context manager, or nothing when `mesh` is None. Trace (and
    call: the mesh is part of jit's cache key) the model's jitted functions inside it so
    `constrain` takes effect."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def param_axes(path: Sequence[str], ndim: int) -> tuple[str, ...] | None:
    """Logical axes of the parameter (or its gradient / optimizer moment) at `path`."""
    for length in (2, 1):
        axes = PARAM_AXES.get(tuple(path[-length:]))
        if axes is not None:
            if ndim == len(axes) + 1:
                return ("layers", *axes)
            return axes if ndim == len(axes) else None
    return None


def _dict_keys(path) -> list[str]:
    return [str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)]


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for params, gradients or optimizer state: leaves named in PARAM_AXES
    follow their logical axes, everything else (step counts, scalars) is replicated."""
    def one(path, leaf):
        shape = getattr(leaf, "shape", ())
        axes = param_axes(_dict_keys(path), len(shape))
        spec = PartitionSpec() if axes is None else logical_spec(axes, shape, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, seq] arrays: batch over data x fsdp, sequence over `sequence`."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"], LOGICAL_RULES["seq"]))


def activation_sharding(name: str, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """NamedSharding of the activation `name` (an `ACTIVATION_AXES` key) of this shape."""
    if name not in ACTIVATION_AXES:
        raise ValueError(f"unknown activation {name!r}; the activations are "
                         f"{sorted(ACTIVATION_AXES)}.")
    return NamedSharding(mesh, logical_spec(ACTIVATION_AXES[name], shape, mesh))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """A `KVCache` of NamedShardings for `cache` (arrays or `kv_cache.cache_shapes`), from
    `CACHE_AXES`: what `kv_cache.init_cache(..., sharding=)` takes. Default table: rows over
    data x fsdp, heads over tensor; ring, slots and head_dim whole."""
    return cache.replace(**{
        name: NamedSharding(mesh, logical_spec(axes, getattr(cache, name).shape, mesh))
        for name, axes in CACHE_AXES.items()})


def shard_model(model: Any, mesh: Mesh) -> Any:
    """Place an nnx model's parameters on `mesh` by `tree_shardings`, in place; returns it."""
    from flax import nnx

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tree_shardings(state, mesh)))
    return model


def unnamed_params(tree: Any) -> list[str]:
    """Paths of array leaves PARAM_AXES does not describe (a test keeps this empty)."""
    missing = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if param_axes(_dict_keys(path), len(getattr(leaf, "shape", ()))) is None:
            missing.append(jax.tree_util.keystr(path))
    return missing
