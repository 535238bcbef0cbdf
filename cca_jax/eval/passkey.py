"""Passkey retrieval and RULER-style needle-in-a-haystack, generated locally from a seed.

- `passkey`: a 5-digit pass key hidden in repeated filler sentences; the prompt ends with
  "What is the pass key? The pass key is".
- `niah`: RULER's single-needle task with the noise haystack: "One of the special magic
  numbers for <word> is: <7 digits>." in the same filler; the prompt asks for <word>'s number.

A sample is fixed by (seed, task, length, depth, index) alone. Its prompt is `length` tokens
or just under (with the tokenizer's own special tokens, as `generate` gets them); the needle
sits after `round(depth * n)` of the `n` filler sentences (depth 0: first, 1: last before the
question). The model answers greedily through `cca_jax.generate`; the answer counts when the
continuation, stripped of leading whitespace, starts with the expected digits and no further
digit follows (exact match).
"""

from __future__ import annotations

import dataclasses
import random
import re
import types
from typing import Any, Sequence

TASKS = ("passkey", "niah")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again.")
INTRO = types.MappingProxyType({
    "passkey": ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                "memorize it. I will quiz you about the important information there."),
    "niah": ("Some special magic numbers are hidden within the following text. Make sure to "
             "memorize it. I will quiz you about the numbers afterwards."),
})
KEY_WORDS = ("apple", "anchor", "badge", "canyon", "cellar", "comet", "crystal", "dolphin",
             "ember", "falcon", "garnet", "harbor", "island", "jasmine", "lantern", "maple",
             "meadow", "nectar", "orchid", "pepper", "quartz", "raven", "saddle", "tiger",
             "tulip", "velvet", "walnut", "willow", "yarrow", "zephyr")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt: its text, token ids, the expected answer and where the needle is."""
    task: str
    length: int
    depth: float
    answer: str
    prompt: str
    input_ids: list[int]
    filler_sentences: int        # n
    needle_after: int            # filler sentences before the needle: round(depth * n)


def _needle_and_question(task: str, rng: random.Random) -> tuple[str, str, str]:
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        return (f"The pass key is {key}. Remember it. {key} is the pass key.",
                "What is the pass key? The pass key is", key)
    word = rng.choice(KEY_WORDS)
    value = str(rng.randint(1000000, 9999999))
    return (f"One of the special magic numbers for {word} is: {value}.",
            f"What is the special magic number for {word} mentioned in the provided text? "
            f"The special magic number for {word} mentioned in the provided text is", value)


def _prompt(task: str, n: int, at: int, needle: str, question: str) -> str:
    parts = [INTRO[task], *([FILLER] * at), needle, *([FILLER] * (n - at))]
    return " ".join(parts) + "\n" + question


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def make_sample(tokenizer, task: str, length: int, depth: float, seed: int,
                index: int = 0) -> Sample:
    """The `index`-th sample of (task, length, depth) for `seed` (deterministic)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1] (0: the start of the haystack, 1: its "
                         f"end), got {depth}.")
    rng = random.Random(f"{seed}/{task}/{length}/{depth!r}/{index}")
    needle, question, answer = _needle_and_question(task, rng)
    base = len(_encode(tokenizer, _prompt(task, 0, 0, needle, question)))
    per = (len(_encode(tokenizer, " ".join([FILLER] * 16))) - 1) / 16
    n = int((length - base) / per)
    while n > 0:
        ids = _encode(tokenizer, _prompt(task, n, round(depth * n), needle, question))
        if len(ids) <= length:
            break
        n -= max(1, int((len(ids) - length) / per))
    if n < 1:
        raise ValueError(f"length {length} is too short for the {task} task: its prompt "
                         f"without filler already takes {base} tokens; ask for at least "
                         f"{base + int(per) + 1}.")
    at = round(depth * n)
    return Sample(task, length, depth, answer, _prompt(task, n, at, needle, question), ids,
                  n, at)


def make_samples(tokenizer, task: str, lengths: Sequence[int], depths: Sequence[float],
                 samples: int, seed: int) -> list[Sample]:
    return [make_sample(tokenizer, task, n, d, seed, i)
            for n in lengths for d in depths for i in range(samples)]


def exact_match(prediction: str, answer: str) -> bool:
    """The continuation (leading whitespace stripped) starts with `answer`, and no further
    digit follows it ("71432." counts; "714321" and "The key is 71432" do not)."""
    return re.match(re.escape(answer) + r"(?!\d)", prediction.lstrip()) is not None


def evaluate(model, tokenizer, samples: Sequence[Sample], *, batch_size: int = 1,
             max_new_tokens: int | None = None, chunk_size: int = 2048,
             progress: bool = True, mesh=None) -> list[dict[str, Any]]:
    """Greedy answers for every sample: a list of {length, depth, answer, prediction,
    correct}. Prompts of one length run in batches of `batch_size`, over `mesh`'s devices
    when given (`generate`'s `mesh`)."""
    from tqdm import tqdm

    from cca_jax.generate import generate

    if max_new_tokens is None:    # the answer's tokens and a few more
        max_new_tokens = max(len(_encode(tokenizer, s.answer)) for s in samples) + 4
    out: list[dict[str, Any]] = []
    bar = tqdm(total=len(samples), desc="passkey", unit="prompt", disable=not progress)
    for b0 in range(0, len(samples), batch_size):
        batch = samples[b0:b0 + batch_size]
        new = generate(model, [s.input_ids for s in batch], max_new_tokens=max_new_tokens,
                       chunk_size=chunk_size, mesh=mesh)
        for s, ids in zip(batch, new):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            out.append({"length": s.length, "depth": s.depth, "prompt_tokens": len(s.input_ids),
                        "answer": s.answer, "prediction": text,
                        "correct": exact_match(text, s.answer)})
        bar.update(len(batch))
    bar.close()
    return out


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy per (length, depth), in the order met."""
    cells: dict[tuple, list[bool]] = {}
    for r in results:
        cells.setdefault((r["length"], r["depth"]), []).append(r["correct"])
    return [{"length": n, "depth": d, "samples": len(v), "accuracy": sum(v) / len(v)}
            for (n, d), v in cells.items()]


def run_passkey(a) -> tuple[dict[str, Any], str]:
    """`python -m cca_jax.eval passkey`: (JSON record, markdown table by length x depth)."""
    from cca_jax.cli import UsageError, mesh_from_args
    from cca_jax.eval.common import (attention_record, check_checkpoint, check_positive,
                                     load_checkpoint_tokenizer, load_model, markdown_table)

    check_checkpoint(a.ckpt)
    check_positive("--samples", a.samples)
    check_positive("--batch-size", a.batch_size)
    check_positive("--chunk-size", a.chunk_size)
    if not a.lengths or not a.depths:
        raise UsageError("give at least one length (--lengths 4096,8192) and one depth "
                         "(--depths 0,0.5,1).")
    for n in a.lengths:
        check_positive("every --lengths value", n)
    bad = [d for d in a.depths if not 0.0 <= d <= 1.0]
    if bad:
        raise UsageError(f"--depths must lie in [0, 1] (0: the start of the haystack, 1: its "
                         f"end), got {bad}.")
    tokenizer = load_checkpoint_tokenizer(a)
    try:
        samples = make_samples(tokenizer, a.task, a.lengths, a.depths, a.samples, a.seed)
    except ValueError as e:
        raise UsageError(str(e).replace("length ", "--lengths value ", 1)) from None
    model = load_model(a)
    limit = model.config.max_position_embeddings
    new_tokens = max(len(_encode(tokenizer, s.answer)) for s in samples) + 4
    if max(a.lengths) + new_tokens > limit:
        raise UsageError(f"--lengths {max(a.lengths)} + {new_tokens} answer tokens exceed the "
                         f"model's max_position_embeddings={limit}: use lengths <= "
                         f"{limit - new_tokens}, or --max-position-embeddings for a model "
                         "fine-tuned (or rope-scaled) that long.")
    results = evaluate(model, tokenizer, samples, batch_size=a.batch_size,
                       max_new_tokens=new_tokens, chunk_size=a.chunk_size,
                       progress=not a.no_progress, mesh=mesh_from_args(a))
    cells = summarize(results)
    accuracy = sum(r["correct"] for r in results) / len(results)
    record = {"task": "passkey", "task_kind": a.task, "ckpt": str(a.ckpt),
              **attention_record(model.config), "seed": a.seed, "samples_per_cell": a.samples,
              "lengths": list(a.lengths), "depths": list(a.depths), "accuracy": accuracy,
              "by_length_depth": cells, "results": results}
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    rows = [[f"{d:g}", *(acc[(n, d)] for n in a.lengths)] for d in a.depths]
    rows.append(["mean", *(sum(acc[(n, d)] for d in a.depths) / len(a.depths)
                           for n in a.lengths)])
    table = markdown_table(["depth \\ length", *map(str, a.lengths)],
                           [[r[0], *(float(v) for v in r[1:])] for r in rows])
    return record, f"{a.task} exact match, {a.samples} samples per cell:\n\n" + table
