"""Training-step speed of `train.finetune` itself, one option per process.

    python benchmarks/train_bench.py --attention cca --seq-len 131072 --trainable qkv \\
        [--preset llama2-7b-shape] [--steps 4] [--remat full] \\
        --out benchmarks/results/train_h200_cca
    python benchmarks/train_bench.py --merge a.json b.json --out benchmarks/results/train_h200

Runs the real CLI (random weights of the preset's shape, byte tokens of one document longer
than all rows together, made by repeating the built-in text, no checkpoints) for `--steps`
steps and records the median step time of the steps after the first (which compiles),
tokens/s, MFU (train/flops.py) and the device's peak memory. `--no-document-mask` runs the
rows without segment ids (what lets full attention use cuDNN).
Writes `<out>.json` (records: model, attention, seq_len, trainable, impl, step_s,
tokens_per_s, mfu, peak_gib, device, jax, date, command) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import claim_output, read_records, stamp, write_results  # noqa: E402


def measure(args) -> dict:
    import jax

    from benchmarks.measure import PAPER_PATTERNS
    from cca_jax.attention import resolve_implementation
    from train import finetune
    from train.config import parse_args

    from train.data.sources import BUILTIN_TEXT

    with tempfile.TemporaryDirectory() as tmp:
        # One document longer than every row of the run, so rows are not packed documents
        # and the attention does the work of one long sequence.
        text = BUILTIN_TEXT.read_text()
        long_doc = os.path.join(tmp, "long.txt")
        with open(long_doc, "w") as f:
            f.write(text * (args.seq_len * (args.steps + 1) // len(text) + 1))
        cfg = parse_args(["--preset", args.preset, "--attention", args.attention,
                          "--data", long_doc,
                          "--seq-len", str(args.seq_len), "--trainable", args.trainable,
                          "--steps", str(args.steps), "--save-every", "0", "--batch-size", "1",
                          "--warmup-steps", "1", "--out", os.path.join(tmp, "run"),
                          "--remat", args.remat,
                          "--document-mask" if args.document_mask else "--no-document-mask"])
        finetune.run(cfg)
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            logged = [json.loads(line) for line in f]
    later = logged[1:] or logged
    step_s = statistics.median(r["step_s"] for r in later)
    stats = jax.devices()[0].memory_stats() or {}
    pattern = PAPER_PATTERNS[args.attention]
    return dict(model=args.preset, attention=args.attention, seq_len=args.seq_len,
                trainable=args.trainable, remat=args.remat,
                document_mask=args.document_mask,
                impl=resolve_implementation("auto", pattern=pattern, packed=args.document_mask),
                step_s=round(step_s, 3), tokens_per_s=round(args.seq_len / step_s, 1),
                mfu=None if later[0]["mfu"] is None else round(statistics.median(
                    r["mfu"] for r in later), 4),
                peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
                first_step_s=round(logged[0]["step_s"], 1), losses=[r["loss"] for r in logged],
                **stamp())


def table(records) -> str:
    first = records[0]
    lines = [f"# Fine-tuning step on {first['device']}", "",
             f"- date: {first['date']}; jax {first['jax']}",
             *[f"- command: `{c}`" for c in sorted({r['command'] for r in records})],
             "- batch 1 sequence, random weights, one long document (byte tokens), AdamW, "
             "bf16 params / float32 optimizer state", "",
             "| model | attention | implementation | rows | seq_len | trainable | remat | step s "
             "| tokens/s | MFU | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = ["", "Implementation: `auto`'s choice. Rows with segment ids (the default document "
             "mask) run the Pallas kernels for every option; `--no-document-mask` rows carry "
             "none, and full attention runs through cuDNN."]
    for r in records:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        rows = "document mask" if r.get("document_mask", True) else "no mask"
        lines.append(f"| {r['model']} | {r['attention']} | {r['impl']} | {rows} | {r['seq_len']} | "
                     f"{r['trainable']} | {r.get('remat', 'full')} | {r['step_s']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {mfu} | {r['peak_gib']:.1f} |")
    return "\n".join(lines + notes) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama2-7b-shape")
    ap.add_argument("--attention", default="cca")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--trainable", default="qkv")
    ap.add_argument("--remat", default="full", help="the layers' remat policy (records before "
                    "2026-12-05 ran `full`)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-document-mask: rows without segment ids (full: cuDNN)")
    ap.add_argument("--merge", nargs="+")
    ap.add_argument("--out", default="benchmarks/results/train_h200")
    args = ap.parse_args(argv)
    claim_output(args.out)
    if args.merge:
        records = read_records(args.merge)
    else:
        records = [measure(args)]
    write_results(args.out, records, table(records))


if __name__ == "__main__":
    main()
