"""Model and CCA configuration: the one place that reads Hugging Face config keys.

`LlamaConfig` is a frozen dataclass built from a HF `config.json` (LLaMA 2/3, Qwen2,
LLaMA-compatible Mistral) plus our runtime settings (dtypes, which attention, remat) and
the attention settings (`AttentionConfig`). CLI flags map onto these fields; nothing else in the project
parses HF keys or branches on model names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from cca_jax.attention import IMPLEMENTATION_CHOICES
from cca_jax.attention.pooling import POOLING_FNS
from cca_jax.blocks import ATTENTION_KINDS, AttentionPattern, default_sink_tokens, parse_option
from cca_jax.family import FAMILIES
from cca_jax.remat import ATTENTION_LSE, ATTENTION_OUT

# Remat policies by name (None: no remat); `model.py` applies them. `save_attention`: as
# `full`, but the attention kernel's output and log-sum-exp are kept (`cca_jax.remat`), so
# the backward does not run the attention forward again.
REMAT_POLICIES = types.MappingProxyType({
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT,
                                                                     ATTENTION_LSE),
})
DTYPES = types.MappingProxyType({"float32": jnp.float32, "bfloat16": jnp.bfloat16,
                                 "float16": jnp.float16})

# The RoPE variants (HF's `rope_type`); `cca_jax.rope.INV_FREQ_FNS` implements each.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Key under which our CCA settings are recorded inside a HF config.json.
CCA_CONFIG_KEY = "cca_attention"
# Format of that record, written into it as "format": 2 since sink_tokens applies to cca too
# (SPEC 6). A record without it is older: there, cca ignored sink_tokens (written as 4, the
# streaming default), so it loads as plain CCA (0 sinks).
ATTENTION_RECORD_FORMAT = 2


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive_int(name: str, value: Any) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        f"{name} must be a positive integer, got {value!r}.",
    )


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention the model runs, and its settings (SPEC.md, "the other attention options").

    kind: "cca" (the default), "full" (causal), "sliding" (the last `window_size` keys) or
    "streaming" (StreamingLLM: `sink_tokens` first tokens plus the sliding window).
    group_size: tokens pooled into one core token (`g`, cca). window_size: the raw local window
    (`s` for cca, `W` for sliding and streaming). sink_tokens (`N`): the first tokens of each
    document every later query sees raw: streaming's sinks, or cca's (SPEC 6: the groups start
    after them). None (the default) takes the option's own default, 4 for streaming and 0
    (the paper's CCA) for cca; a change of `kind` by name (`LlamaConfig.replace(attention=
    "streaming")`) that does not give sink_tokens takes the new option's default too.
    pooling (cca): "cca" (query-weighted, the paper's), "mean" or "max" (ablations).
    implementation: "auto" picks the fastest available for the backend and call; "naive" is
    the dense reference (tests, small L); "xla" is blocked and memory-linear on any backend.
    """

    kind: str = "cca"
    group_size: int = 16
    window_size: int = 1024
    sink_tokens: int | None = None
    pooling: str = "cca"
    implementation: str = "auto"

    def __post_init__(self):
        _require(self.kind in ATTENTION_KINDS,
                 f"attention must be one of {sorted(ATTENTION_KINDS)}, got {self.kind!r}.")
        if self.sink_tokens is None:
            object.__setattr__(self, "sink_tokens", default_sink_tokens(self.kind))
        self.pattern  # validates sizes  # noqa: B018
        _require(self.pooling in tuple(POOLING_FNS),
                 f"pooling must be one of {tuple(POOLING_FNS)}, got {self.pooling!r}.")
        _require(self.implementation in IMPLEMENTATION_CHOICES,
                 f"implementation must be one of {IMPLEMENTATION_CHOICES}, "
                 f"got {self.implementation!r}.")

    @property
    def pattern(self) -> AttentionPattern:
        """Which keys a query sees (`cca_jax.blocks`)."""
        return parse_option(self.kind, group_size=self.group_size, window_size=self.window_size,
                            sink_tokens=self.sink_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ATTENTION_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig))


def _attention_config(value, base: AttentionConfig | None = None) -> AttentionConfig:
    """An AttentionConfig from an AttentionConfig, a kind name or a dict of its fields."""
    if isinstance(value, AttentionConfig):
        return value
    base = base or AttentionConfig()
    if isinstance(value, str):
        value = {"kind": value}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(ATTENTION_FIELDS))
        _require(not unknown, f"unknown attention settings {unknown}; known: {ATTENTION_FIELDS}.")
        value = dict(value)
        if value.get("kind", base.kind) != base.kind:   # another option: its own sink default
            value.setdefault("sink_tokens", None)
        return dataclasses.replace(base, **value)
    raise ValueError(f"attention must be one of {sorted(ATTENTION_KINDS)}, an AttentionConfig "
                     f"or a dict of its fields, got {value!r}.")


def _attention_from_record(record: Any) -> AttentionConfig:
    """The AttentionConfig of a config.json's CCA_CONFIG_KEY record, old formats included."""
    _require(isinstance(record, Mapping),
             f"config.json's {CCA_CONFIG_KEY!r} must be an object of attention settings, "
             f"got {record!r}.")
    record = dict(record)
    fmt = record.pop("format", 1)
    _require(fmt in (1, ATTENTION_RECORD_FORMAT),
             f"config.json's {CCA_CONFIG_KEY!r} has format {fmt!r}; this cca-jax reads formats "
             f"1 and {ATTENTION_RECORD_FORMAT}: update cca-jax to load this checkpoint.")
    if fmt == 1 and record.get("kind", AttentionConfig.kind) == "cca":
        record.pop("sink_tokens", None)    # cca ignored it then: plain CCA
    return _attention_config(record)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, mirroring HF's `rope_scaling` / `rope_parameters`."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _require(self.rope_type in ROPE_TYPES,
                 f"rope type {self.rope_type!r} is not supported; supported: "
                 f"{ROPE_TYPES}.")
        _require(self.factor > 0, f"rope scaling factor must be > 0, got {self.factor}.")
        if self.rope_type == "llama3":
            _require(self.original_max_position_embeddings is not None,
                     "llama3 rope scaling needs original_max_position_embeddings.")
            _require(self.high_freq_factor != self.low_freq_factor,
                     "llama3 rope scaling needs high_freq_factor != low_freq_factor.")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None) -> "RopeScaling":
        if not params:
            return cls()
        rope_type = params.get("rope_type", params.get("type", "default"))
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in params.items() if k in fields and v is not None}
        kwargs["rope_type"] = rope_type
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any] | None:
        if self.rope_type == "default":
            return None
        keys = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings", "attention_factor",
                     "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
        }[self.rope_type]
        out = {"rope_type": self.rope_type}
        out.update({k: getattr(self, k) for k in keys if getattr(self, k) is not None})
        return out


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A LLaMA-family decoder plus how to run it.

    The architecture fields follow HF's names. `attention` (an `AttentionConfig`; a kind name
    or a dict of its fields is accepted) swaps the attention core. `sliding_window` is the
    checkpoint's own window when its config.json sets one (Mistral v0.1, Qwen2 with
    use_sliding_window): such a model runs `sliding` attention by default, and refuses `full`
    attention over more tokens than the window. Weights are `param_dtype`, activations
    `dtype`; norms, softmax and logits are always float32.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # bias on q, k, v and o projections (HF LLaMA)
    qkv_bias: bool | None = None        # bias on q, k, v only (Qwen2); None: attention_bias
    mlp_bias: bool = False
    model_type: str = "llama"           # HF family the weights came from (export target)
    # Special token ids, carried through conversion (eos may be several ids: a tuple).
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    sliding_window: int | None = None   # the checkpoint's own attention window, if any
    # How to run it.
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    dtype: str = "bfloat16"
    param_dtype: str = "bfloat16"
    remat: str = "none"
    scan_layers: bool = True

    def __post_init__(self):
        # Fill derived defaults (frozen: go through object.__setattr__).
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            _positive_int("num_attention_heads", self.num_attention_heads)
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                     f"({self.num_attention_heads}); set head_dim explicitly.")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.attention_bias)
        if isinstance(self.rope_scaling, Mapping) or self.rope_scaling is None:
            object.__setattr__(self, "rope_scaling", RopeScaling.from_hf(self.rope_scaling))
        object.__setattr__(self, "attention", _attention_config(self.attention))
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads}).")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}.")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}.")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}.")
        _require(self.dtype in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}.")
        _require(self.param_dtype in DTYPES,
                 f"param_dtype must be one of {tuple(DTYPES)}, got {self.param_dtype!r}.")
        _require(self.remat in REMAT_POLICIES,
                 f"remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}.")
        _require(self.model_type in FAMILIES,
                 f"model_type must be one of {sorted(FAMILIES)}, got {self.model_type!r}.")

    # ---- derived -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA group size `G`)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with fields changed (the flat form every CLI and `from_pretrained` use).

        `attention` may be a kind name ("sliding") that keeps the other attention settings;
        the fields of `AttentionConfig` (group_size, window_size, sink_tokens, pooling,
        implementation) may be given directly.
        """
        return dataclasses.replace(self, **_route_attention(self.attention, changes))

    def check_length(self, length: int) -> None:
        """Refuse a sequence this model cannot run as configured (clear error before compute)."""
        if (self.attention.kind == "full" and self.sliding_window is not None
                and length > self.sliding_window):
            raise ValueError(
                f"This checkpoint attends over a sliding window of {self.sliding_window} tokens "
                f"(sliding_window in its config.json); full attention over {length} tokens is "
                "not what it computes. Use attention='sliding' (its default), or pass "
                "sliding_window=None to run full attention anyway.")

    # ---- Hugging Face config.json --------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides) -> "LlamaConfig":
        """Build from a HF config dict; `overrides` set our runtime fields (attention, dtype...)."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            archs = hf.get("architectures")
            raise ValueError(
                f"Unsupported architecture: model_type={model_type!r} (architectures={archs}). "
                f"Supported model_type values: {sorted(FAMILIES)}.")
        act = hf.get("hidden_act", "silu")
        _require(act == "silu", f"hidden_act {act!r} is not supported (only 'silu').")
        values = dict(FAMILIES[model_type].implied, model_type=model_type)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                     "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                     "mlp_bias"):
            if hf.get(name) is not None:
                values[name] = hf[name]
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = hf.get(name)
            values[name] = tuple(ids) if isinstance(ids, list) else ids
        # Older configs: rope_theta + rope_scaling. transformers >= 5: rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        values["rope_theta"] = float(theta)
        values["rope_scaling"] = RopeScaling.from_hf(rope)
        values["sliding_window"] = _hf_sliding_window(hf, model_type)
        if CCA_CONFIG_KEY in hf:     # our own export: the attention it was saved with
            attention = _attention_from_record(hf[CCA_CONFIG_KEY])
        elif values["sliding_window"] is not None:   # behave as transformers does
            attention = AttentionConfig(kind="sliding", window_size=values["sliding_window"])
        else:
            attention = AttentionConfig()
        values.update(_route_attention(attention, overrides))
        return cls(**values)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, **overrides) -> "LlamaConfig":
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        return cls.from_hf_dict(read_hf_config(path), **overrides)

    def to_hf_dict(self, model_type: str | None = None) -> dict[str, Any]:
        """A HF `config.json` dict for this architecture, CCA settings under CCA_CONFIG_KEY.

        `model_type` (default: `self.model_type`, the family the weights came from) picks the
        transformers class; raises if that family cannot express this config's biases.
        """
        model_type = self.model_type if model_type is None else model_type
        _require(model_type in FAMILIES,
                 f"Cannot export model_type {model_type!r}; supported: {sorted(FAMILIES)}.")
        family = FAMILIES[model_type]
        implied = family.implied
        if "qkv_bias" in implied:
            _require(self.qkv_bias == implied["qkv_bias"]
                     and self.attention_bias == implied["attention_bias"],
                     f"A {model_type} config implies qkv_bias={implied['qkv_bias']} and "
                     f"attention_bias={implied['attention_bias']}; this config has "
                     f"{self.qkv_bias} / {self.attention_bias}. Export as another model_type.")
        else:
            _require(self.qkv_bias == self.attention_bias,
                     f"model_type {model_type!r} has one attention_bias for q, k, v and o; this "
                     f"config has qkv_bias={self.qkv_bias}, attention_bias={self.attention_bias} "
                     "(export it as model_type='qwen2' if o_proj has no bias).")
        out: dict[str, Any] = {
            "model_type": model_type,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                             else self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
            CCA_CONFIG_KEY: {**self.attention.to_dict(), "format": ATTENTION_RECORD_FORMAT},
        }
        out["architectures"] = [family.architecture]
        out.update(family.export_keys)
        if self.sliding_window is not None:
            windowed = sorted(f.model_type for f in FAMILIES.values() if f.sliding_window)
            _require(family.sliding_window,
                     f"model_type {model_type!r} cannot express sliding_window="
                     f"{self.sliding_window}; export as one of {windowed}.")
            out.update(family.window_export(self.sliding_window))
        return out


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a checkpoint directory (or the file itself), as a dict."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(
            f"No config.json at {file!r}: pass a Hugging Face checkpoint directory.")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file!r} is not valid JSON ({e}).") from None


def hf_weights_dtype(hf: Mapping[str, Any]) -> tuple[str, str] | None:
    """(dtype name, the key it came from) that a HF config.json says its weights are in
    (`dtype`, or the older `torch_dtype`), if it names one of `DTYPES`."""
    for key in ("dtype", "torch_dtype"):
        if isinstance(hf.get(key), str) and hf[key] in DTYPES:
            return hf[key], key
    return None


def _route_attention(attention: AttentionConfig, changes: Mapping[str, Any]) -> dict[str, Any]:
    """Flat overrides -> LlamaConfig fields: attention settings go into `attention`."""
    changes = dict(changes)
    new = changes.pop("attention", None)
    attention = attention if new is None else _attention_config(new, attention)
    flat = {k: changes.pop(k) for k in list(changes) if k in ATTENTION_FIELDS and k != "kind"}
    changes["attention"] = dataclasses.replace(attention, **flat)
    return changes


def _hf_sliding_window(hf: Mapping[str, Any], model_type: str) -> int | None:
    """The attention window transformers applies to every layer of this config, or None.

    Raises when layers differ (Qwen2 with max_window_layers inside the stack): one model here
    runs one attention option in every layer.
    """
    family = FAMILIES[model_type]
    keys = {**family.hf_key_defaults, **hf}
    window = keys.get("sliding_window")
    if family.window_switch and not keys.get(family.window_switch):
        window = None
    if not family.sliding_window or window is None:
        return None
    layers = hf.get("num_hidden_layers", 1)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first_sliding = keys.get(family.full_layers_key, 0) if family.full_layers_key else 0
        layer_types = ["full_attention" if i < first_sliding else "sliding_attention"
                       for i in range(layers)]
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    _require(kinds == {"sliding_attention"},
             f"This {model_type} config mixes sliding and full attention across layers "
             f"({layer_types.count('sliding_attention')} of {len(layer_types)} sliding); "
             "cca-jax runs one attention option in every layer. Set use_sliding_window to false "
             "(or sliding_window to null) in config.json to load it with full attention.")
    return int(window)
