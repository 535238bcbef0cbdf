"""The KV cache for generation (SPEC section 4), for every attention option.

Per layer and sequence it holds
  * a ring of raw keys/values per KV head, `R = blocks.ring_size(pattern, max_len)` entries:
    `s + g` for cca (the local window plus the group still filling), `W` for sliding and
    streaming, `max_len` for full attention; position `u` lives in entry `u % R`;
  * slots per *query* head, `C = slot_capacity(pattern, max_len)`: cca's core tokens (slot `c`
    pooled from its `g` raw keys/values with the query of its last token, at the moment that
    token is processed), streaming's `N` sink tokens and cca's (SPEC 6: slots `0 .. N-1`,
    before the core tokens), slots of one token each, kept raw and copied per query head;
    none for full and sliding;
  * the number of tokens written per sequence (`lengths`, `[B]`): the position of the next
    token, so every batch row has its own position, group boundary and ring state.
Arrays are stacked over layers on a leading axis (the model's layers are), preallocated for
`max_len`, and never reallocated: a `KVCache` is a pytree that `jit` and `scan` take (its
pattern and `max_len` are static metadata).

Which ring entries and slots a query sees is `cca_jax.blocks` (`cache_raw_visible`,
`cache_slot_visible`, `chunk_ranges`); the cached forward passes are `cca_jax.prefill` and
`cca_jax.decode`. The functions at the end update one layer of the stacked arrays in place,
for both.
"""

from __future__ import annotations

import math
import types

import flax.struct
import jax
import jax.numpy as jnp

from cca_jax.attention.cached import layer_of
from cca_jax.blocks import AttentionPattern, ring_positions, ring_size
from cca_jax.config import LlamaConfig


@flax.struct.dataclass
class KVCache:
    """k, v: `[L, B, R, Hkv, D]` ring of raw keys (RoPE applied) and values.
    ck, cv: `[L, B, C, Hq, D]` slots (core tokens / sinks) per query head.
    lengths: int32 `[B]` tokens written per row (the next token's position).
    pattern, max_len: static; positions `0 .. max_len - 1` fit."""

    k: jax.Array
    v: jax.Array
    ck: jax.Array
    cv: jax.Array
    lengths: jax.Array
    pattern: AttentionPattern = flax.struct.field(pytree_node=False)
    max_len: int = flax.struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def ring(self) -> int:
        return self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.ck.shape[2]


# Slot arrays are allocated in whole tiles of this many slots. The Mosaic GPU decode kernel
# copies whole 8-row tiles by TMA; for any other count it must pad (copy) the stacked slots of
# every layer on every decode step: 2.9 ms of a 9.3 ms 7B step at 128K on an H100
# (benchmarks/results/research/h100_2026-12-06c.md). The spare slots are never visible.
SLOT_TILE = 8

# XLA options of the programs that update a donated cache in place and whose own
# temporaries are small beside it: decode steps and the server's prefill chunks (not
# `prefill_chunk` itself: a whole 128K prompt in one chunk may need XLA's rematerialization).
# That GPU pass counts the donated cache twice (as an input and as the output it aliases), so
# at a cache of most of the memory it plans for twice the cache, recomputes nothing, warns
# "Can't reduce memory use below ..." at every compile and lengthens the compile
# (benchmarks/results/research/h100_2026-12-06d.md). Other backends ignore the option.
CACHE_PROGRAM_COMPILER_OPTIONS = types.MappingProxyType(
    {"xla_disable_hlo_passes": "rematerialization"})


def slot_capacity(pattern: AttentionPattern, max_len: int) -> int:
    """Slots per row and query head the cache allocates for sequences of up to `max_len`
    tokens: the most that can be stored (`pattern.max_slots`), in whole `SLOT_TILE`s."""
    need = pattern.max_slots(max_len)
    return -(-need // SLOT_TILE) * SLOT_TILE


def cache_shapes(cfg: LlamaConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """The cache's `jax.ShapeDtypeStruct`s (nothing allocated)."""
    return jax.eval_shape(lambda: init_cache(cfg, batch, max_len, dtype=dtype))


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, *, dtype=None,
               sharding=None) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens under `cfg.attention`.

    dtype: of keys/values (default `cfg.dtype`, the activations'). sharding: optional
    `jax.sharding.Sharding` for every array, or a `KVCache` of them (e.g. the batch axis over
    data-parallel devices, KV heads over tensor-parallel ones); the arrays are created in it.
    """
    if not isinstance(cfg, LlamaConfig):
        raise ValueError(f"init_cache takes a LlamaConfig (model.config), "
                         f"got {type(cfg).__name__}.")
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    pattern = cfg.attention.pattern
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers, hq, hkv, d = (cfg.num_hidden_layers, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim)
    r, c = ring_size(pattern, max_len), slot_capacity(pattern, max_len)

    def make():
        raw = lambda: jnp.zeros((layers, batch, r, hkv, d), dtype)  # noqa: E731
        slots = lambda: jnp.zeros((layers, batch, c, hq, d), dtype)  # noqa: E731
        # Separate buffers: k and v (ck and cv) are donated and updated independently.
        return KVCache(raw(), raw(), slots(), slots(), jnp.zeros((batch,), jnp.int32),
                       pattern=pattern, max_len=max_len)

    if sharding is None:
        return make()
    if not isinstance(sharding, KVCache):
        sharding = jax.tree.map(lambda _: sharding, jax.eval_shape(make))
    return jax.jit(make, out_shardings=sharding)()


def cache_bytes(cache: KVCache) -> int:
    """Bytes of the cached keys and values (ring and slots, all layers and rows); works on
    `cache_shapes` (`jax.ShapeDtypeStruct`s) too."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in (cache.k, cache.v, cache.ck, cache.cv))


def full_cache_bytes(cfg: LlamaConfig, batch: int, max_len: int, dtype=None) -> int:
    """What full attention's cache (every raw key/value) takes for the same model and length."""
    itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
    return (2 * cfg.num_hidden_layers * batch * max_len * cfg.num_key_value_heads
            * cfg.head_dim * itemsize)


# ---- cache updates, shared by the prefill chunks and the decode step ---------------------

def check_cache(cfg: LlamaConfig, cache: KVCache) -> None:
    """ValueError with the fix unless `cache` was made for `cfg` (pattern and shapes)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache (kv_cache.init_cache), "
                         f"got {type(cache).__name__}.")
    if cache.pattern != cfg.attention.pattern:
        raise ValueError(
            f"The cache was made for {cache.pattern}, the model runs {cfg.attention.pattern}: "
            "create the cache from this model's config (kv_cache.init_cache(model.config, ...)).")
    want_raw = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    want_slots = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim)
    got_raw = (cache.k.shape[0], *cache.k.shape[3:])
    got_slots = (cache.ck.shape[0], *cache.ck.shape[3:])
    if got_raw != want_raw or got_slots != want_slots:
        raise ValueError(
            f"The cache's (layers, heads, head_dim) {got_raw} / {got_slots} do not match the "
            f"model's {want_raw} / {want_slots}: make it with init_cache(model.config, ...).")


def put_layer(x, i, layer):
    """`x` with layer `i` replaced: one `dynamic_update_slice`, in place on a donated or
    loop-carried buffer. (A scatter into the whole stacked array inside the layer scan
    makes XLA copy the array.)"""
    return jax.lax.dynamic_update_index_in_dim(x, layer.astype(x.dtype), i, 0)


def scatter_into_layer(x, i, rows, index, update):
    """`x[i, rows, index] = update`; out-of-range indices (the size of the axis) drop. The
    scatter goes into layer `i`'s slice, which `put_layer` puts back in place."""
    return put_layer(x, i, layer_of(x, i).at[rows, index].set(update.astype(x.dtype),
                                                              mode="drop"))


def rows_of_layer(x, i, rows):
    """`x[i, rows]` `[P, ...]` of a stacked cache array `[L, B, ...]`: one dynamic slice per
    row (no gather over the stacked array, which a layer scan would copy)."""
    rest = x.shape[2:]
    zeros = (0,) * len(rest)
    return jnp.concatenate([jax.lax.dynamic_slice(x, (i, rows[p], *zeros), (1, 1, *rest))[0]
                            for p in range(rows.shape[0])])


def put_rows_of_layer(x, i, rows, value):
    """`x` with `x[i, rows] = value` (`value` `[P, ...]`): one in-place dynamic update per row."""
    zeros = (0,) * (x.ndim - 2)
    for p in range(rows.shape[0]):
        x = jax.lax.dynamic_update_slice(x, value[p][None, None].astype(x.dtype),
                                         (i, rows[p], *zeros))
    return x


def put_slot_run(x, i, rows, slot, update):
    """`x[i, rows[p], slot[p, j]] = update[p, j]`, entries set to the slot count dropping
    (a chunk's candidates, `blocks.chunk_slots`): one scatter into the stacked array, in
    place, reading nothing of it. (Reading each run's window and writing it back let XLA
    read the next layer's window from the program's input, unordered with this layer's
    in-place write, and copy the whole stacked array to keep both.)"""
    layer = jnp.full(slot.shape, i, jnp.int32)
    row = jnp.broadcast_to(rows[:, None], slot.shape)
    return x.at[layer, row, slot].set(update.astype(x.dtype), mode="drop")


def ring_after_chunk(old, new, p0, end):
    """One layer's ring `[B, R, H, D]` after a chunk `new` `[B, n, H, D]` at positions
    `p0 ...`, valid up to `end` (per row): entries whose position (`blocks.ring_positions`)
    lies in the chunk take its key/value, the others keep theirs. A gather of R rows, not a
    scatter of the whole chunk (whose indices mostly drop)."""
    u = ring_positions(end - 1, old.shape[1])
    fresh = u >= p0[:, None]
    at = jnp.clip(u - p0[:, None], 0, new.shape[1] - 1)
    taken = jnp.take_along_axis(new, at[:, :, None, None], axis=1)
    return jnp.where(fresh[:, :, None, None], taken.astype(old.dtype), old)


def ring_from_rows(rows, front: int, p0, end, ring: int):
    """`ring_after_chunk`'s ring `[B, R, H, D]`, read from a chunk's rows `[B, front + n, H,
    D]` as `cca_jax.prefill` lays them out (`front - R` unused, the old ring in position
    order, the chunk): the same values. Taken from the rows the attention reads, the new
    ring depends on that read, so XLA orders the read of the cache before the ring's
    in-place update instead of copying the whole stacked cache to keep both."""
    u = ring_positions(end - 1, ring)
    return jnp.take_along_axis(rows, (front + u - p0[:, None])[:, :, None, None], axis=1)


def set_entries(x, i, index, update, keep):
    """`x[i, b, index[b]] = update[b]` for the rows `b` with `keep[b]`: one scatter of B
    entries at a static layer `i`, in place on the donated cache."""
    index = jnp.where(keep, index, x.shape[2])
    return x.at[i, jnp.arange(x.shape[1]), index].set(update.astype(x.dtype), mode="drop")
