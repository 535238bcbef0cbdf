"""A request's output text as its tokens arrive: incremental detokenization plus stop strings.

Each token re-decodes the growing id list (`tokenizer.TextDecoder`: SentencePiece's leading
spaces and characters split over byte tokens come out right) and releases the new suffix,
minus what must wait: an incomplete UTF-8 character, and any tail that may be the start of
a stop string. A stop string ends the text before it (it is not returned, as in OpenAI's API).
"""

from __future__ import annotations

from cca_jax.tokenizer import TextDecoder


class CompletionText:
    """`push(token)` -> the text that is now safe to send; `finish()` -> the rest.
    `stopped` turns True when a stop string appeared (the caller then ends the request)."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] = ()):
        self.decoder = TextDecoder(tokenizer, prompt_ids)
        self.stop = [s for s in stop if s]
        self.sent = 0           # characters of the decoded text already released
        self.output = ""        # everything released
        self.stopped = False

    def push(self, token: int) -> str:
        return self._release(self.decoder.push(token), final=False)

    def finish(self) -> str:
        return self._release(self.decoder.text(), final=True)

    def _release(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._send(text, min(hits))
        if final:
            return self._send(text, len(text))
        if not TextDecoder.stable(text):
            return ""
        return self._send(text, len(text) - self._stop_prefix(text))

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest unsent tail of `text` that begins some stop string."""
        longest = min(max((len(s) for s in self.stop), default=0), len(text) - self.sent)
        for k in range(longest, 0, -1):
            tail = text[len(text) - k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _send(self, text: str, end: int) -> str:
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.output += piece
        return piece


class TokenStrings:
    """Each generated token's own text, for logprobs: what it adds to the text decoded after
    the few ids before it (so SentencePiece's leading spaces come out right), and its bytes
    (a byte-fallback token `<0xNN>` is that one byte; its text alone is U+FFFD)."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-TextDecoder.CONTEXT:])
        self._prefix = self._decode(self.context)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, token: int) -> str:
        """`token`'s text if it came next (the context unchanged: alternatives too)."""
        full = self._decode(self.context + [int(token)])
        return full[len(self._prefix):] if full.startswith(self._prefix) else \
            self._decode([int(token)])

    def bytes(self, token: int, text: str) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(int(token))
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") \
                and piece.endswith(">"):
            return [int(piece[3:5], 16)]
        return list(text.encode("utf-8"))

    def push(self, token: int) -> None:
        """`token` was generated: it joins the context of the next ones."""
        self.context = (self.context + [int(token)])[-TextDecoder.CONTEXT:]
        self._prefix = self._decode(self.context)
