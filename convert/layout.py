"""The HF <-> cca_jax parameter name and layout tables, one per tensor layout.

Our tree is `nnx.to_pure_dict(nnx.state(model, nnx.Param))`: per-layer parameters are stacked
on a leading layer axis (`layers.self_attn.q_proj.kernel` is `[N, in, out]`); HF keeps one
tensor per layer (`model.layers.{i}.self_attn.q_proj.weight`, torch Linear `[out, in]`).
A table entry says which HF tensor a parameter comes from and whether it is transposed.

Which entries exist (biases, `lm_head`) is decided by the config, not by the family: the
expected parameter set is taken from the model itself (`nnx.eval_shape`), so Qwen2's q/k/v
biases, LLaMA's optional `attention_bias` / `mlp_bias` and tied embeddings need no code paths
here. LLaMA, Mistral (sliding_window null) and Qwen2 therefore share the "llama" table (their
`cca_jax.family.Family.weight_layout`); a family that names or lays out tensors differently
gets its own `FamilyLayout` in `LAYOUTS`, named by its `Family` record.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Iterator, Mapping

import jax
import numpy as np
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.family import FAMILIES

Path_ = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_name: str              # HF tensor name; per-layer names contain "{i}"
    transpose: bool = False   # torch Linear [out, in] <-> Flax kernel [in, out]


@dataclasses.dataclass(frozen=True)
class FamilyLayout:
    entries: dict[str, Entry]            # our dotted path -> HF tensor
    ignored: tuple[str, ...] = ()        # HF tensor name suffixes that carry no parameters
    layers_key: str = "layers"           # our subtree whose leaves are stacked per layer


def _linear(hf_prefix: str) -> dict[str, Entry]:
    return {"kernel": Entry(f"{hf_prefix}.weight", True), "bias": Entry(f"{hf_prefix}.bias")}


def _build_llama() -> FamilyLayout:
    e: dict[str, Entry] = {
        "embed_tokens.embedding": Entry("model.embed_tokens.weight"),
        "norm.weight": Entry("model.norm.weight"),
        "lm_head.kernel": Entry("lm_head.weight", True),
        "layers.input_layernorm.weight": Entry("model.layers.{i}.input_layernorm.weight"),
        "layers.post_attention_layernorm.weight":
            Entry("model.layers.{i}.post_attention_layernorm.weight"),
    }
    for mod, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                       ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        for p in projs:
            for leaf, entry in _linear(f"model.layers.{{i}}.{mod}.{p}").items():
                e[f"layers.{mod}.{p}.{leaf}"] = entry
    return FamilyLayout(entries=e, ignored=("rotary_emb.inv_freq",))


LLAMA = _build_llama()
# Layout name (`Family.weight_layout`) -> table.
LAYOUTS: Mapping[str, FamilyLayout] = types.MappingProxyType({"llama": LLAMA})


def family_layout(cfg: LlamaConfig) -> FamilyLayout:
    """The tensor layout of `cfg.model_type`'s family."""
    family = FAMILIES.get(cfg.model_type)
    if family is None or family.weight_layout not in LAYOUTS:
        raise ValueError(f"No weight layout for model_type {cfg.model_type!r}; supported: "
                         f"{sorted(FAMILIES)}.")
    return LAYOUTS[family.weight_layout]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One leaf of our tree and where its data lives in HF."""

    path: Path_                    # key path in our pure-dict tree
    shape: tuple[int, ...]         # our shape (stacked: leading N)
    entry: Entry
    num_layers: int | None         # None: not stacked

    @property
    def name(self) -> str:
        return ".".join(self.path)

    def hf_names(self) -> list[str]:
        if self.num_layers is None:
            return [self.entry.hf_name]
        return [self.entry.hf_name.format(i=i) for i in range(self.num_layers)]

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of one HF tensor (one layer's, for stacked parameters)."""
        shape = self.shape[1:] if self.num_layers is not None else self.shape
        return tuple(reversed(shape)) if self.entry.transpose else tuple(shape)

    def to_ours(self, hf_tensor: np.ndarray) -> np.ndarray:
        return hf_tensor.T if self.entry.transpose else hf_tensor

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.T) if self.entry.transpose else ours


def abstract_params(cfg: LlamaConfig) -> dict:
    """Our parameter tree for `cfg` as ShapeDtypeStructs (no memory allocated)."""
    from cca_jax.model import LlamaForCausalLM
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def param_specs(cfg: LlamaConfig) -> list[ParamSpec]:
    """Every leaf of our tree for `cfg`, with its HF source, in a stable order."""
    layout = family_layout(cfg)
    specs = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        keys = tuple(str(k.key) for k in path)
        dotted = ".".join(keys)
        if dotted not in layout.entries:
            raise ValueError(f"The {cfg.model_type} layout table has no entry for parameter "
                             f"{dotted}; add it to convert/layout.py.")
        stacked = keys[0] == layout.layers_key
        specs.append(ParamSpec(keys, tuple(leaf.shape), layout.entries[dotted],
                               cfg.num_hidden_layers if stacked else None))
    return specs


def iter_hf_tensors(specs: list[ParamSpec]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of every tensor, in HF's usual order (globals, then layer by layer)."""
    flat = [s for s in specs if s.num_layers is None]
    stacked = [s for s in specs if s.num_layers is not None]
    first = [s for s in flat if s.path[0] == "embed_tokens"]
    last = [s for s in flat if s.path[0] != "embed_tokens"]
    for s in first:
        yield s.entry.hf_name, s.hf_shape()
    if stacked:
        for i in range(stacked[0].num_layers):
            for s in stacked:
                yield s.entry.hf_name.format(i=i), s.hf_shape()
    for s in last:
        yield s.entry.hf_name, s.hf_shape()
