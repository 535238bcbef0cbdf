"""What a fused Mosaic backward would do, counted from the kernels' own visit tables (no GPU):
the key-side kernels also making dQ (five products a visited block, FA2/FA3's way) instead of
a dq kernel that recomputes S and dP (seven products: today's `backward.py`, no atomics).

    python benchmarks/research/fused_backward_estimate.py [--length 131072] [--hq 32]
        [--out benchmarks/results/research/fused_backward_estimate_cpu]

Per query head, from `tables.visit_tables` (the dq kernel's) and `tables.key_visit_tables`
(dk/dv over raw key blocks, dck/dcv over slot blocks) at the default `MosaicBackwardConfig`:
the scores each kernel visits (and how many times the visible ones), the backward's matmul
FLOPs both ways, and the fused way's cost: every key-side CTA step adds a `[key_block_q, D]`
float32 dQ partial into global memory (TMA reduce-add, both warpgroups' keys summed in
shared memory first; summed apart it is twice as much), in an order that varies run to run.
`--backward-ms`: a measured backward to scale (the FLOP rate it implies, applied to both).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)   # the repository root: benchmarks.*, cca_jax
from benchmarks.measure import claim_output, stamp, table_heading, write_results  # noqa: E402


def estimate(length: int, hq: int, hkv: int, head_dim: int, group: int, window: int,
             backward_ms: float | None = None) -> dict:
    """The counts (module docstring) for one unpacked row of `length` tokens."""
    import jax.numpy as jnp

    from cca_jax import blocks
    from pallas_kernels.mosaic_gpu.config import KEY_ROWS, MosaicBackwardConfig
    from pallas_kernels.mosaic_gpu.tables import (CORE_FIRST, CORE_LAST, Q_FIRST, Q_LAST,
                                                  RAW_FIRST, RAW_LAST, key_visit_tables,
                                                  visit_tables)
    cfg = MosaicBackwardConfig()
    ranges = blocks.pattern_ranges(blocks.CCA(group, window, 0), length)
    raw_lo, core_lo, core_hi = (np.asarray(x) for x in ranges[:3])
    cta_keys = KEY_ROWS * cfg.compute_wgs
    slots = -(-max(int(core_hi.max()), 1) // cta_keys) * cta_keys
    visible_raw = int((np.arange(length) - raw_lo + 1).sum())
    visible_core = int((core_hi - core_lo).sum())
    dq = np.asarray(visit_tables(raw_lo, core_lo, core_hi, block_q=cfg.block_q,
                                 compute_wgs=cfg.compute_wgs, block_kv=cfg.block_kv).cta)[0]
    dq_steps = int(((dq[:, RAW_LAST] - dq[:, RAW_FIRST])
                    + (dq[:, CORE_LAST] - dq[:, CORE_FIRST])).sum())
    raw, core = (np.asarray(t.cta)[0] for t in key_visit_tables(
        jnp.asarray(raw_lo), jnp.asarray(core_lo), jnp.asarray(core_hi), slots,
        key_rows=KEY_ROWS, compute_wgs=cfg.compute_wgs, block_q=cfg.key_block_q))
    raw_steps = int((raw[:, Q_LAST] - raw[:, Q_FIRST]).sum())
    core_steps = int((core[:, Q_LAST] - core[:, Q_FIRST]).sum())
    dq_scores = dq_steps * cfg.block_q * cfg.compute_wgs * cfg.block_kv
    raw_scores = raw_steps * cta_keys * cfg.key_block_q
    core_scores = core_steps * cta_keys * cfg.key_block_q
    flops = lambda scores: 2 * head_dim * scores * hq   # noqa: E731  (one product, all heads)
    seven = flops(dq_scores) * 3 + flops(raw_scores + core_scores) * 4
    five = flops(raw_scores + core_scores) * 5
    partial = cfg.key_block_q * head_dim * 4
    record = dict(length=length, hq=hq, hkv=hkv, head_dim=head_dim, group=group, window=window,
                  visible_per_head=visible_raw + visible_core,
                  dq_visited_x=round(dq_scores / (visible_raw + visible_core), 3),
                  raw_visited_x=round(raw_scores / visible_raw, 3),
                  core_visited_x=round(core_scores / visible_core, 3) if visible_core else None,
                  key_side_cta_steps_per_head=raw_steps + core_steps,
                  backward_tflop_seven=round(seven / 1e12, 2),
                  backward_tflop_five=round(five / 1e12, 2),
                  five_over_seven=round(five / seven, 3),
                  dq_reduce_gb=round((raw_steps + core_steps) * partial * hq / 1e9, 1),
                  dq_accumulator_gib=round(length * hq * head_dim * 4 / 2**30, 2))
    if backward_ms:
        rate = seven / (backward_ms / 1e3)
        record.update(backward_ms=backward_ms, tflops_implied=round(rate / 1e12),
                      fused_matmul_ms=round(five / rate * 1e3, 1),
                      dq_reduce_tb_per_s=round(record["dq_reduce_gb"] / (five / rate) / 1e3, 2))
    return record


def table(records) -> str:
    first = records[0]
    lines = table_heading("The Mosaic backward fused (5 products) against today's (7), counted "
                          "from the visit tables", first) + [
        "| L | Hq | Hkv | D | visited x visible: dq / raw keys / slots | backward TFLOP 7 -> 5 "
        "| dQ reduce-add GB | dQ f32 GiB | measured ms -> fused matmul ms | reduce TB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(
            f"| {r['length']} | {r['hq']} | {r['hkv']} | {r['head_dim']} | {r['dq_visited_x']} / "
            f"{r['raw_visited_x']} / {r['core_visited_x']} | {r['backward_tflop_seven']} -> "
            f"{r['backward_tflop_five']} ({r['five_over_seven']}x) | {r['dq_reduce_gb']} | "
            f"{r['dq_accumulator_gib']} | {r.get('backward_ms', '')} -> "
            f"{r.get('fused_matmul_ms', '')} | {r.get('dq_reduce_tb_per_s', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--backward-ms", type=float, default=None,
                    help="a measured backward of this shape (ms), to scale the estimate")
    ap.add_argument("--out", default="benchmarks/results/research/fused_backward_estimate_cpu")
    a = ap.parse_args(argv)
    claim_output(a.out)
    record = dict(estimate(a.length, a.hq, a.hkv, a.head_dim, a.group, a.window,
                           a.backward_ms), **stamp(argv))
    write_results(a.out, [record], table([record]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
