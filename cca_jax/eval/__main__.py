"""`python -m cca_jax.eval {ppl,passkey,mdqa}`: evaluate a checkpoint, with any attention.

    python -m cca_jax.eval ppl --ckpt DIR --text-file book.txt --seq-len 32768 [--stride S]
    python -m cca_jax.eval passkey --ckpt DIR --lengths 4096,16384 --depths 0,0.5,1 \\
        --samples 5 --seed 0
    python -m cca_jax.eval mdqa --ckpt DIR --data nq-open-oracle.jsonl.gz --limit 100

Every subcommand takes `--ckpt`, the generate CLI's attention flags (`--attention`,
`--group-size`, `--window-size`, `--sink-tokens`), `--dtype`, `--max-position-embeddings`
and `--json OUT`; it prints a markdown table, writes its results as JSON, and with `--plot
PNG` draws them. Errors the user can fix print `error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from cca_jax.eval import common
from cca_jax.generate import UsageError, add_attention_args


def _shared(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ckpt", required=True, help="converted checkpoint directory "
                    "(convert.hf_to_flax output or a train/ export), with its tokenizer")
    add_attention_args(ap)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="parameter/activation dtype (default: the checkpoint's)")
    ap.add_argument("--max-position-embeddings", type=int, default=None,
                    help="override the checkpoint's context limit (default: its own)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--plot", default=None, help="draw the results into this PNG file")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cca_jax.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="task", required=True)

    p = sub.add_parser("ppl", help="long-document perplexity (cca_jax/eval/ppl.py)")
    _shared(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", help="UTF-8 text, tokenized as-is (no special tokens)")
    src.add_argument("--token-file", help="token ids instead of text: .npy, or .json (a list "
                     "of ids, or of lists of ids, concatenated)")
    p.add_argument("--seq-len", type=int, required=True, help="window length N in tokens")
    p.add_argument("--stride", type=int, default=None, help="strided variant: windows "
                   "every S tokens, each scoring its last S tokens")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (1)")
    p.add_argument("--chunk", type=int, default=1024, help="positions whose logits exist at "
                   "once; also the resolution of the perplexity-by-position curve (1024)")

    p = sub.add_parser("passkey", help="passkey / needle retrieval (cca_jax/eval/passkey.py)")
    _shared(p)
    p.add_argument("--lengths", type=_int_list, required=True,
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", type=_float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths in [0, 1], comma-separated (0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int, default=5, help="samples per (length, depth) (5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks (0)")
    p.add_argument("--task", choices=("passkey", "niah"), default="passkey",
                   help="passkey (a 5-digit key in filler) or niah (RULER-style: a 7-digit "
                   "magic number for a key word)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated together (1)")
    p.add_argument("--chunk-size", type=int, default=2048, help="prefill chunk (2048)")

    p = sub.add_parser("mdqa", help="multi-document QA, Lost in the Middle format "
                       "(cca_jax/eval/mdqa.py)")
    _shared(p)
    p.add_argument("--data", required=True, help="a .jsonl or .jsonl.gz file (QA records "
                   "with question/answers/ctxs, or key-value retrieval records)")
    p.add_argument("--limit", type=int, default=None, help="the first N records only")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens generated per answer (32)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated together (1)")
    p.add_argument("--chunk-size", type=int, default=2048, help="prefill chunk (2048)")
    return ap


def run(a, argv) -> dict:
    """One subcommand on parsed arguments: prints its table, returns its JSON record."""
    if a.task == "ppl":
        from cca_jax.eval.ppl import run_ppl as task
    elif a.task == "passkey":
        from cca_jax.eval.passkey import run_passkey as task
    else:
        from cca_jax.eval.mdqa import run_mdqa as task
    record, table = task(a)
    record["environment"] = common.environment(argv)
    print(table + common.environment_lines(record["environment"]))
    common.write_json(a.json, record)
    if a.plot:
        from cca_jax.eval import plots
        plots.plot_record(record, a.plot)
    return record


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = build_parser().parse_args(argv)
    try:
        run(a, argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
