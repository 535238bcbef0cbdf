"""Running one variant through the project's own CLIs, and turning their outputs into records.

Every step is a subprocess a user could type (the command is kept in each record), and each
writes its output file once: a step whose output exists is skipped, so an interrupted run
picks up where it stopped (train.finetune itself resumes from its last checkpoint).
Records: {"variant", "metric", "context", "value", "train_tokens", "steps", "commit", ...}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.real_model.settings import Experiment, Variant

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
KV_DATA = "kv-retrieval-75_keys.jsonl.gz"
PASSKEY_MARGIN = 64     # prompt tokens left free under a context for the answer


class StepFailed(RuntimeError):
    """A CLI step exited non-zero (its log names the cause)."""


@dataclasses.dataclass(frozen=True)
class Paths:
    """Where the experiment's files live under its work directory."""

    work: Path

    @property
    def hf(self) -> Path:              # the dequantized pretrained model, HF format
        return self.work / "hf"

    @property
    def ckpt(self) -> Path:            # the same, converted (our format)
        return self.work / "ckpt"

    @property
    def corpus(self) -> Path:
        return self.work / "corpus"

    @property
    def book(self) -> Path:            # PG-19 book, Gutenberg header stripped (eval only)
        return self.work / "book.txt"

    @property
    def kv_data(self) -> Path:
        return self.work / KV_DATA

    def run(self, variant: str) -> Path:
        return self.work / "runs" / variant

    def evals(self, variant: str) -> Path:
        return self.work / "eval" / variant

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def compile_cache(self) -> Path:
        return self.work / "jax_cache"


class Runner:
    """Runs the steps of variants of one experiment and collects their records."""

    def __init__(self, exp: Experiment, paths: Paths, commit: str, echo=print):
        self.exp, self.paths, self.commit, self.echo = exp, paths, commit, echo

    # ---- subprocesses --------------------------------------------------------------------
    def cli(self, args: list[str], log: str) -> float:
        """Run `python <args>` from the repository root; its output goes to logs/<log>.log.
        Returns the wall seconds; StepFailed (with the log's tail) on a non-zero exit."""
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(self.paths.compile_cache),
                   PYTHONUNBUFFERED="1")
        command = shlex.join(["python", *args])
        self.echo(f"$ {command}")
        start = time.perf_counter()
        with open(self.paths.logs / f"{log}.log", "a") as out:
            out.write(f"$ {command}\n")
            out.flush()
            code = subprocess.call([sys.executable, *args], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        if code != 0:
            tail = (self.paths.logs / f"{log}.log").read_text().splitlines()[-25:]
            raise StepFailed(f"{command} exited {code} after {seconds:.0f} s:\n"
                             + "\n".join(tail))
        self.echo(f"  done in {seconds:.1f} s")
        return seconds

    # ---- one variant ---------------------------------------------------------------------
    def model_flags(self, v: Variant) -> tuple[Path, list[str]]:
        """The checkpoint a variant is measured from, and the eval flags that make it so."""
        if v.fine_tuned:
            return self.paths.run(v.name) / "final", []
        if v.native:
            return self.paths.ckpt, ["--attention", "full"]
        return self.paths.ckpt, [*self.exp.option_flags(v.option), "--rope-theta",
                                 str(self.exp.rope_theta), "--max-position-embeddings",
                                 str(self.exp.seq_len)]

    def contexts(self, v: Variant) -> tuple[int, ...]:
        if v.native:
            return (self.exp.short_context, self.exp.native_context)
        return (self.exp.short_context, *self.exp.eval_contexts)

    def train(self, v: Variant) -> None:
        e, out = self.exp, self.paths.run(v.name)
        marker = out / "final" / "trained_steps.json"
        if marker.exists() and json.loads(marker.read_text())["step"] == e.steps:
            return
        self._share_data_cache(out)
        self.cli(["-m", "train.finetune", "--checkpoint", str(self.paths.ckpt),
                  "--data", str(self.paths.corpus / "train"), "--seq-len", str(e.seq_len),
                  "--batch-size", str(e.batch_size), "--no-document-mask",
                  "--rope-theta", str(e.rope_theta), "--dtype", e.dtype,
                  "--param-dtype", e.param_dtype, "--trainable", v.trainable,
                  *e.option_flags(v.option), "--lr", str(e.lr if v.lr is None else v.lr),
                  "--warmup-steps", str(e.warmup_steps), "--steps", str(e.steps),
                  "--save-every", str(e.save_every), "--seed", str(e.seed),
                  "--out", str(out)], f"{v.name}_train")

    def _share_data_cache(self, out: Path) -> None:
        """A new run starts with an earlier run's prepared data (hard links): the corpus is
        the same files, so train.finetune would prepare the same array_record data again."""
        if out.exists():
            return
        done = sorted(self.paths.work.glob("runs/*/data_cache"))
        if done:
            shutil.copytree(done[0], out / "data_cache", copy_function=os.link)

    def eval_commands(self, v: Variant) -> list[list[str]]:
        """`python -m cca_jax.eval` argument lists of a variant's evaluations; each writes
        its own --json file (the last two arguments)."""
        e, dest = self.exp, self.paths.evals(v.name)
        ckpt, flags = self.model_flags(v)
        shared = ["--ckpt", str(ckpt), *flags, "--dtype", e.dtype, "--no-progress"]
        out = []
        for context in self.contexts(v):
            for text, path in (("code", self.paths.corpus / "heldout_code.txt"),
                               ("book", self.paths.book)):
                out.append(["ppl", *shared, "--text-file", str(path), "--seq-len", str(context),
                            "--chunk", str(min(1024, context)),
                            "--json", str(dest / f"ppl_{text}_{context}.json")])
        lengths = [c - PASSKEY_MARGIN for c in
                   ((e.native_context,) if v.native else e.eval_contexts)]
        out.append(["passkey", *shared, "--lengths", ",".join(map(str, lengths)),
                    "--depths", ",".join(f"{d:g}" for d in e.passkey_depths),
                    "--samples", str(e.passkey_samples), "--batch-size", str(e.passkey_batch),
                    "--seed", str(e.seed), "--json", str(dest / "passkey.json")])
        out.append(["mdqa", *shared, "--data", str(self.paths.kv_data), "--limit",
                    str(e.kv_limit), "--batch-size", str(e.kv_batch), "--max-new-tokens", "48",
                    "--json", str(dest / "kv.json")])
        return out

    def evaluate(self, v: Variant) -> None:
        """The evaluations not done yet, in one child process (`evals`: the eval CLI's own
        `main` on each argument list, so the model's programs compile once per shape), then
        the inference benchmark of a fine-tuned model."""
        dest = self.paths.evals(v.name)
        dest.mkdir(parents=True, exist_ok=True)
        todo = [argv for argv in self.eval_commands(v) if not Path(argv[-1]).exists()]
        if todo:
            plan = dest / "commands.json"
            plan.write_text(json.dumps(todo, indent=1) + "\n")
            self.cli(["-m", "benchmarks.real_model", "evals", str(plan)], f"{v.name}_eval")
        if v.fine_tuned and not (dest / "inference.json").exists():
            ckpt, _ = self.model_flags(v)
            self.cli(["benchmarks/inference.py", "--ckpt", str(ckpt), "--dtype", self.exp.dtype,
                      "--contexts", str(self.exp.efficiency_context),
                      "--out", str(dest / "inference")], f"{v.name}_eval")

    # ---- records -------------------------------------------------------------------------
    def records(self, v: Variant) -> list[dict[str, Any]]:
        """Every measurement of a variant so far, as result records."""
        e, dest = self.exp, self.paths.evals(v.name)
        base = {"variant": v.name, "train_tokens": e.train_tokens if v.fine_tuned else 0,
                "steps": e.steps if v.fine_tuned else 0, "commit": self.commit}
        out = []
        for context in self.contexts(v):
            for text in ("code", "book"):
                path = dest / f"ppl_{text}_{context}.json"
                if path.exists():
                    r = json.loads(path.read_text())
                    out.append({**base, "metric": f"ppl_{text}", "context": context,
                                "value": r["ppl"], "windows": r["windows"],
                                "scored_tokens": r["scored_tokens"],
                                "by_position": r["by_position"],
                                **_where(r.get("environment"))})
        path = dest / "passkey.json"
        if path.exists():
            r = json.loads(path.read_text())
            for length in r["lengths"]:
                cells = [c for c in r["by_length_depth"] if c["length"] == length]
                out.append({**base, "metric": "passkey_acc", "context": length + PASSKEY_MARGIN,
                            "value": statistics.mean(c["accuracy"] for c in cells),
                            "prompt_tokens": length,
                            "by_depth": {f"{c['depth']:g}": c["accuracy"] for c in cells},
                            "samples_per_cell": r["samples_per_cell"],
                            **_where(r.get("environment"))})
        path = dest / "kv.json"
        if path.exists():
            r = json.loads(path.read_text())
            tokens = [x["prompt_tokens"] for x in r["results"]]
            out.append({**base, "metric": "kv_acc", "context": max(tokens),
                        "value": r["accuracy"], "examples": r["examples"],
                        "mean_prompt_tokens": statistics.mean(tokens),
                        **_where(r.get("environment"))})
        metrics = self.paths.run(v.name) / "metrics.jsonl"
        if v.fine_tuned and metrics.exists():
            lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            steady = [x["tokens_per_s"] for x in lines if x["step"] > 3]
            if steady:
                out.append({**base, "metric": "train_tokens_per_s", "context": e.seq_len,
                            "value": statistics.median(steady),
                            "loss_curve": [[x["step"], x["loss"]] for x in lines],
                            "mfu": statistics.median(x["mfu"] or 0 for x in lines
                                                     if x["step"] > 3)})
        path = dest / "inference.json"
        if path.exists():
            for r in json.loads(path.read_text()):
                for metric, key in (("ttft_s", "ttft_s"), ("decode_ms_per_token",
                                                           "decode_ms_per_token")):
                    out.append({**base, "metric": metric, "context": r["context"],
                                "value": r[key], "device": r["device"], "jax": r["jax"],
                                "date": r["date"], "command": r["command"]})
        return out


def _where(env: dict | None) -> dict:
    if not env:
        return {}
    return {"device": env["device"], "jax": env["jax"], "date": env["date"],
            "command": env["command"]}
