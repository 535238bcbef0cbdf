"""Is CCA on the real model a bug? naive vs xla logits, and generate vs the forward's greedy.

    python benchmarks/research/real_model_cca_check.py WORK/ckpt

On `benchmarks.real_model`'s converted SmolLM2 checkpoint, with CCA swapped in (g = 16,
s = 256, RoPE theta 1e6), for 2K-token passkey prompts at depths 0 and 1: the largest logit
difference between the `naive` and `xla` implementations, and whether `generate` (prefill +
decode through the compressed KV cache) gives the naive forward pass's greedy tokens (it
stops at EOS; the greedy loop does not). Record: `results/research/real_model_cca_check_cpu.log`.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer

import cca_jax
from cca_jax.eval.passkey import make_samples
from cca_jax.generate import generate

NEW_TOKENS = 8


def main(ckpt: str) -> None:
    tok = AutoTokenizer.from_pretrained(ckpt)
    models = {impl: cca_jax.from_pretrained(ckpt, dtype="float32", attention="cca",
                                            group_size=16, window_size=256, rope_theta=1e6,
                                            max_position_embeddings=4096, implementation=impl)
              for impl in ("naive", "xla")}
    for s in make_samples(tok, "passkey", [2048], [0.0, 1.0], 1, 0):
        ids = jnp.asarray([s.input_ids], jnp.int32)
        logits = {impl: np.asarray(m(ids))[0] for impl, m in models.items()}
        diff = np.abs(logits["naive"] - logits["xla"]).max()
        generated = generate(models["xla"], [s.input_ids], max_new_tokens=NEW_TOKENS)[0]
        seq, greedy = list(s.input_ids), []
        for _ in range(NEW_TOKENS):
            last = models["naive"](jnp.asarray([seq], jnp.int32), last_only=True)
            greedy.append(int(np.argmax(np.asarray(last)[0, -1])))
            seq.append(greedy[-1])
        print(f"depth {s.depth}: {len(s.input_ids)} tokens, naive-xla max |dlogit| {diff:.3g}; "
              f"generate {tok.decode(generated)!r}, forward greedy {tok.decode(greedy)!r}, "
              f"same tokens up to EOS: {greedy[:len(generated)] == generated}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
