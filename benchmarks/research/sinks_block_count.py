"""Key blocks the Pallas GPU forward visits for CCA with N sinks, from `cca_jax.blocks` alone.

    python benchmarks/research/sinks_block_count.py [--length 131072] [--block 128] [--narrow 16]

Explains the sinks' kernel time (cca_sinks_speed_h200.md): for every query block, the raw
and core-slot key blocks `raw_blocks_for_rows` / `core_blocks_for_rows` return, summed, for
several N (g = 16, s = 1024, block_q = block_k as the forward's defaults). A narrow head
(`blocks.narrow_head`, the kernels' `narrow_block`) counts as narrow / block of a block;
`--narrow 0` counts the walk without it.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from cca_jax.blocks import (CCA, core_blocks_for_rows, narrow_head,  # noqa: E402
                            raw_blocks_for_rows)


def count(length: int, block: int, sinks: int, narrow: int, group: int = 16,
          window: int = 1024):
    pattern = CCA(group, window, sinks)
    t = np.arange(length)
    raw_lo, slots = np.asarray(pattern.raw_start(t)), np.asarray(pattern.num_slots(t))
    raw = core = 0
    for r0 in range(0, length, block):
        r1 = r0 + block - 1
        bounds = raw_blocks_for_rows(r0, r1, int(raw_lo[r0]), int(raw_lo[r1]), block)
        if 0 < narrow < block:
            head, _, bounds = narrow_head(bounds, int(raw_lo[r0]), block, narrow)
            raw += head * narrow / block
        raw += bounds[3] - bounds[0]
        first, _, _, last = core_blocks_for_rows(0, 0, int(slots[r0]), int(slots[r1]), block)
        core += last - first
    return raw, core


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--narrow", type=int, default=16)
    args = ap.parse_args(argv)
    base = sum(count(args.length, args.block, 0, args.narrow))
    print("| N | raw blocks | core blocks | total | vs N = 0 |\n|---|---|---|---|---|")
    for sinks in (0, 4, 8, 12, 16, 20, 64, 128):
        raw, core = count(args.length, args.block, sinks, args.narrow)
        print(f"| {sinks} | {raw:.1f} | {core} | {raw + core:.1f} | {(raw + core) / base - 1:+.2%} |")


if __name__ == "__main__":
    main()
