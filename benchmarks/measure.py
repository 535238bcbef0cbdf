"""Timing and error measures shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from cca_jax.blocks import parse_option

# The settings every benchmark compares: the paper's CCA and its baselines with the same
# raw window.
PAPER_PATTERNS = {
    "full": parse_option("full"),
    "sliding": parse_option("sliding", window_size=1024),
    "streaming": parse_option("streaming", window_size=1024, sink_tokens=4),
    "cca": parse_option("cca", group_size=16, window_size=1024),
}


def median_ms(fn, args, *, warmup: int = 1, iters: int | None = None, max_s: float = 0.5,
              max_iters: int = 20) -> float:
    """Median wall milliseconds of `fn(*args)` after `warmup` calls. `iters=None` sizes the
    count from one timed call: about `max_s` seconds in all, 3 to `max_iters` runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if iters is None:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = time.perf_counter() - start
        iters = int(max(3, min(max_iters, max_s / max(once, 1e-4))))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rel_l2(a, b) -> float:
    """|a - b| / |b| in float32 (L2 norms)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def read_records(paths) -> list:
    """The records of earlier `<out>.json` files, concatenated (for `--merge`)."""
    import json

    records = []
    for path in paths:
        with open(path) as f:
            records += json.load(f)
    return records


def write_results(out: str, records: list, table: str) -> None:
    """Print the markdown table; write `<out>.json` (the records) and `<out>.md` (the table)."""
    import json
    import os

    print(table)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(records, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(table)
