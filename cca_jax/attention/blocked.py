"""Blocked attention with per-row bounds: which backend runs it for a model.

`Backend.blocked(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window)`: one softmax
per row over raw keys `[raw_lo[t], t]` and slots `[core_lo[t], core_hi[t])`
(`xla.blocked_attention`'s contract; differentiable). `window`: the most raw keys any row
sees (the TPU kernels size their static grid with it; None: every key block). `blocking`
tiles the XLA form; the kernels choose their own.

Every backend but cuDNN and naive has that entry, and it is what a sequence that does not
start at row 0 of its keys needs: a prefill chunk at an offset (keys: the cache's ring plus
the chunk, `cca_jax.decode`) and one chunk of a sequence-sharded row (keys: a halo plus the
chunk, `sequence_parallel`).
"""

from __future__ import annotations

from cca_jax.attention.backends import blocked_backend


def blocked_implementation(implementation: str, *, pattern, head_dim: int, dtype) -> str:
    """The name of the backend whose blocked entry serves a model's `implementation`
    (`backends.blocked_backend`)."""
    return blocked_backend(implementation, pattern, head_dim=head_dim, dtype=dtype).name
