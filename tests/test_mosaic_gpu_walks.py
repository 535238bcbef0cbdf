"""The block walks the Mosaic GPU kernels take (forward and key-side backward), checked
against dense visibility in Python: `tables.walk_steps` and `tables.key_walk_steps` mirror
the kernels' loop bounds. Also the Triton backward taking this forward's statistics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.padding import pad_row_bounds
from pallas_kernels.mosaic_gpu import visit_tables
from pallas_kernels.mosaic_gpu.tables import key_visit_tables, key_walk_steps, walk_steps
from tests.mosaic_gpu_cases import random_segments


PATTERNS = {
    "full": blocks.Full(),
    "sliding": blocks.Sliding(37),
    "streaming": blocks.Streaming(37, 4),
    "cca": blocks.CCA(4, 37),
    "cca_sinks": blocks.CCA(5, 41, 3),
}


@functools.lru_cache(maxsize=None)
def _row_bounds(name: str, packed: bool, b: int, length: int):
    """numpy `[B, L]` raw_lo, core_lo, core_hi of a pattern (three documents a row if packed)."""
    seg = random_segments(b, length, 5) if packed else None
    ranges = jax.jit(blocks.pattern_ranges, static_argnums=(0, 1))(PATTERNS[name], length, seg)
    return [np.broadcast_to(np.asarray(x), (b, length)) for x in
            (ranges.raw_lo, ranges.core_lo, ranges.core_hi)]


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block_q,wgs,block_kv,narrow", [(8, 2, 16, 0), (16, 1, 8, 0),
                                                        (8, 2, 16, 4), (16, 1, 8, 4)])
def test_walk_covers_every_visible_key_and_masks_every_partial_block(name, packed, block_q,
                                                                     wgs, block_kv, narrow):
    """For every CTA and warpgroup, the steps the kernel takes (`walk_steps`, from the
    tables, narrow head included): every (row, key) or (row, slot) pair a row sees lies in
    a visited step, and a step left unmasked for a warpgroup is seen whole by each of its
    rows. Small blocks stand in for the kernel's (the arithmetic is the same at any size)."""
    b, length = 2, 150
    bounds = _row_bounds(name, packed, b, length)
    cfg_rows = block_q * wgs
    lp = -(-length // max(cfg_rows, block_kv)) * max(cfg_rows, block_kv)
    rlo, clo, chi = (np.asarray(x) for x in pad_row_bounds(*bounds, lp))
    tables = visit_tables(rlo, clo, chi, block_q=block_q, compute_wgs=wgs, block_kv=block_kv,
                          narrow=narrow)
    assert tables.cta.shape == (b, lp // cfg_rows, 9) and tables.wg.shape == (b, lp // block_q, 8)
    slots = int(chi.max()) + block_kv
    for z in range(b):
        for tile in range(lp // cfg_rows):
            steps = walk_steps(tables.cta[z, tile], tables.wg[z, tile * wgs:(tile + 1) * wgs],
                               block_kv, narrow)
            assert len(steps) >= 1
            for w in range(wgs):
                rows = tile * cfg_rows + w * block_q + np.arange(block_q)
                keys = np.arange(lp)
                raw = (keys[None] >= rlo[z, rows, None]) & (keys[None] <= rows[:, None])
                slot_ids = np.arange(slots)
                core = ((slot_ids[None] >= clo[z, rows, None])
                        & (slot_ids[None] < chi[z, rows, None]))
                covered = {"raw": np.zeros_like(raw), "core": np.zeros_like(core)}
                for kind, first, width, masked in steps:
                    cols = slice(first, first + width)
                    covered[kind][:, cols] = True
                    if not masked[w]:
                        seen = raw if kind == "raw" else core
                        assert seen[:, cols].all(), (z, tile, w, kind, first)
                assert not (raw & ~covered["raw"]).any(), (z, tile, w)
                assert not (core & ~covered["core"]).any(), (z, tile, w)
            kinds = [kind for kind, *_ in steps]
            assert kinds == sorted(kinds, key=["raw", "core"].index)   # raw blocks first


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("key_rows,wgs,block_q", [(8, 2, 16), (16, 1, 8)])
def test_key_walk_covers_every_row_that_sees_a_key_and_masks_every_partial_block(
        name, packed, key_rows, wgs, block_q):
    """The backward's key-side kernels (dk/dv over raw keys, dck/dcv over slots): for every
    CTA and warpgroup, the steps taken (`key_walk_steps`, from `key_visit_tables`) visit,
    for each query head of the group, every query block holding a row that sees one of the
    warpgroup's keys (slots), and a step left unmasked is seen whole by every row of it.
    Small blocks stand in for the kernel's (`KEY_ROWS` = 64)."""
    b, length, groups = 2, 150, 2
    bounds = _row_bounds(name, packed, b, length)
    cta = key_rows * wgs
    lp = -(-length // max(cta, block_q)) * max(cta, block_q)
    rlo, clo, chi = (np.asarray(x) for x in pad_row_bounds(*bounds, lp))
    mp = -(-max(int(chi.max()), 1) // cta) * cta
    tables = key_visit_tables(rlo, clo, chi, mp, key_rows=key_rows, compute_wgs=wgs,
                              block_q=block_q)
    t, keys, slots = np.arange(lp), np.arange(lp), np.arange(mp)
    seen = {"raw": (keys[None, None] >= rlo[..., None]) & (keys[None, None] <= t[None, :, None]),
            "core": (slots[None, None] >= clo[..., None]) & (slots[None, None] < chi[..., None])}
    for kind, table in zip(("raw", "core"), tables):
        cta_table, wg_table = np.asarray(table.cta), np.asarray(table.wg)
        n = (lp if kind == "raw" else mp) // cta
        assert cta_table.shape == (b, n, 4) and wg_table.shape == (b, n * wgs, 4)
        for z in range(b):
            for tile in range(n):
                steps = key_walk_steps(cta_table[z, tile],
                                       wg_table[z, tile * wgs:(tile + 1) * wgs], groups)
                assert [h for h, _, _ in steps] == sorted(h for h, _, _ in steps)
                for w in range(wgs):
                    own = tile * cta + w * key_rows + np.arange(key_rows)
                    rows_seeing = seen[kind][z][:, own]                # [Lp rows, keys]
                    for gi in range(groups):
                        covered = np.zeros(lp, bool)
                        for h, block, masked in steps:
                            if h != gi:
                                continue
                            rows = slice(block * block_q, (block + 1) * block_q)
                            covered[rows] = True
                            if not masked[w]:
                                assert rows_seeing[rows].all(), (kind, z, tile, w, block)
                        assert not (rows_seeing.any(axis=1) & ~covered).any(), (kind, z, tile)


@pytest.mark.slow   # about 40 s: three Triton kernels in interpret mode
def test_triton_backward_takes_this_forwards_log2_sum_exp():
    """The gradient path: `cca_backward` fed with an output and a log2-sum-exp made outside
    the Triton forward (here in XLA, with the Mosaic forward's convention and its own row
    padding, garbage past L) equals the Triton kernels' own VJP (interpret mode, small
    tiles). This is the contract the Mosaic forward's custom_vjp relies on."""
    from cca_jax.attention.pooling import slots_and_bounds
    from pallas_kernels.gpu import cca_core_attention, kernel_config
    from pallas_kernels.gpu.kernels import cca_backward
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    b, length, hq, hkv, d = 1, 40, 2, 1, 64
    q = jax.random.normal(ks[0], (b, length, hq, d))
    k, v = (jax.random.normal(x, (b, length, hkv, d)) for x in ks[1:3])
    dout = jax.random.normal(ks[3], q.shape)
    ck, cv, rlo, clo, chi = slots_and_bounds(q, k, v, blocks.CCA(4, 9))
    cfg = kernel_config(interpret=True, block_q=16, block_k=16, dq_block_q=16, dq_block_k=16,
                        dkv_block_k=16, dkv_block_q=16, dc_block_k=16, dc_block_q=16)
    # Dense forward with the Mosaic kernel's lse convention: log2 sum exp2(s * scale * log2 e).
    t = jnp.arange(length)
    kk, vv = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
    keys = jnp.concatenate([ck, kk], axis=1)
    vals = jnp.concatenate([cv, vv], axis=1)
    slot = jnp.arange(ck.shape[1])
    core = (slot[None, None] >= clo[..., None]) & (slot[None, None] < chi[..., None])
    raw = (t[None, None] >= rlo[..., None]) & (t[None, None] <= t[None, :, None])
    seen = jnp.concatenate([core, raw], axis=-1)                             # [B, L, m + L]
    s = jnp.einsum("bthd,buhd->bhtu", q, keys) / np.sqrt(d)
    s = jnp.where(seen[:, None], s, -jnp.inf)
    out = jnp.einsum("bhtu,buhd->bthd", jax.nn.softmax(s, axis=-1), vals)
    lse = jax.nn.logsumexp(s, axis=-1) / np.log(2.0)                         # [B, Hq, L]
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, 88)), constant_values=1e30)    # another padding
    got = cca_backward(q, k, v, ck, cv, rlo, clo, chi, out, lse, dout, cfg)
    _, vjp = jax.vjp(lambda *x: cca_core_attention(*x, rlo, clo, chi, cfg), q, k, v, ck, cv)
    for name, g, w in zip(("dq", "dk", "dv", "dck", "dcv"), got, vjp(dout)):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=name)
