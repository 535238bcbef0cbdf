"""train/: sharded steps equal single-device steps, exact resume, a run that learns, bad inputs.

Runs on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS before jax loads).
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import (batch_sharding, make_mesh, tree_shardings, unnamed_params)
from train import finetune
from train import step as steps
from train.config import TrainConfig, parse_args
from train.step import chunked_cross_entropy

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SEQ = 64


def _model_cfg(kind="cca"):
    return LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, dtype="float32",
                       param_dtype="float32", max_position_embeddings=SEQ,
                       attention=dict(kind=kind, group_size=4, window_size=8,
                                      implementation="xla"))


def _batch(accum=2, b=8, seed=0):
    """Packed rows: documents of random lengths, positions restarting per document."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 101, (accum, b, SEQ + 1))
    seg = np.zeros((accum, b, SEQ), np.int32)
    pos = np.zeros((accum, b, SEQ), np.int32)
    for a in range(accum):
        for r in range(b):
            cuts = np.sort(rng.choice(np.arange(1, SEQ), 2, replace=False))
            seg[a, r] = np.searchsorted(cuts, np.arange(SEQ), side="right") + 1
            starts = np.concatenate([[0], cuts])
            pos[a, r] = np.arange(SEQ) - starts[seg[a, r] - 1]
    return {"input_ids": ids[..., :-1].astype(np.int32), "targets": ids[..., 1:].astype(np.int32),
            "segment_ids": seg, "positions": pos,
            "loss_mask": (rng.random((accum, b, SEQ)) > 0.1).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def _setup(kind: str, trainable: str):
    cfg = TrainConfig(out="unused", preset="tiny", trainable=trainable, seq_len=SEQ)
    model = LlamaForCausalLM(_model_cfg(kind), rngs=nnx.Rngs(0))
    graphdef, model_state = nnx.split(model)
    apply = steps.model_apply(graphdef, model_state)
    tx = steps.make_optimizer(cfg)
    state = steps.init_state(steps.params_of(model), cfg, tx)
    return cfg, apply, state


def _grads_on(mesh_shape, kind="cca", trainable="all"):
    cfg, apply, state = _setup(kind, trainable)
    devices = jax.devices()[:1] if mesh_shape is None else None
    mesh = make_mesh(mesh_shape or {}, devices=devices)
    shard = tree_shardings(state, mesh)
    spec = batch_sharding(mesh).spec
    batch_shard = NamedSharding(mesh, PartitionSpec(None, *spec))
    fn = jax.jit(steps.make_grad_fn(apply, cfg), in_shardings=(shard, batch_shard))
    state = jax.device_put(state, shard)
    return jax.device_get(fn(state, jax.device_put(_batch(), batch_shard)))


@needs_8
@pytest.mark.parametrize("mesh_shape,kind", [
    pytest.param({"fsdp": 8}, "cca", marks=pytest.mark.slow),   # also run by the run tests
    ({"data": 2, "fsdp": 2, "tensor": 2}, "cca"),
    ({"fsdp": 2, "sequence": 4}, "cca"),       # sequence sharding with CCA and packed rows
    pytest.param({"data": 2, "sequence": 4}, "streaming", marks=pytest.mark.slow),
])
def test_sharded_gradients_equal_single_device(mesh_shape, kind):
    loss1, count1, grads1 = _grads_on(None, kind)
    loss, count, grads = _grads_on(mesh_shape, kind)
    assert count == count1
    np.testing.assert_allclose(loss, loss1, rtol=2e-6)
    for path, g in steps.flatten(grads).items():
        # float32; measured max abs difference ~1e-8 (reduction order), tolerance 2e-6
        np.testing.assert_allclose(g, steps.flatten(grads1)[path], atol=2e-6, rtol=1e-4,
                                   err_msg=str(path))


def test_frozen_parameters_get_no_gradient_or_optimizer_state():
    cfg, apply, state = _setup("cca", "qkv")
    trained = steps.flatten(state.trainable)
    assert trained and all(p[-2] in ("q_proj", "k_proj", "v_proj") for p in trained)
    moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in trained.values())
    assert all(x.dtype == jnp.float32 for x in moments)


def test_every_parameter_has_logical_axes():
    model = LlamaForCausalLM(_model_cfg().replace(attention_bias=True, tie_word_embeddings=False))
    assert unnamed_params(steps.params_of(model)) == []


def test_chunked_cross_entropy_equals_dense():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((2, 37, 16)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((16, 50)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, 50, (2, 37)))
    mask = jnp.asarray(rng.random((2, 37)) > 0.3, jnp.float32)
    logits = hidden @ weight
    dense = jnp.sum((jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, tgt[..., None], -1)[..., 0]) * mask)

    def chunked(h, w):
        return chunked_cross_entropy(h, w, tgt, mask, chunk=8)[0]
    np.testing.assert_allclose(chunked(hidden, weight), dense, rtol=1e-6)
    g1 = jax.grad(chunked, argnums=(0, 1))(hidden, weight)
    g2 = jax.grad(lambda h, w: jnp.sum((jax.nn.logsumexp(h @ w, -1) - jnp.take_along_axis(
        h @ w, tgt[..., None], -1)[..., 0]) * mask), argnums=(0, 1))(hidden, weight)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


TINY_ARGS = ["--preset", "tiny", "--seq-len", "64", "--save-every", "3", "--no-export-hf"]


def test_run_learns_resumes_exactly_and_is_deterministic(tmp_path):
    """The README's main job on every device: loss falls; a rerun with more steps resumes
    (params, optimizer, step, data) and reproduces an uninterrupted run step for step."""
    straight = tmp_path / "straight"
    assert finetune.main(TINY_ARGS[:-1] + ["--steps", "6", "--out", str(straight)]) == 0
    resumed = tmp_path / "resumed"
    assert finetune.main(TINY_ARGS + ["--steps", "3", "--out", str(resumed)]) == 0
    assert finetune.main(TINY_ARGS + ["--steps", "6", "--out", str(resumed)]) == 0
    a, b = _losses(straight), _losses(resumed)
    assert len(a) == 6 and a == b, (a, b)
    assert a[-1] < a[0] - 0.5, a
    record = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(record)
    # The end of the run exports a Hugging Face checkpoint that transformers loads.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(straight / "hf")
    assert hf.config.vocab_size == 258


@pytest.mark.parametrize("args,match", [
    (["--mesh", "fsdp=3"], "needs 3 devices"),
    (["--mesh", "tensor=2,rows=4"], "unknown mesh axes|axis=size"),
    (["--batch-size", "4"], "data x fsdp"),
    (["--mesh", "fsdp=2,sequence=4", "--seq-len", "66"], "multiple of the mesh's sequence"),
    (["--data", "/no/such/file.txt"], "no such|does not exist|not found"),
    (["--batch-size", "6", "--grad-accum", "4"], "multiple of --grad-accum"),
])
def test_bad_inputs_fail_before_compute(tmp_path, args, match, capsys):
    if jax.device_count() < 8 and "fsdp=2,sequence=4" in args:
        pytest.skip("needs 8 devices")
    code = finetune.main(["--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "o")]
                         + args)
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(match, err, re.IGNORECASE), err


def test_out_dir_of_another_run_or_with_user_files_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune.main(TINY_ARGS + ["--steps", "1", "--out", str(out)]) == 0
    assert finetune.main(TINY_ARGS + ["--steps", "2", "--lr", "0.1", "--out", str(out)]) == 2
    assert "different run" in capsys.readouterr().err
    # A run refused for a bad input leaves nothing that blocks the corrected command.
    fixed = tmp_path / "fixed"
    assert finetune.main(TINY_ARGS + ["--steps", "1", "--batch-size", "4",
                                      "--out", str(fixed)]) == 2
    assert finetune.main(TINY_ARGS + ["--steps", "1", "--out", str(fixed)]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert finetune.main(TINY_ARGS + ["--steps", "1", "--out", str(mine)]) == 2
    assert (mine / "notes.txt").read_text() == "keep me"


def test_checkpoint_and_preset_are_exclusive_and_config_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        parse_args(["--out", "x"])
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\nseq_len = 32\nlr = 0.01\n')
    cfg = parse_args(["--config", str(toml), "--out", "x", "--lr", "0.02"])
    assert (cfg.seq_len, cfg.lr, cfg.batch_size) == (32, 0.02, 8)
    toml.write_text('preset = "tiny"\nsequence_length = 32\n')
    with pytest.raises(ValueError, match="unknown settings"):
        parse_args(["--config", str(toml), "--out", "x"])
