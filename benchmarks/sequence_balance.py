"""Per-shard attention work when a sequence is split over devices, from `cca_jax.blocks`.

    python benchmarks/sequence_balance.py [--length 131072] [--shards 8]
        [--out benchmarks/results/sequence_balance]

For each attention option, the visible query-key scores (work) of each shard's query rows
under a contiguous split (shard i holds rows [i L/n, (i+1) L/n)) and a zigzag split (the
sequence cut into 2n chunks; shard i holds chunks i and 2n-1-i), and the imbalance
max/mean: the step waits for the busiest shard. Pure arithmetic, no device.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import PAPER_PATTERNS, claim_output, stamp, write_results  # noqa: E402



def row_work(pattern, length: int) -> np.ndarray:
    t = np.arange(length, dtype=np.int64)
    return pattern.num_slots(t) + t - pattern.raw_start(t) + 1


def shard_work(work: np.ndarray, shards: int, zigzag: bool) -> np.ndarray:
    if not zigzag:
        return work.reshape(shards, -1).sum(1)
    chunks = work.reshape(2 * shards, -1).sum(1)
    return chunks[:shards] + chunks[::-1][:shards]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/sequence_balance")
    args = ap.parse_args(argv)
    claim_output(args.out)
    records, lines = [], [
        f"# Per-shard attention work, L = {args.length}, {args.shards} sequence shards", "",
        f"- command: `python benchmarks/sequence_balance.py {' '.join(argv or sys.argv[1:])}`",
        "- work = visible query-key scores of the shard's query rows (per head); imbalance = "
        "max / mean over shards", "",
        "| attention | split | work per shard (millions of scores) | imbalance |",
        "| --- | --- | --- | --- |"]
    for kind, pattern in PAPER_PATTERNS.items():
        work = row_work(pattern, args.length)
        for zigzag in (False, True):
            per = shard_work(work, args.shards, zigzag)
            imbalance = float(per.max() / per.mean())
            split = "zigzag" if zigzag else "contiguous"
            records.append(dict(stamp(), attention=kind, split=split, work=per.tolist(),
                                imbalance=round(imbalance, 4)))
            lines.append(f"| {kind} | {split} | {' / '.join(f'{x / 1e6:.0f}' for x in per)} | "
                         f"{imbalance:.3f} |")
    write_results(args.out, records, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
