"""Measure the data pipeline alone: `python -m train.data --bench [options]` prints tokens/s.

    python -m train.data --bench                                   # builtin text, bytes
    python -m train.data --bench --tokenizer CKPT_DIR_OR_TOKENIZER_FILE --seq-len 8192
    python -m train.data --bench ... --out results.jsonl      # also append a JSON record

`--tokenizer` takes a checkpoint directory or a lone tokenizer.model / tokenizer.json file.
Counts input tokens of batches after the first (setup and preparation are reported apart).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import make_batches, make_tokenizer


def bench(args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = args.tokenizer
        if tok_dir and Path(tok_dir).is_file():  # a lone tokenizer file: give it a directory
            name = "tokenizer.json" if tok_dir.endswith(".json") else "tokenizer.model"
            shutil.copy(tok_dir, Path(tmp) / name)
            tok_dir = tmp
        t0 = time.perf_counter()
        tokenizer = make_tokenizer(tok_dir)
        it = make_batches(args.source, tokenizer, seq_len=args.seq_len,
                          batch_size=args.batch_size, seed=args.seed, data_dir=args.data_dir,
                          text_field=args.text_field, cache_dir=args.cache_dir)
        next(it)
        setup = time.perf_counter() - t0
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            next(it)
            n += 1
        dt = time.perf_counter() - t0
    rate = n * args.batch_size * args.seq_len / dt
    print(f"source {args.source}  tokenizer {tokenizer!r}  seq_len {args.seq_len}  "
          f"batch {args.batch_size}: setup + first batch {setup:.2f} s, then {n} batches in "
          f"{dt:.2f} s: {rate:,.0f} tokens/s")
    if args.out:
        record = dict(source=args.source, tokenizer=repr(tokenizer), seq_len=args.seq_len,
                      batch_size=args.batch_size, setup_s=round(setup, 2), batches=n,
                      seconds=round(dt, 2), tokens_per_s=round(rate), cpus=os.cpu_count(),
                      date=str(datetime.date.today()),
                      command="python -m train.data " + " ".join(sys.argv[1:]))
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return rate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", action="store_true", help="measure tokens/s of the pipeline")
    p.add_argument("--source", default="builtin")
    p.add_argument("--tokenizer", default=None, help="checkpoint dir or tokenizer file "
                   "(default: the byte tokenizer)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--text-field", default="text")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None, help="append a JSON record to this file")
    args = p.parse_args(argv)
    if not args.bench:
        p.error("nothing to do: pass --bench")
    try:
        bench(args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
