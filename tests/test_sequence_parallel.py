"""Sequence-sharded attention (halo ppermute + all-gathered slots) against one device.

`sequence_sharded_attention` must compute exactly `run_attention(..., implementation="xla")`:
outputs and q/k/v gradients, for cca (G > 1, s not a multiple of g, chunks not a multiple of
g), sliding and streaming, unpacked and packed (documents crossing shard boundaries, an id
reused), on meshes {sequence: 4}, {sequence: 8}, {data: 2, sequence: 4}, zigzag on and off.
The default run covers every option, mesh, packing and split at least once; the full product
is @slow. The compiled HLO of one case shows no collective larger than the slots, the halos
or the segment ids: no all-gather (or ring) of the full K/V.

Speed: compiling dominates (2-6 s per sharded forward + backward on CPU); every case compiles
one program for the sharded output and gradients and shares its reference program.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax import parse_option, run_attention
from cca_jax.attention.sequence_parallel import (sequence_layout, sequence_sharded_attention,
                                                 zigzag_permutation)
from cca_jax.sharding import make_mesh

B, L, HQ, HKV, D = 2, 192, 4, 2, 8     # G = 2; L / 16 chunks = 12 rows
PATTERNS = {
    "cca": parse_option("cca", group_size=3, window_size=7),      # s % g != 0; halo 8
    "cca-g5": parse_option("cca", group_size=5, window_size=4),   # chunks of 12, 24, 48
    "sliding": parse_option("sliding", window_size=7),
    "streaming": parse_option("streaming", window_size=7, sink_tokens=3),
}
MESHES = {"seq4": {"sequence": 4}, "seq8": {"sequence": 8},
          "data2-seq4": {"data": 2, "sequence": 4}}

# float32, sharded vs single-device xla, over the 48 cases of the full product (CPU, jax
# 0.10.2): measured max |err| 4.8e-7 on outputs (|out| <= ~3) and 1.5e-6 on gradients
# (|grad| <= ~7); only the order of the blocks' sums differs. Tolerances 5e-6 / 2e-5: about
# 10x margin.
OUT_ATOL = 5e-6
GRAD_ATOL = 2e-5


def _segments() -> np.ndarray:
    """Row 0: documents 0 | 1 | 0 | 2 (id 0 reused); row 1: 5 | 3 | 5. Boundaries 50, 87,
    150 and 20, 130 cross the shard boundaries (multiples of 12, 24, 48) and fall inside
    chunks; every document but one is longer than the windows, so all have slots."""
    seg = np.zeros((B, L), np.int32)
    seg[0, 50:87], seg[0, 150:] = 1, 2
    seg[1, :20], seg[1, 20:130], seg[1, 130:] = 5, 3, 5
    return seg


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, cot = (jnp.asarray(rng.standard_normal((B, L, h, D)), jnp.float32)
                    for h in (HQ, HKV, HKV, HQ))
    return q, k, v, cot


@functools.lru_cache(maxsize=None)
def _mesh(name):
    shape = MESHES[name]
    return make_mesh(shape, devices=jax.devices()[:int(np.prod(list(shape.values())))])


def _out_and_grads(attend, q, k, v, cot, seg):
    def loss(q, k, v):
        out = attend(q, k, v, seg)
        return jnp.sum(out * cot), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@functools.lru_cache(maxsize=None)
def _reference_fn(pattern_name):
    pattern = PATTERNS[pattern_name]
    attend = lambda q, k, v, seg: run_attention(  # noqa: E731
        q, k, v, pattern, implementation="xla", segment_ids=seg)
    return jax.jit(functools.partial(_out_and_grads, attend))


@functools.lru_cache(maxsize=None)
def _reference(pattern_name, packed):
    q, k, v, cot = _inputs()
    seg = jnp.asarray(_segments()) if packed else None
    return jax.device_get(_reference_fn(pattern_name)(q, k, v, cot, seg))


def _sharded_fn(pattern_name, mesh_name, zigzag):
    pattern, mesh = PATTERNS[pattern_name], _mesh(mesh_name)
    attend = lambda q, k, v, seg: sequence_sharded_attention(  # noqa: E731
        q, k, v, pattern, mesh=mesh, segment_ids=seg, zigzag=zigzag)
    return jax.jit(functools.partial(_out_and_grads, attend))


def _check(pattern_name, mesh_name, packed, zigzag):
    q, k, v, cot = _inputs()
    seg = jnp.asarray(_segments()) if packed else None
    out, grads = jax.device_get(_sharded_fn(pattern_name, mesh_name, zigzag)(q, k, v, cot, seg))
    ref_out, ref_grads = _reference(pattern_name, packed)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=OUT_ATOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=0, atol=GRAD_ATOL, err_msg=f"d{name}")


# (pattern, mesh, packed, zigzag): every option, mesh, packing and split at least once
# (the contiguous split through sliding; every other combination runs in the slow set).
FAST = [
    ("cca", "data2-seq4", True, True),
    ("cca-g5", "seq8", False, True),
    ("sliding", "seq8", True, False),
]
ALL = [(p, m, packed, zz) for p in PATTERNS for m in MESHES for packed in (False, True)
       for zz in (True, False)]


@pytest.mark.parametrize("case", FAST, ids=lambda c: "-".join(map(str, c)))
def test_matches_single_device(case):
    _check(*case)


@pytest.mark.parametrize("kernels", ["pallas_gpu",
                                     pytest.param("pallas_tpu", marks=pytest.mark.slow)])
def test_chunks_through_the_pallas_kernels(kernels):
    """implementation='pallas_gpu' / 'pallas_tpu' (interpreted on CPU): every chunk runs the
    Pallas kernels (per-row bounds, custom VJP; the TPU grid sized by the widest raw window)
    inside the shard_map; output and gradients equal one device's xla attention. Packed rows,
    zigzag on 2 shards (4 chunks of 32 rows, halo 10)."""
    pattern = parse_option("cca", group_size=4, window_size=8)
    rng = np.random.default_rng(3)
    q, k, v, cot = (jnp.asarray(rng.standard_normal((1, 128, h, 64)), jnp.float32)
                    for h in (2, 1, 1, 2))
    seg = jnp.asarray(np.where(np.arange(128) < 45, 1, 2)[None], jnp.int32)
    sharded = jax.jit(functools.partial(_out_and_grads, lambda q, k, v, seg: (
        sequence_sharded_attention(q, k, v, pattern, segment_ids=seg,
                                   mesh=make_mesh({"sequence": 2}, devices=jax.devices()[:2]),
                                   implementation=kernels))))
    single = jax.jit(functools.partial(_out_and_grads, lambda q, k, v, seg: run_attention(
        q, k, v, pattern, implementation="xla", segment_ids=seg)))
    (out, grads), (ref, ref_grads) = (f(q, k, v, cot, seg) for f in (sharded, single))
    np.testing.assert_allclose(out, ref, rtol=0, atol=OUT_ATOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=0, atol=GRAD_ATOL, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in ALL if c not in FAST],
                         ids=lambda c: "-".join(map(str, c)))
def test_matches_single_device_all(case):
    _check(*case)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"tensor": 2, "sequence": 4}, {"data": 2, "sequence": 4}],
                         ids=["heads-over-tensor", "batch1-replicated-over-data"])
def test_other_mesh_axes(shape):
    """Heads split over `tensor` beside the sequence (GQA groups stay together), and a batch
    of 1 replicated over `data`: outputs and gradients still equal one device's."""
    mesh = make_mesh(shape)
    q, k, v, cot = (x[:1] for x in _inputs())
    seg = jnp.asarray(_segments())[:1]
    attend = lambda q, k, v, s: sequence_sharded_attention(  # noqa: E731
        q, k, v, PATTERNS["cca"], mesh=mesh, segment_ids=s)
    out, grads = jax.jit(functools.partial(_out_and_grads, attend))(q, k, v, cot, seg)
    ref_out, ref_grads = _reference_fn("cca")(q, k, v, cot, seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=0, atol=OUT_ATOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=GRAD_ATOL,
                                   err_msg=f"d{name}")


# ---- no collective of full-K/V size ----------------------------------------------------------

_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast)(-start)?\(")
_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")
_SINGLETONS = re.compile(r"replica_groups=(\{(\{\d+\},?)*\}|\[\d+,1\]<=)")


def _collectives(hlo: str) -> list[tuple[str, int]]:
    """(op, elements of its largest result array) of every collective of an HLO module that
    moves data. Skipped: ops over groups of one device (the transpose of shard_map psums over
    the mesh axes of size 1, e.g. data/fsdp/tensor here; they move nothing)."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match and not _SINGLETONS.search(line):
            sizes = [int(np.prod([int(x) for x in dims.split(",") if x]))
                     for dims in _SHAPE.findall(match.group(1))]
            found.append((match.group(2), max(sizes)))
    return found


def _hlo_case(zigzag):
    """Forward + backward, packed cca (g = 5) on {sequence: 8}; with zigzag the rows are given
    in zigzag order (layout='zigzag': nothing is permuted inside). Checks the results, then
    every collective of the compiled program: the largest ppermute is one halo of k or v, the
    largest all-gather / reduce-scatter the slots (or the segment ids); the full K is larger
    than any of them. (layout='natural' with zigzag adds chunk-sized ppermutes of q, k, v and
    the output to move rows; still no all-gather of K/V.)"""
    pattern, mesh = PATTERNS["cca-g5"], _mesh("seq8")
    perm = zigzag_permutation(L, 8) if zigzag else np.arange(L)
    q, k, v, cot = (x[:, perm] for x in _inputs())
    seg = jnp.asarray(_segments())[:, perm]
    attend = lambda q, k, v, s: sequence_sharded_attention(  # noqa: E731
        q, k, v, pattern, mesh=mesh, segment_ids=s, zigzag=zigzag,
        layout="zigzag" if zigzag else "natural")
    compiled = jax.jit(functools.partial(_out_and_grads, attend)).lower(
        q, k, v, cot, seg).compile()
    out, grads = jax.device_get(compiled(q, k, v, cot, seg))
    ref_out, ref_grads = _reference("cca-g5", True)
    np.testing.assert_allclose(out, ref_out[:, perm], rtol=0, atol=OUT_ATOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r[:, perm], rtol=0, atol=GRAD_ATOL, err_msg=f"d{name}")

    lay = sequence_layout(pattern, L, 8, zigzag=zigzag, packed=True)
    halo = B * lay.halo * HKV * D                                  # one of k, v; one chunk
    slots = B * lay.chunks * lay.capacity * HQ * D                 # all chunks' slots
    full_k = B * L * HKV * D
    ops = _collectives(compiled.as_text())
    assert {op for op, _ in ops} >= {"collective-permute", "all-gather"}, ops
    for op, size in ops:
        if op == "collective-permute":
            assert size <= halo, (op, size, halo)
        else:   # all-gather of slots / segment ids, reduce-scatter or all-reduce of slot grads
            assert size <= max(slots, B * L), (op, size, slots)
    assert max(halo, slots, B * L) < full_k


def test_hlo_zigzag_layout_moves_only_halos_slots_and_segment_ids():
    _hlo_case(zigzag=True)


@pytest.mark.slow
def test_hlo_contiguous_moves_only_halos_slots_and_segment_ids():
    _hlo_case(zigzag=False)


# ---- bad inputs --------------------------------------------------------------------------------

def _call(pattern=PATTERNS["cca"], length=L, mesh="seq4", **kw):
    q, k, v, _ = _inputs()
    q, k, v = q[:, :length], k[:, :length], v[:, :length]
    return sequence_sharded_attention(q, k, v, pattern, mesh=_mesh(mesh), **kw)


@pytest.mark.parametrize("kwargs, message", [
    (dict(axis="seq"), "not an axis of the mesh"),
    (dict(length=188), "not a multiple of the 8 chunks"),                 # zigzag: 2 x 4
    (dict(length=182, zigzag=False), "not a multiple of the 4 chunks"),
    (dict(pattern=parse_option("full")), "ring attention"),
    (dict(pattern=parse_option("sliding", window_size=14), mesh="seq8"),
     "halo would span several neighbours"),                               # 13 > 12 rows
    (dict(pattern=parse_option("cca", group_size=4, window_size=11), mesh="seq8"),
     "halo would span several neighbours"),                               # s + g - 2 = 13
    (dict(layout="zigzag", zigzag=False), "needs zigzag=True"),
    (dict(layout="striped"), "layout must be one of"),
    (dict(pooling="sum"), "pooling must be one of"),
    (dict(mesh=None), "jax.sharding.Mesh"),
])
def test_bad_inputs(kwargs, message):
    if kwargs.get("mesh", "seq4") is None:
        q, k, v, _ = _inputs()
        with pytest.raises(ValueError, match=message):
            sequence_sharded_attention(q, k, v, PATTERNS["cca"], mesh=None)
        return
    with pytest.raises(ValueError, match=message):
        _call(**kwargs)


def test_halo_at_the_limit_is_accepted():
    """s + g - 2 == chunk rows: the halo is exactly the previous chunk (no error)."""
    lay = sequence_layout(parse_option("cca", group_size=4, window_size=10), L, 8)
    assert (lay.halo, lay.chunk) == (12, 12)


def test_bad_arrays():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="segment_ids must be"):
        sequence_sharded_attention(q, k, v, PATTERNS["cca"], mesh=_mesh("seq4"),
                                   segment_ids=jnp.zeros((B, L - 1), jnp.int32))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sequence_sharded_attention(q[:, :, :3], k, v, PATTERNS["cca"], mesh=_mesh("seq4"))


def test_sequence_sharding_splits_bounded_windows_only():
    """`SequenceSharding.splits`: cca, sliding and streaming on an axis of more than one
    device; never full (unbounded window) nor an axis of one; bad axes/layouts refused."""
    from cca_jax.attention import SequenceSharding
    from cca_jax.attention.sequence_parallel import has_bounded_window

    sharded = SequenceSharding(_mesh("seq4"), "sequence", "zigzag")
    for name, pattern in PATTERNS.items():
        assert has_bounded_window(pattern) and sharded.splits(pattern), name
    assert not has_bounded_window(parse_option("full"))
    assert not sharded.splits(parse_option("full"))
    single = SequenceSharding(make_mesh({}, devices=jax.devices()[:1]))
    assert not single.splits(PATTERNS["cca"])
    np.testing.assert_array_equal(sharded.row_order(L), zigzag_permutation(L, 4))
    np.testing.assert_array_equal(SequenceSharding(_mesh("seq4")).row_order(L), np.arange(L))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        SequenceSharding(_mesh("seq4"), "seq")
    with pytest.raises(ValueError, match="layout must be one of"):
        SequenceSharding(_mesh("seq4"), layout="striped")
