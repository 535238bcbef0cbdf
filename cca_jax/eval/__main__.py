"""`python -m cca_jax.eval {ppl,passkey,mdqa}`: evaluate a checkpoint, with any attention.

    python -m cca_jax.eval ppl --ckpt DIR --text-file book.txt --seq-len 32768 [--stride S]
    python -m cca_jax.eval passkey --ckpt DIR --lengths 4096,16384 --depths 0,0.5,1 \\
        --samples 5 --seed 0
    python -m cca_jax.eval mdqa --ckpt DIR --data nq-open-oracle.jsonl.gz --limit 100

Every subcommand takes `--ckpt`, the generate CLI's attention flags (`--attention`,
`--group-size`, `--window-size`, `--sink-tokens`), `--dtype`, `--max-position-embeddings`,
`--rope-theta` and `--json OUT`; it prints a markdown table, writes its results as JSON,
and with `--plot PNG` draws them. Errors the user can fix print `error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from cca_jax.eval import common
from cca_jax.cli import UsageError, add_checkpoint_arg, add_model_args, enable_compile_cache


def _shared(ap: argparse.ArgumentParser) -> None:
    add_checkpoint_arg(ap)
    add_model_args(ap)
    ap.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                    help="the model's context limit, raised to evaluate longer prompts "
                    "(default: the checkpoint's)")
    ap.add_argument("--rope-theta", type=float, default=None, metavar="THETA",
                    help="RoPE base, raised to evaluate a model as extended to a longer "
                    "context before (or without) fine-tuning (default: the checkpoint's)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write the results to this JSON file (default: none)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="draw the results into this PNG file (default: none)")
    ap.add_argument("--no-progress", action="store_true",
                    help="hide the progress bars (default: shown)")


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

    p = sub.add_parser("ppl", help="long-document perplexity (cca_jax/eval/ppl.py)",
                       description="Long-document perplexity: the tokens cut into windows "
                       "of --seq-len, each scored on its own.")
    _shared(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", metavar="FILE", help="UTF-8 text, tokenized as-is, no "
                     "special tokens (required: this or --token-file)")
    src.add_argument("--token-file", metavar="FILE", help="token ids instead of text: .npy, "
                     "or .json (a list of ids, or of lists of ids, concatenated) (required: "
                     "this or --text-file)")
    p.add_argument("--seq-len", type=int, required=True, metavar="N",
                   help="window length in tokens (required)")
    p.add_argument("--stride", type=int, default=None, metavar="S", help="windows start "
                   "every S tokens and each scores its last S, so every scored token has at "
                   "least N - S tokens of context (default: N, windows side by side)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="windows per forward pass (default: 1)")
    p.add_argument("--chunk", type=int, default=1024, metavar="C", help="positions whose "
                   "logits exist at once; also the bucket of the perplexity-by-position "
                   "curve (default: 1024)")

    p = sub.add_parser("passkey", help="passkey / needle retrieval (cca_jax/eval/passkey.py)",
                       description="Passkey / needle retrieval: a key hidden at each depth of "
                       "filler text, answered greedily, scored by exact match.")
    _shared(p)
    p.add_argument("--lengths", type=_int_list, required=True, metavar="L1,L2",
                   help="prompt lengths in tokens, comma-separated (required)")
    p.add_argument("--depths", type=_float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   metavar="D1,D2", help="needle depths in [0, 1] (0 = the start of the "
                   "filler), comma-separated (default: 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int, default=5, metavar="K",
                   help="prompts per (length, depth) (default: 5)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the generated prompts (default: 0)")
    p.add_argument("--task", choices=("passkey", "niah"), default="passkey",
                   help="passkey: a 5-digit key in filler; niah: RULER's 7-digit magic number "
                   "for a key word (default: passkey)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="prompts generated together (default: 1)")
    p.add_argument("--chunk-size", type=int, default=2048, metavar="N",
                   help="prefill chunk in tokens (default: 2048)")

    p = sub.add_parser("mdqa", help="multi-document QA, Lost in the Middle format "
                       "(cca_jax/eval/mdqa.py)",
                       description="Multi-document QA (Lost in the Middle): accuracy by "
                       "position of the gold document.")
    _shared(p)
    p.add_argument("--data", required=True, metavar="FILE", help="a .jsonl or .jsonl.gz file: "
                   "QA records with question/answers/ctxs, or key-value retrieval records "
                   "(required)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="the first N records only (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens generated per answer (default: 32)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="prompts generated together (default: 1)")
    p.add_argument("--chunk-size", type=int, default=2048, metavar="N",
                   help="prefill chunk in tokens (default: 2048)")
    return ap


def run(a, argv) -> dict:
    """One subcommand on parsed arguments: prints its table, returns its JSON record."""
    enable_compile_cache(a)
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
