"""train/: exact resume, a run that learns, frozen parameters, bad inputs.

Runs on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS before jax loads). Sharded
steps against one device: tests/test_train_sharded.py.
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

from cca_jax.checkpoint import restore_params
from cca_jax.config import LlamaConfig
from cca_jax.losses import chunked_cross_entropy
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import unnamed_params
from train import finetune
from train import step as steps
from train.config import TrainConfig, parse_args

SEQ = 64


def _model_cfg(kind="cca"):
    return LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, dtype="float32",
                       param_dtype="float32", max_position_embeddings=SEQ,
                       attention=dict(kind=kind, group_size=4, window_size=8,
                                      implementation="xla"))


@functools.lru_cache(maxsize=None)
def _setup(kind: str, trainable: str):
    cfg = TrainConfig(out="unused", preset="tiny", trainable=trainable, seq_len=SEQ)
    model = LlamaForCausalLM(_model_cfg(kind), rngs=nnx.Rngs(0))
    graphdef, model_state = nnx.split(model)
    apply = steps.model_apply(graphdef, model_state)
    tx = steps.make_optimizer(cfg)
    state = steps.init_state(steps.params_of(model), cfg, tx)
    return cfg, apply, state


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


def test_rows_across_documents_are_one_sequence():
    """--no-document-mask: a packed row's loss is that of one unpacked sequence."""
    _, apply, state = _setup("cca", "qkv")
    model = apply(state.trainable, state.frozen)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 101, (2, SEQ + 1)).astype(np.int32)
    seg = np.where(np.arange(SEQ) < 20, 1, 2)[None].repeat(2, 0).astype(np.int32)
    pos = np.where(seg == 1, np.arange(SEQ), np.arange(SEQ) - 20).astype(np.int32)
    batch = dict(input_ids=ids[:, :-1], targets=ids[:, 1:], segment_ids=seg, positions=pos,
                 loss_mask=np.ones((2, SEQ), np.float32))
    one = dict(batch, segment_ids=np.ones_like(seg),
               positions=np.broadcast_to(np.arange(SEQ, dtype=np.int32), seg.shape))
    loss = jax.jit(lambda b, mask: steps.loss_fn(model, b, 16, document_mask=mask)[0],
                   static_argnums=1)
    across = loss(batch, False)
    np.testing.assert_allclose(across, loss(one, True), rtol=1e-6)
    assert abs(across - loss(batch, True)) > 1e-3
    assert parse_args(["--preset", "tiny", "--out", "x", "--no-document-mask"]).document_mask \
        is False


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


TINY_ARGS = ["--preset", "tiny", "--seq-len", "64", "--save-every", "3", "--no-export-hf"]


@pytest.mark.long
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
    # The longer rerun exported again; the first export is kept beside it.
    want, got = (steps.flatten(restore_params(out / "final")) for out in (straight, resumed))
    assert want.keys() == got.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert json.loads((resumed / "final" / "trained_steps.json").read_text()) == {"step": 6}
    assert json.loads((resumed / "final-step3" / "trained_steps.json").read_text()) == {
        "step": 3}
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
    # zigzag cuts rows into 2 x sequence chunks: 68 is a multiple of 4, not of 8
    (["--mesh", "fsdp=2,sequence=4", "--seq-len", "68"], "must be a multiple of 8"),
    # tiny's cca (window 16, group 4) needs an 18-row halo; 64 / 8 = 8-row chunks
    (["--mesh", "fsdp=2,sequence=4", "--seq-len", "64"], "window plus group.*--seq-len >= 144"),
    # full attention stays on the plain path, which needs only a multiple of the axis
    (["--mesh", "fsdp=2,sequence=4", "--seq-len", "66", "--attention", "full"],
     "multiple of the mesh's sequence"),
    (["--coordinator", "localhost:1234"], "--num-processes"),
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
    assert not (tmp_path / "o").exists()      # refused: nothing written


def _tree(path):
    """Every path under `path` with its file bytes (None for a directory); None if absent."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes()
            for p in sorted(path.rglob("*"))}


def _model_dir(path, tiny_tokenizer=True):
    """A directory with a tiny model's config.json and (optionally) a tokenizer: a checkpoint
    as convert.hf_to_flax writes it, but for the parameters."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_model_cfg().to_hf_dict()))
    if tiny_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3},
                                         unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


def _hf_dir(tmp_path):
    from safetensors.numpy import save_file
    path = _model_dir(tmp_path / "hf")
    save_file({"model.embed_tokens.weight": np.zeros((101, 64), np.float32)},
              str(path / "model.safetensors"))
    return ["--checkpoint", str(path)], "looks like a Hugging Face checkpoint.*hf_to_flax"


def _config_only(tmp_path):
    return ["--checkpoint", str(_model_dir(tmp_path / "ckpt"))], "no orbax checkpoint"


def _params_without_model(tmp_path):
    from cca_jax.checkpoint import save_tree
    path = _model_dir(tmp_path / "ckpt")
    save_tree(path / "params", {"opt_state": {"mu": np.zeros(3, np.float32)}})
    return ["--checkpoint", str(path)], "no parameter tree"


def _bad_record(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\nnot json\n')
    return ["--preset", "tiny", "--data", str(data)], "d.jsonl:3 is not a JSON object"


def _bad_mesh(tmp_path):
    return ["--preset", "tiny", "--mesh", "fsdp=3"], "needs 3 devices"


def _other_run(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    other = TrainConfig(out=str(out), preset="tiny", lr=0.5)
    (out / finetune.RUN_CONFIG).write_text(json.dumps(other.to_dict()))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return ["--preset", "tiny"], "different run.*lr"


def _user_files(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("keep me")
    return ["--preset", "tiny"], "not a cca-jax run directory"


@pytest.mark.parametrize("case", [_hf_dir, _config_only, _params_without_model, _bad_record,
                                  _bad_mesh, _other_run, _user_files],
                         ids=lambda f: f.__name__.strip("_"))
def test_refused_run_leaves_out_as_it_was(tmp_path, case, capsys):
    """Every check comes before the first write: a refused command leaves --out absent or
    byte for byte as it was, so the corrected command can use the same --out."""
    args, match = case(tmp_path)
    out = tmp_path / "o"
    before = _tree(out)
    assert finetune.main(args + ["--steps", "1", "--seq-len", "64", "--batch-size", "8",
                                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert _tree(out) == before
    assert re.search(match, err, re.IGNORECASE), err
    assert len(err.strip().splitlines()) == 1, err


def test_out_dir_of_another_run_or_with_user_files_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    # A run refused for a bad input leaves nothing that blocks the corrected command.
    assert finetune.main(TINY_ARGS + ["--steps", "1", "--batch-size", "4",
                                      "--out", str(out)]) == 2
    assert finetune.main(TINY_ARGS + ["--steps", "1", "--out", str(out)]) == 0
    assert finetune.main(TINY_ARGS + ["--steps", "2", "--lr", "0.1", "--out", str(out)]) == 2
    assert "different run" in capsys.readouterr().err
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
