"""Test fixtures: tiny random transformers checkpoints per family, and stories260K as HF.

`make_tiny_hf(family, path, fmt)` saves a tiny random model (float32) as single safetensors,
sharded safetensors with index, or `pytorch_model.bin`. `stories260k_to_hf(bin, path)` turns
llama2.c's stories260K.bin into a HF LLaMA checkpoint (wq/wk rows permuted per head from
llama2.c's interleaved RoPE pairs to HF's rotate-halves layout), and
`llama2c_forward(weights, tokens)` is an independent float64 numpy forward pass in llama2.c's
own convention (interleaved RoPE), used to prove that fixture right.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
STORIES = DATA_DIR / "stories260K.bin"

_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2)

# family -> (transformers config class name, config kwargs)
TINY = {
    "llama2": ("LlamaConfig", dict(_BASE, num_attention_heads=4, num_key_value_heads=4,
                                   tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(
        _BASE, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(_BASE, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, use_sliding_window=False,
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1000000.0})),
    "qwen2_yarn": ("Qwen2Config", dict(
        _BASE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        use_sliding_window=False,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(_BASE, num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=None, tie_word_embeddings=False)),
}


def make_tiny_hf(family: str, path: Path, fmt: str = "safetensors", seed: int = 0,
                 **config_overrides):
    """Save a tiny random HF model; returns the torch model (eval mode, float32)."""
    import torch
    import transformers

    cls_name, kwargs = TINY[family]
    config = getattr(transformers, cls_name)(**{**kwargs, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and biases so the mapping is really tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        model.save_pretrained(path)
    elif fmt == "sharded":
        model.save_pretrained(path, max_shard_size="60KB")
        assert (path / "model.safetensors.index.json").exists()
    elif fmt == "bin":
        config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        raise ValueError(fmt)
    return model


# ---- stories260K -------------------------------------------------------------------------
_HEADER = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


def read_llama2c(path: Path) -> tuple[dict, dict]:
    """(header, float32 weights in llama2.c's own layout) from a legacy llama2.c .bin."""
    raw = Path(path).read_bytes()
    h = dict(zip(_HEADER, struct.unpack("<7i", raw[:28])))
    shared = h["vocab_size"] > 0
    h["vocab_size"] = abs(h["vocab_size"])
    d, hid, n, nh, nkv, v, sl = (h[k] for k in _HEADER)
    kv = d * nkv // nh
    hd = d // nh
    shapes = [("tok_embeddings", (v, d)), ("attention_norm", (n, d)), ("wq", (n, d, d)),
              ("wk", (n, kv, d)), ("wv", (n, kv, d)), ("wo", (n, d, d)), ("ffn_norm", (n, d)),
              ("w1", (n, hid, d)), ("w2", (n, d, hid)), ("w3", (n, hid, d)), ("norm", (d,)),
              ("freq_cis_real", (sl, hd // 2)), ("freq_cis_imag", (sl, hd // 2))]
    if not shared:
        shapes.append(("wcls", (v, d)))
    total = 28 + 4 * sum(int(np.prod(s)) for _, s in shapes)
    if total != len(raw):
        raise ValueError(f"{path}: {len(raw)} bytes, the header implies {total}.")
    w, off = {}, 28
    for name, shape in shapes:
        cnt = int(np.prod(shape))
        w[name] = np.frombuffer(raw, np.float32, cnt, off).reshape(shape)
        off += 4 * cnt
    h["shared_classifier"] = shared
    return h, w


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Meta/llama2.c interleaved pairs -> HF halves, per head (rows of a [out, in] matrix)."""
    out, inn = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inn).transpose(0, 2, 1, 3).reshape(out, inn)


def stories260k_to_hf(bin_path: Path, out: Path) -> dict:
    """Write stories260K as a HF LLaMA checkpoint (float32 safetensors); returns the header."""
    from safetensors.numpy import save_file

    h, w = read_llama2c(bin_path)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "vocab_size": h["vocab_size"], "hidden_size": h["dim"],
           "intermediate_size": h["hidden_dim"], "num_hidden_layers": h["n_layers"],
           "num_attention_heads": h["n_heads"], "num_key_value_heads": h["n_kv_heads"],
           "max_position_embeddings": h["seq_len"], "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": h["shared_classifier"],
           "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
    sd = {"model.embed_tokens.weight": w["tok_embeddings"], "model.norm.weight": w["norm"]}
    if not h["shared_classifier"]:
        sd["lm_head.weight"] = w["wcls"]
    for i in range(h["n_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = w["attention_norm"][i]
        sd[p + "post_attention_layernorm.weight"] = w["ffn_norm"][i]
        sd[p + "self_attn.q_proj.weight"] = _permute(w["wq"][i], h["n_heads"])
        sd[p + "self_attn.k_proj.weight"] = _permute(w["wk"][i], h["n_kv_heads"])
        sd[p + "self_attn.v_proj.weight"] = w["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = w["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = w["w1"][i]
        sd[p + "mlp.down_proj.weight"] = w["w2"][i]
        sd[p + "mlp.up_proj.weight"] = w["w3"][i]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return h


def llama2c_forward(h: dict, w: dict, tokens) -> np.ndarray:
    """Logits [T, vocab] in float64, transcribing llama2.c's run.c (interleaved RoPE pairs)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    d, nh, nkv = h["dim"], h["n_heads"], h["n_kv_heads"]
    hd, T = d // nh, len(tokens)
    rep = nh // nkv

    def rmsnorm(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5) * g

    def rope(x):  # x [T, heads, hd]; rotate pairs (x[2i], x[2i+1]) by pos * theta^(-2i/hd)
        freq = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
        ang = np.arange(T)[:, None] * freq[None]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    x = w["tok_embeddings"][np.asarray(tokens)]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(h["n_layers"]):
        xb = rmsnorm(x, w["attention_norm"][i])
        q = rope((xb @ w["wq"][i].T).reshape(T, nh, hd))
        k = rope((xb @ w["wk"][i].T).reshape(T, nkv, hd))
        v = (xb @ w["wv"][i].T).reshape(T, nkv, hd)
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", att, v).reshape(T, d) @ w["wo"][i].T
        xb = rmsnorm(x, w["ffn_norm"][i])
        a, b = xb @ w["w1"][i].T, xb @ w["w3"][i].T
        x = x + (a / (1 + np.exp(-a)) * b) @ w["w2"][i].T
    x = rmsnorm(x, w["norm"])
    return x @ w.get("wcls", w["tok_embeddings"]).T
