"""A checkpoint's tokenizer: finding and loading it (offline), and streaming detokenized text.

Shared by the generate CLI and the evaluations; bad input raises `cli.UsageError`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cca_jax.cli import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def find_tokenizer_dir(ckpt: Path) -> Path:
    """The directory holding the checkpoint's tokenizer (its own, or config.json's)."""
    candidates = [ckpt]
    from cca_jax.checkpoint import find_config
    try:
        candidates.append(find_config(ckpt).parent)
    except FileNotFoundError:
        pass
    for d in candidates:
        if any((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    raise UsageError(
        f"no tokenizer in {ckpt}: expected {' or '.join(TOKENIZER_FILES)} there. "
        "convert.hf_to_flax copies them from the Hugging Face checkpoint; copy them in by hand "
        "for checkpoints converted without one.")


def load_tokenizer(ckpt: Path):
    """`transformers.AutoTokenizer` from the checkpoint's files, offline.

    A bare SentencePiece `tokenizer.model` (no tokenizer.json / tokenizer_config.json, as
    llama.c-style and hand-assembled checkpoints have) is a LLaMA/Mistral tokenizer, which
    puts BOS first (`add_bos_token=True`, the default of transformers' LlamaTokenizer and
    what Meta's own encoder does); transformers 5 would load it without that rule, so it is
    set here. With a tokenizer_config.json / tokenizer.json their own settings apply.
    """
    from transformers import AutoTokenizer

    where = find_tokenizer_dir(ckpt)
    kwargs = {}
    if not any((where / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        kwargs["add_bos_token"] = True
    try:
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True, **kwargs)
    except Exception as e:  # transformers raises many types for unreadable tokenizers
        raise UsageError(f"could not load the tokenizer in {where}: {e}") from None


class TextDecoder:
    """Incremental detokenization: the text of the generated ids so far, decoded after a few
    prompt tokens (so that the first word keeps its SentencePiece leading space), and how
    much of it is safe to show (`stable`: not ending in an incomplete character, U+FFFD from
    a partial byte sequence, which the next token completes)."""

    CONTEXT = 4

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-self.CONTEXT:])
        self.prefix = self._decode(self.context)
        self.ids: list[int] = []

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str:
        full = self._decode(self.context + self.ids)
        return full[len(self.prefix):] if full.startswith(self.prefix) else self._decode(self.ids)

    def push(self, token: int) -> str:
        """Add a token; the whole text so far."""
        self.ids.append(int(token))
        return self.text()

    @staticmethod
    def stable(text: str) -> bool:
        return not text.endswith("\ufffd")


class TextStream(TextDecoder):
    """`TextDecoder` printing only the new suffix of the text to `out` as tokens come."""

    def __init__(self, tokenizer, prompt_ids: list[int], out=None):
        super().__init__(tokenizer, prompt_ids)
        self.out = out or sys.stdout
        self.printed = ""

    def put(self, token: int) -> None:
        text = self.push(token)
        if self.stable(text):
            self._emit(text)

    def end(self) -> None:
        self._emit(self.text())
        self.out.write("\n")
        self.out.flush()

    def _emit(self, text: str) -> None:
        new = text[len(self.printed):] if text.startswith(self.printed) else ""
        if new:
            self.out.write(new)
            self.out.flush()
        self.printed = text if text.startswith(self.printed) else self.printed
