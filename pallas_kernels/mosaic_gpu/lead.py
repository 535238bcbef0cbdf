"""Lead rows: the first N rows of a row that no later row sees raw (CCA's sinks once
`cca_jax.blocks.sinks_as_slots` has moved them into the slots for every later row).

The kernels then run on rows `[N, L)` in a frame shifted by N: an offset in their TMA row
coordinates, not a copy. There CCA's raw windows lie on the key-block grid again (with 4
sinks they start 12 keys before a block edge in the row's own frame: one more, masked, step
per CTA). The lead rows' own N x N block is a dense product here, in XLA.

On the GPU the kernels read q/k/v/dO rows unpadded: TMA zero-fills reads past the last row
and clips writes there. jax's GPU interpreter clamps slices instead, so there the rows are
zero-padded to whole CTAs first (`kernel_rows`).

N must be a multiple of `LEAD_ROW_MULTIPLE`: Mosaic GPU tiles a TMA copy into swizzled
shared memory by 8 rows, so a copy's row start must be a multiple of 8. With N = 4 every
kernel fails to compile, in its layout inference (H100, jax 0.11.2, 2026-12-06:
benchmarks/results/research/h100_2026-12-06.md); jax's GPU interpreter and cross-lowering
do not check it. Other N run in the rows' own frame (`cca_jax.attention.pallas_mosaic_gpu`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cca_jax.padding import pad_rows

_LOG2E = math.log2(math.e)
LEAD_ROW_MULTIPLE = 8   # rows of a TMA tile in swizzled shared memory (2-byte dtypes)


def lead_rows_fit(lead: int) -> bool:
    """Whether the kernels can run in the frame after `lead` rows (a whole number of TMA
    row tiles)."""
    return lead % LEAD_ROW_MULTIPLE == 0


def check_lead_rows(lead: int, length: int) -> None:
    if not 0 <= lead < length:
        raise ValueError(f"lead_rows must be in [0, L) = [0, {length}), got {lead}.")
    if not lead_rows_fit(lead):
        raise ValueError(
            f"lead_rows must be a multiple of {LEAD_ROW_MULTIPLE} (Mosaic GPU's TMA copies "
            f"start on whole {LEAD_ROW_MULTIPLE}-row tiles), got {lead}; pass lead_rows=0 "
            "and the bounds of the rows' own frame (the backend's choice for such N).")


def kernel_rows(x, lead: int, rows: int, interpreted: bool):
    """`x` `[B, L, ...]` as the kernels read it when they run `rows` rows (whole CTAs) from
    row `lead`: as it is on the GPU when `lead > 0` (TMA bounds), else zero-padded to
    `lead + rows` rows."""
    if lead and not interpreted:
        return x
    return pad_rows(x, lead + rows)


def shifted(x, lead: int):
    """Per-row values `[..., L]` of rows `[lead, L)`: the kernels' frame."""
    return x[..., lead:]


def frame_bounds(raw_lo, core_lo, core_hi, lead: int):
    """Row bounds `[B, L]` of rows `[lead, L)` in the kernels' frame (raw keys counted from
    row `lead`; slots as they are); as given when `lead` is 0."""
    if not lead:
        return raw_lo, core_lo, core_hi
    return shifted(raw_lo - lead, lead), shifted(core_lo, lead), shifted(core_hi, lead)


def lead_attention(q, k, v, raw_lo, scale: float):
    """Output (q's dtype) and log2-sum-exp `[B, Hq, N]` float32 of the N lead rows: q
    `[B, N, Hq, D]`, k/v `[B, N, Hkv, D]` their rows, `raw_lo` `[B, N]`; row t sees raw keys
    `[raw_lo[t], t]`, no slots. float32 softmax; the kernels' log2 convention."""
    f32 = jnp.float32
    groups = q.shape[2] // k.shape[2]
    keys = jnp.repeat(k.astype(f32), groups, axis=2)
    values = jnp.repeat(v.astype(f32), groups, axis=2)
    scores = jnp.einsum("bthd,buhd->bhtu", q.astype(f32), keys) * scale
    t = jnp.arange(q.shape[1])
    seen = (t[None, None, :] >= raw_lo[:, :, None]) & (t[None, None, :] <= t[None, :, None])
    scores = jnp.where(seen[:, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    p = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("bhtu,buhd->bthd", p, values)
    return out.astype(q.dtype), lse * _LOG2E


def lead_gradients(q, k, v, raw_lo, dout, scale: float):
    """(dq, dk, dv) of the lead rows' block (`lead_attention`'s output under cotangent
    `dout` `[B, N, Hq, D]`), in the dtypes of q, k, v."""
    _, vjp = jax.vjp(lambda q, k, v: lead_attention(q, k, v, raw_lo, scale)[0], q, k, v)
    return vjp(dout.astype(q.dtype))


def with_lead_rows(x, lead_x):
    """`x` `[B, L', ...]` with its first rows replaced by `lead_x` `[B, N, ...]` (in place
    where XLA can: the kernels' outputs are fresh buffers).

    `x` passes an optimization barrier first: a kernel's output as the update's target
    failed XLA's dynamic-slice fusion in a forward-only program at 128K (H100, jax 0.11.2:
    "DUS target must be a fusion parameter, got %mpmd_map.1"); through the barrier it
    compiles, and 8 sinks cost 0.99x of none forward (`research/h100_2026-12-06b.md`)."""
    x = jax.lax.optimization_barrier(x)
    return jax.lax.dynamic_update_slice(x, lead_x.astype(x.dtype), (0,) * x.ndim)
