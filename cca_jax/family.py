"""One `Family` record per supported Hugging Face model family (llama, mistral, qwen2): the
only place a family name changes anything.

`cca_jax.config` reads and writes `config.json` through it; `convert.layout` picks the
weights' tensor names and layouts by its `weight_layout`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Family:
    """What a `model_type` implies.

    implied: `LlamaConfig` values the family fixes (not keys of its config.json).
    hf_key_defaults: what transformers assumes for keys a config.json may leave out.
    export_keys: what `to_hf_dict` writes besides the architecture fields: keys whose
        transformers default would change the model.
    sliding_window: whether config.json can hold a sliding window (`sliding_window`).
    window_switch: the key that must be true for the window to apply (qwen2's
        `use_sliding_window`), or None.
    full_layers_key: the key counting the first layers that keep full attention (qwen2's
        `max_window_layers`), or None.
    weight_layout: the name of the converter's tensor layout (`convert.layout.LAYOUTS`).
    """

    model_type: str
    architecture: str
    implied: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_key_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    export_keys: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sliding_window: bool = False
    window_switch: str | None = None
    full_layers_key: str | None = None
    weight_layout: str = "llama"

    def __post_init__(self):
        for name in ("implied", "hf_key_defaults", "export_keys"):
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))

    def window_export(self, window: int) -> dict[str, Any]:
        """The config.json keys that give every layer this sliding window."""
        if not self.sliding_window:
            raise ValueError(f"model_type {self.model_type!r} has no sliding window.")
        out: dict[str, Any] = {"sliding_window": window}
        if self.window_switch:
            out[self.window_switch] = True
        if self.full_layers_key:
            out[self.full_layers_key] = 0
        return out


FAMILIES: Mapping[str, Family] = types.MappingProxyType({f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", hf_key_defaults={"sliding_window": 4096},
           export_keys={"sliding_window": None}, sliding_window=True),
    Family("qwen2", "Qwen2ForCausalLM", implied={"qkv_bias": True, "attention_bias": False},
           hf_key_defaults={"use_sliding_window": False, "sliding_window": 4096,
                            "max_window_layers": 28},
           export_keys={"use_sliding_window": False, "sliding_window": None},
           sliding_window=True, window_switch="use_sliding_window",
           full_layers_key="max_window_layers"),
)})
