"""The chunked prefill: prompts into the KV cache (SPEC section 4, property 6).

Each chunk runs the model's own layers (`LlamaForCausalLM.decode_layers`, so weights and math
are exactly the model's); only the attention core here reads and writes the `KVCache`. What
each query sees comes from `cca_jax.blocks`.

One chunk of queries at positions `[p0, p0 + n)` per row (`p0` = the row's cache length): a
virtual self-attention sequence is built per layer,
    [ front - R unused rows | the ring in position order (p0 - R .. p0 - 1) | the chunk ],
(`blocks.ring_order`), the chunk's queries sit at their keys' rows and the `front` rows before
them are padding (whole query blocks that see only themselves). Slots completed inside the
chunk are pooled from that sequence with their last token's query (`blocks.chunk_slots`) and
written into the cache's slots, then a blocked attention (`attention.blocked`: the Pallas
kernels on GPU/TPU, XLA elsewhere) runs with the per-row bounds of `blocks.chunk_ranges`, and
the chunk's keys/values go into the ring. Memory: the cache plus one chunk (plus the ring
once) per layer, at any prompt length. A first chunk (every row empty) is the model's own
forward (`run_attention`, cuDNN included), its slots and ring then written.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cca_jax import blocks
from cca_jax.attention import resolve_implementation, run_attention
from cca_jax.attention.backends import BACKENDS
from cca_jax.attention.pooling import pool_pattern_slots, slots_and_bounds
from cca_jax.attention.xla import Blocking
from cca_jax.config import LlamaConfig
from cca_jax.decode import decode_implementation, offset_implementation
from cca_jax.kv_cache import (KVCache, check_cache, layer_of, put_layer, put_rows_of_layer,
                              put_slot_run, ring_after_chunk, ring_from_rows, rows_of_layer,
                              scatter_into_layer)
from cca_jax.padding import round_up
from cca_jax.rope import rope_cos_sin

DEFAULT_CHUNK_SIZE = 2048


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


def _first_slots(x, i, new, done):
    """Layer `i` of the slots `x` with slots `0 .. n - 1` set from `new` `[B, n, H, D]` where
    `done` `[B, n, 1, 1]` (completed in the row): one slice update, no scatter."""
    old = layer_of(x, i)
    n = new.shape[1]
    return put_layer(x, i, old.at[:, :n].set(jnp.where(done, new.astype(old.dtype),
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
            new_ck, new_cv, *bounds = slots_and_bounds(
                q, k, v, pat, pooling=cfg.attention.pooling,
                min_slots=BACKENDS[name].slots_to_pool(pooled, cfg.head_dim))
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
            k=put_layer(cache.k, i,
                        ring_after_chunk(layer_of(cache.k, i), k, zero, n_valid)),
            v=put_layer(cache.v, i,
                        ring_after_chunk(layer_of(cache.v, i), v, zero, n_valid)),
            ck=ck, cv=cv)
        if out_rows is not None:
            out = _attend_rows(cfg, cache, i, q, out_rows, n_valid)
        return out, cache

    return attend


def prefill_chunk_traced(model_state, cache: KVCache, ids, n_valid, all_logits: bool = False,
                         first: bool = False, rows=None, unroll_layers: bool = False):
    """`prefill_chunk` unjitted, for a program that jits it with more around it and its own
    compiler options (a nested jit cannot carry them): the server's chunks, with
    `kv_cache.CACHE_PROGRAM_COMPILER_OPTIONS`."""
    with jax.named_scope("prefill_chunk"):
        if rows is None or not first:   # the rows in place (`rows`: P of the cache's rows)
            return _prefill_chunk_body(model_state, cache, ids, n_valid, all_logits, first,
                                       unroll_layers, rows)
        sub = cache.replace(k=cache.k[:, rows], v=cache.v[:, rows], ck=cache.ck[:, rows],
                            cv=cache.cv[:, rows], lengths=cache.lengths[rows])
        sub, *logits = _prefill_chunk_body(model_state, sub, ids, n_valid, all_logits, first,
                                           unroll_layers)
        cache = cache.replace(k=cache.k.at[:, rows].set(sub.k), v=cache.v.at[:, rows].set(sub.v),
                              ck=cache.ck.at[:, rows].set(sub.ck),
                              cv=cache.cv.at[:, rows].set(sub.cv),
                              lengths=cache.lengths.at[rows].set(sub.lengths))
        return (cache, *logits)


def _prefill_chunk_body(model_state, cache: KVCache, ids, n_valid, all_logits: bool,
                        first: bool, unroll: bool, rows=None):
    """The chunk into every row of the cache, or (`rows` [P], not `first`) into those rows,
    read and written in place: a ring and the new slots per row and layer, no copy of the
    rows' whole cache."""
    graphdef, state = model_state
    model = nnx.merge(graphdef, state)
    cfg = model.config
    check_cache(cfg, cache)
    pat = cache.pattern
    b, n = ids.shape
    ring, num_slots = cache.ring, cache.num_slots
    front, blocking = chunk_blocking(n, ring, num_slots, cfg.head_dim)
    total = front + n
    backend = BACKENDS[offset_implementation(cfg)]
    window = blocks.widest_window(pat, cache.max_len)   # raw keys of one query, at most

    p0 = cache.lengths if rows is None else cache.lengths[rows]
    r = jnp.arange(n, dtype=jnp.int32)
    pos = p0[:, None] + r
    end = p0 + n_valid
    cos, sin = rope_cos_sin(pos, cfg)
    if first:
        attend = _first_chunk_attend(cfg, pat, n, n_valid, num_slots, window)
        return _finish_prefill(model, cache, ids, cos, sin, attend, end, n_valid, all_logits,
                               unroll)

    def of_layer(x, i):
        return layer_of(x, i) if rows is None else rows_of_layer(x, i, rows)

    def put(x, i, value):
        return put_layer(x, i, value) if rows is None else put_rows_of_layer(x, i, rows, value)

    def put_slots(x, i, new):
        if rows is None:
            return scatter_into_layer(x, i, jnp.arange(b)[:, None], slot, new)
        return put_slot_run(x, i, rows, slot, new)
    order = blocks.ring_order(p0, ring)
    raw_lo, core_lo, core_hi = blocks.chunk_ranges(pat, p0, n, front, num_slots)
    # A backend that can reads each layer's slots in the stacked cache; else they are sliced
    # out per layer (a copy of both slot arrays: 0.1 ms a layer at 7B, 128K, on an H100).
    in_place = backend.reads_slots_in_cache(cache.ck.dtype, cfg.head_dim, num_slots)
    cache_rows = jnp.arange(b, dtype=jnp.int32) if rows is None else rows
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
        ring_k, ring_v = of_layer(cache.k, i), of_layer(cache.v, i)
        kv_k, kv_v = virtual(ring_k, k), virtual(ring_v, v)
        qv = jnp.concatenate([jnp.zeros((b, front, *q.shape[2:]), kv_k.dtype),
                              q.astype(kv_k.dtype)], axis=1)
        ck, cv = cache.ck, cache.cv
        if num_slots:
            new_ck, new_cv = pool_pattern_slots(qv, kv_k, kv_v, pat, slot.shape[1],
                                                pooling=cfg.attention.pooling,
                                                group_start=start,
                                                group_last=start + length - 1)
            ck = put_slots(ck, i, new_ck)
            cv = put_slots(cv, i, new_cv)
        if out_rows is None and in_place:   # the slots read where they are: no copy
            out = backend.blocked_in_cache(qv, kv_k, kv_v, ck, cv, i, cache_rows, raw_lo,
                                           core_lo, core_hi, blocking, window, front)
        elif out_rows is None:
            out = backend.blocked(qv, kv_k, kv_v, of_layer(ck, i), of_layer(cv, i), raw_lo,
                                  core_lo, core_hi, blocking, window)[:, front:]
        cache = cache.replace(k=put(cache.k, i, ring_from_rows(kv_k, front, p0, end, ring)),
                              v=put(cache.v, i, ring_from_rows(kv_v, front, p0, end, ring)),
                              ck=ck, cv=cv)
        if out_rows is not None:
            if rows is None:
                out = _attend_rows(cfg, cache, i, q, out_rows, end)
            else:   # the decode kernels take the stacked cache: layer i of the rows, alone
                one = cache.replace(**{name: of_layer(getattr(cache, name), i)[None]
                                       for name in ("k", "v", "ck", "cv")})
                out = _attend_rows(cfg, one, 0, q, out_rows, end)
        return out, cache

    return _finish_prefill(model, cache, ids, cos, sin, attend, end, n_valid, all_logits,
                           unroll, rows)


def _finish_prefill(model, cache, ids, cos, sin, attend, end, n_valid, all_logits, unroll,
                    rows=None):
    x = model.embed(ids)
    last = jnp.maximum(n_valid - 1, 0)
    if all_logits:
        hidden, cache = model.decode_layers(x, cos, sin, attend, cache, unroll=unroll)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    else:   # the last layer for the last rows only
        last_hidden, cache = model.decode_layers(x, cos, sin, attend, cache, unroll=unroll,
                                                 last_rows=last)
    cache = cache.replace(lengths=end if rows is None else cache.lengths.at[rows].set(end))
    last_logits = model.logits(last_hidden[:, 0])
    if all_logits:
        return cache, last_logits, model.logits(hidden)
    return cache, last_logits


prefill_chunk = jax.jit(prefill_chunk_traced,
                        static_argnames=("all_logits", "first", "unroll_layers"),
                        donate_argnames=("cache",))
prefill_chunk.__doc__ = """One prefill chunk, jitted: `(model_state, cache, ids [B, n], n_valid [B])
-> (cache, logits of each row's last valid token [B, V])` (`all_logits=True`: also `[B, n, V]`).

Row `b`'s first `n_valid[b]` tokens of `ids` go in at positions `cache.lengths[b] ...`; the
others are ignored (nothing of them enters the cache). `model_state = nnx.split(model)`. The
cache is donated. `rows` (int `[P]`, distinct): the chunk is for these rows of the cache only
(`ids [P, n]`, `n_valid [P]`, logits `[P, V]`); the other rows are untouched and cost nothing
(a server prefills one request while the others decode): per layer each row's ring and
slots are read and its ring and new slots written in place (with `first`, the P rows' whole
cache is copied out and back). `first=True` promises every row's cache is empty (the chunk starts at
position 0): the chunk then runs as the model's own forward does (`run_attention`, cuDNN
included), with no ring rows in front. `unroll_layers`: run the layers unrolled, every weight
a static slice read in place, instead of scanned, which copies each layer's weights out of
the stack first (~4 ms a chunk at the 7B shape, by the decode step's 11.9 ms scanned against
7.5 unrolled: benchmarks/results/research/decode_compile_probe_b16_h200.jsonl) but compiles
several times faster. A server's small chunks between decode steps want it; a prompt's
large chunks and `generate` keep the scan (unrolled, a 128K chunk compiled 9x slower and ran
4% slower: benchmarks/results/research/h100_2026-12-06h.md). With the layers unstacked
(`model.unstack_layers`, as the CLIs hold them on a GPU), unrolled reads each layer's own
arrays and scanned copies one layer a step, as with the stack."""


def _prefill_plan(model, cache: KVCache, input_ids, lengths, chunk_size: int):
    """Checked inputs of `prefill` -> (lengths [B], the chunk calls: `(ids [B, chunk],
    n_valid [B], first, width)` each, numpy)."""
    cfg = model.config
    check_cache(cfg, cache)
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
