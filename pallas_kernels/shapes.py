"""Input checks shared by the kernels of every backend: the blocked attention's and the
decode step's contracts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cca_jax.blocks import DecodeBounds


def check_blocked_inputs(q, k, v, ck, cv, bounds) -> None:
    """q `[B, L, Hq, D]`, k/v `[B, L, Hkv, D]` (Hq a multiple of Hkv), ck/cv `[B, m, Hq, D]`
    and the three row bounds `[B, L]`; a ValueError naming the expected shapes otherwise."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [B, L, H, D], got {q.shape} and {k.shape}.")
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    if k.shape != (b, length, hkv, d) or v.shape != k.shape or hq % hkv:
        raise ValueError(f"k and v must be [B, L, Hkv, D] with Hq a multiple of Hkv; got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}.")
    if ck.ndim != 4 or ck.shape[0] != b or ck.shape[2:] != (hq, d) or cv.shape != ck.shape:
        raise ValueError(f"ck and cv must be [B, m, Hq, D]; got {ck.shape} and {cv.shape} for "
                         f"q {q.shape}.")
    if any(x.shape != (b, length) for x in bounds):
        raise ValueError(f"raw_lo, core_lo and core_hi must be [B, L] = {(b, length)}; got "
                         f"{[x.shape for x in bounds]}.")


def check_decode_inputs(q, k_ring, v_ring, ck, cv, bounds, *, stacked: bool,
                        slot_layout: str = "bchd") -> tuple[int, int, int, int]:
    """The decode kernels' contract: q `[B, Hq, D]`, k/v rings `[B, R, Hkv, D]` (R >= 1, Hq a
    multiple of Hkv), slots `[B, C, Hq, D]` (`bchd`) or `[B, Hq, C, D]` (`bhcd`), each with a
    leading layers axis when `stacked`, and three int `[B]` bounds. -> (B, Hq, D, Hkv); a
    ValueError naming the expected shapes otherwise."""
    shapes = [np.shape(x) for x in (k_ring, v_ring, ck, cv)]
    lead = 1 if stacked else 0
    if np.ndim(q) != 3 or any(len(x) != 4 + lead for x in shapes):
        raise ValueError(
            f"q must be [B, Hq, D] and the cache arrays [B, ...] 4-D (or [L, B, ...] 5-D with "
            f"layer=); got q {np.shape(q)}, {shapes}.")
    b, hq, d = np.shape(q)
    k_shape, v_shape, ck_shape, cv_shape = (x[lead:] for x in shapes)
    ring, hkv = k_shape[1], k_shape[2]
    if (k_shape[0], k_shape[3]) != (b, d) or v_shape != k_shape or ring < 1 or hq % hkv:
        raise ValueError(f"k_ring and v_ring must be [B, R, Hkv, D] with R >= 1 and Hq a "
                         f"multiple of Hkv; got q {np.shape(q)}, {shapes[0]}, {shapes[1]}.")
    slot_axis = 1 if slot_layout == "bchd" else 2
    want = [b, ck_shape[slot_axis], ck_shape[slot_axis], d]
    want[3 - slot_axis] = hq
    if list(ck_shape) != want or cv_shape != ck_shape or shapes[2][:lead] != shapes[0][:lead]:
        layout = "[B, C, Hq, D]" if slot_axis == 1 else "[B, Hq, C, D]"
        raise ValueError(f"ck and cv must be {layout} (slot_layout={slot_layout!r}) like the "
                         f"ring; got {shapes[2]} and {shapes[3]} for q {np.shape(q)}, ring "
                         f"{shapes[0]}.")
    if len(bounds) != 3:
        raise ValueError("bounds must be (ring_first, ring_count, num_slots), e.g. "
                         "cca_jax.blocks.decode_bounds(pattern, positions, R, C).")
    for name, x in zip(DecodeBounds._fields, bounds):
        if np.shape(x) != (b,) or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"bounds.{name} must be an int array [B={b}], got "
                             f"{jnp.result_type(x)} {np.shape(x)}.")
    return b, hq, d, hkv
