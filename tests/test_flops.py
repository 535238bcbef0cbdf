"""train/flops.py against a count by hand for one small model.

The model: hidden 8, MLP 12, 2 layers, 2 query heads and 1 KV head of 4, vocabulary 10, a
sequence of 7 tokens. Per layer the matmul parameters are q 8x8 = 64, k 8x4 = 32, v 32,
o 64, gate 8x12 = 96, up 96, down 96: 480, so 960 for the layers plus the LM head 8x10 = 80:
1040 in all. Per token: 2 FLOPs per parameter forward, 2 for the input gradient, 2 more for
a trainable one's own gradient; attention: 4 * D per visible score and head forward, twice
that backward (12 * D in all), per layer.
"""

from __future__ import annotations

import pytest

from cca_jax.config import LlamaConfig
from train.flops import matmul_params, peak_flops, train_flops_per_sequence

L = 7
ATTN = 12 * 4 * 2 * 2          # 12 * D * heads * layers, per visible score


def _cfg(**attention):
    return LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1,
                       attention={"sink_tokens": 0, **attention})


def test_matmul_parameters_by_hand():
    total, per = matmul_params(_cfg(kind="full"))
    assert per == {"q_proj": 128, "k_proj": 64, "v_proj": 64, "o_proj": 128,
                   "gate_proj": 192, "up_proj": 192, "down_proj": 192, "lm_head": 80}
    assert total == 1040


@pytest.mark.parametrize("attention,scores", [
    # every t sees t + 1 keys: 1 + 2 + ... + 7
    (dict(kind="full"), 28),
    # W = 3: 1, 2, 3, 3, 3, 3, 3
    (dict(kind="sliding", window_size=3), 18),
    # W = 2 plus sink 0: 1, 2, then {0, t-1, t} from t = 2 on
    (dict(kind="streaming", window_size=2, sink_tokens=1), 18),
    # g = 2, s = 3: core tokens 0, 0, 0, 0, 1, 1, 2 and local windows 1, 2, 3, 4, 3, 4, 3
    (dict(kind="cca", group_size=2, window_size=3), 24),
], ids=["full", "sliding", "streaming", "cca"])
def test_train_flops_by_hand(attention, scores):
    cfg = _cfg(**attention)
    dense_all = L * (4 * 1040 + 2 * 1040)                          # 43680
    assert train_flops_per_sequence(cfg, L, None) == dense_all + ATTN * scores
    # Only q, k, v trained: 2 x (64 + 32 + 32) = 256 trainable matmul parameters.
    dense_qkv = L * (4 * 1040 + 2 * 256)                           # 32704
    assert train_flops_per_sequence(cfg, L, ("q_proj", "k_proj", "v_proj")) == (
        dense_qkv + ATTN * scores)


def test_totals_for_the_cca_model():
    """The two numbers of the module docstring's model, written out."""
    cfg = _cfg(kind="cca", group_size=2, window_size=3)
    assert train_flops_per_sequence(cfg, 7, None) == 48288
    assert train_flops_per_sequence(cfg, 7, ("q_proj", "k_proj", "v_proj")) == 37312


def test_peak_flops_by_device_kind():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("cpu") is None
