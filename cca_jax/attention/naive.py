"""Dense attention for every option (SPEC sections 1-3 for CCA, 6 with sinks) with L x L
masks. Tests, small L.

Every position is treated as a candidate slot (the slot ending there: a group, or a lead
slot's one token); masks keep the slots that really end there and that the query may see.
Everything is computed in float32, so this doubles as the high-precision reference for bf16
runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cca_jax.attention.backend import Backend
from cca_jax.blocks import CCA, AttentionPattern, completed_slot, document_starts

# The dense path refuses lengths where its L x L float32 masks and logits would not fit.
NAIVE_MAX_LEN = 16384


def _document_positions(segment_ids, batch: int, length: int):
    """(document index, document start, position in document), each `[B, L]`."""
    t = jnp.arange(length)
    if segment_ids is None:
        zeros = jnp.zeros((batch, length), jnp.int32)
        return zeros, zeros, jnp.broadcast_to(t, (batch, length))
    start = document_starts(segment_ids)
    return jnp.cumsum(start == t, axis=1), start, t - start


def _pool_every_position(q, k, v, group_size: int, pooling: str):
    """Core key/value of the group ending at every position: `[B, L, Hq, D]` float32."""
    g = group_size
    length = q.shape[1]
    pad = ((0, 0), (g - 1, 0), (0, 0), (0, 0))
    kp, vp = jnp.pad(k, pad), jnp.pad(v, pad)
    kw = jnp.stack([kp[:, u:u + length] for u in range(g)], axis=2)   # [B, L, g, Hq, D]
    vw = jnp.stack([vp[:, u:u + length] for u in range(g)], axis=2)
    if pooling == "cca":
        logits = jnp.einsum("behd,beuhd->behu", q, kw) / math.sqrt(q.shape[-1])
        a = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("behu,beuhd->behd", a, kw), jnp.einsum("behu,beuhd->behd", a, vw)
    if pooling == "mean":
        return kw.mean(axis=2), vw.mean(axis=2)
    return kw.max(axis=2), vw.max(axis=2)


def attention_naive(q, k, v, pattern: AttentionPattern, *, pooling: str = "cca",
                    segment_ids=None):
    """Attention under `pattern` by dense masks; same signature and result as `run_attention`."""
    b, length, hq, d = q.shape
    reps = hq // k.shape[2]
    size = pattern.slot_size
    compute = jnp.promote_types(q.dtype, jnp.float32)  # float32, or float64 under x64
    qf = q.astype(compute)
    kf = jnp.repeat(k.astype(compute), reps, axis=2)
    vf = jnp.repeat(v.astype(compute), reps, axis=2)

    doc, start, pos = _document_positions(segment_ids, b, length)
    nc = pattern.num_slots(pos)                                       # [B, L]
    t = jnp.arange(length)
    same_doc = doc[:, :, None] == doc[:, None, :]                     # [B, Lq, Lk]
    raw_mask = same_doc & (t[None, None, :] <= t[None, :, None]) & (
        t[None, None, :] >= (start + pattern.raw_start(pos))[:, :, None])
    slot_index = completed_slot(pattern, pos)                         # -1: no slot ends here
    core_mask = same_doc & (slot_index >= 0)[:, None, :] & (
        slot_index[:, None, :] < nc[:, :, None])

    ck, cv = _pool_every_position(qf, kf, vf, size, pooling if size > 1 else "mean")
    if pattern.lead_slots:   # a lead slot (a sink) ending at a position is its own token
        lead = (slot_index < pattern.lead_slots)[:, :, None, None]
        ck, cv = jnp.where(lead, kf, ck), jnp.where(lead, vf, cv)
    scale = 1.0 / math.sqrt(d)
    neg = jnp.finfo(compute).min
    core_logits = jnp.einsum("bthd,behd->bhte", qf, ck) * scale
    raw_logits = jnp.einsum("bthd,buhd->bhtu", qf, kf) * scale
    logits = jnp.concatenate([
        jnp.where(core_mask[:, None], core_logits, neg),
        jnp.where(raw_mask[:, None], raw_logits, neg)], axis=-1)
    p = jax.nn.softmax(logits, axis=-1)
    out = (jnp.einsum("bhte,behd->bthd", p[..., :length], cv)
           + jnp.einsum("bhtu,buhd->bthd", p[..., length:], vf))
    return out.astype(q.dtype)


def cca_attention_naive(q, k, v, *, group_size: int, window_size: int, sink_tokens: int = 0,
                        pooling: str = "cca", segment_ids=None):
    """CCA attention by dense masks; same signature and result as `cca_attention`."""
    return attention_naive(q, k, v, CCA(group_size, window_size, sink_tokens),
                           pooling=pooling, segment_ids=segment_ids)


class NaiveBackend(Backend):
    """`attention_naive` for tests and small L: every option, every platform; never picked
    by `auto`."""

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        if q.shape[1] > NAIVE_MAX_LEN:
            raise ValueError(
                f"implementation='naive' builds L x L arrays; L={q.shape[1]} is over its limit "
                f"of {NAIVE_MAX_LEN}. Use implementation='xla' or 'auto' (memory-linear).")
        return attention_naive(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)


NAIVE = NaiveBackend("naive", None, "every platform", frozenset({"attention"}))
