"""Text generation through the KV cache: the Python API (the CLI is `__main__.py`).

    from cca_jax.generate import generate
    new_ids = generate(model, [[1, 450, 4996], [1, 9038]], max_new_tokens=32)

runs every prompt in one batch (each row at its own position, group boundary and ring state):
a chunked prefill (`cca_jax.prefill.prefill`), then one jitted step per token (`decode_loop`:
`cca_jax.decode.decode_step` and the sampling of `cca_jax.sampling` in one program, compiled
once, dispatched ahead of the host). Rows that emit an end-of-sequence token stop (they keep
their cache and feed padding).

`python -m cca_jax.generate` is the command line on top of it (`cca_jax/generate/__main__.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from cca_jax import blocks
from cca_jax.decode import DECODE_COMPILER_OPTIONS, decode_step_traced
from cca_jax.kv_cache import cache_bytes, cache_shapes, full_cache_bytes, init_cache
from cca_jax.padding import round_up
from cca_jax.prefill import DEFAULT_CHUNK_SIZE, compile_prefill, prefill
from cca_jax.sampling import check_sampling, sample
from cca_jax.sharding import cache_shardings, mesh_context, shard_model

# Prompt widths and default max_len are rounded up to this, so prompts of similar lengths
# share one compiled prefill and decode step.
LENGTH_BUCKET = 64
_FROM_CONFIG = object()


@dataclasses.dataclass
class GenerationStats:
    """Filled in by `stream_generate` as it runs (seconds, tokens, bytes). Every program
    (prefill chunks, sampling, each decode step program) is compiled before the clocks start,
    so the times below hold no compilation."""
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    max_len: int = 0
    compile_seconds: float = 0.0         # compiling the prefill, sampling and decode programs
    time_to_first_token: float = 0.0     # prefill + first sample
    decode_tokens: int = 0      # tokens after each row's first, all rows together
    decode_seconds: float = 0.0  # wall time from the first tokens to the last ones
    kv_cache_bytes: int = 0
    full_attention_kv_cache_bytes: int = 0


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),)


def _check_prompts(input_ids, vocab_size: int) -> list[list[int]]:
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of token-id lists, one per prompt "
                         f"(e.g. [[1, 450, 4996]]), got {type(input_ids).__name__}.")
    prompts = []
    for i, row in enumerate(input_ids):
        row = np.asarray(row).tolist() if hasattr(row, "shape") else row
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(row).__name__}; "
                             "tokenize text first (or pass [[ids...]] for one prompt).")
        if not row:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS).")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in row):
            raise ValueError(f"prompt {i} must hold ints only.")
        if min(row) < 0 or max(row) >= vocab_size:
            raise ValueError(f"prompt {i}: token ids must lie in [0, {vocab_size}) (vocab_size), "
                             f"got min {min(row)} max {max(row)}: is the tokenizer the "
                             "model's own?")
        prompts.append([int(t) for t in row])
    return prompts


def resolve_max_len(prompt_len: int, max_new_tokens: int, max_len, max_positions: int) -> int:
    """The cache's max_len: `max_len` if given (checked), else prompt + new tokens rounded up
    to `LENGTH_BUCKET` (within max_position_embeddings)."""
    need = prompt_len + max_new_tokens
    if max_len is None:
        if need > max_positions:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
                f"exceeds the model's max_position_embeddings={max_positions}. Generate fewer "
                "tokens, or raise max_position_embeddings (from_pretrained(..., "
                "max_position_embeddings=N)) for longer contexts.")
        return min(round_up(need, LENGTH_BUCKET), max_positions)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}.")
    if need > max_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{need} exceeds max_len={max_len}: raise max_len or generate fewer.")
    return max_len


def stream_generate(model, input_ids, *, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    stop_at_eos: bool = True, max_len: int | None = None,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, eos_token_id=_FROM_CONFIG,
                    stats: GenerationStats | None = None, mesh: Mesh | None = None,
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`generate`, one step at a time: yields `(tokens [B], emitted [B] bool)` per step, where
    `emitted[b]` says whether `tokens[b]` is part of prompt `b`'s output (False once it
    finished). `eos_token_id`: default `model.config.eos_token_id` (an int or a tuple)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (cca_jax.sharding.make_mesh), "
                         f"got {type(mesh).__name__}.")
    cfg = model.config
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}.")
    check_sampling(temperature, top_k, top_p)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    prompts = _check_prompts(input_ids, cfg.vocab_size)
    eos = _eos_ids(cfg.eos_token_id if eos_token_id is _FROM_CONFIG else eos_token_id)
    stats = stats if stats is not None else GenerationStats()
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    stats.prompt_tokens = lengths.tolist()
    max_len = resolve_max_len(longest, max_new_tokens, max_len, cfg.max_position_embeddings)
    cfg.check_length(max_len)
    batch = len(prompts)
    stats.max_len = max_len
    stats.kv_cache_bytes = cache_bytes(cache_shapes(cfg, batch, max_len))
    stats.full_attention_kv_cache_bytes = full_cache_bytes(cfg, batch, max_len)
    if max_new_tokens == 0:
        return
    width = min(round_up(longest, LENGTH_BUCKET), max_len)
    ids = np.zeros((batch, width), np.int32)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    pad = cfg.pad_token_id
    pad = pad if pad is not None and 0 <= pad < cfg.vocab_size else 0

    cache_sharding = None
    if mesh is not None:   # parameters and cache over the mesh, by the logical-axis table
        shard_model(model, mesh)
        cache_sharding = cache_shardings(cache_shapes(cfg, batch, max_len), mesh)
    cache = init_cache(cfg, batch, max_len, sharding=cache_sharding)
    chunk_size = min(chunk_size, width)
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    start = time.perf_counter()   # compile the prefill's programs and sampling's, untimed
    with mesh_context(mesh):   # the model's activation constraints (sharding.constrain)
        compile_prefill(model, cache, ids, lengths, chunk_size=chunk_size)
    key = jax.random.PRNGKey(seed)
    sample(jnp.zeros((batch, cfg.vocab_size), jnp.float32), jax.random.fold_in(key, 0),
           **settings).block_until_ready()
    stats.compile_seconds += time.perf_counter() - start

    start = time.perf_counter()
    with mesh_context(mesh):
        cache, logits = prefill(model, cache, ids, lengths, chunk_size=chunk_size)
    tokens = sample(logits, jax.random.fold_in(key, 0), **settings)
    tokens.block_until_ready()
    stats.time_to_first_token = time.perf_counter() - start
    yield from decode_loop(model, cache, tokens, lengths, max_new_tokens=max_new_tokens,
                           key=key, stop_at_eos=stop_at_eos, eos=eos, pad=pad, stats=stats,
                           mesh=mesh, **settings)


@functools.partial(jax.jit, donate_argnames=("cache",),
                   static_argnames=("sampling", "stop_at_eos", "pool_slots"),
                   compiler_options=dict(DECODE_COMPILER_OPTIONS))
def _advance(model_state, cache, tokens, done, step, key, eos, pad, *, sampling,
             stop_at_eos, pool_slots):
    """One token per row, on the device: rows whose last token was an EOS finish (they feed
    `pad` and write nothing), the others decode it; the next tokens are sampled with the key
    of `step + 1`. -> (next tokens, done, step + 1, cache)."""
    if stop_at_eos:
        done = done | jnp.isin(tokens, eos)
    logits, cache = decode_step_traced(model_state, cache, jnp.where(done, pad, tokens),
                                       ~done, pool_slots=pool_slots)
    nxt = sample(logits, jax.random.fold_in(key, step + 1), **dict(sampling))
    return nxt, done, step + 1, cache


def _step_programs(pattern, positions, steps: int, num_slots: int) -> list[bool]:
    """The `pool_slots` values of the `_advance` programs that `steps` decode steps from
    `positions` (one per row) can run: without pooling (any step, once rows finish), and with
    it if some step completes a slot the cache stores."""
    if steps < 1:
        return []
    if not num_slots:
        return [False]
    t = np.asarray(positions)[None, :] + np.arange(steps)[:, None]
    return [False] + ([True] if blocks.completes_slot(pattern, t, num_slots).any() else [])


def decode_loop(model, cache, tokens, lengths, *, max_new_tokens: int, key,
                temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, stop_at_eos: bool = True, eos=(), pad: int = 0,
                stats: GenerationStats | None = None, mesh: Mesh | None = None
                ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield `(tokens [B], emitted [B])` for `max_new_tokens` steps from the first sampled
    `tokens` (device array) after a prefill that left row `b` at position `lengths[b]`.

    Pipelined: step n + 1 is dispatched before the tokens of step n are read back, so the
    device never waits for the host (a stop at EOS is seen one step late: that step is
    computed and dropped). Steps where no running row completes a slot skip pooling
    (`decode_step(pool_slots=False)`, decided from the host's positions): a second program.
    Every program the loop can run is compiled before the first step (`stats.compile_seconds`);
    `stats.decode_seconds` is the wall time from the first tokens to the last. The cache is
    consumed. `mesh`: the one the model and cache are sharded over; the steps are traced and
    run under it (`sharding.mesh_context`).
    """
    from flax import nnx

    stats = stats if stats is not None else GenerationStats()
    model_state = nnx.split(model)
    pattern, num_slots = cache.pattern, cache.num_slots
    sampling = tuple(dict(temperature=temperature, top_k=top_k, top_p=top_p).items())
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)
    positions = np.asarray(lengths, np.int64).copy()   # of the token each row feeds next
    done_dev = jnp.zeros(len(positions), bool)
    step_dev = jnp.zeros((), jnp.int32)
    host_done = np.zeros(len(positions), bool)
    static = dict(sampling=sampling, stop_at_eos=bool(stop_at_eos and eos))
    start = time.perf_counter()
    for pool in _step_programs(pattern, positions, max_new_tokens - 1, num_slots):
        with mesh_context(mesh):
            _advance.lower(model_state, cache, tokens, done_dev, step_dev, key, eos_ids, pad,
                           pool_slots=pool, **static).compile()
    stats.compile_seconds += time.perf_counter() - start
    first_out = None
    for step in range(max_new_tokens):
        nxt = None
        if step < max_new_tokens - 1:
            running = positions[~host_done]
            pool = bool(num_slots and blocks.completes_slot(pattern, running, num_slots).any())
            with mesh_context(mesh):   # the mesh is part of jit's cache key
                nxt = _advance(model_state, cache, tokens, done_dev, step_dev, key, eos_ids,
                               pad, pool_slots=pool, **static)
            cache = nxt[3]
        emitted = ~np.asarray(done_dev)
        out = np.asarray(tokens)
        if first_out is None:
            first_out = time.perf_counter()
        else:
            stats.decode_tokens += int(emitted.sum())
            stats.decode_seconds = time.perf_counter() - first_out
        yield out, emitted
        if stop_at_eos and eos:
            host_done = ~emitted | np.isin(out, eos)
        else:
            host_done = ~emitted
        if nxt is None or host_done.all():
            return
        tokens, done_dev, step_dev = nxt[0], nxt[1], nxt[2]
        positions += 1


def generate(model, input_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_at_eos: bool = True, max_len: int | None = None,
             chunk_size: int = DEFAULT_CHUNK_SIZE, mesh: Mesh | None = None
             ) -> list[list[int]]:
    """New token ids per prompt.

    model: a `LlamaForCausalLM` (e.g. `cca_jax.from_pretrained(dir)`), any attention option.
    input_ids: a list of token-id lists, any lengths (one batch). temperature 0 is greedy;
    otherwise top_k / top_p filter before a seeded draw (`seed`, jax.random). With
    `stop_at_eos`, a prompt's output ends with the model's EOS token (config.eos_token_id)
    when it emits one. max_len: the cache's capacity in tokens (default: the longest prompt
    plus max_new_tokens, rounded up). chunk_size: prefill chunk (memory: cache + one chunk).
    mesh: a `jax.sharding.Mesh` (`cca_jax.sharding.make_mesh`) to run over several devices:
    the model's parameters are placed on it (in place: the model stays there) and the cache
    is created on it, both by the logical-axis table of `cca_jax.sharding` (rows over
    data x fsdp, heads over tensor). The tokens are the same as on one device.
    On a GPU, pass `cca_jax.model.inference_layers(model)`, as the CLI does: the decode
    programs then compile about 6x faster (XLA tunes each GEMM once, not once per layer).
    """
    prompts = _check_prompts(input_ids, model.config.vocab_size)
    out: list[list[int]] = [[] for _ in prompts]
    for tokens, emitted in stream_generate(
            model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=stop_at_eos, max_len=max_len,
            chunk_size=chunk_size, mesh=mesh):
        for row in np.flatnonzero(emitted):
            out[row].append(int(tokens[row]))
    return out
