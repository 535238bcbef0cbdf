"""Which keys a query sees, for every attention option, written from /work/shared/SPEC.md alone.

A brute-force, per-query oracle for the tests of `cca_jax.blocks`, the KV cache and the
kernels: nothing here calls `cca_jax` (an `AttentionPattern` is read for its four fields
only), and no rule is a closed formula shared with the code under test. Positions are
in-document (a document is a maximal run of equal `segment_ids`; positions count from its
start). Query `p` sees key `u` only if `u <= p`. The options (SPEC, "The other attention
options", sections 2 and 4):

  full       every key `u <= p`, raw.
  sliding    `p - W < u <= p` (W keys including itself), raw.
  streaming  the sliding window raw, plus the sinks `u < N`; a sink outside the window is
             seen through a *slot* (the cache and the blocked kernels hold sinks as slots of
             one token; a sink inside the window is seen raw, as itself).
  cca        core group `j` (positions `[j*g, (j+1)*g)`) is seen through one slot (its core
             token) once its last token is `s` positions back: `p >= (j+1)*g + s - 1`
             (SPEC 4: "visible ... from t = (j+1)*g + s - 1 on"); every other key `u <= p`
             is seen raw (SPEC 2: core groups and the local window neither overlap nor
             leave a gap). With `sink_tokens = N` (SPEC 6) the first N positions are seen
             by every later query and the groups start after them (`spec_sees`,
             `core_groups`); whether a sink sits in the ring or in a slot is a layout choice
             SPEC leaves open, so `sees_raw` / `slots_seen` refuse cca with N > 0.

Slots of a row are numbered document by document, in position order ("stored back to back"):
a document's slots are those some query of that document sees.
"""

from __future__ import annotations

import functools

import numpy as np


def _fields(pattern):
    """(kind, g, s_or_W, N) of an `AttentionPattern` (or anything with those attributes)."""
    return (pattern.kind, int(pattern.group_size), int(pattern.window_size),
            int(pattern.sink_tokens))


@functools.lru_cache(maxsize=4096)
def core_groups(g: int, s: int, p: int, sinks: int = 0) -> tuple[int, ...]:
    """CCA: the groups whose core token the query at in-document position p sees."""
    groups = []
    j = 0
    while sinks + (j + 1) * g - 1 <= p:           # every group that is complete by p
        if p >= sinks + (j + 1) * g + s - 1:      # ... and whose last token is s back
            groups.append(j)
        j += 1
    return tuple(groups)


@functools.lru_cache(maxsize=4096)
def _in_core_groups(g: int, s: int, p: int, sinks: int) -> frozenset[int]:
    """Positions the query at p sees through core tokens."""
    return frozenset(u for j in core_groups(g, s, p, sinks)
                     for u in range(sinks + j * g, sinks + (j + 1) * g))


def sees_raw(pattern, p: int, u: int) -> bool:
    """The query at in-document position p sees key u as itself (not through a slot)."""
    kind, g, w, n = _fields(pattern)
    if u < 0 or u > p:
        return False
    if kind == "full":
        return True
    if kind in ("sliding", "streaming"):
        return p - w < u
    if kind == "cca":
        _no_cca_sinks(n)
        return u not in _in_core_groups(g, w, p, n)
    raise ValueError(f"unknown attention kind {kind!r}")


def slots_seen(pattern, p: int) -> list[int]:
    """In-document slot indices the query at in-document position p sees."""
    kind, g, w, n = _fields(pattern)
    if kind == "cca":
        _no_cca_sinks(n)
        return list(core_groups(g, w, p, n))
    if kind == "streaming":
        return [u for u in range(min(n, p + 1)) if not p - w < u]
    return []


def slot_tokens(pattern, c: int) -> list[int]:
    """In-document positions summarised by slot c."""
    kind, g, _, n = _fields(pattern)
    if kind == "cca":
        return list(range(n + c * g, n + (c + 1) * g))
    return [c]


def _no_cca_sinks(n: int) -> None:
    if n:
        raise NotImplementedError("the cache/slot layout of CCA with sink tokens (SPEC 6) is "
                                  "not specified: use spec_sees, or extend the oracle.")


def spec_sees(pattern, p: int, u: int) -> bool:
    """Whether the query at p attends to key u at all (raw or inside a slot), from SPEC's
    one-line description of each option."""
    kind, _, w, n = _fields(pattern)
    if u < 0 or u > p:
        return False
    if kind in ("full", "cca"):
        return True            # CCA: every earlier position, raw or through a core token
                               # (with sinks too: SPEC 6, "every earlier position is still
                               # seen exactly once")
    if kind == "sliding":
        return p - w < u
    return u < n or p - w < u  # streaming


def documents(segment_ids, length: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of equal ids in one row (or the whole row)."""
    seg = np.zeros(length, int) if segment_ids is None else np.asarray(segment_ids)
    starts = [t for t in range(length) if t == 0 or seg[t] != seg[t - 1]]
    return list(zip(starts, starts[1:] + [length]))


def dense_masks(pattern, length: int, segment_ids=None):
    """One row: raw `[L, L]` and slot `[L, m]` boolean masks, and the first position of each
    slot's tokens `[m]` (slots of all documents back to back; m = the slots some query sees)."""
    docs = documents(segment_ids, length)
    per_doc = []
    for d0, d1 in docs:
        seen = sorted({c for p in range(d1 - d0) for c in slots_seen(pattern, p)})
        assert seen == list(range(len(seen))), "slots are seen in order"
        per_doc.append(len(seen))
    offsets = np.concatenate([[0], np.cumsum(per_doc)]).astype(int)
    raw = np.zeros((length, length), bool)
    slot = np.zeros((length, offsets[-1]), bool)
    start = np.zeros(offsets[-1], int)
    for (d0, d1), off, m in zip(docs, offsets, per_doc):
        for c in range(m):
            start[off + c] = d0 + slot_tokens(pattern, c)[0]
        for p in range(d1 - d0):
            for u in range(p + 1):
                raw[d0 + p, d0 + u] = sees_raw(pattern, p, u)
            for c in slots_seen(pattern, p):
                slot[d0 + p, off + c] = True
    return raw, slot, start


def ring_holds(t: int, ring: int) -> list[int]:
    """Once positions 0..t are written to a ring of R entries (position u into entry u % R,
    overwriting), the position each entry holds (-1: never written), by brute force."""
    held = [-1] * ring
    for u in range(max(0, t + 1 - 2 * ring), t + 1):   # earlier writes are overwritten
        held[u % ring] = u
    return held


def cache_masks(pattern, positions, ring: int, num_slots: int):
    """The KV cache of one unpacked sequence (SPEC 4): `[len(positions), R]` ring entries and
    `[len(positions), C]` slots the query at each position sees. Also asserts that what the
    cache holds covers SPEC's keys exactly once (each seen key is in the ring or in a slot, and
    every seen slot fits in the cache)."""
    positions = [int(t) for t in np.asarray(positions).reshape(-1)]
    raw = np.zeros((len(positions), ring), bool)
    slot = np.zeros((len(positions), num_slots), bool)
    for row, t in enumerate(positions):
        held = ring_holds(t, ring)
        for i, u in enumerate(held):
            raw[row, i] = u >= 0 and sees_raw(pattern, t, u)
        for c in slots_seen(pattern, t):
            assert c < num_slots, f"slot {c} seen at t={t} does not fit in {num_slots} slots"
            slot[row, c] = True
        in_ring = {held[i] for i in np.flatnonzero(raw[row])}
        wanted = {u for u in range(t + 1) if sees_raw(pattern, t, u)}
        assert in_ring == wanted, f"t={t}: the ring of {ring} lost raw keys {wanted - in_ring}"
    return raw, slot
