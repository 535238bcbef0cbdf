"""Packing tokenized documents into fixed-length training rows (a grain IterDataset).

Each document becomes `[BOS] + ids + [EOS]` (no BOS when the tokenizer has none). The
documents are concatenated in order and cut into consecutive, non-overlapping rows of
`seq_len + 1` tokens; a row's inputs are `row[:-1]` and its targets `row[1:]`. Per input token:

- `segment_ids`: 1, 2, 3, ... for each document piece in the row (a document continued from
  the previous row is a fresh segment, number 1 of the new row); 0 is reserved for padding,
  which an infinite stream never needs.
- `positions`: the token's offset in its document. A document continued from the previous
  row keeps counting from its real offset (as in pretraining, where a document's tokens sat at
  their true positions); each document start in the row restarts at 0.
- `loss_mask`: 0 where the input is a document's last token (its EOS): the target there is
  the next document's first token, which a document must not learn to predict; 1 elsewhere.

The iterator is exactly resumable. Its state is the upstream (document) iterator's state
taken just before the document now being cut was read, plus the offset into that document: on
restore the document is read and tokenized again and the first `offset` tokens dropped. The
state stays a few integers however long the documents are.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np


def frame_document(ids: np.ndarray, bos_id: int | None, eos_id: int) -> np.ndarray:
    """`[BOS] + ids + [EOS]` as int32 (no BOS when `bos_id` is None)."""
    head = 0 if bos_id is None else 1
    out = np.empty(len(ids) + head + 1, np.int32)
    if head:
        out[0] = bos_id
    out[head:-1] = ids
    out[-1] = eos_id
    return out


def build_row(pieces: list[tuple[np.ndarray, int, bool]], seq_len: int) -> dict[str, np.ndarray]:
    """One training row from document pieces `(tokens, offset in document, ends document)`.

    The pieces' tokens add up to `seq_len + 1`. Returns the five `[seq_len]` arrays.
    """
    row = np.concatenate([p[0] for p in pieces]) if len(pieces) > 1 else pieces[0][0]
    assert len(row) == seq_len + 1, (len(row), seq_len)
    seg = np.empty(seq_len + 1, np.int32)
    pos = np.empty(seq_len + 1, np.int32)
    mask = np.ones(seq_len + 1, np.float32)
    at = 0
    for k, (tokens, start, ends) in enumerate(pieces):
        n = len(tokens)
        seg[at:at + n] = k + 1
        pos[at:at + n] = np.arange(start, start + n, dtype=np.int32)
        if ends:
            mask[at + n - 1] = 0.0  # the input is this document's EOS
        at += n
    return {
        "input_ids": np.ascontiguousarray(row[:-1], dtype=np.int32),
        "targets": np.ascontiguousarray(row[1:], dtype=np.int32),
        "segment_ids": seg[:-1],
        "positions": pos[:-1],
        "loss_mask": mask[:-1],
    }


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._doc: np.ndarray | None = None  # the document being cut, framed
        self._offset = 0                     # tokens of it already emitted
        self._doc_state: dict | None = None  # parent state just before self._doc was read

    def _next_doc(self) -> None:
        while True:
            state = self._parent.get_state()
            doc = next(self._parent)
            if len(doc):  # empty documents (blank text) are skipped
                self._doc, self._offset, self._doc_state = doc, 0, state
                return

    def __next__(self) -> dict[str, np.ndarray]:
        need = self._seq_len + 1
        pieces = []
        while need:
            if self._doc is None:
                self._next_doc()
            doc, off = self._doc, self._offset
            take = min(need, len(doc) - off)
            pieces.append((doc[off:off + take], off, off + take == len(doc)))
            need -= take
            self._offset = off + take
            if self._offset == len(doc):
                self._doc = None
        return build_row(pieces, self._seq_len)

    def get_state(self) -> dict[str, Any]:
        if self._doc is None:
            return {"parent": self._parent.get_state(), "offset": 0}
        return {"parent": self._doc_state, "offset": int(self._offset)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._doc = None
        if state["offset"]:
            self._next_doc()
            if state["offset"] >= len(self._doc):
                raise ValueError(f"data state offset {state['offset']} is past the end of its "
                                 f"document ({len(self._doc)} tokens): the state belongs to "
                                 "other data or another tokenizer")
            self._offset = int(state["offset"])


class PackIterDataset(grain.IterDataset):
    """Rows of `seq_len` inputs/targets from a stream of framed token arrays."""

    def __init__(self, parent: grain.IterDataset, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self._seq_len)

    def __str__(self) -> str:
        return f"PackIterDataset(seq_len={self._seq_len})"
