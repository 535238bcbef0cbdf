"""The built-in demo: a few CCA training steps of a tiny random LLaMA, then a generation.

    python -m train.demo [--steps 150] [--seq-len 128] [--attention cca|full|sliding|streaming]

Runs on CPU in about a minute with no downloads: byte-level tokens of a built-in text, a
2-layer LLaMA whose attention is CCA (group 4, window 16, so that core tokens are really used
at 128 tokens), AdamW, a progress line with loss and tokens/s, then greedy generation from a
prompt. The real training and generation CLIs replace this as they land.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cca_jax.blocks import ATTENTION_KINDS
from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM

TEXT = """\
Core context aware attention keeps two kinds of memory. Near the present it keeps every
token as it is, in a window of recent positions; further back it keeps one core token for
each group of tokens, a summary weighted by how much the last token of the group cares about
each of its members. A query reads both through one softmax, so it sees the whole past,
the near past in detail and the far past in summary, and the cost of reading grows far more
slowly than the square of the length. A model trained with full attention can be taught to
read this way with a short fine-tuning, and then it answers questions about long documents
with a cache that is a small fraction of the usual size. The window keeps the grammar of the
sentence at hand; the core tokens keep the names, the numbers and the plot of everything that
came before. The tokens of a group share one summary, and the summary is pooled with the eyes
of the group's last token, which has already read all of them.
"""


def tiny_config(attention: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, dtype="float32", param_dtype="float32",
                       attention={"kind": attention, "group_size": 4, "window_size": 16,
                                  "implementation": "xla"})


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, batch)
        yield np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def make_train_step(graphdef, optimizer):
    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def progress(step: int, total: int, loss: float, tokens_per_s: float) -> None:
    width = 30
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    sys.stdout.write(f"\r[{bar}] step {step}/{total}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s")
    sys.stdout.flush()


def generate(graphdef, params, prompt: bytes, new_tokens: int) -> bytes:
    """Greedy decoding by re-running the model over a fixed buffer (no KV cache yet)."""
    total = len(prompt) + new_tokens
    buf = jnp.zeros((1, total), jnp.int32).at[0, :len(prompt)].set(jnp.frombuffer(prompt, jnp.uint8))

    @jax.jit
    def next_token(buf, t):
        logits = nnx.merge(graphdef, params)(buf)
        return buf.at[0, t].set(jnp.argmax(logits[0, t - 1]).astype(jnp.int32))

    for t in range(len(prompt), total):
        buf = next_token(buf, t)
    return bytes(np.asarray(buf[0], np.uint8))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Tiny CCA training + generation demo (CPU).")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--attention", choices=sorted(ATTENTION_KINDS), default="cca")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = tiny_config(args.attention)
    print(f"jax {jax.__version__} on {jax.default_backend()}; model: {cfg.num_hidden_layers} "
          f"layers, hidden {cfg.hidden_size}, attention={cfg.attention.kind} "
          f"(g={cfg.attention.group_size}, s={cfg.attention.window_size}), seq_len={args.seq_len}")
    data = np.frombuffer(TEXT.encode(), np.uint8)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, args.lr, 10, args.steps, args.lr / 10), weight_decay=0.01)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(graphdef, optimizer)
    losses = []
    start = time.perf_counter()
    for step, tokens in zip(range(1, args.steps + 1), batches(data, args.batch, args.seq_len,
                                                               args.seed)):
        params, opt_state, loss = step_fn(params, opt_state, jnp.asarray(tokens))
        losses.append(float(loss))
        if step == 1:  # the first step compiles: measure throughput from the second on
            compiled_at = time.perf_counter()
        rate = (step - 1) * tokens.size / max(time.perf_counter() - compiled_at, 1e-9)
        progress(step, args.steps, losses[-1], rate)
    print(f"\nloss: first {losses[0]:.3f} -> last {losses[-1]:.3f} "
          f"({time.perf_counter() - start:.1f} s)")
    prompt = b"A query reads both"
    text = generate(graphdef, params, prompt, 80)
    print("generation:", repr(text.decode("utf-8", errors="replace")))
    return {"losses": losses, "generation": text}


if __name__ == "__main__":
    main()
