"""The Mosaic GPU decode kernel (`pallas_kernels.mosaic_gpu.decode`).

CPU (default suite): cross-lowering for "cuda" (builds the Mosaic GPU module: API, shapes,
layouts, wgmma/TMA constraints; not ptxas or run-time shared memory); the whole kernel in
jax's GPU interpreter (TMA copies, barriers, the block walk, masks, the split and the merge;
its two products are plain dots there) at tiny shapes against a float64 reference written
from the contract (ring entries `(ring_first + i) % R` for `i < ring_count`, slots
`[0, num_slots)`) or from the SPEC oracle's cache masks; argument and config errors.
Invisible ring entries and slots are poisoned with large finite values (keys that would win
every softmax, values far off): a kernel that let one through would fail. (Not NaN: blocks
are read whole and masked by score, so invisible entries must be finite, as a `KVCache`'s
are: zero-initialised, then written.)
On a Hopper GPU (`gpu` marker): the 7B shape at 128K context against float64 and against the
Triton decode kernel, row by row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import blocks
from cca_jax.blocks import DecodeBounds
from pallas_kernels.mosaic_gpu.decode import decode_attention_mosaic_gpu
from pallas_kernels.mosaic_gpu.decode_config import (SMEM_LIMIT_BYTES, MosaicDecodeConfig,
                                                     decode_config, decode_refusal,
                                                     resolve_splits, shared_memory_bytes)

S = jax.ShapeDtypeStruct

# Largest per-row error (max |error| / row norm) against float64. The probabilities are
# rounded to the cache dtype for the value product (as in the Triton kernel): bf16 measured
# <= 6e-4 in the interpreter at D = 64 -> 2e-3 * sqrt(128 / D) as the Triton decode tests;
# float16 has 3 more mantissa bits (measured 5e-5). A dropped or extra entry among the
# ~20-70 a tiny row sees moves the row by ~1e-2 or more.
ROW_TOL = {"bfloat16": 2e-3, "float16": 5e-4}


def _tol(dtype, d):
    return ROW_TOL[jnp.dtype(dtype).name] * (128 / d) ** 0.5


def row_errors(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.abs(out - ref).max(-1) / np.linalg.norm(ref, axis=-1)


def contract_masks(bounds, ring: int, num_slots: int):
    """`[B, R]`, `[B, C]` visibility written from the contract, entry by entry."""
    first, count, slots = (np.asarray(x) for x in bounds)
    raw = np.zeros((len(first), ring), bool)
    slot = np.zeros((len(first), num_slots), bool)
    for z in range(len(first)):
        raw[z, [(first[z] + i) % ring for i in range(count[z])]] = True
        slot[z, :slots[z]] = True
    return raw, slot


def reference(q, k, v, ck, cv, raw, slot):
    """float64 `[B, Hq, D]`: one softmax over the visible ring entries (KV head h // G) and
    slots (query head h) of each row."""
    q, k, v, ck, cv = (np.asarray(x, np.float64) for x in (q, k, v, ck, cv))
    b, hq, d = q.shape
    groups = hq // k.shape[2]
    k, v = (np.repeat(x, groups, axis=2) for x in (k, v))           # [B, R, Hq, D]
    keys, vals = np.concatenate([k, ck], 1), np.concatenate([v, cv], 1)
    seen = np.concatenate([raw, slot], 1)                           # [B, R + C]
    s = np.einsum("bhd,bnhd->bhn", q, keys) / np.sqrt(d)
    s = np.where(seen[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhn,bnhd->bhd", p / p.sum(-1, keepdims=True), vals)


def _poison(x, visible, value):
    """x `[B, N, H, D]` with the entries a row does not see set to `value`."""
    return np.where(visible[:, :, None, None], x, value)


def _case(b, hq, hkv, d, ring, num_slots, dtype, seed, layers=None):
    """Random bf16/fp16 q `[B, Hq, D]`, ring and slots (float32 numpy of exact values),
    stacked over `layers` when given."""
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)

    def normal(*shape):
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float32)
    return (normal(b, hq, d), normal(*lead, b, ring, hkv, d), normal(*lead, b, ring, hkv, d),
            normal(*lead, b, num_slots, hq, d), normal(*lead, b, num_slots, hq, d))


def _check_interpreted(bounds, *, b=2, hq=4, hkv=2, d=64, ring=48, num_slots=20,
                       dtype=jnp.bfloat16, seed=0, masks=None, layers=None, layer=0,
                       slot_layout="bchd", out_dtype=jnp.float32, **tiling):
    q, k, v, ck, cv = _case(b, hq, hkv, d, ring, num_slots, dtype, seed, layers)
    raw, slot = masks if masks is not None else contract_masks(bounds, ring, num_slots)
    ref = reference(q, *(x if layers is None else x[layer] for x in (k, v, ck, cv)), raw, slot)
    if layers is None:
        k, v = _poison(k, raw, 30.0), _poison(v, raw, 1e3)
        ck, cv = _poison(ck, slot, 30.0), _poison(cv, slot, 1e3)
    else:   # the layer read is poisoned; the others are garbage anyway
        k[layer], v[layer] = _poison(k[layer], raw, 30.0), _poison(v[layer], raw, 1e3)
        ck[layer], cv[layer] = _poison(ck[layer], slot, 30.0), _poison(cv[layer], slot, 1e3)
    if slot_layout == "bhcd":
        ck, cv = (np.swapaxes(x, -3, -2) for x in (ck, cv))
    args = [jnp.asarray(x, dtype) for x in (q, k, v, ck, cv)]
    bounds = DecodeBounds(*(jnp.asarray(x, jnp.int32) for x in bounds))
    out = decode_attention_mosaic_gpu(*args, bounds, interpret=True, out_dtype=out_dtype,
                                      slot_layout=slot_layout,
                                      layer=None if layers is None else jnp.int32(layer),
                                      **tiling)
    assert out.shape == (b, hq, d) and out.dtype == jnp.dtype(out_dtype)
    err = row_errors(out, ref)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= _tol(dtype, d), (f"row error {err.max():.2e} at (row, head) {worst}; "
                                         f"bounds {[np.asarray(x) for x in bounds]}")
    return err.max()


# ---- CPU: the kernel in jax's GPU interpreter ---------------------------------------------

# (ring_first, ring_count, num_slots) per row; R = 48, C = 20 unless given.
INTERPRETED = {
    # row 0 wraps (40 + 20 > 48) with no slot; row 1: one ring entry, every slot.
    "wrap_no_slots_one_entry": dict(bounds=([40, 5], [20, 1], [0, 20]), splits=2),
    # the whole ring (wrapping at 13), a ragged slot count; 4 splits, 3 stages.
    "full_ring_many_splits": dict(bounds=([13, 47], [48, 1], [13, 20]), splits=4, stages=3),
    # MQA (G = 4: 16 slots of each head a step), a 2-entry wrap, 3 splits (one empty).
    "mqa": dict(bounds=([47, 0], [2, 48], [17, 3]), hkv=1, splits=3),
    # MHA and no slots at all in the cache (C = 0), default splits.
    "mha_no_slot_cache": dict(bounds=([10, 30], [30, 48], [0, 0]), hkv=4, num_slots=0),
    # R = 100, C = 40: two ring blocks (the second starts at 36 and masks the overlap), two
    # slot blocks of 32 per head (the second starts at 8), a wrap across both ring blocks.
    "several_blocks": dict(bounds=([90, 20], [60, 80], [40, 33]), ring=100, num_slots=40,
                           splits=2, stages=2),
    # R = 70, C = 21 (MQA, G = 4): above a block but not whole 8-row tiles, zero-padded to
    # 72 and 24 entries that no row sees; row 0 wraps, row 1 reads the whole ring.
    "sizes_off_the_tiles": dict(bounds=([65, 0], [10, 70], [21, 5]), ring=70, num_slots=21,
                                hkv=1, splits=2),
    # G = 7 (Qwen2-7B's 28 / 4): 8 lanes of 8 slots a step, the spare lane a copy of head 6;
    # three slot steps, one ring wrap.
    "seven_heads_per_kv_head": dict(bounds=([40, 5], [20, 7], [20, 17]), hq=7, hkv=1,
                                    splits=2),
    # G = 3 (SmolLM2's 9 / 3) on two KV heads: 4 lanes of 16 slots a step.
    "three_heads_per_kv_head": dict(bounds=([13, 47], [48, 1], [13, 20]), hq=6, hkv=2),
    # Key copies issued after each step's scores, value copies after its values: two ring
    # blocks and two slot blocks a row through 2 stages (buffers reused mid-row), a wrap,
    # and G = 4 (4 lanes' key copies apart from their value copies).
    "early_keys": dict(bounds=([90, 20], [60, 80], [40, 33]), ring=100, num_slots=40,
                       splits=1, stages=2, early_keys=True),
    "early_keys_mqa": dict(bounds=([47, 0], [2, 48], [17, 20]), hkv=1, splits=1,
                           early_keys=True),
}


@pytest.mark.parametrize("name", sorted(INTERPRETED))
def test_interpreted_matches_float64(name):
    """Hand-made bounds at B = 2, Hq = 4, D = 64, block 64 (rings and slot caches smaller
    than a block are zero-padded): wraps, per-head slot blocks, splits that cut ring and
    slot steps, empty splits."""
    case = dict(INTERPRETED[name])
    _check_interpreted(case.pop("bounds"), block=64, **case)


EDGE_MASK_CASES = ("wrap_no_slots_one_entry", "full_ring_many_splits", "several_blocks",
                   "sizes_off_the_tiles", "seven_heads_per_kv_head", "early_keys")


@pytest.mark.parametrize("name", EDGE_MASK_CASES)
def test_interpreted_edge_masks_only_matches_float64(name):
    """`edge_masks_only`: blocks every row sees whole skip the position mask (slot blocks
    keep their lanes' mask at G > 1). The cases cover whole and partial ring blocks (wraps,
    a block that holds the ring's first visible entry, a clipped last block, padding past
    R), whole and partial slot blocks, and G = 2, 4 and 7 (invisible entries poisoned)."""
    case = dict(INTERPRETED[name])
    _check_interpreted(case.pop("bounds"), block=64, edge_masks_only=True, **case)


@pytest.mark.parametrize("name", ["wrap_no_slots_one_entry", "full_ring_many_splits", "mqa",
                                  "several_blocks", "sizes_off_the_tiles",
                                  "seven_heads_per_kv_head", "three_heads_per_kv_head",
                                  "early_keys"])
def test_interpreted_keys_along_rows_matches_float64(name):
    """`keys_along_rows`: each step transposed (S^T = K Q^T, the softmax down the columns,
    O^T += V^T P through shared memory), alone and with the other options."""
    case = dict(INTERPRETED[name])
    _check_interpreted(case.pop("bounds"), block=64, keys_along_rows=True, **case)
    if name == "several_blocks":
        _check_interpreted(INTERPRETED[name]["bounds"], ring=100, num_slots=40, block=64,
                           splits=2, keys_along_rows=True, edge_masks_only=True,
                           early_keys=True, stages=3, seed=5)


def test_interpreted_edge_masks_only_at_cca_positions():
    """`edge_masks_only` at CCA(8, 40)'s decode positions (R = 48 < one block: every ring
    block padded and masked), and at R = C = 128 where rings and slots hold whole blocks."""
    from tests import visibility_oracle as oracle
    pattern = blocks.CCA(8, 40)
    t = np.asarray([0, 47, 48, 199])
    bounds = blocks.decode_bounds(pattern, t, 48, 20)
    _check_interpreted(bounds, b=4, masks=oracle.cache_masks(pattern, t, 48, 20), seed=21,
                       block=64, splits=2, edge_masks_only=True)
    # R = 128, C = 128, blocks of 64: a whole first ring block and a partial second, a wrap
    # whose second block is whole, one whole block alone, and blocks one entry (ring) or one
    # slot short of whole, next to whole slot blocks.
    _check_interpreted(([0, 36, 64, 0], [99, 100, 64, 63], [128, 127, 0, 64]), b=4, ring=128,
                       num_slots=128, seed=22, block=64, splits=1, edge_masks_only=True)


def test_interpreted_stacked_cache_head_major_slots_bf16_out():
    """Stacked `[L, B, ...]` cache read at a traced layer, slots `[L, B, Hq, C, D]`, bf16
    out."""
    _check_interpreted(([40, 5], [20, 7], [20, 9]), layers=3, layer=2, slot_layout="bhcd",
                       out_dtype=jnp.bfloat16, block=64)


def test_interpreted_float16_d128_default_tiling():
    _check_interpreted(([40, 5], [20, 7], [20, 9]), d=128, dtype=jnp.float16, seed=3)


@pytest.mark.parametrize("d", [80, 96, 256])
def test_interpreted_other_head_dims(d):
    """D = 80 and 96 (the cache read in place: 32- and 64-byte swizzled tiles) and 256 (its
    default 64-key steps), R = 100 (two ring blocks), GQA."""
    _check_interpreted(([90, 20], [60, 80], [20, 9]), d=d, ring=100, seed=d)


def test_interpreted_cca_positions_against_the_spec_oracle():
    """Bounds from `cca_jax.blocks.decode_bounds` of CCA(g=8, s=40) (R = s + g = 48, C = 20
    at max_len 200) at positions crossing the first core token (t = 47), ring wraps and the
    last position; the reference's masks from the SPEC oracle (`tests/visibility_oracle`)."""
    from tests import visibility_oracle as oracle
    pattern = blocks.CCA(8, 40)
    ring, num_slots = blocks.ring_size(pattern, 200), pattern.max_slots(200)
    assert (ring, num_slots) == (48, 20)
    for i, positions in enumerate([[0, 46, 47, 48], [95, 96, 150, 199]]):
        t = np.asarray(positions)
        bounds = blocks.decode_bounds(pattern, t, ring, num_slots)
        _check_interpreted(bounds, b=4, masks=oracle.cache_masks(pattern, t, ring, num_slots),
                           seed=10 + i, block=64, splits=2)


# ---- CPU: the backend's decode entry ---------------------------------------------------------

def _backend_case(hq, hkv, dtype, seed=0, d=64):
    """A stacked two-layer cache of CCA(8, 40) at max_len 200 (R = 48, C = 20), as a `KVCache`
    holds it, and positions crossing the first core token and ring wraps."""
    pattern = blocks.CCA(8, 40)
    ring, num_slots = blocks.ring_size(pattern, 200), pattern.max_slots(200)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    positions = jnp.asarray([0, 47, 96, 199], jnp.int32)
    q = normal(4, hq, d)
    k, v = normal(2, 4, ring, hkv, d), normal(2, 4, ring, hkv, d)
    ck, cv = normal(2, 4, num_slots, hq, d), normal(2, 4, num_slots, hq, d)
    return (q, k, v, ck, cv, 1, pattern, positions)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 128), (4, 2, 96), (6, 2, 64)],
                         ids=["d128g1", "d96", "g3"])
def test_backend_decode_runs_the_mosaic_kernel_and_borrows_triton_only_for_refusals(
        monkeypatch, hq, hkv, d):
    """`mosaic_gpu`'s decode entry (a model's decode steps and a prefill's last-layer rows)
    runs the Mosaic kernel wherever it takes the cache, while JAX still has the Triton
    lowering: within bf16 rounding of the Triton kernel, and a default run on Hopper then
    lowers no Triton kernel. A cache it refuses (G = 32 at block 128) goes to the Triton
    kernel, bit for bit."""
    from cca_jax.attention.pallas_gpu import PALLAS_GPU
    from cca_jax.attention.pallas_mosaic_gpu import MOSAIC_GPU
    from pallas_kernels.mosaic_gpu import decode as mosaic_decode

    calls = []
    real = mosaic_decode.decode_attention_mosaic_gpu
    monkeypatch.setattr(mosaic_decode, "decode_attention_mosaic_gpu",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = _backend_case(hq, hkv, jnp.bfloat16, seed=2, d=d)
    assert decode_refusal(jnp.bfloat16, d, hq, hkv) is None
    own = np.asarray(MOSAIC_GPU.decode(*args), np.float32)
    assert calls
    triton = np.asarray(PALLAS_GPU.decode(*args), np.float32)
    assert not np.array_equal(own, triton)      # another kernel: other rounding
    assert row_errors(own, triton).max() <= 2 * _tol(jnp.bfloat16, d)
    calls.clear()
    wide = _backend_case(32, 1, jnp.bfloat16, seed=1)
    assert decode_refusal(jnp.bfloat16, 64, 32, 1) is not None
    np.testing.assert_array_equal(np.asarray(MOSAIC_GPU.decode(*wide), np.float32),
                                  np.asarray(PALLAS_GPU.decode(*wide), np.float32))
    assert not calls


def test_backend_decode_without_triton_runs_its_own_kernel_and_names_what_it_refuses(
        monkeypatch):
    """Without the Triton lowering, `mosaic_gpu`'s decode entry (what a model's decode step
    calls) runs the Mosaic kernel (against XLA's dense-mask decode); a cache it refuses
    (G = 32 query heads per KV head; a float32 cache) gets an error that names both
    refusals and the fix, not a silent fallback."""
    from cca_jax.attention import pallas_gpu
    from cca_jax.attention.pallas_mosaic_gpu import MOSAIC_GPU
    from cca_jax.attention.xla import XLA
    from pallas_kernels.mosaic_gpu import decode as mosaic_decode

    monkeypatch.setattr(pallas_gpu, "triton_lowering_available", lambda: False)
    calls = []
    real = mosaic_decode.decode_attention_mosaic_gpu
    monkeypatch.setattr(mosaic_decode, "decode_attention_mosaic_gpu",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = _backend_case(4, 2, jnp.bfloat16)
    out = MOSAIC_GPU.decode(*args)
    assert calls and out.dtype == jnp.bfloat16 and out.shape == (4, 4, 64)
    up = [a.astype(jnp.float32) if hasattr(a, "dtype") and a.dtype == jnp.bfloat16 else a
          for a in args]
    with jax.default_matmul_precision("highest"):
        ref = XLA.decode(*up)
    err = row_errors(out, ref)
    assert err.max() <= _tol(jnp.bfloat16, 64), err.max()

    for hq, hkv, dtype, says in [(32, 1, jnp.bfloat16, "block / G"),
                                 (4, 2, jnp.float32, "float32")]:
        with pytest.raises(ValueError, match="implementation='xla'") as caught:
            MOSAIC_GPU.decode(*_backend_case(hq, hkv, dtype, seed=1))
        assert says in str(caught.value)


# ---- CPU: cross-lowering for "cuda" ----------------------------------------------------------

def _lowered_text(b, hq, hkv, d, ring, num_slots, dtype, layers=None, **tiling):
    lead = () if layers is None else (layers,)
    dtype = jnp.dtype(dtype)
    q = S((b, hq, d), dtype)
    kv = S(lead + (b, ring, hkv, d), dtype)
    slots = S(lead + (b, num_slots, hq, d), dtype)
    if tiling.get("slot_layout") == "bhcd":
        slots = S(lead + (b, hq, num_slots, d), dtype)
    row = S((b,), jnp.int32)

    def f(q, k, v, ck, cv, first, count, n, layer):
        return decode_attention_mosaic_gpu(q, k, v, ck, cv, DecodeBounds(first, count, n),
                                           layer=None if layers is None else layer,
                                           out_dtype=q.dtype, **tiling)
    return jax.jit(f).trace(q, kv, kv, slots, slots, row, row, row,
                            S((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("b,hq,hkv,d,dtype,layers,tiling", [
    (4, 32, 8, 128, "bfloat16", 32, {}),                          # 7B GQA, stacked
    (1, 32, 32, 128, "bfloat16", None, dict(block=64, stages=4)),  # MHA, unstacked
    (2, 8, 2, 64, "float16", 4, dict(block=256, splits=3, slot_layout="bhcd")),
    (2, 16, 1, 128, "bfloat16", None, dict(block=128, stages=3)),  # MQA: 8 slots a head
    (1, 32, 32, 128, "bfloat16", 32, dict(stages=3, early_keys=True)),  # keys copied early
    (4, 32, 8, 128, "bfloat16", 32, dict(edge_masks_only=True)),  # masks on edge blocks only
    (1, 32, 32, 128, "bfloat16", 32, dict(edge_masks_only=True, stages=3, early_keys=True)),
    (1, 32, 32, 128, "bfloat16", 32, dict(keys_along_rows=True)),    # keys along M
    (4, 32, 8, 128, "bfloat16", 32, dict(keys_along_rows=True, edge_masks_only=True)),
    (2, 28, 4, 256, "bfloat16", 4, dict(keys_along_rows=True)),     # G = 7, D = 256
    (2, 8, 1, 64, "float16", None, dict(keys_along_rows=True, block=128)),
    (2, 16, 2, 256, "bfloat16", 4, {}),                          # D = 256: 64-key steps
    (2, 16, 2, 96, "bfloat16", 4, {}),                           # 64-byte swizzle
    (2, 8, 1, 80, "float16", None, {}),                          # 32-byte swizzle
    (2, 28, 4, 128, "bfloat16", 4, {}),                          # G = 7: 8 lanes
    (1, 9, 3, 64, "bfloat16", None, dict(block=64)),             # G = 3: 4 lanes
])
def test_lowers_for_cuda(b, hq, hkv, d, dtype, layers, tiling):
    """R = 1040, C = 8192 (the 7B cache at 128K): one Mosaic GPU kernel, named for
    profiles, no Triton one."""
    text = _lowered_text(b, hq, hkv, d, 1040, 8192, dtype, layers, **tiling)
    assert text.count("mosaic_gpu_v2(") == 1 and "cca_decode_mosaic_gpu" in text
    assert "xla.gpu.triton" not in text


def test_lowers_for_cuda_with_tiny_and_empty_caches():
    """A ring and slots smaller than a block (zero-padded), C = 0, and (float16 MQA, G = 8:
    16 slots a head per step) a ring and slot count above a block but not whole 8-row
    tiles (padded; the H200 refused C = 20 at G = 8 before)."""
    for num_slots in (5, 0):
        text = _lowered_text(2, 4, 2, 64, 20, num_slots, "bfloat16", 2)
        assert text.count("mosaic_gpu_v2(") == 1
    for layout in ("bchd", "bhcd"):
        text = _lowered_text(2, 8, 1, 64, 1037, 20, "float16", 2, slot_layout=layout)
        assert text.count("mosaic_gpu_v2(") == 1


def test_a_cache_of_whole_slot_tiles_is_read_in_place():
    """The 7B cache at 128K (stacked, 32 layers): a `KVCache`'s slots come in whole 8-row
    tiles (`kv_cache.slot_capacity`), and the kernel reads them in place. A ragged slot count
    (8132: what `max_slots` gives for max_len 131136) makes XLA pad (copy) both stacked slot arrays
    on every step (2.9 ms of a 9.3 ms step on an H100)."""
    from cca_jax.blocks import CCA
    from cca_jax.kv_cache import slot_capacity

    def stacked_pads(num_slots):
        text = _lowered_text(1, 32, 32, 128, 1040, num_slots, "bfloat16", 32)
        return [line for line in text.splitlines()
                if "stablehlo.pad" in line and f"tensor<32x1x{num_slots}x32x128x" in line]
    assert CCA(16, 1024).max_slots(131136) == 8132
    assert stacked_pads(8132)          # (one padding function, called for ck and cv)
    assert stacked_pads(slot_capacity(CCA(16, 1024), 131136)) == []


# ---- CPU: configuration and argument errors ---------------------------------------------

@pytest.mark.parametrize("batch, kv_heads, slots_at_once, expected", [
    (8, 32, 132, 2),     # 256 programs: 1 split and 2 both take 2 waves; 2 for idle rows
    (16, 32, 132, 2),
    (1, 32, 132, 4),     # 32 programs: 4 splits fill one wave
    (1, 8, 132, 16),
    (64, 32, 132, 1),    # 2048 programs: one split a row is all the cap allows
])
def test_splits_fill_the_gpu_and_leave_busy_rows_two_at_least(batch, kv_heads, slots_at_once,
                                                              expected):
    """The 7B cache at 128K (R 1040, C 8128): whole waves of programs, at least 2 splits
    where a row's steps allow it, the config's own count when it sets one."""
    cfg = decode_config(groups=32 // kv_heads)
    assert resolve_splits(cfg, batch, kv_heads, 1040, 8128, 32 // kv_heads,
                          slots_at_once) == expected
    fixed = decode_config(groups=32 // kv_heads, splits=1)
    assert resolve_splits(fixed, batch, kv_heads, 1040, 8128, 32 // kv_heads,
                          slots_at_once) == 1
    tiny = decode_config(groups=32 // kv_heads)   # a cache of one step a row: one split
    assert resolve_splits(tiny, batch, kv_heads, 0, 0, 32 // kv_heads, slots_at_once) == 1


def test_config_defaults_fit_shared_memory():
    cfg = decode_config()
    assert cfg == MosaicDecodeConfig() and decode_config(block=None) == cfg
    # G = 2..4 at D <= 128: 64-key steps in 4 stages (the H200 sweep); explicit settings win
    assert decode_config(groups=4)[:2] == (64, 4) == decode_config(head_dim=64, groups=2)[:2]
    assert decode_config(groups=8) == cfg
    assert decode_config(groups=4, block=128)[:2] == (128, 2)     # the pair, or neither
    assert decode_config(head_dim=256, groups=4).stages == cfg.stages
    for d in (64, 128):
        assert shared_memory_bytes(cfg, d) <= SMEM_LIMIT_BYTES
    assert shared_memory_bytes(cfg, 256) > SMEM_LIMIT_BYTES     # hence D = 256's default
    wide = decode_config(head_dim=256)
    assert wide.block == 64 and shared_memory_bytes(wide, 256) <= SMEM_LIMIT_BYTES
    assert decode_config(head_dim=256, block=128).block == 128  # explicit settings win


def test_keys_along_rows_refuses_what_it_cannot_tile():
    """D along wgmma's M must be a multiple of 64, and G at most 16 (its N)."""
    assert decode_refusal(jnp.bfloat16, 128, 32, 2, keys_along_rows=True) is None
    assert "multiple of 64" in decode_refusal(jnp.bfloat16, 96, 32, 8, keys_along_rows=True)
    assert "at most 16" in decode_refusal(jnp.bfloat16, 64, 64, 2, block=256,
                                          keys_along_rows=True)


@pytest.mark.parametrize("fields,match", [
    (dict(block=48), "block must be one of"),
    (dict(block=32), "block must be one of"),
    (dict(block=True), "block must be one of"),
    (dict(stages=1), "stages must be from 2 to 8"),
    (dict(stages=2.0), "stages must be a positive int"),
    (dict(splits=0), "splits must be a positive int"),
    (dict(slot_layout="cbhd"), "slot_layout must be one of"),
    (dict(early_keys=1), "early_keys must be True or False"),
    (dict(edge_masks_only="yes"), "edge_masks_only must be True or False"),
    (dict(keys_along_rows=0), "keys_along_rows must be True or False"),
    (dict(block_q=64), "unknown Mosaic GPU decode setting 'block_q'"),
])
def test_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        decode_config(**fields)


def _small(b=2, hq=4, hkv=2, d=64, ring=48, num_slots=20, dtype=jnp.bfloat16):
    q = jnp.zeros((b, hq, d), dtype)
    kv = jnp.zeros((b, ring, hkv, d), dtype)
    slots = jnp.zeros((b, num_slots, hq, d), dtype)
    bounds = DecodeBounds(*(jnp.zeros((b,), jnp.int32) for _ in range(3)))
    return q, kv, kv, slots, slots, bounds


def test_input_errors_name_the_fix():
    call = decode_attention_mosaic_gpu
    q, k, v, ck, cv, bounds = _small()
    with pytest.raises(ValueError, match="head_dim in .*implementation='pallas_gpu' or 'xla'"):
        call(*_small(d=72))
    with pytest.raises(ValueError, match="shared memory.*lower stages or block"):
        call(*_small(d=256), block=128)
    with pytest.raises(ValueError, match="bfloat16 or float16.*'pallas_gpu'"):
        call(*_small(dtype=jnp.float32))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        call(q[:, :3], k, v, ck[:, :, :3], cv[:, :, :3], bounds)
    with pytest.raises(ValueError, match="ck and cv"):
        call(q, k, v, ck[:, :, :2], cv[:, :, :2], bounds)
    with pytest.raises(ValueError, match="ring_count"):
        call(q, k, v, ck, cv, bounds._replace(ring_count=bounds.ring_count[:1]))
    with pytest.raises(ValueError, match="bounds must be"):
        call(q, k, v, ck, cv, bounds[:2])
    with pytest.raises(ValueError, match="layer="):
        call(q, k, v, ck, cv, bounds, layer=0)
    with pytest.raises(ValueError, match="shared memory.*lower stages or block"):
        call(q, k, v, ck, cv, bounds, block=256, stages=4)
    with pytest.raises(ValueError, match=r"block / G must be a multiple of 8, G rounded up "
                                         r"to 16\); use block in \[128, 256\]"):
        call(*_small(hq=16, hkv=1), block=64)    # G = 16: 4 slots of a head per step


def test_decode_refusal_says_why():
    assert decode_refusal(jnp.bfloat16, 128, 32, 8) is None
    assert decode_refusal(jnp.float16, 64, 32, 32) is None
    assert "float32" in decode_refusal(jnp.float32, 128, 32, 8)
    assert "head_dim" in decode_refusal(jnp.bfloat16, 72, 32, 8)
    assert decode_refusal(jnp.bfloat16, 80, 32, 8) is None
    assert decode_refusal(jnp.bfloat16, 256, 32, 8) is None                # G = 4, block 64
    assert "block / G" in decode_refusal(jnp.bfloat16, 256, 32, 2)        # G = 16 at 64
    assert "multiple of Hkv" in decode_refusal(jnp.bfloat16, 128, 12, 8)
    assert "block / G" in decode_refusal(jnp.bfloat16, 128, 32, 1)        # G = 32
    assert decode_refusal(jnp.bfloat16, 128, 28, 4) is None               # G = 7: 8 lanes
    assert decode_refusal(jnp.bfloat16, 64, 9, 3) is None                 # G = 3: 4 lanes
    assert "shared memory" in decode_refusal(jnp.bfloat16, 128, 32, 1, block=256)
    assert decode_refusal(jnp.bfloat16, 64, 32, 1, block=256) is None


# ---- on a Hopper GPU ----------------------------------------------------------------------

def _hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")

GPU_PATTERN = blocks.CCA(16, 1024)      # R = 1040; C = 8192 at 128K
GPU_MAX_LEN = 131072
# s + g - 2 (no core token yet), s + g - 1 (the first), ring wraps, and the last position
# (every slot seen): 4 rows of the 7B shape each.
GPU_POSITIONS = [[1038, 1039, 2079, 2080], [3119, 50000, 100001, GPU_MAX_LEN - 1]]


def _gpu_case(hkv, positions, layers, seed):
    ring = blocks.ring_size(GPU_PATTERN, GPU_MAX_LEN)
    num_slots = GPU_PATTERN.max_slots(GPU_MAX_LEN)
    b, hq, d = len(positions), 32, 128
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)

    def bf(key, shape):
        return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    q = bf(ks[0], (b, hq, d))
    k, v = (bf(x, (layers, b, ring, hkv, d)) for x in ks[1:3])
    ck, cv = (bf(x, (layers, b, num_slots, hq, d)) for x in ks[3:5])
    t = np.asarray(positions)
    bounds = blocks.decode_bounds(GPU_PATTERN, jnp.asarray(t, jnp.int32), ring, num_slots)
    return (q, k, v, ck, cv), bounds, (ring, num_slots)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("hkv", [8, 32], ids=["gqa", "mha"])
@pytest.mark.parametrize("tiling", [{}, dict(block=64, stages=4), dict(splits=1),
                                    dict(stages=3, early_keys=True),
                                    dict(edge_masks_only=True),
                                    dict(block=64, stages=4, edge_masks_only=True),
                                    dict(keys_along_rows=True),
                                    dict(keys_along_rows=True, edge_masks_only=True, stages=3)],
                         ids=["default", "block64_stages4", "one_split", "early_keys",
                              "edge_masks_only", "block64_stages4_edge_masks_only",
                              "keys_along_rows", "keys_along_rows_edge_masks_stages3"])
def test_gpu_matches_float64_and_triton(hkv, tiling):
    """7B per-layer call at 128K: Hq = 32, D = 128, R = 1040, C = 8192, stacked cache of 2
    layers read at layer 1, bf16; each row and query head within 2e-3 of float64 and 4e-3 of
    the Triton decode kernel (relative to its norm; each rounds its probabilities to bf16)."""
    from pallas_kernels.gpu import decode_attention_pallas_gpu
    layer = 1
    for i, positions in enumerate(GPU_POSITIONS):
        (q, k, v, ck, cv), bounds, (ring, num_slots) = _gpu_case(hkv, positions, 2, seed=i)
        run = jax.jit(lambda *a: decode_attention_mosaic_gpu(*a, layer=layer, **tiling))
        out = run(q, k, v, ck, cv, bounds)
        assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
        masks = contract_masks(bounds, ring, num_slots)
        ref = reference(q, k[layer], v[layer], ck[layer], cv[layer], *masks)
        triton = jax.jit(lambda *a: decode_attention_pallas_gpu(*a, layer=layer))(
            q, k, v, ck, cv, bounds)
        err, vs_triton = row_errors(out, ref).max(), row_errors(out, triton).max()
        print(f"hkv={hkv} {tiling} t={positions}: row error vs float64 {err:.2e}, "
              f"vs Triton {vs_triton:.2e} (Triton vs float64 "
              f"{row_errors(triton, ref).max():.2e})")
        assert err <= ROW_TOL["bfloat16"], err
        assert vs_triton <= 2 * ROW_TOL["bfloat16"], vs_triton   # both round P to bf16


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype,d,hq,hkv", [
    ("bfloat16", 128, 8, 2), ("float16", 64, 8, 1), ("bfloat16", 256, 8, 2),
    ("bfloat16", 96, 8, 2), ("float16", 80, 8, 1), ("bfloat16", 128, 14, 2)])
def test_gpu_small_cache_head_major_slots_model_dtype_out(dtype, d, hq, hkv):
    """Tiny and ragged caches compiled (R = 48 and C = 20 zero-padded up to a block), slots
    `[L, B, Hq, C, D]`, output in the cache dtype; bf16 GQA at D = 128, 256 (64-key steps)
    and 96, float16 MQA at D = 64 and 80 (G = 8), and G = 7 (a spare lane)."""
    row_bounds = ([40, 5], [20, 7], [20, 9])
    dtype = jnp.dtype(dtype)
    q, k, v, ck, cv = _case(2, hq, hkv, d, 48, 20, dtype, 0, layers=2)
    raw, slot = contract_masks(row_bounds, 48, 20)
    ref = reference(q, k[1], v[1], ck[1], cv[1], raw, slot)
    ck, cv = (np.swapaxes(x, -3, -2) for x in (ck, cv))
    bounds = DecodeBounds(*(jnp.asarray(x, jnp.int32) for x in row_bounds))
    out = decode_attention_mosaic_gpu(*(jnp.asarray(x, dtype) for x in (q, k, v, ck, cv)),
                                      bounds, layer=1, slot_layout="bhcd", out_dtype=dtype)
    err = row_errors(out, ref).max()
    print(f"small cache, bhcd, {dtype.name} D={d} G={hq // hkv}: row error vs float64 "
          f"{err:.2e}")
    # the output's own rounding to the cache dtype adds up to half an ulp of the row
    assert out.dtype == dtype and err <= 2 * _tol(dtype, d), err
