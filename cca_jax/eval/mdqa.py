"""Multi-document QA and key-value retrieval in the "Lost in the Middle" format (Liu et al.).

Records (one JSON object per line, `.jsonl` or `.jsonl.gz`), as the benchmark ships them:
- QA: `question`, `answers` (acceptable strings), `ctxs` (documents with `title`, `text`,
  and `isgold` on the one that answers). Prompt: the instruction, a blank line, one line per
  document `Document [i](Title: <title>) <text>` (i from 1, in the given order), a blank
  line, `Question: <question>` and `Answer:`. Score (`best_subspan_em`): the prediction is
  cut at its first newline; it counts when some normalized answer is a substring of the
  normalized prediction (SQuAD normalization: lower case, ASCII punctuation removed, the
  articles a/an/the removed, whitespace collapsed).
- Key-value retrieval: `ordered_kv_records` ([key, value] pairs), `key`, `value`. Prompt:
  the instruction, the pairs as one JSON object (one pair a line), the key; it counts when
  the value is in the prediction (case-insensitive).

Answers are greedy, through `cca_jax.generate`. Results include accuracy by the position of
the gold document (or of the key), the benchmark's "lost in the middle" curve.
"""

from __future__ import annotations

import gzip
import json
import re
import string
from pathlib import Path
from typing import Any, Sequence

QA_INSTRUCTION = ("Write a high-quality answer for the given question using only the provided "
                  "search results (some of which might be irrelevant).")
KV_INSTRUCTION = ("Extract the value corresponding to the specified key in the JSON object "
                  "below.")
_PUNCTUATION = frozenset(string.punctuation)


def qa_prompt(question: str, documents: Sequence[dict[str, Any]]) -> str:
    """The benchmark's QA prompt for `documents` (dicts with `title` and `text`) in order."""
    if not question or not documents:
        raise ValueError("a QA record needs a non-empty question and at least one document.")
    docs = "\n".join(f"Document [{i}](Title: {d['title']}) {d['text']}"
                     for i, d in enumerate(documents, 1))
    return f"{QA_INSTRUCTION}\n\n{docs}\n\nQuestion: {question}\nAnswer:"


def kv_prompt(pairs: Sequence[Sequence[str]], key: str) -> str:
    """The benchmark's key-value retrieval prompt: the pairs as one JSON object, a line each."""
    if len(pairs) < 2 or key not in [k for k, _ in pairs]:
        raise ValueError("a key-value record needs at least 2 pairs, one of them for its key.")
    body = ",\n ".join(f'"{k}": "{v}"' for k, v in pairs)
    return f'{KV_INSTRUCTION}\n\nJSON data:\n{{{body}}}\n\nKey: "{key}"\nCorresponding value:'


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def best_subspan_em(prediction: str, answers: Sequence[str]) -> bool:
    """Some normalized answer is a substring of the normalized prediction (which the caller
    has cut at its first newline)."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(a) in pred for a in answers)


def first_line(prediction: str) -> str:
    """What the benchmark scores: the prediction up to its first newline, stripped."""
    return prediction.split("\n")[0].strip()


def read_records(path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` records (all when None) of a .jsonl / .jsonl.gz file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path} does not exist: pass a Lost in the Middle .jsonl(.gz) "
                         "file (e.g. ../shared/data/nq-open-oracle.jsonl.gz).")
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not JSON ({e}): is --data a .jsonl file?")
            record_format(records[-1], f"{path}:{n}")
    if not records:
        raise ValueError(f"--data {path} holds no records.")
    return records


def record_format(record: Any, where: str = "record") -> str:
    """'qa' or 'kv', or a ValueError naming the keys expected."""
    if isinstance(record, dict) and {"question", "answers", "ctxs"} <= set(record):
        return "qa"
    if isinstance(record, dict) and {"ordered_kv_records", "key", "value"} <= set(record):
        return "kv"
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where}: expected a Lost in the Middle record (question/answers/ctxs, "
                     f"or ordered_kv_records/key/value), got {keys}.")


def prompt_and_gold(record: dict[str, Any]) -> tuple[str, int | None]:
    """(prompt, 0-based position of the gold document or key; None if unmarked)."""
    if record_format(record) == "qa":
        gold = [i for i, d in enumerate(record["ctxs"]) if d.get("isgold")]
        return qa_prompt(record["question"], record["ctxs"]), (gold[0] if gold else None)
    keys = [k for k, _ in record["ordered_kv_records"]]
    return kv_prompt(record["ordered_kv_records"], record["key"]), keys.index(record["key"])


def score(record: dict[str, Any], prediction: str) -> bool:
    if record_format(record) == "qa":
        return best_subspan_em(first_line(prediction), record["answers"])
    return record["value"].lower() in prediction.lower()


def evaluate(model, tokenizer, records: Sequence[dict[str, Any]], *, max_new_tokens: int = 32,
             batch_size: int = 1, chunk_size: int = 2048,
             progress: bool = True, mesh=None) -> list[dict[str, Any]]:
    """Greedy answers and scores, one dict per record; over `mesh`'s devices when given
    (`generate`'s `mesh`)."""
    from tqdm import tqdm

    from cca_jax.generate import generate

    out = []
    limit = model.config.max_position_embeddings - max_new_tokens
    bar = tqdm(total=len(records), desc="mdqa", unit="question", disable=not progress)
    for b0 in range(0, len(records), batch_size):
        batch = records[b0:b0 + batch_size]
        prompts = [prompt_and_gold(r) for r in batch]
        ids = [list(tokenizer(p)["input_ids"]) for p, _ in prompts]
        longest = max(map(len, ids))
        if longest > limit:
            raise ValueError(f"a prompt of {longest} tokens + {max_new_tokens} new tokens "
                             f"exceeds max_position_embeddings="
                             f"{model.config.max_position_embeddings}: use a model with a "
                             "longer context (--max-position-embeddings) or fewer documents.")
        new = generate(model, ids, max_new_tokens=max_new_tokens, chunk_size=chunk_size,
                       mesh=mesh)
        for r, (_, gold), prompt_ids, answer in zip(batch, prompts, ids, new):
            text = tokenizer.decode(answer, skip_special_tokens=True)
            out.append({"gold_position": gold, "prompt_tokens": len(prompt_ids),
                        "prediction": text, "correct": score(r, text),
                        "answers": r["answers"] if "answers" in r else [r["value"]]})
        bar.update(len(batch))
    bar.close()
    return out


def by_gold_position(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[Any, list[bool]] = {}
    for r in results:
        cells.setdefault(r["gold_position"], []).append(r["correct"])
    return [{"gold_position": k, "examples": len(v), "accuracy": sum(v) / len(v)}
            for k, v in sorted(cells.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def run_mdqa(a) -> tuple[dict[str, Any], str]:
    """`python -m cca_jax.eval mdqa`: (JSON record, markdown table)."""
    from cca_jax.cli import UsageError, mesh_from_args
    from cca_jax.eval.common import (attention_record, check_checkpoint, check_positive,
                                     load_checkpoint_tokenizer, load_model, markdown_table)

    check_checkpoint(a.ckpt)
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--batch-size", a.batch_size),
                        ("--chunk-size", a.chunk_size)):
        check_positive(flag, value)
    if a.limit is not None:
        check_positive("--limit", a.limit)
    try:
        records = read_records(a.data, a.limit)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    tokenizer = load_checkpoint_tokenizer(a)
    model = load_model(a)
    try:
        results = evaluate(model, tokenizer, records, max_new_tokens=a.max_new_tokens,
                           batch_size=a.batch_size, chunk_size=a.chunk_size,
                           progress=not a.no_progress, mesh=mesh_from_args(a))
    except ValueError as e:
        raise UsageError(str(e)) from None
    fmt = record_format(records[0])
    accuracy = sum(r["correct"] for r in results) / len(results)
    positions = by_gold_position(results)
    record = {"task": "mdqa", "format": fmt, "data": str(a.data), "ckpt": str(a.ckpt),
              **attention_record(model.config), "examples": len(results),
              "accuracy": accuracy, "by_gold_position": positions, "results": results}
    metric = "best_subspan_em" if fmt == "qa" else "value in prediction"
    rows = [[p["gold_position"] if p["gold_position"] is not None else "-", p["examples"],
             float(p["accuracy"])] for p in positions]
    rows.append(["all", len(results), float(accuracy)])
    table = markdown_table(["gold position (0-based)", "examples", f"accuracy ({metric})"],
                           rows)
    return record, f"{Path(a.data).name} ({fmt}), {len(results)} examples:\n\n" + table
