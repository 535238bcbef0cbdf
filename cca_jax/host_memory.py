"""Host memory helper for the streaming checkpoint writers and converters.

`release_freed_memory()` asks glibc to return freed heap to the OS (`malloc_trim(0)`).
Without it, glibc keeps large freed blocks in the arenas of the threads that used them
(tensorstore's writer threads, orbax's commit threads), so a process that builds and writes
big arrays one after another keeps memory it no longer uses. Measured on a random
1.1B-parameter bf16 checkpoint (TinyLlama shapes, largest stacked parameter 0.51 GB, 2 shared
cores, one run each), peak RSS with / without the calls:

    convert.hf_to_flax   1.04 / 1.18 GB   (wall 36 / 36 s)
    convert.flax_to_hf   1.13 / 1.43 GB   (wall 43 / 35 s; noisy machine)

A no-op where glibc is absent (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc `malloc_trim`); no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
