"""Experiment 1: does a short fine-tune recover what swapping CCA into a pretrained model costs?

    python benchmarks/stories_experiment.py [--steps 48] [--batch-size 2] [--lr 5e-4]
        [--work /tmp/stories_experiment] [--out benchmarks/results/stories_ppl]

The model is llama2.c's stories260K (`../shared/data/stories260K.bin`, context 512), converted
to our format. Its own tokenizer is not shipped, so the text is token ids throughout: the
held-out document and the fine-tuning data are sampled from the model itself (llama2.c's
default sampling, temperature 1.0, top-p 0.9, from BOS, 512 tokens each): the first
`--heldout` samples are the held-out document, the next `--train-sequences` the training data.
Options, all with the same raw window of 64 tokens:
  full | cca g=4 s=64 | sliding W=64 | streaming N=4 W=64.
For each: perplexity without fine-tuning (weights swapped in as they are), and after the same
fine-tune (`train.step`: the step, AdamW and loss of `python -m train.finetune`; all
parameters, `--steps` steps of `--batch-size` sequences of 512, lr `--lr` after 10 warmup
steps, one pass over the training samples, in the same order for every option; the budget
is small because this 2-core CPU is shared. A first try, 50 steps of 4 at lr 1e-3 cycling
six times through 32 samples, overfitted: the full-attention control went from 10.6 to 31.5
on the held-out samples). Full attention is
fine-tuned too, as the control: it shows what training on the model's own samples does alone.
Perplexity goes through the CLI (`python -m cca_jax.eval ppl --token-file ... --seq-len 512`,
windows of 512 = one sample each, tokens 2..512 scored).

Writes `<out>.json`, `<out>.md` and `<out>.png` (perplexity per option, and by position).
The work directory keeps the checkpoints (`ckpt/`, `ft_<option>/`) and token files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LEN = 512
OPTIONS = {
    "full": dict(attention="full"),
    "cca": dict(attention="cca", group_size=4, window_size=64),
    "sliding": dict(attention="sliding", window_size=64),
    "streaming": dict(attention="streaming", window_size=64, sink_tokens=4),
}
LABELS = {"full": "full", "cca": "cca g=4 s=64", "sliding": "sliding W=64",
          "streaming": "streaming N=4 W=64"}


def convert_stories(work: Path) -> Path:
    """stories260K.bin -> HF -> our checkpoint (once); returns the converted directory."""
    from convert.hf_to_flax import convert_hf_to_flax
    from tests.hf_fixtures import STORIES, stories260k_to_hf

    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        if not STORIES.exists():
            sys.exit(f"error: {STORIES} not found (the shared test data).")
        stories260k_to_hf(STORIES, work / "hf")
        convert_hf_to_flax(work / "hf", ckpt, verbose=False)
    return ckpt


def write_byte_tokenizer(ckpt: Path) -> None:
    """A stand-in tokenizer for stories260K, for running the text tasks (passkey, mdqa) at all.

    llama2.c's tok512 is a SentencePiece BPE with byte fallback: ids 0-2 are <unk>, <s>, </s>
    and ids 3-258 the bytes <0x00>-<0xFF>, as in every such model; ids 259-511 (its merges)
    are not shipped. Text is therefore encoded byte by byte (a valid tok512 encoding, though
    never the one the model was trained on), and ids 259-511 decode to `<tok512:ID>`."""
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({f"<tok512:{i}>": i for i in range(259, 512)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "model_max_length": SEQ_LEN}, indent=1) + "\n")


def sample_sequences(ckpt: Path, count: int, seed: int, batch: int = 16,
                     have: np.ndarray | None = None) -> np.ndarray:
    """`[count, 512]` token ids: BOS + 511 tokens sampled from the full-attention model, in
    batches of `batch` rows seeded by their index (so `have`, the first rows of an earlier
    call with the same seed, whole batches, is extended rather than sampled again)."""
    import cca_jax
    from cca_jax.generate import generate

    model = cca_jax.from_pretrained(ckpt, attention="full")
    rows = [] if have is None else have.tolist()
    for i, start in enumerate(range(0, count, batch)):
        if start < len(rows):
            continue
        n = min(batch, count - start)
        out = generate(model, [[1]] * n, max_new_tokens=SEQ_LEN - 1, temperature=1.0,
                       top_p=0.9, seed=seed * 1000 + i, stop_at_eos=False)
        rows += [[1] + o for o in out]
    return np.asarray(rows, np.int32)


# `<checkpoint><this>` beside a fine-tuned checkpoint marks it as this script's (replaced by a
# rerun); a folder without it is never deleted.
FINE_TUNED_MARK = ".written_by_stories_experiment.json"


def fine_tune(ckpt: Path, option: dict, data: np.ndarray, steps: int, batch_size: int,
              lr: float, out: Path) -> list[float]:
    """Train every parameter with `option`'s attention on `data` rows; save to `out` (which
    may be only this script's own earlier checkpoint)."""
    mark = out.with_name(out.name + FINE_TUNED_MARK)
    if out.exists() and not mark.exists():
        raise SystemExit(f"{out} exists and this script did not write it: pass another "
                         "--work, or move that folder away first.")
    import jax
    from flax import nnx

    import cca_jax
    from cca_jax.checkpoint import save_pretrained
    from train import step as train_step
    from train.config import TrainConfig

    model = cca_jax.from_pretrained(ckpt, remat="none", **option)
    cfg = TrainConfig(out=str(out), checkpoint=str(ckpt), seq_len=SEQ_LEN,
                      batch_size=batch_size, steps=steps, lr=lr, warmup_steps=10,
                      trainable="all", dtype="float32", remat="none", loss_chunk=SEQ_LEN)
    graphdef, model_state = nnx.split(model)
    apply = train_step.model_apply(graphdef, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_state))
    tx = train_step.make_optimizer(cfg)
    state = train_step.init_state(train_step.params_of(model), cfg, tx)
    step_fn = jax.jit(train_step.make_train_step(apply, cfg, tx), donate_argnums=(0,))
    positions = np.broadcast_to(np.arange(SEQ_LEN, dtype=np.int32), (1, batch_size, SEQ_LEN))
    mask = np.ones((1, batch_size, SEQ_LEN), np.float32)
    mask[..., -1] = 0.0                       # the last position has no next token
    losses = []
    for s in range(steps):
        rows = data[(np.arange(batch_size) + s * batch_size) % len(data)][None]
        targets = np.concatenate([rows[..., 1:], np.zeros_like(rows[..., :1])], -1)
        batch = dict(input_ids=rows, targets=targets, segment_ids=np.ones_like(rows),
                     positions=positions, loss_mask=mask)
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        if s % 10 == 0 or s == steps - 1:
            print(f"  step {s + 1}/{steps}: loss {losses[-1]:.4f}", flush=True)
    params = train_step.merge_params(state.trainable, state.frozen)
    if out.exists():                  # this script's own, from an earlier run (checked above)
        shutil.rmtree(out)
    save_pretrained(out, jax.tree.map(np.asarray, params), model.config)
    mark.write_text(json.dumps({"option": option, "steps": steps}) + "\n")
    return losses


def evaluate(ckpt: Path, option: dict, tokens: Path, out_json: Path) -> dict:
    """Perplexity through the CLI (`python -m cca_jax.eval ppl`), in this process."""
    from cca_jax.eval.__main__ import main

    flags = []
    for key, value in option.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    argv = ["ppl", "--ckpt", str(ckpt), "--token-file", str(tokens), "--seq-len",
            str(SEQ_LEN), "--batch-size", "16", "--chunk", "32", "--json", str(out_json),
            "--no-progress", *flags]
    if main(argv) != 0:
        raise SystemExit(f"ppl failed: {' '.join(argv)}")
    record = json.loads(out_json.read_text())
    record["cli"] = "python -m cca_jax.eval " + " ".join(argv)
    return record


def table(records: dict) -> str:
    from cca_jax.eval.common import markdown_table

    full = records["full"]["swapped"]["ppl"]
    rows = []
    for name in OPTIONS:
        r = records[name]
        before, after = r["swapped"]["ppl"], r["fine_tuned"]["ppl"]
        gap = before - full
        recovered = (before - after) / gap if name != "full" and gap > 0 else None
        rows.append([LABELS[name], before, after, r["train_loss_first"],
                     r["train_loss_last"], "-" if recovered is None else f"{recovered:.0%}"])
    return markdown_table(["attention", "ppl, swapped in (no fine-tune)", "ppl, fine-tuned",
                           "train loss, step 1", "train loss, last step",
                           "gap to full (pretrained) recovered"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--heldout", type=int, default=32, help="held-out samples (of 512)")
    ap.add_argument("--train-sequences", type=int, default=96,
                    help="training samples (of 512), cycled through in the same order")
    ap.add_argument("--work", default="/tmp/stories_experiment")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/stories_ppl"))
    ap.add_argument("--replot", action="store_true", help="redraw <out>.png from <out>.json")
    ap.add_argument("--tokenizer-only", action="store_true", help="convert stories260K into "
                    "<work>/ckpt with the byte-fallback stand-in tokenizer, and stop")
    a = ap.parse_args(argv)
    from cca_jax.eval import plots

    if a.replot:
        plots.plot_stories(json.loads(Path(a.out + ".json").read_text()), a.out + ".png")
        return 0
    from benchmarks.measure import claim_output
    claim_output(a.out)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ckpt = convert_stories(work)
    if a.tokenizer_only:
        write_byte_tokenizer(ckpt)
        print(f"wrote {ckpt}/tokenizer.json")
        return 0
    samples_file, heldout = work / "samples.npy", work / "heldout_tokens.npy"
    count = a.heldout + a.train_sequences
    have = np.load(samples_file) if samples_file.exists() else None
    if have is None or len(have) < count:
        print(f"sampling {count - (0 if have is None else len(have))} sequences", flush=True)
        np.save(samples_file, sample_sequences(ckpt, count, seed=1, have=have))
    samples = np.load(samples_file)[:count]
    np.save(heldout, samples[:a.heldout])
    data = samples[a.heldout:]
    records = {}
    for name, option in OPTIONS.items():
        print(f"{name}: swapped in", flush=True)
        rec = {"option": option}
        rec["swapped"] = evaluate(ckpt, option, heldout, work / f"ppl_{name}_swapped.json")
        print(f"{name}: fine-tuning {a.steps} steps", flush=True)
        t0 = time.time()
        ft_dir = work / f"ft_{name}"
        losses = fine_tune(ckpt, option, data, a.steps, a.batch_size, a.lr, ft_dir)
        rec.update(train_losses=losses, train_loss_first=losses[0], train_loss_last=losses[-1],
                   train_seconds=time.time() - t0)
        rec["fine_tuned"] = evaluate(ft_dir, option, heldout, work / f"ppl_{name}_ft.json")
        records[name] = rec
    from cca_jax.eval.common import environment, environment_lines

    from benchmarks.measure import commit

    env = environment()
    env["commit"] = commit()
    env["command"] = "python benchmarks/stories_experiment.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result = {"experiment": "stories260K: ppl on held-out self-samples, swapped vs fine-tuned",
              "seq_len": SEQ_LEN, "heldout_sequences": a.heldout,
              "train": {"steps": a.steps, "batch_size": a.batch_size, "lr": a.lr,
                        "warmup_steps": 10, "trainable": "all", "sequences": len(data),
                        "tokens": int(a.steps * a.batch_size * SEQ_LEN)},
              "options": records, "environment": env,
              "total_seconds": time.time() - started}
    md = table(records)
    header = ("# stories260K: perplexity on held-out samples of the model itself (512 tokens, "
              f"{a.heldout} windows)\n\nFine-tune: {a.steps} steps x {a.batch_size} sequences "
              f"x 512 tokens, all parameters, AdamW lr {a.lr}, same data and order for every "
              "option.\n\n")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(a.out + ".md").write_text(header + md + environment_lines(env))
    print(header + md)
    plots.plot_stories(result, a.out + ".png")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
