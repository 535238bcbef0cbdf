"""Model and CCA configuration: the one place that reads Hugging Face config keys.

`LlamaConfig` is a frozen dataclass built from a HF `config.json` (LLaMA 2/3, Qwen2,
LLaMA-compatible Mistral) plus our runtime settings (dtypes, which attention, remat) and
the CCA settings (`CCAConfig`). CLI flags map onto these fields; nothing else in the project
parses HF keys or branches on model names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp

POOLINGS = ("cca", "mean", "max")
IMPLEMENTATIONS = ("auto", "naive", "xla", "pallas_gpu", "pallas_tpu")
ATTENTIONS = ("full", "cca")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
REMAT_POLICIES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16", "float16")

# Key under which our CCA settings are recorded inside a HF config.json.
CCA_CONFIG_KEY = "cca_attention"

# Per-family facts of the HF config format (values implied by `model_type`, not present as
# keys). This table is the only place a model family name changes anything.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True, "attention_bias": False},
}

# What `to_hf_dict` writes per family besides the architecture fields: the transformers class,
# and keys whose transformers default would change the model (Mistral/Qwen2 sliding windows).
_FAMILY_HF_EXPORT: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
              "sliding_window": None},
}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive_int(name: str, value: Any) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        f"{name} must be a positive integer, got {value!r}.",
    )


@dataclasses.dataclass(frozen=True)
class CCAConfig:
    """Settings of Core Context Aware attention (see SPEC.md).

    group_size: tokens pooled into one core token (`g`). window_size: raw local window (`s`).
    pooling: "cca" (query-weighted, the paper's), "mean" or "max" (ablations).
    implementation: "auto" picks the fastest available for the backend; "naive" is the dense
    reference (tests, small L); "xla" is blocked and memory-linear on any backend.
    """

    group_size: int = 16
    window_size: int = 1024
    pooling: str = "cca"
    implementation: str = "auto"

    def __post_init__(self):
        _positive_int("group_size", self.group_size)
        _positive_int("window_size", self.window_size)
        _require(self.pooling in POOLINGS,
                 f"pooling must be one of {POOLINGS}, got {self.pooling!r}.")
        _require(self.implementation in IMPLEMENTATIONS,
                 f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
                 f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}.")
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

    The architecture fields follow HF's names. `attention` swaps the attention core
    ("full" causal attention, or "cca"); `cca` holds its settings. Weights are `param_dtype`,
    activations `dtype`; norms, softmax and logits are always float32.
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
    # How to run it.
    attention: str = "cca"
    cca: CCAConfig = dataclasses.field(default_factory=CCAConfig)
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
        if isinstance(self.cca, Mapping):
            object.__setattr__(self, "cca", CCAConfig(**self.cca))
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
        _require(self.attention in ATTENTIONS,
                 f"attention must be one of {ATTENTIONS}, got {self.attention!r}.")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        _require(self.param_dtype in DTYPES,
                 f"param_dtype must be one of {DTYPES}, got {self.param_dtype!r}.")
        _require(self.remat in REMAT_POLICIES,
                 f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}.")
        _require(self.model_type in _FAMILY_DEFAULTS,
                 f"model_type must be one of {sorted(_FAMILY_DEFAULTS)}, got {self.model_type!r}.")

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
        """A copy with fields changed; `cca_*` keys (e.g. cca_group_size) change `cca`."""
        cca_changes = {k[4:]: changes.pop(k) for k in list(changes) if k.startswith("cca_")}
        if cca_changes:
            changes["cca"] = dataclasses.replace(self.cca, **cca_changes)
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json --------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides) -> "LlamaConfig":
        """Build from a HF config dict; `overrides` set our runtime fields (attention, dtype...)."""
        model_type = hf.get("model_type")
        if model_type not in _FAMILY_DEFAULTS:
            archs = hf.get("architectures")
            raise ValueError(
                f"Unsupported architecture: model_type={model_type!r} (architectures={archs}). "
                f"Supported model_type values: {sorted(_FAMILY_DEFAULTS)}.")
        if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
            raise ValueError(
                f"This {model_type} config uses sliding-window attention "
                f"(sliding_window={hf.get('sliding_window')}), which is not LLaMA-compatible. "
                "Set sliding_window to null (or use_sliding_window to false) to convert it.")
        act = hf.get("hidden_act", "silu")
        _require(act == "silu", f"hidden_act {act!r} is not supported (only 'silu').")
        values = dict(_FAMILY_DEFAULTS[model_type], model_type=model_type)
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
        if CCA_CONFIG_KEY in hf:
            values["cca"] = CCAConfig(**hf[CCA_CONFIG_KEY])
        cca_overrides = {k[4:]: overrides.pop(k) for k in list(overrides) if k.startswith("cca_")}
        if cca_overrides:
            values["cca"] = dataclasses.replace(values.get("cca", CCAConfig()), **cca_overrides)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, **overrides) -> "LlamaConfig":
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"No config.json at {file!r}: pass a Hugging Face checkpoint directory.")
        with open(file) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file!r} is not valid JSON ({e}).") from None
        return cls.from_hf_dict(hf, **overrides)

    def to_hf_dict(self, model_type: str | None = None) -> dict[str, Any]:
        """A HF `config.json` dict for this architecture, CCA settings under CCA_CONFIG_KEY.

        `model_type` (default: `self.model_type`, the family the weights came from) picks the
        transformers class; raises if that family cannot express this config's biases.
        """
        model_type = self.model_type if model_type is None else model_type
        _require(model_type in _FAMILY_HF_EXPORT,
                 f"Cannot export model_type {model_type!r}; supported: {sorted(_FAMILY_HF_EXPORT)}.")
        implied = _FAMILY_DEFAULTS[model_type]
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
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
            CCA_CONFIG_KEY: self.cca.to_dict(),
        }
        out["model_type"] = model_type
        out.update(_FAMILY_HF_EXPORT[model_type])
        return out

