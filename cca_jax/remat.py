"""Names of the values a remat policy may keep: the attention kernels' own residuals.

Every attention implementation with a custom vjp (Mosaic GPU, Triton, TPU, blocked XLA)
names its forward's output and log-sum-exp here, inside its vjp's forward rule, so that
`config.REMAT_POLICIES["save_attention"]` can keep them: a rematerialized layer's backward
then recomputes the cheap inputs of the kernel (projections, RoPE, pooling) but not the
kernel itself, for one output per layer of memory (`[B, L, Hq, D]`, 1 GiB at 128K for 7B).
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"


def name_attention_residuals(out, lse):
    """`(out, lse)` tagged with `ATTENTION_OUT` / `ATTENTION_LSE` (identity otherwise)."""
    return checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
