"""The fine-tuning data pipeline: sources -> tokenize -> pack -> batch, deterministic and resumable.

    tok = make_tokenizer(checkpoint_dir)            # None -> bytes (vocab 258)
    check_vocab(tok, config.vocab_size)
    check_source(source, cache_dir=...)             # every check of the source, nothing written
    it = make_batches("tfds:pg19:train" | "path/to/file.jsonl" | "builtin", tok,
                      seq_len=8192, batch_size=1, seed=0, data_dir=..., cache_dir=...)
    batch = next(it)      # dict of [batch, seq_len] numpy arrays: input_ids, targets,
                          # segment_ids, positions (int32) and loss_mask (float32)
    state = it.get_state()            # JSON-serializable; it.set_state(state) resumes exactly

Stages (grain): `MapDataset.source(records).shuffle(seed).repeat()` (a new document order
every epoch, derived from the seed), `.map(tokenize)` run ahead in a few threads,
`PackIterDataset` (see `packing.py` for row layout, segment ids, positions and loss mask),
`.batch(batch_size)`. Sources are in `sources.py`, tokenizers in `tokenizers.py`.
Every host that builds the same call gets the same batches: a multi-host trainer builds the
global batch everywhere and keeps its own rows.

`python -m train.data --bench` measures the pipeline alone in tokens/s.
"""

from __future__ import annotations

import json
from typing import Any

import grain
import numpy as np

from .packing import PackIterDataset, build_row, frame_document
from .sources import check_local_source, is_prepared_local, resolve_source
from .tokenizers import (ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, encode_array,
                         make_tokenizer)

__all__ = ["BatchIterator", "ByteTokenizer", "HFTokenizer", "Tokenizer", "build_row",
           "check_source", "check_vocab", "frame_document", "make_batches", "make_tokenizer"]

STATE_VERSION = 1
# Documents tokenized ahead of the packer, and threads doing it. Bounded so that long
# documents (a book is ~100K tokens) do not pile up in memory.
READ_THREADS = 2
READ_AHEAD = 8


def _text_of(record: Any, field: str) -> str:
    value = record[field] if isinstance(record, dict) else record
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO" and value.shape == ():
        value = value.item()
        return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
    if not isinstance(value, str):
        raise ValueError(f"feature {field!r} holds {type(value).__name__}, not text: pass "
                         "text_field= a text feature")
    return value


class _Tokenize:
    """record -> framed int32 tokens; blank text -> an empty array (skipped by the packer)."""

    def __init__(self, tokenizer: Tokenizer, field: str):
        self.tokenizer, self.field = tokenizer, field

    def __call__(self, record: Any) -> np.ndarray:
        text = _text_of(record, self.field)
        if not text.strip():
            return np.zeros(0, np.int32)
        ids = encode_array(self.tokenizer, text)
        return frame_document(ids, self.tokenizer.bos_id, self.tokenizer.eos_id)


class BatchIterator:
    """Infinite iterator of packed batches with a JSON-serializable, exactly resumable state."""

    def __init__(self, dataset: grain.IterDataset, fingerprint: dict[str, Any]):
        self._it = iter(dataset)
        self._fingerprint = fingerprint

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """The position after the last batch returned: {"version", "config", "grain"}."""
        return {"version": STATE_VERSION, "config": dict(self._fingerprint),
                "grain": self._it.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from `get_state` of an iterator built with the same call)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a data iterator state of version {STATE_VERSION}: {state!r:.200}")
        if state["config"] != self._fingerprint:
            diff = {k: (state["config"].get(k), v) for k, v in self._fingerprint.items()
                    if state["config"].get(k) != v}
            raise ValueError(f"the data state was saved by a different pipeline (saved, now): "
                             f"{diff}: resume with the same data settings")
        self._it.set_state(state["grain"])


def _check_int(name: str, value: Any, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}: {fix}")


def _require_text(records, field: str, source: str) -> None:
    """Some document must have text, or packing would never finish (local sources already
    dropped blank documents; this stops at the first record in the usual case)."""
    if not any(_text_of(records[i], field).strip() for i in range(len(records))):
        raise ValueError(f"data source {source!r} holds no text (every {field!r} is blank): "
                         "give a source with text")


def check_source(source: str, *, data_dir: str | None = None, text_field: str = "text",
                 cache_dir: str | None = None) -> None:
    """Every check `make_batches` makes of its source, writing nothing, so that a trainer
    can refuse a bad source before it writes into its output directory. A local source not
    yet prepared in `cache_dir` is read through once (its preparation reads it again)."""
    if is_prepared_local(source, text_field=text_field, cache_dir=cache_dir) is False:
        check_local_source(source, text_field=text_field)
        return
    # a tfds: source, or a prepared local one: opening it writes nothing
    records, field = resolve_source(source, data_dir=data_dir, text_field=text_field,
                                    cache_dir=cache_dir)
    _require_text(records, field, source)


def make_batches(source: str, tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                 seed: int = 0, data_dir: str | None = None, text_field: str = "text",
                 cache_dir: str | None = None) -> BatchIterator:
    """Packed, shuffled, infinite batches of `source` tokenized with `tokenizer`.

    `source` is "builtin", a path (.txt, .jsonl, .jsonl.gz or a directory of them) or
    "tfds:NAME[:SPLIT]" (a TFDS data set prepared in array_record format under `data_dir`).
    `text_field` names the text in JSONL records and TFDS features. Local sources are prepared
    once into `cache_dir` (default ~/.cache/cca_jax/data or $CCA_JAX_DATA_CACHE).
    All checks (arguments, source, text present) run here, before any batch is made.
    """
    _check_int("seq_len", seq_len, 2, "a row needs at least 2 inputs")
    _check_int("batch_size", batch_size, 1, "pass a positive batch size")
    _check_int("seed", seed, 0, "seeds are integers in [0, 2**32)")
    if seed >= 2**32:
        raise ValueError(f"seed must be < 2**32, got {seed}")
    for attr in ("encode", "eos_id", "vocab_size"):
        if not hasattr(tokenizer, attr):
            raise ValueError(f"tokenizer {tokenizer!r} lacks {attr!r}: build it with "
                             "make_tokenizer(checkpoint_dir)")
    records, field = resolve_source(source, data_dir=data_dir, text_field=text_field,
                                    cache_dir=cache_dir)
    _require_text(records, field, source)
    docs = (grain.MapDataset.source(records).shuffle(seed=int(seed)).repeat(None)
            .map(_Tokenize(tokenizer, field))
            .to_iter_dataset(grain.ReadOptions(num_threads=READ_THREADS,
                                               prefetch_buffer_size=READ_AHEAD)))
    batches = PackIterDataset(docs, int(seq_len)).batch(int(batch_size), drop_remainder=True)
    fingerprint = {"source": source, "text_field": text_field, "seq_len": int(seq_len),
                   "batch_size": int(batch_size), "seed": int(seed),
                   "vocab_size": int(tokenizer.vocab_size), "bos_id": tokenizer.bos_id,
                   "eos_id": int(tokenizer.eos_id), "documents": len(records)}
    json.dumps(fingerprint)  # the state must stay JSON-serializable
    return BatchIterator(batches, fingerprint)
