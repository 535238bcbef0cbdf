"""Sharded training steps equal one device's; CCA under sequence sharding moves no full K/V.

The trainer's own pieces (`step.sequence_sharding_for`, `step.in_row_order`,
`step.make_grad_fn`, `sharding.tree_shardings`) build the step on each mesh. Loss and
gradients are compared with a single-device step on the same packed rows; with the sequence
split, the model runs the zigzag layout (rows permuted once per batch, halos and slots
exchanged inside attention), which the loss does not see.

Speed: compiling dominates (CPU seconds: ~6 per single-device step, ~11 per sharded one, on
a one-layer model). Each single-device reference compiles once per attention option and
each sharded program once (shared by the equality and the HLO tests).
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cca_jax.checkpoint import restore_params
from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import batch_sharding, make_mesh, mesh_context, tree_shardings
from train import finetune
from train import step as steps
from train.config import TrainConfig
from tests.xla_flags import xla_flags

REPO = Path(__file__).resolve().parents[1]
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

# SEQ equals no model dimension (hidden 64, mlp 80, vocab 101, head_dim 16), so an
# all-gathered array with a SEQ-long axis is an activation (K/V, hidden states), never a
# parameter. sequence=4 zigzag: 8 chunks of 12 rows; halo 7 (cca: s + g - 2 = 5 + 4 - 2;
# sliding / streaming: W - 1 = 5).
SEQ, ACCUM, ROWS = 96, 2, 8
ATTENTION = {
    "cca": dict(kind="cca", group_size=4, window_size=5),      # s not a multiple of g
    "sliding": dict(kind="sliding", window_size=6),
    "streaming": dict(kind="streaming", window_size=6, sink_tokens=2),
    "full": dict(kind="full"),
}


def model_config(kind: str, remat: str = "none") -> LlamaConfig:
    return LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, dtype="float32",
                       param_dtype="float32", max_position_embeddings=SEQ, remat=remat,
                       attention=dict(ATTENTION[kind], implementation="xla"))


def packed_batch(seed=0) -> dict:
    """`[ACCUM, ROWS, SEQ]` packed rows: 3 documents per row at random cuts (crossing chunk
    and shard boundaries), positions restarting per document, ~10% of tokens masked."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 101, (ACCUM, ROWS, SEQ + 1))
    seg = np.zeros((ACCUM, ROWS, SEQ), np.int32)
    pos = np.zeros((ACCUM, ROWS, SEQ), np.int32)
    for a in range(ACCUM):
        for r in range(ROWS):
            cuts = np.sort(rng.choice(np.arange(1, SEQ), 2, replace=False))
            seg[a, r] = np.searchsorted(cuts, np.arange(SEQ), side="right") + 1
            starts = np.concatenate([[0], cuts])
            pos[a, r] = np.arange(SEQ) - starts[seg[a, r] - 1]
    return {"input_ids": ids[..., :-1].astype(np.int32), "targets": ids[..., 1:].astype(np.int32),
            "segment_ids": seg, "positions": pos,
            "loss_mask": (rng.random((ACCUM, ROWS, SEQ)) > 0.1).astype(np.float32)}


def _mesh(shape):
    if shape is None:
        return make_mesh({}, devices=jax.devices()[:1])
    return make_mesh(shape)


def compiled_step(kind: str, mesh_items: tuple | None, remat: str = "none",
                  document_mask: bool = True):
    """(compiled grads program, its (loss, count, grads) on `packed_batch()`), as the trainer
    builds them for this mesh (remat changes no result: tests/test_model.py). Cached."""
    return _compiled_step(kind, mesh_items, remat, document_mask)


@functools.lru_cache(maxsize=None)
def _compiled_step(kind: str, mesh_items: tuple | None, remat: str, document_mask: bool):
    mesh = _mesh(None if mesh_items is None else dict(mesh_items))
    cfg = TrainConfig(out="unused", preset="tiny", seq_len=SEQ, document_mask=document_mask)
    model = LlamaForCausalLM(model_config(kind, remat), rngs=nnx.Rngs(0))
    sequence = steps.sequence_sharding_for(mesh, model.config.attention.pattern)
    model.sequence_sharding = sequence
    graphdef, model_state = nnx.split(model)
    state = steps.init_state(steps.params_of(model), cfg, steps.make_optimizer(cfg))
    shardings = tree_shardings(state, mesh)
    batch_shard = NamedSharding(mesh, PartitionSpec(None, *batch_sharding(mesh).spec))
    fn = jax.jit(steps.make_grad_fn(steps.model_apply(graphdef, model_state), cfg),
                 in_shardings=(shardings, batch_shard))
    state = jax.device_put(state, shardings)
    batch = jax.device_put(steps.in_row_order(packed_batch(), sequence), batch_shard)
    with mesh_context(mesh):   # as the trainer: the model's activation constraints apply
        compiled = fn.lower(state, batch).compile()
    return compiled, jax.device_get(compiled(state, batch))


MESHES = {
    "data2-fsdp2-tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp2-seq4": {"fsdp": 2, "sequence": 4},
    "data2-fsdp2-seq2": {"data": 2, "fsdp": 2, "sequence": 2},
    "tensor2-seq4": {"tensor": 2, "sequence": 4},
    "data2-seq4": {"data": 2, "sequence": 4},
    "seq8": {"sequence": 8},
}


def _items(name):
    return tuple(sorted(MESHES[name].items()))


# float32. Measured (CPU, jax 0.10.2): |loss - loss_1| <= 4.8e-7 (loss ~4.6, i.e. ~1e-7
# relative) and max |grad - grad_1| <= 1e-8 (|grad| up to ~1e-1): only the order of sums
# differs (shards' partial sums, blocks' online softmax). Tolerances: loss rtol 2e-6, grads
# atol 2e-7 + rtol 1e-4: over 10x the measured differences, far below any real error (a
# wrong halo or slot changes gradients by ~1e-3).
LOSS_RTOL, GRAD_ATOL, GRAD_RTOL = 2e-6, 2e-7, 1e-4


@needs_8
@pytest.mark.parametrize("kind,mesh,remat", [
    ("cca", "data2-fsdp2-tensor2", "none"),     # no sequence split: FSDP + tensor + data
    ("cca", "fsdp2-seq4", "none"),              # sequence=4, zigzag, halos + core tokens
    ("cca", "data2-fsdp2-seq2", "full"),        # sequence=2, shard_map under jax.checkpoint
    pytest.param("cca", "fsdp2-seq4", "save_attention",   # kernels' outputs kept, shard_map
                 marks=pytest.mark.slow),
    pytest.param("streaming", "data2-seq4", "none", marks=pytest.mark.slow),  # sinks + halo
    pytest.param("sliding", "tensor2-seq4", "none", marks=pytest.mark.slow),  # heads split
    pytest.param("sliding", "seq8", "none", marks=pytest.mark.slow),     # chunks of 6 rows
    pytest.param("full", "fsdp2-seq4", "none", marks=pytest.mark.slow),  # plain path, XLA
])
def test_sharded_step_equals_single_device(kind, mesh, remat):
    _, (loss1, count1, grads1) = compiled_step(kind, None)
    _, (loss, count, grads) = compiled_step(kind, _items(mesh), remat)
    assert count == count1
    np.testing.assert_allclose(loss, loss1, rtol=LOSS_RTOL)
    flat1 = steps.flatten(grads1)
    for path, g in steps.flatten(grads).items():
        np.testing.assert_allclose(g, flat1[path], atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   err_msg=str(path))


@needs_8
@pytest.mark.slow      # ~16 s; test_train.py checks the same rows on one device by default
def test_rows_across_documents_under_sequence_sharding_equal_single_device():
    """--no-document-mask: positions 0..L-1 follow the zigzag row order; no segment ids."""
    _, (loss1, _, grads1) = compiled_step("cca", None, document_mask=False)
    _, (loss, _, grads) = compiled_step("cca", _items("fsdp2-seq4"), document_mask=False)
    _, (masked, _, _) = compiled_step("cca", None)
    assert abs(loss1 - masked) > 50 * LOSS_RTOL * abs(masked)   # the masks did matter
    np.testing.assert_allclose(loss, loss1, rtol=LOSS_RTOL)
    flat1 = steps.flatten(grads1)
    for path, g in steps.flatten(grads).items():
        np.testing.assert_allclose(g, flat1[path], atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   err_msg=str(path))


# ---- no all-gather of full K/V -----------------------------------------------------------

_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def activation_collectives(hlo: str) -> list[str]:
    """Collectives of a compiled module whose floating-point result has a SEQ-long axis:
    whole-sequence activations (K/V, hidden states) moved between devices."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        for dtype, dims in _ARRAY.findall(match.group(1)):
            shape = [int(x) for x in dims.split(",") if x]
            if dtype.startswith(("f", "bf")) and SEQ in shape:
                found.append(f"{match.group(2)} {dtype}{shape}")
    return found


@needs_8
def test_cca_under_sequence_sharding_gathers_no_full_kv():
    """The compiled forward + backward of cca on {fsdp: 2, sequence: 4} moves only halos,
    slots, segment ids and parameters: no collective returns a float array with a whole
    sequence. (Full attention on the same mesh does: XLA all-gathers K/V, test below.)"""
    compiled, _ = compiled_step("cca", _items("fsdp2-seq4"))
    hlo = compiled.as_text()
    assert "collective-permute" in hlo and "all-gather" in hlo    # halos; slots / segment ids
    assert activation_collectives(hlo) == []


@needs_8
@pytest.mark.slow
def test_full_attention_under_sequence_sharding_gathers_kv():
    """The check above can see a K/V all-gather: full attention (plain path) has one."""
    compiled, _ = compiled_step("full", _items("fsdp2-seq4"))
    assert any(op.startswith("all-gather") for op in activation_collectives(compiled.as_text()))


# ---- the zigzag row order ------------------------------------------------------------------

def test_batches_are_permuted_together_and_loss_mask_follows():
    """Every key moves by the same permutation, so (token, target, position, segment, mask)
    rows stay together; the masked loss sums over the same rows."""
    mesh = make_mesh({"sequence": 4, "fsdp": -1}) if jax.device_count() % 4 == 0 else None
    if mesh is None:
        pytest.skip("needs a device count divisible by 4")
    sharding = steps.sequence_sharding_for(mesh, model_config("cca").attention.pattern)
    batch = packed_batch()
    moved = steps.in_row_order(batch, sharding)
    order = sharding.row_order(SEQ)
    assert sorted(order) == list(range(SEQ)) and not np.array_equal(order, np.arange(SEQ))
    for key in steps.BATCH_KEYS:
        np.testing.assert_array_equal(moved[key], batch[key][..., order])
    assert steps.sequence_sharding_for(mesh, model_config("full").attention.pattern) is None


# ---- several processes -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# cca (window 8, group 4: halo 10) over sequence=8 with 160 tokens: 16 chunks of 10 rows, so
# halos, slots and gradients cross the two processes (devices 0-3 and 4-7 of the mesh).
MULTI_ARGS = ["--preset", "tiny", "--seq-len", "160", "--window-size", "8",
              "--mesh", "sequence=8", "--save-every", "2", "--no-export-hf"]


@needs_8
@pytest.mark.slow      # ~150 s of CPU: one process runs the command, then two processes twice
def test_two_processes_equal_one_and_resume(tmp_path):
    """`python -m train.finetune --coordinator ... --num-processes 2 --process-id I`, on
    localhost with 4 CPU devices each (gloo collectives): stopped after 2 steps and rerun with
    `--steps 4` (each process restores the checkpoint: params, optimizer state, step, data
    position), it logs the losses of one uninterrupted process on 8 devices and exports the
    same parameters."""
    single = tmp_path / "single"
    assert finetune.main(MULTI_ARGS + ["--steps", "4", "--out", str(single)]) == 0
    multi = tmp_path / "multi"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices=4)}
    for total in (2, 4):
        launch = MULTI_ARGS + ["--steps", str(total), "--out", str(multi),
                               "--coordinator", f"localhost:{_free_port()}",
                               "--num-processes", "2"]
        procs = [subprocess.Popen([sys.executable, "-m", "train.finetune", *launch,
                                   "--process-id", str(i)], env=env, cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)

    def losses(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]
    # the same program on the same mesh; only the collectives' transport differs
    assert len(losses(single)) == 4
    np.testing.assert_allclose(losses(multi), losses(single), rtol=1e-6)
    want, got = (steps.flatten(restore_params(out / "final")) for out in (single, multi))
    assert want.keys() == got.keys()
    for key, x in want.items():
        np.testing.assert_allclose(got[key], x, rtol=1e-6, atol=1e-7, err_msg=str(key))
