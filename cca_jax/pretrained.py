"""`from_pretrained`: a ready `LlamaForCausalLM` from a converted model or train checkpoint.

Reading the checkpoint is `cca_jax.checkpoint`; the configuration is `LlamaConfig`
(`config.json` next to the checkpoint, plus the caller's overrides, which this module passes
through unread).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax

from cca_jax.checkpoint import CheckpointReader, find_config
from cca_jax.config import LlamaConfig


def from_pretrained(path: str | os.PathLike, *, dtype: str | None = None,
                    params_path: Sequence | None = None, **overrides):
    """A `LlamaForCausalLM` from a directory written by `convert.hf_to_flax` (or train/).

    `dtype` sets parameter and activation dtype (default: the stored parameters' dtype).
    Every other keyword argument is a `LlamaConfig` override (e.g. `attention="cca",
    group_size=16, window_size=1024`), applied on top of the stored config.json.
    `params_path`: where the parameters sit in a train state, if not found automatically.
    """
    from flax import nnx

    from cca_jax.model import LlamaForCausalLM

    reader = CheckpointReader(path, params_path)
    dtype = dtype or reader.stored_dtype() or "float32"
    cfg = LlamaConfig.from_pretrained_dir(find_config(path),
                                          **{"param_dtype": dtype, **overrides, "dtype": dtype})
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    want = {k: tuple(v.shape) for k, v in _flat(nnx.to_pure_dict(state))}
    got = {k: tuple(m.shape) for k, m in reader.leaves()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:6]
        raise ValueError(f"Checkpoint {reader.dir} does not match its config.json: differing "
                         f"(param, shape) pairs {diff}.")
    # Leaf by leaf: host memory holds one numpy leaf besides the arrays already placed.
    params: dict = {}
    for keys in want:
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = jax.numpy.asarray(reader.read(keys, cfg.param_dtype))
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _flat(tree) -> list[tuple[tuple, Any]]:
    return [(tuple(str(k.key) for k in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
