"""Tokenizers for the data pipeline: the checkpoint's own (Hugging Face, offline) or bytes.

Every tokenizer here satisfies `Tokenizer`: `encode(text) -> list[int]` WITHOUT special
tokens, plus `bos_id` (None when the tokenizer has no BOS, as Qwen2's), `eos_id` and
`vocab_size` (the number of ids it can emit, added tokens included). The packer adds BOS/EOS
itself, so every tokenizer frames documents the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

# Files from which transformers.AutoTokenizer can build a tokenizer offline.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@runtime_checkable
class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS = 256, EOS = 257: vocab 258. For the tiny preset."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an int32 array, without the Python list (the packer's fast path)."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258, bos_id=256, eos_id=257)"


class HFTokenizer:
    """A Hugging Face tokenizer loaded offline from a checkpoint directory.

    Text that spells a special token ("</s>", "<|endoftext|>") is tokenized as plain text
    (`split_special_tokens=True`), so raw training text cannot inject document boundaries.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike):
        path = Path(checkpoint_dir)
        if not path.is_dir():
            raise ValueError(f"tokenizer directory {str(path)!r} does not exist: pass the "
                             "checkpoint directory (from convert.hf_to_flax or a Hugging Face "
                             "download), or None for the built-in byte tokenizer")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{str(path)!r} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}):"
                             " copy the tokenizer files of the original Hugging Face checkpoint"
                             " into it (convert.hf_to_flax does this)")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many types; name the directory.
            raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {e}") from e
        # Documents are far longer than model_max_length; silence the length warning.
        self._tok.model_max_length = 1 << 62
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer in {str(path)!r} has no EOS token, which packing "
                             "needs between documents: set \"eos_token\" in its "
                             "tokenizer_config.json")
        self.vocab_size = len(self._tok)
        self.path = str(path)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


def make_tokenizer(checkpoint_dir: str | os.PathLike | None) -> Tokenizer:
    """The checkpoint's own tokenizer, or the byte tokenizer when `checkpoint_dir` is None."""
    if checkpoint_dir is None:
        return ByteTokenizer()
    return HFTokenizer(checkpoint_dir)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raise ValueError if `tokenizer` can emit an id the model has no embedding for."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model_vocab_size}: use the checkpoint's own tokenizer (make_tokenizer(checkpoint"
            f"_dir)), or a model with vocab_size >= {tokenizer.vocab_size}")


def encode_array(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """`tokenizer.encode(text)` as int32, through the tokenizer's array fast path if it has one."""
    fast = getattr(tokenizer, "encode_array", None)
    if fast is not None:
        return fast(text)
    return np.asarray(tokenizer.encode(text), dtype=np.int32)
