"""Shared by the Mosaic GPU kernels' tests (`tests/test_mosaic_gpu*.py`): random inputs,
packed rows, the float64 references they are checked against, the row-error tolerances,
the text of a module lowered for "cuda", and the Hopper check for the `gpu` tests."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu


S = jax.ShapeDtypeStruct


def lowered_text(dtype, d, hq, hkv, length, m, grad=False, remat=None, **tiling):
    q, kv, c = (S((2, length, h, d), jnp.dtype(dtype)) for h in (hq, hkv, hkv))
    c = S((2, m, hq, d), jnp.dtype(dtype))
    bounds = S((2, length), jnp.int32)

    def fwd(q, k, v, ck, cv, *b):
        return blocked_attention_mosaic_gpu(q, k, v, ck, cv, *b, **tiling)
    if remat is not None:     # a rematerialized layer: the policy of that name
        from cca_jax.config import REMAT_POLICIES
        fwd = jax.checkpoint(lambda *a, f=fwd: jnp.tanh(f(*a)), policy=REMAT_POLICIES[remat])
    fn = fwd
    if grad:   # with remat, the loss too: else the first forward is dead code
        fn = (jax.grad if remat is None else jax.value_and_grad)(
            lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    return jax.jit(fn).trace(q, kv, kv, c, c, bounds, bounds, bounds).lower(
        lowering_platforms=("cuda",)).as_text()


def in_cache_inputs(layers=3, rows=4, m=104, b=2, length=48, d=64, seed=0,
                     dtype=jnp.bfloat16):
    """q/k/v rows of a prefill chunk and a KV cache's stacked slots `[layers, rows, m, Hq, D]`
    (Hq 2, Hkv 1) with the bounds of CCA at a chunk offset: rows see raw keys of their
    window and every slot up to their own."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (b, length, 2, d), dtype)
    k, v = (jax.random.normal(x, (b, length, 1, d), dtype) for x in keys[1:3])
    ck_cache, cv_cache = (jax.random.normal(x, (layers, rows, m, 2, d), dtype)
                          for x in keys[3:5])
    t = jnp.arange(length)
    raw_lo = jnp.broadcast_to(jnp.maximum(t - 20, 0), (b, length)).astype(jnp.int32)
    core_lo = jnp.zeros((b, length), jnp.int32)
    core_hi = jnp.broadcast_to(jnp.minimum(m - 30 + t, m), (b, length)).astype(jnp.int32)
    return q, k, v, ck_cache, cv_cache, (raw_lo, core_lo, core_hi)


def dense_reference(q, k, v, ck, cv, bounds):
    """The blocked contract in float64: row t sees raw keys [raw_lo[t], t] and slots
    [core_lo[t], core_hi[t]) in one softmax; `[B, L, Hq, D]`."""
    q, k, v, ck, cv = (np.asarray(x, np.float64) for x in (q, k, v, ck, cv))
    raw_lo, core_lo, core_hi = (np.asarray(x) for x in bounds)
    b, length, hq, d = q.shape
    groups = hq // k.shape[2]
    t, u, c = np.arange(length), np.arange(length), np.arange(ck.shape[1])
    out = np.zeros(q.shape)
    for row in range(b):
        raw = (u[None] >= raw_lo[row][:, None]) & (u[None] <= t[:, None])
        core = (c[None] >= core_lo[row][:, None]) & (c[None] < core_hi[row][:, None])
        for h in range(hq):
            keys = np.concatenate([k[row, :, h // groups], ck[row, :, h]])
            values = np.concatenate([v[row, :, h // groups], cv[row, :, h]])
            scores = q[row, :, h] @ keys.T / math.sqrt(d)
            scores = np.where(np.concatenate([raw, core], axis=1), scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[row, :, h] = (p / p.sum(axis=1, keepdims=True)) @ values
    return out


def random_segments(b, length, seed):
    """Segment ids `[b, length]` of packed rows: three documents a row, cut at random."""
    rng = np.random.default_rng(seed)
    cuts = [np.sort(rng.choice(np.arange(1, length), 2, replace=False)) for _ in range(b)]
    return np.stack([np.searchsorted(c, np.arange(length), side="right")
                     for c in cuts]).astype(np.int32)


def on_hopper() -> bool:
    """Whether jax's default device is a GPU of compute capability 9.0 or later."""
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return float(cc) >= 9.0


needs_hopper = pytest.mark.skipif(not on_hopper(), reason="needs a Hopper (sm_90) GPU")


# Largest per-row error (`tests/row_errors.py`) against float64: bf16 as the Triton kernels'
# GPU test (tests/test_pallas_gpu.py GPU_ROW_TOL); float16 has 3 more mantissa bits, x1/3
# margin kept. Not yet measured for this kernel: the first GPU run prints the errors.
ROW_TOL = {"bfloat16": dict(out=6e-3, grad=2.5e-2), "float16": dict(out=3e-3, grad=1.2e-2)}


def random_inputs(b, length, hq, hkv, d, dtype, seed):
    """Standard normal q `[b, L, hq, d]`, k and v `[b, L, hkv, d]` in `dtype`, and a float32
    cotangent shaped like q."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, length, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, length, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, length, hkv, d), jnp.float32).astype(dtype)
    ct = jax.random.normal(ks[3], q.shape, jnp.float32)
    return q, k, v, ct


def naive_grads64(q, k, v, ct, pattern, seg):
    """float64 q/k/v gradients of sum(out * ct) through the naive implementation (x64):
    pooling and attention by dense masks, from cca_jax.attention.naive."""
    from cca_jax.attention.naive import attention_naive
    with jax.enable_x64(True):
        q, k, v, ct = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, ct))
        seg = None if seg is None else jnp.asarray(np.asarray(seg))
        grads = jax.grad(lambda q, k, v: jnp.sum(attention_naive(
            q, k, v, pattern, segment_ids=seg) * ct), argnums=(0, 1, 2))(q, k, v)
        return [np.asarray(g) for g in grads]


def sinks_through_the_backend(q, k, v, ct, pattern):
    """Output and q/k/v gradients of sum(out * ct) through the Mosaic backend
    (`run_attention`: on the CPU its kernels run in the GPU interpreter): unpacked rows with
    sinks run in the frame after them (`lead_rows`)."""
    from cca_jax.attention import run_attention

    def loss(q, k, v):
        out = run_attention(q, k, v, pattern, implementation="mosaic_gpu")
        return jnp.sum(out.astype(jnp.float32) * ct), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def sinks_reference64(q, k, v, ct, pattern):
    """SPEC 6 (tests/cca_sinks_cases.py) in float64: output and q/k/v gradients."""
    from tests.cca_sinks_cases import sinks_reference
    args = (pattern.group_size, pattern.window_size, pattern.sink_tokens)
    with jax.enable_x64():
        x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, ct)]
        out, vjp = jax.vjp(lambda q, k, v: sinks_reference(q, k, v, *args), *x64[:3])
        return np.asarray(out), [np.asarray(g) for g in vjp(x64[3])]


def core_reference64(q, k, v, ck, cv, raw_lo, core_lo, core_hi, dout):
    """float64 (x64) output, log2-sum-exp `[B, Hq, L]` and (dq, dk, dv, dck, dcv) of the
    function the kernels compute, by dense masks: one softmax per row over raw keys
    `[raw_lo, t]` and slots `[core_lo, core_hi)` (K/V repeated over the GQA group here)."""
    with jax.enable_x64(True):
        x = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, ck, cv)]
        rlo, clo, chi = (jnp.asarray(np.asarray(a)) for a in (raw_lo, core_lo, core_hi))
        length, d = q.shape[1], q.shape[-1]
        t, slot = jnp.arange(length), jnp.arange(ck.shape[1])
        core = (slot[None, None] >= clo[..., None]) & (slot[None, None] < chi[..., None])
        raw = (t[None, None] >= rlo[..., None]) & (t[None, None] <= t[None, :, None])
        seen = jnp.concatenate([core, raw], axis=-1)[:, None]          # [B, 1, L, m + L]

        def scores(q, k, ck):
            keys = jnp.concatenate([ck, jnp.repeat(k, q.shape[2] // k.shape[2], 2)], axis=1)
            s = jnp.einsum("bthd,buhd->bhtu", q, keys) / np.sqrt(d)
            return jnp.where(seen, s, -jnp.inf)

        def attend(q, k, v, ck, cv):
            vals = jnp.concatenate([cv, jnp.repeat(v, q.shape[2] // v.shape[2], 2)], axis=1)
            return jnp.einsum("bhtu,buhd->bthd", jax.nn.softmax(scores(q, k, ck), -1), vals)
        out, vjp = jax.vjp(attend, *x)
        lse = jax.nn.logsumexp(scores(x[0], x[1], x[3]), axis=-1) / np.log(2.0)
        grads = vjp(jnp.asarray(np.asarray(dout, np.float64)))
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]
