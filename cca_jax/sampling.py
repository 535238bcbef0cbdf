"""Next-token choice from logits: greedy, temperature, top-k, top-p (nucleus), seeded.

The order follows transformers' logits processors: temperature, then top-k, then top-p; then
one categorical draw per row with `jax.random`. `temperature == 0` is greedy (argmax).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def check_sampling(temperature, top_k, top_p) -> None:
    """ValueError with the fix for settings `sample` cannot take."""
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or temperature < 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}.")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}.")


@jax.jit
def _greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("top_k", "use_top_p"))
def _sample(logits, key, temperature, top_p, top_k, use_top_p):
    x = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if use_top_p:
        ranked = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass ranked
        # before it is below top_p (the most likely token always stays).
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p
        cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Tokens `[B]` int32 from logits `[B, V]`; `key` (jax.random) only matters when sampling."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return _greedy(logits)
    use_top_p = top_p is not None and top_p < 1
    return _sample(logits, key, jnp.float32(temperature), jnp.float32(top_p or 1.0),
                   top_k=top_k, use_top_p=use_top_p)


def sample_rows(logits: jax.Array, seeds, steps, temperature, top_k, top_p) -> jax.Array:
    """`sample` with settings per row, all traced (`[B]` each), for a batch whose rows belong to
    different requests (a server): one program for any mix of settings. temperature 0 is
    greedy, top_k 0 and top_p 1 are off. Row `b` draws with the key
    `fold_in(PRNGKey(seeds[b]), steps[b])`, as `generate(seed=...)` draws its token `steps[b]`,
    so a row samples what `sample` would for that request alone. Jittable; not jitted here.
    The vocabulary is sorted (one sort) only when some row filters, and nothing is drawn when
    every row is greedy (`lax.cond`): a sort of 32K logits costs tens of ms on a CPU."""
    x = logits.astype(jnp.float32)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def draw(x):
        x = x / jnp.where(sampled, temperature, 1.0)[:, None]
        x = jax.lax.cond(jnp.any(sampled & ((top_k > 0) | (top_p < 1))), _filter_rows,
                         lambda x, *_: x, x, top_k, top_p)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seeds, steps)
        drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row[None], axis=-1)[0])(keys, x)
        return jnp.where(sampled, drawn.astype(jnp.int32), greedy)

    with jax.named_scope("sampling"):
        return jax.lax.cond(jnp.any(sampled), draw, lambda x: greedy, x)


def _filter_rows(x, top_k, top_p):
    """Rows of scaled logits with top-k, then top-p, applied per row (as `_sample`: the top-p
    mass is over the top-k survivors), from one sort."""
    vocab = x.shape[-1]
    ranked = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
    kth = jnp.take_along_axis(ranked, (jnp.clip(top_k, 1, vocab) - 1)[:, None], axis=-1)
    kth = jnp.where((top_k > 0)[:, None], kth, -jnp.inf)
    x = jnp.where(x < kth, -jnp.inf, x)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)   # = the sorted survivors
    probs = jax.nn.softmax(ranked, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p[:, None] < 1) & (x < cutoff), -jnp.inf, x)

