"""Blocked attention with per-row bounds, by implementation.

`blocked(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window)`: one softmax per row
over raw keys `[raw_lo[t], t]` and slots `[core_lo[t], core_hi[t])` (`xla.blocked_attention`'s
contract; differentiable). `window`: the most raw keys any row sees (the TPU kernels size
their static grid with it; None: every key block). `blocking` tiles the XLA form; the
kernels choose their own.

Every implementation but cuDNN takes that form, and it is what a sequence that does not
start at row 0 of its keys needs: a prefill chunk at an offset (keys: the cache's ring plus
the chunk, `cca_jax.decode`) and one chunk of a sequence-sharded row (keys: a halo plus the
chunk, `sequence_parallel`).
"""

from __future__ import annotations

from cca_jax.attention.xla import blocked_attention


def _xla(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window=None):
    return blocked_attention(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking)


def _pallas_gpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window=None):
    from pallas_kernels.gpu import blocked_attention_pallas_gpu  # lazy: kernels import us
    return blocked_attention_pallas_gpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi)


def _pallas_tpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window=None):
    from pallas_kernels.tpu import blocked_attention_pallas_tpu
    window = None if window is None else min(window, q.shape[1])
    return blocked_attention_pallas_tpu(q, k, v, ck, cv, raw_lo, core_lo, core_hi,
                                        window=window)


BLOCKED_IMPLEMENTATIONS = {"xla": _xla, "pallas_gpu": _pallas_gpu, "pallas_tpu": _pallas_tpu}


def blocked_implementation(implementation: str, *, pattern, head_dim: int, dtype) -> str:
    """The blocked form for a model's `implementation`: itself where it has one, else what
    `auto` picks for packed rows (cuDNN and naive have none), else `xla`."""
    from cca_jax.attention import resolve_implementation   # lazy: the package imports us

    name = implementation
    if name not in BLOCKED_IMPLEMENTATIONS:
        name = resolve_implementation("auto", pattern=pattern, head_dim=head_dim, dtype=dtype,
                                      packed=True)
    return name if name in BLOCKED_IMPLEMENTATIONS else "xla"
