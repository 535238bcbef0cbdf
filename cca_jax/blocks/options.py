"""The attention options (`Full`, `Sliding`, `Streaming`, `CCA`): each one's rule of which raw
keys and which slots a query at in-document position `p` sees, its slots' sizes and bounds, and
`parse_option`, the one parse of a kind string. See the package docstring for the rules.
"""

from __future__ import annotations

import dataclasses
import types
from typing import ClassVar

import numpy as np

from cca_jax.blocks._arith import _maximum, _minimum, _where


def n_core(t, group_size: int, window_size: int):
    """Number of core tokens visible to the query at in-document position `t` (SPEC 2).

    The clamp comes before the division so truncating integer division (Triton, C) gives the
    same result as Python's floor division.
    """
    return _maximum(t + 1 - window_size, 0) // group_size


def raw_start(t, group_size: int, window_size: int):
    """First raw key position visible to in-document position `t`: `g * n_core(t)`."""
    return group_size * n_core(t, group_size, window_size)


def num_pooled_groups(length: int, group_size: int, window_size: int) -> int:
    """Groups pooled for a sequence of `length`: those some query can see (SPEC 1)."""
    return max(0, (length - window_size) // group_size)


# ---- attention options ----------------------------------------------------------------------

def _window_start(p, window: int):
    return _maximum(p - window + 1, 0)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _non_negative(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """Which keys a query sees: the base of the attention options `Full`, `Sliding`,
    `Streaming` and `CCA` (frozen, hashable, static under jit). Each option holds its rule
    (`raw_start`, `num_slots`), its slots' sizes, its slot bound and its KV-cache ring size;
    the shared slot arithmetic is here. `parse_option` builds one from a kind string.

    The size fields every option answers (1, 1, 0 where it has none): group_size (`g`, cca),
    window_size (`s` for cca, `W` for sliding and streaming), sink_tokens (`N`).
    """

    kind: ClassVar[str] = ""
    default_sinks: ClassVar[int] = 0   # sink_tokens when a configuration leaves it unset

    def raw_start(self, p):
        """First raw key (in-document position) visible to in-document position `p`."""
        raise NotImplementedError

    def num_slots(self, p):
        """Slots `0 .. num_slots(p) - 1` of its document are visible to position `p`."""
        return 0 * p

    @property
    def slot_size(self) -> int:
        """Tokens summarised by one pooled slot (g for cca; 1 for streaming's sinks)."""
        return 1

    @property
    def lead_slots(self) -> int:
        """Slots of one raw token each that lead a document's slots, before the pooled ones
        (cca's sinks: N). Slot `c` of a document covers in-document positions
        `[slot_first(c), slot_last(c)]`."""
        return 0

    def max_slots(self, length: int, packed: bool = False) -> int:
        """Slots a row of `length` needs (all documents together when `packed`)."""
        return 0

    def ring_size(self, max_len: int) -> int:
        """Raw keys/values the KV cache keeps per KV head for sequences of up to `max_len`
        tokens, before clipping to `[1, max_len]` (`blocks.ring_size`): the widest raw window
        a query sees (cca: SPEC section 4's `s + g`)."""
        raise NotImplementedError

    def slot_first(self, c):
        """First in-document position of the tokens of slot `c`."""
        n = self.lead_slots
        if not n:
            return c * self.slot_size
        return _minimum(c, n) + _maximum(c - n, 0) * self.slot_size

    def slot_last(self, c):
        """Last in-document position of slot `c`: its slot is pooled with that token's query."""
        return self.slot_first(c + 1) - 1

    def slot_length(self, c):
        """Tokens of slot `c`: 1 for a lead slot, else `slot_size`."""
        return self.slot_first(c + 1) - self.slot_first(c)

    def slots_ending_before(self, p):
        """How many slots end before in-document position `p` (their last token `< p`); also
        the index of the first slot that ends at or after `p`."""
        n = self.lead_slots
        if not n:
            return p // self.slot_size
        return _minimum(p, n) + _maximum(p - n, 0) // self.slot_size

    def visible_scores(self, length: int) -> int:
        """Query-key scores per head for one unpacked sequence of `length`."""
        t = np.arange(length, dtype=np.int64)
        return int(np.sum(self.num_slots(t) + t - self.raw_start(t) + 1))


@dataclasses.dataclass(frozen=True)
class Full(AttentionPattern):
    """Causal attention over every earlier key; no slots."""

    kind: ClassVar[str] = "full"
    group_size: ClassVar[int] = 1
    window_size: ClassVar[int] = 1
    sink_tokens: ClassVar[int] = 0

    def raw_start(self, p):
        return 0 * p

    def ring_size(self, max_len: int) -> int:
        return max_len


@dataclasses.dataclass(frozen=True)
class Sliding(AttentionPattern):
    """The last `window_size` keys (the query's own included); no slots."""

    window_size: int

    kind: ClassVar[str] = "sliding"
    group_size: ClassVar[int] = 1
    sink_tokens: ClassVar[int] = 0

    def __post_init__(self):
        _positive("window_size", self.window_size)

    def raw_start(self, p):
        return _window_start(p, self.window_size)

    def ring_size(self, max_len: int) -> int:
        return self.window_size


@dataclasses.dataclass(frozen=True)
class Streaming(AttentionPattern):
    """StreamingLLM: the sliding window plus the first `sink_tokens` tokens of the document
    as slots of one token each, for those sinks that have left the window."""

    window_size: int
    sink_tokens: int = 4

    kind: ClassVar[str] = "streaming"
    group_size: ClassVar[int] = 1
    default_sinks: ClassVar[int] = 4

    def __post_init__(self):
        _positive("window_size", self.window_size)
        _non_negative("sink_tokens", self.sink_tokens)

    def raw_start(self, p):
        return _window_start(p, self.window_size)

    def num_slots(self, p):
        return _minimum(_window_start(p, self.window_size), self.sink_tokens)

    def max_slots(self, length: int, packed: bool = False) -> int:
        w, n = self.window_size, self.sink_tokens
        if not packed:
            return max(0, min(n, length - w))
        # Only documents longer than W have sinks outside their window, at most L // (W + 1)
        # of them, and their slots add up to at most L - W.
        return max(0, min(length - w, n * (length // (w + 1))))

    def ring_size(self, max_len: int) -> int:
        return self.window_size


@dataclasses.dataclass(frozen=True)
class CCA(AttentionPattern):
    """Core Context Aware attention (SPEC section 2) with group `g`, window `s` and `N` sink
    tokens (SPEC 6; 0: the paper's CCA exactly)."""

    group_size: int
    window_size: int
    sink_tokens: int = 0

    kind: ClassVar[str] = "cca"

    def __post_init__(self):
        _positive("group_size", self.group_size)
        _positive("window_size", self.window_size)
        _non_negative("sink_tokens", self.sink_tokens)

    def _sinks_seen(self, p):
        """Sinks (SPEC 6) the query at `p` sees through their slots: those that have left the
        widest raw window of `s + g - 1` keys (all N once a core token is visible)."""
        return _minimum(_window_start(p, self.window_size + self.group_size - 1),
                        self.sink_tokens)

    def _cores(self, p):
        """n_core of SPEC 6: CCA on the positions after the N sinks."""
        return n_core(p - self.sink_tokens, self.group_size, self.window_size)

    def raw_start(self, p):
        if not self.sink_tokens:
            return raw_start(p, self.group_size, self.window_size)
        return self._sinks_seen(p) + self.group_size * self._cores(p)

    def num_slots(self, p):
        if not self.sink_tokens:
            return n_core(p, self.group_size, self.window_size)
        return self._sinks_seen(p) + self._cores(p)

    @property
    def slot_size(self) -> int:
        return self.group_size

    @property
    def lead_slots(self) -> int:
        return self.sink_tokens

    def max_slots(self, length: int, packed: bool = False) -> int:
        # Documents' groups never add up to more than one sequence's:
        # sum (l_i - s) // g <= (L - s) // g.
        g, s, n = self.group_size, self.window_size, self.sink_tokens
        if not n:
            return num_pooled_groups(length, g, s)
        if not packed:
            return int(self.num_slots(length - 1)) if length else 0
        # Sinks become slots in documents of s + g tokens or more (at most L // (s + g) of
        # them), at most l - s - g + 1 in one of l tokens; the groups after the sinks add up
        # as above.
        sinks = max(0, min(n * (length // (s + g)), length - s - g + 1))
        return sinks + max(0, (length - n - s) // g)

    def ring_size(self, max_len: int) -> int:
        # SPEC section 4's `s + g`: the local window plus the group that is still filling
        # (the widest window is `s + g - 1`, so one entry is spare).
        return self.window_size + self.group_size


# kind string -> option type: what `parse_option` and the CLIs' choices read.
ATTENTION_KINDS = types.MappingProxyType(
    {cls.kind: cls for cls in (Full, Sliding, Streaming, CCA)})


def default_sink_tokens(kind: str) -> int:
    """`sink_tokens` of option `kind` when a configuration leaves it unset: StreamingLLM's 4
    for streaming, 0 (the paper's CCA) for cca."""
    return ATTENTION_KINDS[kind].default_sinks


def parse_option(kind: str, *, group_size: int = 1, window_size: int = 1,
                 sink_tokens: int = 0) -> AttentionPattern:
    """THE parse of an attention option from a kind string and sizes (CLIs, config files):
    `Full()`, `Sliding(window_size)`, `Streaming(window_size, sink_tokens)` or
    `CCA(group_size, window_size, sink_tokens)`. Every size is validated, used or not."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {sorted(ATTENTION_KINDS)}, got {kind!r}.")
    _positive("group_size", group_size)
    _positive("window_size", window_size)
    _non_negative("sink_tokens", sink_tokens)
    if kind == "full":
        return Full()
    if kind == "sliding":
        return Sliding(window_size)
    if kind == "streaming":
        return Streaming(window_size, sink_tokens)
    return CCA(group_size, window_size, sink_tokens)


def completed_slot(pattern: AttentionPattern, t):
    """The slot whose last token is in-document position `t` (`slot_last(c) == t`), or -1
    when `t` completes none. The cache stores it only if it is `< C` (later slots are never
    visible within max_len)."""
    size, lead = pattern.slot_size, pattern.lead_slots
    u = t - lead if lead else t            # position among the pooled tokens
    done = (u + 1) % size == 0
    c = (u + 1) // size - 1 + lead
    if lead:                               # a lead slot (a sink) is its own token
        done = done | (u < 0)
        c = _where(u < 0, t, c)
    return _where(done, c, -1)


def completes_slot(pattern: AttentionPattern, t, num_slots: int):
    """Whether the token at position `t` completes a slot the cache stores (`0 <= c < C`):
    the decode steps that pool (numpy or jax, elementwise)."""
    c = completed_slot(pattern, t)
    return (c >= 0) & (c < num_slots)


def slot_ends_bound(pattern: AttentionPattern, rows: int, packed: bool = False) -> int:
    """Static bound on the slots whose last token lies in `rows` consecutive rows.

    Pooled slots end at least `slot_size` apart, across documents too (a document's first
    one ends `slot_size - 1` after its lead slots, after the previous document's last one).
    Lead slots (cca's sinks) end at a document's first N positions: one document's (its
    start) unpacked; packed, those of the documents met, which are `s + g` tokens or more
    when they have sink slots.
    """
    pooled = -(-rows // pattern.slot_size)
    lead = pattern.lead_slots
    if not lead:
        return pooled
    docs = (rows - 1) // (pattern.window_size + pattern.slot_size) + 2 if packed else 1
    return min(rows, pooled + lead * docs)
