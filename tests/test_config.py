"""LlamaConfig / AttentionConfig: loading HF config.json files and rejecting bad values."""

import json

import pytest

from cca_jax.config import CCA_CONFIG_KEY, AttentionConfig, LlamaConfig

LLAMA2 = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
          "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
          "hidden_act": "silu"}
LLAMA31 = {**LLAMA2, "vocab_size": 128256, "intermediate_size": 14336, "num_key_value_heads": 8,
           "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN25 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "max_position_embeddings": 32768, "tie_word_embeddings": True,
          "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu"}


def test_llama2():
    c = LlamaConfig.from_hf_dict(LLAMA2)
    assert (c.head_dim, c.num_groups, c.rope_scaling.rope_type) == (128, 1, "default")
    assert c.attention == AttentionConfig() and (c.attention.group_size, c.attention.window_size) == (16, 1024)
    assert c.attention.kind == "cca" and c.dtype == "bfloat16"


def test_llama31_rope_scaling_and_theta_kept():
    c = LlamaConfig.from_hf_dict(LLAMA31)
    assert c.rope_theta == 500000.0 and c.num_groups == 4
    sc = c.rope_scaling
    assert (sc.rope_type, sc.factor, sc.original_max_position_embeddings) == ("llama3", 8.0, 8192)


def test_transformers5_rope_parameters_key():
    hf = {**LLAMA2, "rope_scaling": None, "rope_theta": None,
          "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 25000.0}}
    c = LlamaConfig.from_hf_dict(hf)
    assert (c.rope_theta, c.rope_scaling.rope_type, c.rope_scaling.factor) == (25000.0, "linear", 2.0)


def test_qwen2_biases_and_tied_embeddings():
    c = LlamaConfig.from_hf_dict(QWEN25)
    assert c.qkv_bias and not c.attention_bias and c.tie_word_embeddings
    assert c.head_dim == 64 and c.num_groups == 7


def test_overrides_and_cca_settings_round_trip(tmp_path):
    c = LlamaConfig.from_hf_dict(LLAMA31, attention="full", group_size=8, dtype="float32")
    assert (c.attention.kind, c.attention.group_size, c.dtype) == ("full", 8, "float32")
    hf = c.to_hf_dict()
    assert hf[CCA_CONFIG_KEY]["group_size"] == 8
    (tmp_path / "config.json").write_text(json.dumps(hf))
    back = LlamaConfig.from_pretrained_dir(tmp_path, attention="full", dtype="float32")
    assert back == c


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, "Unsupported architecture"),
    ({"num_key_value_heads": 5}, "multiple"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "not supported"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 16}, "mixes sliding and full"),
])
def test_bad_hf_configs(change, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict({**LLAMA2, **change})


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_size=0), "group_size"),
    (dict(window_size=1.5), "window_size"),
    (dict(pooling="attention"), "pooling"),
    (dict(implementation="triton"), "implementation"),
])
def test_bad_cca_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention="flash"), "attention"), (dict(dtype="int8"), "dtype"),
    (dict(remat="some"), "remat"), (dict(hidden_size=100, num_attention_heads=3), "divisible"),
])
def test_bad_runtime_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kwargs)


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlamaConfig.from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LlamaConfig.from_pretrained_dir(tmp_path)


def test_special_token_ids_survive_a_round_trip():
    hf = {**LLAMA31, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    c = LlamaConfig.from_hf_dict(hf)
    assert c.eos_token_id == (128001, 128008, 128009) and hash(c)
    out = c.to_hf_dict()
    assert (out["bos_token_id"], out["eos_token_id"]) == (128000, [128001, 128008, 128009])
    assert LlamaConfig.from_hf_dict(out) == c


def test_sliding_window_checkpoints_default_to_sliding_attention():
    """Mistral v0.1 (sliding_window 4096) and Qwen2 with use_sliding_window in every layer run
    as transformers runs them; an absent Mistral key means transformers' default 4096."""
    mistral = LlamaConfig.from_hf_dict({**LLAMA2, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096
    assert (mistral.attention.kind, mistral.attention.window_size) == ("sliding", 4096)
    absent = {k: v for k, v in LLAMA2.items()}
    assert LlamaConfig.from_hf_dict({**absent, "model_type": "mistral"}).sliding_window == 4096
    off = LlamaConfig.from_hf_dict({**LLAMA2, "model_type": "mistral", "sliding_window": None})
    assert off.sliding_window is None and off.attention.kind == "cca"
    qwen = LlamaConfig.from_hf_dict({**QWEN25, "use_sliding_window": True, "sliding_window": 512,
                                     "max_window_layers": 0})
    assert (qwen.attention.kind, qwen.attention.window_size) == ("sliding", 512)
    assert LlamaConfig.from_hf_dict(QWEN25).sliding_window is None   # use_sliding_window false
    # Our export keeps the window, and a re-import gives the same config.
    for c in (mistral, qwen):
        assert LlamaConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ValueError, match="cannot express sliding_window"):
        mistral.to_hf_dict(model_type="llama")


def test_full_attention_beyond_the_checkpoints_window_is_refused():
    c = LlamaConfig.from_hf_dict({**LLAMA2, "model_type": "mistral", "sliding_window": 64},
                                 attention="full")
    c.check_length(64)
    with pytest.raises(ValueError, match="sliding_window=None"):
        c.check_length(65)
    c.replace(sliding_window=None).check_length(65)


def test_attention_overrides_are_flat_and_keep_other_settings():
    c = LlamaConfig.from_hf_dict(LLAMA2, group_size=8, window_size=256)
    s = c.replace(attention="streaming", sink_tokens=2)
    assert (s.attention.kind, s.attention.window_size, s.attention.sink_tokens) == (
        "streaming", 256, 2)
    assert s.attention.pattern.max_slots(1000) == 2
    with pytest.raises(ValueError, match="unknown attention settings"):
        LlamaConfig(attention={"kind": "cca", "groups": 3})
    with pytest.raises(ValueError, match="sink_tokens"):
        c.replace(sink_tokens=-1)
