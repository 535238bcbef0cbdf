"""Cached forward passes: the chunked prefill and the decode step (SPEC section 4, property 6).

Both run the model's own submodules (`embed_tokens`, the stacked `layers` through
`nnx.split` and one `lax.scan`, each layer's norms, projections and MLP, `norm`, `logits`) and
`cca_jax.rope`, so weights and math are exactly `LlamaForCausalLM`'s; only the attention
reads and writes the `KVCache`. What each query sees comes from `cca_jax.blocks`.

Prefill, one chunk of queries at positions `[p0, p0 + n)` per row (`p0` = the row's cache
length): a virtual self-attention sequence is built per layer,
    [ front - R unused rows | the ring in position order (p0 - R .. p0 - 1) | the chunk ],
(`blocks.ring_order`), the chunk's queries sit at their keys' rows and the `front` rows before
them are padding (whole query blocks that see only themselves). Slots completed inside the
chunk are pooled from that sequence with their last token's query (`blocks.chunk_slots`) and
written into the cache's slots, then a blocked attention (`attention.blocked`: the Pallas
kernels on GPU/TPU, XLA elsewhere) runs with the per-row bounds of `blocks.chunk_ranges`, and
the chunk's keys/values go into the ring. Memory: the cache plus one chunk (plus the ring
once) per layer, at any prompt length. A first chunk (every row empty) is the model's own
forward (`run_attention`, cuDNN included), its slots and ring then written.

Decode, one token per row at position `p` = its cache length: its key/value goes into ring
entry `p % R`, a slot completed by it is pooled from the ring, and its query runs one masked
softmax over the ring and the slots (the decode entry of the backend, `decode_implementation`:
the Pallas decode kernels from `blocks.decode_bounds`, or XLA with `blocks.cache_raw_visible` /
`cache_slot_visible`).
The step unrolls the layers, so every weight and cache slice is static.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cca_jax import blocks
from cca_jax.attention import resolve_implementation, run_attention
from cca_jax.attention.backends import BACKENDS, blocked_backend, decode_backend
from cca_jax.attention.cached import cached_attention  # noqa: F401  (re-exported)
from cca_jax.attention.pooling import pool_ending_slot, pool_pattern_slots, slots_and_bounds
from cca_jax.attention.xla import Blocking
from cca_jax.config import LlamaConfig
from cca_jax.kv_cache import KVCache
from cca_jax.padding import round_up
from cca_jax.rope import apply_rope, rope_cos_sin

DEFAULT_CHUNK_SIZE = 2048


# ---- shared layer machinery --------------------------------------------------------------

def _check_cache(cfg: LlamaConfig, cache: KVCache) -> None:
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


def _layer(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _scatter(x, i, rows, index, update):
    """`x[i, rows, index] = update`; out-of-range indices (the size of the axis) drop. The
    scatter goes into layer `i`'s slice, which `_put_layer` puts back (in place)."""
    return _put_layer(x, i, _layer(x, i).at[rows, index].set(update.astype(x.dtype),
                                                             mode="drop"))


def _put_layer(x, i, layer):
    """`x` with layer `i` replaced: one `dynamic_update_slice`, in place on a donated or
    loop-carried buffer (a scatter into the whole stacked cache inside the layer scan made
    XLA copy the cache, 2x its memory)."""
    return jax.lax.dynamic_update_index_in_dim(x, layer.astype(x.dtype), i, 0)


def _ring_after_chunk(old, new, p0, end):
    """One layer's ring `[B, R, H, D]` after a chunk `new` `[B, n, H, D]` at positions
    `p0 ...`, valid up to `end` (per row): entries whose position (`blocks.ring_positions`)
    lies in the chunk take its key/value, the others keep theirs. A gather of R rows: a
    scatter of the whole chunk (mostly dropped indices) cost 2 ms per layer at 128K."""
    u = blocks.ring_positions(end - 1, old.shape[1])
    fresh = u >= p0[:, None]
    at = jnp.clip(u - p0[:, None], 0, new.shape[1] - 1)
    taken = jnp.take_along_axis(new, at[:, :, None, None], axis=1)
    return jnp.where(fresh[:, :, None, None], taken.astype(old.dtype), old)


def _set_entry(x, i, index, update, keep):
    """`x[i, b, index[b]] = update[b]` for the rows `b` with `keep[b]`: one scatter of B
    entries at a static layer `i`, in place on the donated cache."""
    index = jnp.where(keep, index, x.shape[2])
    return x.at[i, jnp.arange(x.shape[1]), index].set(update.astype(x.dtype), mode="drop")


def _run_layers(model, cache: KVCache, x, cos, sin, attend, *, unroll: bool = False,
                last_rows=None):
    """The model's decoder stack on `x` `[B, n, hidden]` with `attend` as the attention core.

    attend(i, q, k, v, cache) -> (out `[B, n, Hq, D]`, cache), with q `[B, n, Hq, D]` and k, v
    `[B, n, Hkv, D]` of layer `i`, RoPE applied. Returns the final normed hidden states.
    `unroll`: a Python loop with static layer indices instead of one `lax.scan` (what a decode
    step needs: XLA streams static slices of the stacked weights at 3.4 TB/s on the H200, but
    copies the scan's dynamic slices first, 1.2 TB/s; benchmarks/research/
    decode_weights_probe.py). The scan compiles faster, and prefill is compute-bound.
    `last_rows` (int `[B]`, scan only): only row `last_rows[b]` of each row is wanted from the
    last layer, whose keys/values still go into the cache but whose attention, output
    projection and MLP run for that row alone (`attend(..., out_rows=last_rows)` -> `[B, 1, Hq,
    D]`); returns `[B, 1, hidden]`. A prefill needs no more: 1/L of the last layer's work.
    """
    cfg = model.config
    graphdef, stacked = nnx.split(model.layers)
    num_layers = cfg.num_hidden_layers

    def layer_at(i):
        # a static index is a static slice (streamed in place by a decode step)
        take = (lambda p: p[i]) if isinstance(i, int) else (lambda p: _layer(p, i))
        return nnx.merge(graphdef, jax.tree.map(take, stacked))

    def projections(layer, x):
        attn = layer.self_attn
        b, n, _ = x.shape
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).reshape(b, n, cfg.num_attention_heads, cfg.head_dim)
        k = attn.k_proj(h).reshape(b, n, cfg.num_key_value_heads, cfg.head_dim)
        v = attn.v_proj(h).reshape(b, n, cfg.num_key_value_heads, cfg.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(layer, x, out):
        b, n, _ = x.shape
        x = x + layer.self_attn.o_proj(out.astype(x.dtype).reshape(b, n, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def body(carry, i):
        x, cache = carry
        layer = layer_at(i)
        q, k, v = projections(layer, x)
        out, cache = attend(i, q, k, v, cache)
        return (finish(layer, x, out), cache), None

    if unroll:
        if last_rows is not None:
            raise ValueError("last_rows needs the scanned stack (unroll=False).")
        carry = (x, cache)
        for i in range(num_layers):
            carry, _ = body(carry, i)
        x, cache = carry
        return model.norm(x), cache
    trimmed = last_rows is not None
    layers = jnp.arange(num_layers - trimmed, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), layers)
    if trimmed:
        layer = layer_at(num_layers - 1)
        q, k, v = projections(layer, x)
        out, cache = attend(num_layers - 1, q, k, v, cache, out_rows=last_rows)
        x = jnp.take_along_axis(x, last_rows[:, None, None], axis=1)
        x = finish(layer, x, out)
    return model.norm(x), cache


def _stored(q, k):
    """A chunk's rotated q and k as stored bf16 tensors. Otherwise XLA (excess precision)
    hands the pooling k's float32 rotation and keeps it for the chunk: twice k's bytes, 2 GB
    per layer at 128K. (A decode step keeps its fusions: its tensors are one token.)"""
    return jax.lax.optimization_barrier((q, k))


def _attend_rows(cfg: LlamaConfig, cache: KVCache, i: int, q, rows, end):
    """Attention output `[B, 1, Hq, D]` of query `rows[b]` of each row, at position
    `end[b] - 1`, from the cache after the chunk (layer `i` static): what a decode step of that
    token computes (SPEC property 6), through the decode kernels."""
    q_rows = jnp.take_along_axis(q, rows[:, None, None, None], axis=1)[:, 0]
    attention = BACKENDS[decode_implementation(cfg)].decode
    out = attention(q_rows.astype(cache.k.dtype), cache.k, cache.v, cache.ck, cache.cv, i,
                    cache.pattern, jnp.maximum(end - 1, 0))
    return out[:, None]


# ---- prefill -----------------------------------------------------------------------------

def chunk_blocking(chunk: int, ring: int, num_slots: int, head_dim: int):
    """(front, Blocking) of a prefill chunk: `front >= ring` padding rows, whole query blocks.

    `front` is a multiple of 512 as well as of the XLA query block, so that the query blocks
    of every blocked implementation (XLA's and the Pallas kernels', powers of two <= 512)
    hold padding rows or chunk rows, never both: the bounds restart at the chunk.
    """
    block_q = min(512, round_up(chunk, 16))
    block_c = min(512, round_up(max(num_slots, 1), 16))
    front = round_up(ring, math.lcm(block_q, 512))
    return front, Blocking(1.0 / math.sqrt(head_dim), block_q, block_c,
                           round_up(front + chunk, block_q), round_up(max(num_slots, 1), block_c))


def offset_implementation(cfg: LlamaConfig) -> str:
    """The implementation of prefill chunks at an offset (`attention.blocked`): the model's
    where it takes per-row bounds, else what `auto` picks for packed rows, else `xla`."""
    return blocked_backend(cfg.attention.implementation, cfg.attention.pattern,
                           head_dim=cfg.head_dim, dtype=cfg.dtype).name


def _first_slots(x, i, new, done):
    """Layer `i` of the slots `x` with slots `0 .. n - 1` set from `new` `[B, n, H, D]` where
    `done` `[B, n, 1, 1]` (completed in the row): one slice update, no scatter."""
    old = _layer(x, i)
    n = new.shape[1]
    return _put_layer(x, i, old.at[:, :n].set(jnp.where(done, new.astype(old.dtype),
                                                         old[:, :n])))


def _first_chunk_attend(cfg, pat, n, n_valid, num_slots, window):
    """Attention of a chunk at position 0 of every row: the model's own `run_attention` (any
    implementation, cuDNN included), then its completed slots and last raw keys into the
    cache. The same result as the offset path, without the ring's padding rows. Where the
    model's implementation has a blocked form and the pattern slots, the slots are pooled
    once for the attention and the cache. With `out_rows`: the cache, then those rows'
    outputs from it (`_attend_rows`)."""
    pooled = min(pat.slots_ending_before(n), num_slots)
    done = (jnp.arange(pooled) < pat.slots_ending_before(n_valid)[:, None])[:, :, None, None]
    zero = jnp.zeros_like(n_valid)
    name = resolve_implementation(cfg.attention.implementation, pattern=pat,
                                  head_dim=cfg.head_dim, dtype=cfg.jnp_dtype)
    shared = "blocked" in BACKENDS[name].entries and pat.max_slots(n) > 0

    def attend(i, q, k, v, cache, out_rows=None):
        q, k = _stored(q, k)
        q = q.astype(cache.k.dtype)
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        if shared and out_rows is None:
            new_ck, new_cv, *bounds = slots_and_bounds(q, k, v, pat,
                                                       pooling=cfg.attention.pooling,
                                                       min_slots=pooled)
            _, blocking = chunk_blocking(n, 0, new_ck.shape[1], cfg.head_dim)
            out = BACKENDS[name].blocked(q, k, v, new_ck, new_cv, *bounds, blocking, window)
        else:
            if pooled:
                new_ck, new_cv = pool_pattern_slots(q, k, v, pat, pooled,
                                                    pooling=cfg.attention.pooling)
            if out_rows is None:
                out = run_attention(q, k, v, pat, pooling=cfg.attention.pooling,
                                    implementation=cfg.attention.implementation)
        ck, cv = cache.ck, cache.cv
        if pooled:
            ck = _first_slots(ck, i, new_ck[:, :pooled], done)
            cv = _first_slots(cv, i, new_cv[:, :pooled], done)
        cache = cache.replace(
            k=_put_layer(cache.k, i, _ring_after_chunk(_layer(cache.k, i), k, zero, n_valid)),
            v=_put_layer(cache.v, i, _ring_after_chunk(_layer(cache.v, i), v, zero, n_valid)),
            ck=ck, cv=cv)
        if out_rows is not None:
            out = _attend_rows(cfg, cache, i, q, out_rows, n_valid)
        return out, cache

    return attend


def _prefill_chunk(model_state, cache: KVCache, ids, n_valid, all_logits: bool = False,
                   first: bool = False):
    graphdef, state = model_state
    model = nnx.merge(graphdef, state)
    cfg = model.config
    _check_cache(cfg, cache)
    pat = cache.pattern
    b, n = ids.shape
    ring, num_slots = cache.ring, cache.num_slots
    front, blocking = chunk_blocking(n, ring, num_slots, cfg.head_dim)
    total = front + n
    blocked = BACKENDS[offset_implementation(cfg)].blocked
    window = blocks.widest_window(pat, cache.max_len)   # raw keys of one query, at most

    p0 = cache.lengths
    r = jnp.arange(n, dtype=jnp.int32)
    pos = p0[:, None] + r
    end = p0 + n_valid
    rows = jnp.arange(b)[:, None]
    cos, sin = rope_cos_sin(pos, cfg)
    if first:
        attend = _first_chunk_attend(cfg, pat, n, n_valid, num_slots, window)
        return _finish_prefill(model, cache, ids, cos, sin, attend, end, n_valid, all_logits)
    order = blocks.ring_order(p0, ring)
    raw_lo, core_lo, core_hi = blocks.chunk_ranges(pat, p0, n, front, num_slots)
    if num_slots:
        slot, start = blocks.chunk_slots(pat, p0, n, front)
        done = (pat.slot_last(slot) < end[:, None]) & (slot < num_slots)
        length = pat.slot_length(slot)
        slot = jnp.where(done, slot, num_slots)
        start = jnp.clip(start, 0, total - length)

    def virtual(ring_x, new):
        old = jnp.take_along_axis(ring_x, order[:, :, None, None], axis=1)
        unused = jnp.zeros((b, front - ring, *ring_x.shape[2:]), ring_x.dtype)
        return jnp.concatenate([unused, old, new.astype(ring_x.dtype)], axis=1)

    def attend(i, q, k, v, cache, out_rows=None):
        q, k = _stored(q, k)
        ring_k, ring_v = _layer(cache.k, i), _layer(cache.v, i)
        kv_k, kv_v = virtual(ring_k, k), virtual(ring_v, v)
        qv = jnp.concatenate([jnp.zeros((b, front, *q.shape[2:]), kv_k.dtype),
                              q.astype(kv_k.dtype)], axis=1)
        ck, cv = cache.ck, cache.cv
        if num_slots:
            new_ck, new_cv = pool_pattern_slots(qv, kv_k, kv_v, pat, slot.shape[1],
                                                pooling=cfg.attention.pooling,
                                                group_start=start,
                                                group_last=start + length - 1)
            ck, cv = _scatter(ck, i, rows, slot, new_ck), _scatter(cv, i, rows, slot, new_cv)
        if out_rows is None:
            out = blocked(qv, kv_k, kv_v, _layer(ck, i), _layer(cv, i), raw_lo, core_lo,
                          core_hi, blocking, window)[:, front:]
        cache = cache.replace(k=_put_layer(cache.k, i, _ring_after_chunk(ring_k, k, p0, end)),
                              v=_put_layer(cache.v, i, _ring_after_chunk(ring_v, v, p0, end)),
                              ck=ck, cv=cv)
        if out_rows is not None:
            out = _attend_rows(cfg, cache, i, q, out_rows, end)
        return out, cache

    return _finish_prefill(model, cache, ids, cos, sin, attend, end, n_valid, all_logits)


def _finish_prefill(model, cache, ids, cos, sin, attend, end, n_valid, all_logits):
    x = model.embed_tokens(ids)
    last = jnp.maximum(n_valid - 1, 0)
    if all_logits:
        hidden, cache = _run_layers(model, cache, x, cos, sin, attend)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    else:   # the last layer for the last rows only
        last_hidden, cache = _run_layers(model, cache, x, cos, sin, attend, last_rows=last)
    cache = cache.replace(lengths=end)
    last_logits = model.logits(last_hidden[:, 0])
    if all_logits:
        return cache, last_logits, model.logits(hidden)
    return cache, last_logits


prefill_chunk = jax.jit(_prefill_chunk, static_argnames=("all_logits", "first"),
                        donate_argnames=("cache",))
prefill_chunk.__doc__ = """One prefill chunk, jitted: `(model_state, cache, ids [B, n], n_valid [B])
-> (cache, logits of each row's last valid token [B, V])` (`all_logits=True`: also `[B, n, V]`).

Row `b`'s first `n_valid[b]` tokens of `ids` go in at positions `cache.lengths[b] ...`; the
others are ignored (nothing of them enters the cache). `model_state = nnx.split(model)`. The
cache is donated. `first=True` promises every row's cache is empty (the chunk starts at
position 0): the chunk then runs as the model's own forward does (`run_attention`, cuDNN
included), with no ring rows in front."""


def _prefill_plan(model, cache: KVCache, input_ids, lengths, chunk_size: int):
    """Checked inputs of `prefill` -> (lengths [B], the chunk calls: `(ids [B, chunk],
    n_valid [B], first, width)` each, numpy)."""
    cfg = model.config
    _check_cache(cfg, cache)
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] != cache.batch or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be an int array [batch={cache.batch}, seq], got "
                         f"shape {ids.shape} dtype {ids.dtype}.")
    b, t = ids.shape
    lengths = np.full((b,), t) if lengths is None else np.asarray(lengths)
    if lengths.shape != (b,) or lengths.min(initial=0) < 0 or lengths.max(initial=0) > t:
        raise ValueError(f"lengths must be [batch={b}] ints in [0, {t}], got {lengths}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    for row in range(b):
        if lengths[row] and (ids[row, :lengths[row]].min() < 0
                             or ids[row, :lengths[row]].max() >= cfg.vocab_size):
            raise ValueError(f"token ids of row {row} must lie in [0, {cfg.vocab_size}).")
    start = np.asarray(cache.lengths)
    if np.any(start + lengths > cache.max_len):
        raise ValueError(f"prompt of {int((start + lengths).max())} tokens (with the cache's "
                         f"{int(start.max())}) exceeds the cache's max_len={cache.max_len}.")
    chunk = min(chunk_size, max(t, 1))
    empty = not start.any()
    calls = []
    for c0 in range(0, max(int(lengths.max(initial=0)), 1), chunk):
        part = np.zeros((b, chunk), np.int32)
        width = min(chunk, t - c0)
        part[:, :width] = ids[:, c0:c0 + width]
        n_valid = np.clip(lengths - c0, 0, chunk).astype(np.int32)
        calls.append((part, n_valid, empty and c0 == 0, width))
    return lengths, calls


def _merge_kind(n_valid, empty: bool):
    """How a chunk's last logits enter `prefill`'s: "take" them (every row had tokens in the
    chunk), merge them into the earlier ones ("merge", or "zeros" before any), or None."""
    if n_valid.all():
        return "take"
    if n_valid.any() or empty:
        return "zeros" if empty else "merge"
    return None


@jax.jit
def _keep_last(n_valid, new, last):
    """The logits after each row's last prompt token so far: the chunk's `new` where the row
    had tokens in it, else `last` (zeros before the first chunk: `last=None`)."""
    return jnp.where((n_valid > 0)[:, None], new, 0.0 if last is None else last)


def prefill(model, cache: KVCache, input_ids, lengths=None, *,
            chunk_size: int = DEFAULT_CHUNK_SIZE, return_all_logits: bool = False):
    """Append prompts to the cache in chunks of `chunk_size` tokens.

    input_ids: int `[B, T]`; row `b` appends its first `lengths[b]` tokens (default all `T`)
    at positions `cache.lengths[b] ...`. Each chunk attends to the cache so far plus itself,
    so memory is the cache plus one chunk at any prompt length; every chunk has the same
    shape (one compilation per chunk size). Returns `(cache, logits [B, V])`, the logits after
    each row's last prompt token (zeros for rows with none), float32; with
    `return_all_logits`, also the logits of every position, `[B, max(lengths), V]` (memory:
    that many floats). The cache passed in is consumed (donated).
    """
    lengths, calls = _prefill_plan(model, cache, input_ids, lengths, chunk_size)
    model_state = nnx.split(model)
    last = None
    all_logits = []
    for i, (part, n_valid, first, width) in enumerate(calls):
        out = prefill_chunk(model_state, cache, part, n_valid, all_logits=return_all_logits,
                            first=first)
        cache, chunk_last = out[0], out[1]
        merge = _merge_kind(n_valid, i == 0)
        if merge == "take":
            last = chunk_last
        elif merge is not None:
            last = _keep_last(n_valid, chunk_last, None if merge == "zeros" else last)
        if return_all_logits:
            all_logits.append(out[2][:, :width])
    if return_all_logits:
        longest = int(lengths.max(initial=0))
        return cache, last, jnp.concatenate(all_logits, axis=1)[:, :longest]
    return cache, last


def compile_prefill(model, cache: KVCache, input_ids, lengths=None, *,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, return_all_logits: bool = False
                    ) -> None:
    """Compile the chunk programs `prefill` runs on these arguments (each distinct one once)
    without running them or consuming the cache, so that a timed prefill compiles nothing."""
    _, calls = _prefill_plan(model, cache, input_ids, lengths, chunk_size)
    model_state = nnx.split(model)
    for part, n_valid, first, _ in {c[2]: c for c in calls}.values():
        out = prefill_chunk.lower(model_state, cache, part, n_valid,
                                  all_logits=return_all_logits, first=first).compile()
    logits = jax.ShapeDtypeStruct(out.out_info[1].shape, out.out_info[1].dtype)
    merges = {_merge_kind(call[1], i == 0) for i, call in enumerate(calls)}
    for merge in merges - {None, "take"}:
        _keep_last.lower(calls[0][1], logits, None if merge == "zeros" else logits).compile()


# ---- decode ------------------------------------------------------------------------------

def decode_implementation(cfg: LlamaConfig) -> str:
    """What a decode step runs: the decode entry of the backend the prefill's chunks use
    (`offset_implementation`) where it takes the call, else the XLA form
    (`backends.decode_backend`)."""
    return decode_backend(cfg.attention.implementation, cfg.attention.pattern,
                          head_dim=cfg.head_dim, dtype=cfg.dtype).name


def decode_step_traced(model_state, cache: KVCache, tokens, active=None, implementation=None,
                       pool_slots: bool = True):
    """`decode_step` unjitted, for a program that jits it with more around it (it must pass
    `DECODE_COMPILER_OPTIONS` to its own jit: a nested jit cannot carry them)."""
    graphdef, state = model_state
    model = nnx.merge(graphdef, state)
    cfg = model.config
    _check_cache(cfg, cache)
    implementation = implementation or decode_implementation(cfg)
    decoders = sorted(n for n, b in BACKENDS.items() if "decode" in b.entries)
    if implementation not in decoders:
        raise ValueError(f"decode implementation must be one of {decoders}, "
                         f"got {implementation!r}.")
    attention = BACKENDS[implementation].decode
    pat = cache.pattern
    ring, num_slots, size = cache.ring, cache.num_slots, pat.slot_size
    b = tokens.shape[0]
    active = jnp.ones((b,), bool) if active is None else active
    p = cache.lengths
    write = p % ring
    rows = jnp.arange(b)[:, None]
    pool_slots = pool_slots and num_slots > 0
    if pool_slots:
        c = blocks.completed_slot(pat, p)
        pooled = active & blocks.completes_slot(pat, p, num_slots)
        slot = jnp.clip(c, 0, num_slots - 1)
        members = (p[:, None] - size + 1 + jnp.arange(size)) % ring

    def attend(i, q, k, v, cache):
        k_all = _set_entry(cache.k, i, write, k[:, 0], active)
        v_all = _set_entry(cache.v, i, write, v[:, 0], active)
        q = q.astype(k_all.dtype)
        ck, cv = cache.ck, cache.cv
        if pool_slots:
            k_members, v_members = k_all[i, rows, members], v_all[i, rows, members]
            q_group = jnp.concatenate([jnp.zeros((b, size - 1, *q.shape[2:]), q.dtype), q], 1)
            new_ck, new_cv = pool_ending_slot(q_group, k_members, v_members, pat, c,
                                              pooling=cfg.attention.pooling)
            ck = _set_entry(ck, i, slot, new_ck[:, 0], pooled)
            cv = _set_entry(cv, i, slot, new_cv[:, 0], pooled)
        out = attention(q[:, 0], k_all, v_all, ck, cv, i, pat, p)
        return out[:, None], cache.replace(k=k_all, v=v_all, ck=ck, cv=cv)

    cos, sin = rope_cos_sin(p[:, None], cfg)
    x = model.embed_tokens(tokens[:, None])
    hidden, cache = _run_layers(model, cache, x, cos, sin, attend, unroll=True)
    cache = cache.replace(lengths=p + active.astype(p.dtype))
    return model.logits(hidden[:, 0]), cache


# XLA options of every program that runs decode steps. A decode step is bound by reading the
# weights, and one matrix product per shared input reads them faster than several: XLA's dot
# merger joins products of one input (q/k/v, gate/up; the weights' concatenation fused into
# the product, not copied) up to this size, 32 MB by default (only k + v at the 7B shape).
# A GPU pass; the other backends ignore it.
DECODE_COMPILER_OPTIONS = types.MappingProxyType({"xla_gpu_dot_merger_threshold_mb": 1024})

decode_step = jax.jit(decode_step_traced, donate_argnames=("cache",),
                      static_argnames=("implementation", "pool_slots"),
                      compiler_options=dict(DECODE_COMPILER_OPTIONS))
decode_step.__doc__ = """One token per row through the cache, jitted once, reused for every token:
`decode_step(model_state, cache, tokens [B], active [B] bool | None) -> (logits [B, V], cache)`.
`implementation`: a backend with a decode entry (default `decode_implementation(config)`).
`pool_slots=False` skips pooling: only for a step where no active row's token completes a
slot (`blocks.completes_slot`), which is 15 of 16 steps at g = 16; a second compiled program.

`model_state = nnx.split(model)`. Row `b`'s token sits at position `cache.lengths[b]`; rows
with `active[b]` False (finished sequences) write nothing and keep their length (their
logits are meaningless). The cache is donated; positions must stay below `cache.max_len`."""
