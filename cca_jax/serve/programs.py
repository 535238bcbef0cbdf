"""The engine's device programs, each compiled once for the engine's shapes: rows reset, a
prefill chunk with each row's first token sampled, a decode step of every row with its next
token sampled, and the logprobs of sampled tokens (run only when a request asks)."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp

from cca_jax.decode import DECODE_COMPILER_OPTIONS, decode_step_traced
from cca_jax.kv_cache import CACHE_PROGRAM_COMPILER_OPTIONS
from cca_jax.prefill import prefill_chunk_traced
from cca_jax.sampling import sample_rows

# The most alternatives a request may ask logprobs for (OpenAI's chat limit; completions: 5).
TOP_LOGPROBS = 20


class TokenLogprobs(typing.NamedTuple):
    """A generated token's logprob and the likeliest alternatives (ids, logprobs), as many
    as its request asked for: the model's log-softmax, before temperature and filters."""
    logprob: float
    top_ids: tuple
    top_logprobs: tuple


@functools.partial(jax.jit, donate_argnames=("cache",),
                   compiler_options=dict(CACHE_PROGRAM_COMPILER_OPTIONS))
def reset_rows(cache, rows_mask):
    """Rows where `rows_mask` start over at position 0."""
    return cache.replace(lengths=jnp.where(rows_mask, 0, cache.lengths))


# Every program here compiles with XLA's GEMM autotuning (its default level): untuned GEMM
# fusions ran 18x slower in the 7B serving chunk and 2.3x in a decode step (measured:
# cca_jax/serve/NOTES.md; `test_no_cache_program_turns_gemm_autotuning_off` keeps it so).
@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("unroll",),
                   compiler_options=dict(CACHE_PROGRAM_COMPILER_OPTIONS))
def prefill_and_sample(model_state, cache, rows, ids, n_valid, seeds, temperature, top_k,
                       top_p, *, unroll=False):
    """One prefill chunk into cache rows `rows` [P], then each row's first token (its token
    0) sampled from the logits after its last prompt token (`unroll`: the layers unrolled).
    -> (tokens [P], those logits [P, V] float32, cache)."""
    cache, logits = prefill_chunk_traced(model_state, cache, ids, n_valid, rows=rows,
                                         unroll_layers=unroll)
    first = sample_rows(logits, seeds, jnp.zeros_like(seeds), temperature, top_k, top_p)
    return first, logits, cache


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("pool_slots",),
                   compiler_options=dict(DECODE_COMPILER_OPTIONS))
def decode_and_sample(model_state, cache, tokens, active, seeds, steps, temperature, top_k,
                      top_p, *, pool_slots):
    """One decode step of every active row, then its next token (token `steps[b]` of row b).
    -> (tokens [B], the logits they were drawn from [B, V] float32, cache). The logits stay
    on the device unless a row's request asked for logprobs: no work is added to a step."""
    logits, cache = decode_step_traced(model_state, cache, tokens, active,
                                       pool_slots=pool_slots)
    return sample_rows(logits, seeds, steps, temperature, top_k, top_p), logits, cache


@jax.jit
def token_logprobs(logits, tokens):
    """(logprob of `tokens` [N], the `TOP_LOGPROBS` likeliest ids [N, k], their logprobs
    [N, k]): the log-softmax of the raw float32 logits (before temperature and filters, as
    OpenAI reports them). Run only after a program some row asked logprobs of."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    return chosen, top_ids, top_lp


def fetch_logprobs(logits, tokens, seqs, force: bool = False):
    """`token_logprobs` on the host, if some row's request asked for logprobs (or `force`:
    the warm-up compiles it), else None."""
    if force or any(s is not None and s.request.logprobs is not None for s in seqs):
        return jax.device_get(token_logprobs(logits, tokens))
    return None


def row_logprobs(logprobs, i: int, seq) -> TokenLogprobs | None:
    """Row `i`'s `TokenLogprobs`, cut to what its request asked for (None if none)."""
    n = seq.request.logprobs
    if logprobs is None or n is None:
        return None
    chosen, ids, lps = logprobs
    return TokenLogprobs(float(chosen[i]), tuple(int(t) for t in ids[i, :n]),
                         tuple(float(x) for x in lps[i, :n]))
