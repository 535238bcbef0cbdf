"""Cross-entropy over long sequences without `[L, vocab]` logits at once: the training loss
(`train.step`) and the perplexity evaluation (`cca_jax.eval.ppl`) share it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def chunk_cross_entropy(hidden, weight, targets, mask, chunk: int):
    """Per chunk of `chunk` tokens: (masked token loss sums `[n]`, token counts `[n]`).

    hidden `[B, L, H]`, weight `[H, V]`, targets int `[B, L]`, mask float `[B, L]`. Each
    chunk's float32 logits exist only inside a rematerialized map step, so the backward
    recomputes them chunk by chunk too. The last chunk is padded (mask 0).
    """
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (tokens per loss chunk), got {chunk!r}.")
    chunk = int(chunk)
    with jax.named_scope("loss"):
        b, length, h = hidden.shape
        chunk = min(chunk, length)
        pad = -length % chunk
        if pad:
            hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
            targets = jnp.pad(targets, ((0, 0), (0, pad)))
            mask = jnp.pad(mask, ((0, 0), (0, pad)))
        n = hidden.shape[1] // chunk
        xs = (hidden.reshape(b, n, chunk, h).swapaxes(0, 1),
              targets.reshape(b, n, chunk).swapaxes(0, 1),
              mask.reshape(b, n, chunk).swapaxes(0, 1))

        @jax.checkpoint
        def one(x):
            hid, tgt, msk = x
            logits = jnp.dot(hid, weight.astype(hid.dtype), preferred_element_type=jnp.float32)
            nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
                logits, tgt[..., None], axis=-1)[..., 0]
            return jnp.sum(nll * msk), jnp.sum(msk)

        return jax.lax.map(one, xs)


def chunked_cross_entropy(hidden, weight, targets, mask, chunk: int):
    """(sum of masked token losses, token count) over `[B, L]` (`chunk_cross_entropy`)."""
    sums, counts = chunk_cross_entropy(hidden, weight, targets, mask, chunk)
    return jnp.sum(sums), jnp.sum(counts)
