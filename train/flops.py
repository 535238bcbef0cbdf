"""FLOPs of a training step and model FLOPs utilisation (MFU).

The count (documented in the README): per token, every matmul parameter costs 2 FLOPs
forward and 2 for the gradient of its input; a trainable one 2 more for its own gradient.
Attention adds 4 * D FLOPs per visible query-key score and head forward (scores and
probabilities times values), and twice that backward; visible scores follow the attention
option (`blocks.AttentionPattern.visible_scores`). Rematerialization is not counted (MFU, not
hardware FLOPs). Embedding lookups and norms are ignored.
"""

from __future__ import annotations

import types

from cca_jax.config import LlamaConfig

# Dense bf16 peak FLOP/s by device kind (datasheet figures, without sparsity).
PEAK_FLOPS = types.MappingProxyType({
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v6": 918e12,
    "TPU v4": 275e12,
})


def matmul_params(cfg: LlamaConfig) -> tuple[int, dict[str, int]]:
    """(all matmul parameters, per projection name) of one forward pass."""
    h, d = cfg.hidden_size, cfg.head_dim
    per = {
        "q_proj": h * cfg.num_attention_heads * d,
        "k_proj": h * cfg.num_key_value_heads * d,
        "v_proj": h * cfg.num_key_value_heads * d,
        "o_proj": cfg.num_attention_heads * d * h,
        "gate_proj": h * cfg.intermediate_size,
        "up_proj": h * cfg.intermediate_size,
        "down_proj": cfg.intermediate_size * h,
    }
    per = {k: v * cfg.num_hidden_layers for k, v in per.items()}
    per["lm_head"] = h * cfg.vocab_size
    return sum(per.values()), per


def train_flops_per_sequence(cfg: LlamaConfig, seq_len: int,
                             trainable: tuple[str, ...] | None) -> float:
    """Model FLOPs of forward + backward over one sequence of `seq_len` tokens."""
    total, per = matmul_params(cfg)
    trained = total if trainable is None else sum(
        v for k, v in per.items() if any(n == k for n in trainable))
    dense = seq_len * (4 * total + 2 * trained)
    scores = cfg.attention.pattern.visible_scores(seq_len)
    attention = 12 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers * scores
    return float(dense + attention)


def peak_flops(device_kind: str) -> float | None:
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return flops
    return None
