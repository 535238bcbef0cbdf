"""Input checks shared by the blocked attention kernels of every backend."""

from __future__ import annotations


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
