"""Host memory helper for the streaming checkpoint writers and converters.

`release_freed_memory()` asks glibc to return freed heap to the OS (`malloc_trim(0)`).
Without it, glibc keeps large freed blocks in the arenas of the threads that used them
(tensorstore's writer threads, orbax's commit threads), so a process that builds and writes
big arrays one after another keeps memory it no longer uses (the converters' peak RSS with and
without it: `benchmarks/results/implementation_notes.md`).

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
