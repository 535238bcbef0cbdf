"""convert/ and cca_jax.pretrained: HF <-> Flax parity, round trips, stories260K, bad input."""

from __future__ import annotations

import gc
import json
import os
import shutil
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cca_jax  # noqa: E402
from cca_jax.pretrained import (CheckpointReader, LazyArray, restore_params,  # noqa: E402
                                save_tree)
from convert import flax_to_hf, hf_to_flax  # noqa: E402
from convert.flax_to_hf import convert_flax_to_hf  # noqa: E402
from convert.hf_io import ConversionError, open_hf_weights  # noqa: E402
from convert.hf_to_flax import convert_hf_to_flax  # noqa: E402
from tests import hf_fixtures as fx  # noqa: E402

SEQ = 256
TOL = 1e-4


def _hf_tensors(d: Path) -> dict[str, np.ndarray]:
    r = open_hf_weights(d)
    return {n: r.read(n) for n in r.names()}


def _torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _ours(path, ids, **kw) -> np.ndarray:
    model = cca_jax.from_pretrained(path, **kw)
    return np.asarray(model(jnp.asarray(ids)))


def _no_leftovers(parent: Path, name: str) -> None:
    left = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}")]
    assert not left, f"temporary directories left behind: {left}"


# ---- per-family parity and round trip ------------------------------------------------------
CASES = [("llama2", "safetensors"), ("llama3", "sharded"), ("qwen2", "safetensors"),
         ("qwen2_yarn", "bin"), ("mistral", "safetensors")]


@pytest.mark.parametrize("family,fmt", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_family_parity_and_round_trip(tmp_path, family, fmt):
    hf_dir, ours_dir, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    ref_model = fx.make_tiny_hf(family, hf_dir, fmt)
    convert_hf_to_flax(hf_dir, ours_dir, dtype="float32", verbose=False)
    cfg = json.loads((ours_dir / "config.json").read_text())
    src = json.loads((hf_dir / "config.json").read_text())
    assert cfg["model_type"] == src["model_type"] and cfg["cca_attention"]["group_size"] == 16

    ids = np.random.default_rng(0).integers(0, ref_model.config.vocab_size, (2, SEQ))
    ref = _torch_logits(ref_model, ids)
    err_full = np.abs(_ours(ours_dir, ids, attention="full") - ref).max()
    err_cca = np.abs(_ours(ours_dir, ids, attention="cca", group_size=1, window_size=8)
                     - ref).max()
    print(f"\n{family} ({fmt}): max |ours - torch| full={err_full:.2e} cca(g=1)={err_cca:.2e}")
    assert err_full < TOL and err_cca < TOL

    convert_flax_to_hf(ours_dir, back, verbose=False)
    a, b = _hf_tensors(hf_dir), _hf_tensors(back)
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and np.array_equal(a[n].view(np.uint8),
                                                           b[n].view(np.uint8)), n
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded) is type(ref_model)
    assert np.abs(_torch_logits(reloaded, ids) - ref).max() == 0.0


def test_rope_scaling_is_carried(tmp_path):
    """llama3 / yarn settings survive HF -> ours -> HF (a dropped scaling breaks long context)."""
    for family, rope_type in (("llama3", "llama3"), ("qwen2_yarn", "yarn")):
        fx.make_tiny_hf(family, tmp_path / family)
        convert_hf_to_flax(tmp_path / family, tmp_path / f"{family}_o", verbose=False)
        cfg = cca_jax.LlamaConfig.from_pretrained_dir(tmp_path / f"{family}_o")
        assert cfg.rope_scaling.rope_type == rope_type and cfg.rope_scaling.factor > 1
        convert_flax_to_hf(tmp_path / f"{family}_o", tmp_path / f"{family}_b", verbose=False)
        hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / f"{family}_b")
        assert hf_cfg.rope_parameters["rope_type"] == rope_type
    # transformers < 5 / Hub style: rope_theta + rope_scaling instead of rope_parameters.
    c = json.loads((tmp_path / "llama3" / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    (tmp_path / "llama3" / "config.json").write_text(json.dumps(c))
    legacy = cca_jax.LlamaConfig.from_pretrained_dir(tmp_path / "llama3")
    current = cca_jax.LlamaConfig.from_pretrained_dir(tmp_path / "llama3_o")
    assert legacy.rope_scaling == current.rope_scaling and legacy.rope_theta == 500000.0


def test_cca_settings_survive_export_and_reimport(tmp_path):
    fx.make_tiny_hf("mistral", tmp_path / "hf")
    convert_hf_to_flax(tmp_path / "hf", tmp_path / "o", group_size=4, window_size=32,
                       verbose=False)
    convert_flax_to_hf(tmp_path / "o", tmp_path / "b", verbose=False)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["cca_attention"][
        "group_size"] == 4
    convert_hf_to_flax(tmp_path / "b", tmp_path / "o2", verbose=False)
    cfg = cca_jax.LlamaConfig.from_pretrained_dir(tmp_path / "o2")
    assert (cfg.cca.group_size, cfg.cca.window_size, cfg.model_type) == (4, 32, "mistral")
    model = cca_jax.from_pretrained(tmp_path / "o2", group_size=8)
    assert model.config.cca.group_size == 8 and model.config.attention == "cca"


def test_bf16_default_and_bit_exact_round_trip(tmp_path, capsys):
    model = fx.make_tiny_hf("llama3", tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    (tmp_path / "bf16" / "tokenizer.json").write_text('{"version": "1.0"}')
    assert hf_to_flax.main(["--hf", str(tmp_path / "bf16"), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "tensor 1/" in err and "MB/s" in err          # progress output
    leaves = CheckpointReader(tmp_path / "o").leaves()
    assert {np.dtype(m.dtype) for _, m in leaves} == {np.dtype(ml_dtypes.bfloat16)}
    assert flax_to_hf.main(["--ckpt", str(tmp_path / "o"), "--out", str(tmp_path / "b"),
                            "--quiet"]) == 0
    for d in ("o", "b"):   # tokenizer files travel with the weights both ways
        assert (tmp_path / d / "tokenizer.json").read_text() == '{"version": "1.0"}'
    a, b = _hf_tensors(tmp_path / "bf16"), _hf_tensors(tmp_path / "b")
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[n].view(np.uint16), b[n].view(np.uint16)) for n in a)
    # float32 source -> bfloat16 (default): round to nearest even, as torch does.
    convert_hf_to_flax(tmp_path / "f32", tmp_path / "o2", verbose=False)
    emb = restore_params(tmp_path / "o2")["embed_tokens"]["embedding"]
    want = model.model.embed_tokens.weight.to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(emb.view(np.int16), want)


def test_train_state_checkpoint_exports(tmp_path):
    """flax_to_hf reads params nested in a train state (CheckpointManager-like layout)."""
    fx.make_tiny_hf("qwen2", tmp_path / "hf")
    convert_hf_to_flax(tmp_path / "hf", tmp_path / "ours", dtype="float32", verbose=False)
    params = restore_params(tmp_path / "ours")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tmp_path / "ours" / "config.json", run / "config.json")
    state = {"params": params, "step": 7,
             "opt_state": {"mu": jax.tree.map(np.zeros_like, params), "count": np.int32(7)}}
    save_tree(run / "checkpoints" / "7" / "state", state)
    again = restore_params(run / "checkpoints")
    assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
    convert_flax_to_hf(run / "checkpoints", tmp_path / "back", verbose=False)
    a, b = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "back")
    assert all(np.array_equal(a[n], b[n]) for n in a) and sorted(a) == sorted(b)


def test_plain_orbax_train_state_with_nnx_value_leaves(tmp_path):
    """A train state saved by plain orbax (OCDBT) with nnx `{"value": x}` leaves restores."""
    import orbax.checkpoint as ocp
    fx.make_tiny_hf("llama2", tmp_path / "hf")
    convert_hf_to_flax(tmp_path / "hf", tmp_path / "ours", dtype="float32", verbose=False)
    params = restore_params(tmp_path / "ours")
    boxed = jax.tree.map(lambda x: {"value": x}, params)
    ocp.PyTreeCheckpointer().save(tmp_path / "run" / "3" / "default",
                                  {"model": boxed, "opt": {"count": np.int32(3)}})
    shutil.copy(tmp_path / "ours" / "config.json", tmp_path / "run" / "config.json")
    again = restore_params(tmp_path / "run")
    assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
    ids = np.arange(32)[None] % 100
    a = _ours(tmp_path / "ours", ids, attention="full")
    b = _ours(tmp_path / "run", ids, attention="full")
    assert np.array_equal(a, b)


def test_lazy_save_builds_one_leaf_at_a_time(tmp_path):
    alive: list[weakref.ref] = []

    def build(i):
        def f():
            gc.collect()
            assert all(r() is None for r in alive), "previous leaf still alive during build"
            arr = np.full((64, 64), i, np.float32)
            alive.append(weakref.ref(arr))
            return arr
        return f

    tree = {f"p{i}": LazyArray((64, 64), np.float32, build(i)) for i in range(5)}
    save_tree(tmp_path / "ck", tree)
    import orbax.checkpoint as ocp
    out = ocp.PyTreeCheckpointer().restore(tmp_path / "ck")   # a plain orbax checkpoint
    assert all(np.all(out[f"p{i}"] == i) for i in range(5))


# ---- bad input -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "hf"
    fx.make_tiny_hf("llama2", d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _expect_error(hf_dir, out, exc, match, **kw):
    with pytest.raises(exc, match=match):
        convert_hf_to_flax(hf_dir, out, verbose=False, **kw)
    assert not out.exists()
    _no_leftovers(out.parent, out.name)


def test_bad_inputs(tiny_hf, tmp_path):
    out = tmp_path / "out"
    d = _copy(tiny_hf, tmp_path / "noconf")
    (d / "config.json").unlink()
    _expect_error(d, out, FileNotFoundError, "No config.json")

    d = _copy(tiny_hf, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    _expect_error(d, out, FileNotFoundError, "No weights")

    d = _copy(tiny_hf, tmp_path / "trunc")
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    _expect_error(d, out, ConversionError, "truncated")

    d = _copy(tiny_hf, tmp_path / "shape")
    c = json.loads((d / "config.json").read_text())
    c["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(c))
    _expect_error(d, out, ConversionError, "Shape mismatch.*mlp")

    _expect_error(tiny_hf, out, ConversionError, "Unknown dtype 'int8'", dtype="int8")

    d = _copy(tiny_hf, tmp_path / "arch")
    c = json.loads((d / "config.json").read_text())
    c["model_type"], c["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(c))
    _expect_error(d, out, ValueError, r"Unsupported architecture.*gpt2.*'llama', 'mistral'")

    d = _copy(tiny_hf, tmp_path / "sliding")
    c = json.loads((d / "config.json").read_text())
    c["model_type"], c["sliding_window"] = "mistral", 4096
    (d / "config.json").write_text(json.dumps(c))
    _expect_error(d, out, ValueError, "sliding-window")


def test_missing_tensor_and_shard(tmp_path):
    d = tmp_path / "hf"
    fx.make_tiny_hf("llama3", d, "sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (d / shard).unlink()
    _expect_error(d, tmp_path / "o1", ConversionError, "missing")
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(d, tmp_path / "o2", ConversionError, "lacks")


def test_existing_output_refused_unless_force(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert hf_to_flax.main(["--hf", str(tiny_hf), "--out", str(out), "--quiet"]) == 1
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert hf_to_flax.main(["--hf", str(tiny_hf), "--out", str(out), "--quiet", "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "params").is_dir()
    _no_leftovers(tmp_path, "out")
    back = tmp_path / "back"
    back.mkdir()
    assert flax_to_hf.main(["--ckpt", str(out), "--out", str(back), "--quiet"]) == 1
    with pytest.raises(FileNotFoundError, match="convert it first"):
        cca_jax.from_pretrained(tiny_hf)


# ---- stories260K: a real trained checkpoint --------------------------------------------------
@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    if not fx.STORIES.exists():
        pytest.skip(f"{fx.STORIES} not found (shared test data is absent)")
    base = tmp_path_factory.mktemp("stories")
    header = fx.stories260k_to_hf(fx.STORIES, base / "hf")
    convert_hf_to_flax(base / "hf", base / "ours", dtype="float32", verbose=False)
    return base, header


def _greedy(model, length):
    """BOS + greedy continuation to `length` tokens (one jitted fixed-shape causal forward)."""
    fwd = nnx.jit(lambda m, ids: m(ids))
    buf = np.zeros((1, length), np.int32)
    buf[0, 0] = 1
    for t in range(length - 1):
        buf[0, t + 1] = int(np.asarray(fwd(model, jnp.asarray(buf)))[0, t].argmax())
    return buf[0].tolist()


def test_stories260k_fixture_conversion_and_perplexity(stories):
    base, header = stories
    h, w = fx.read_llama2c(fx.STORIES)
    assert (h["dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"]) == (64, 5, 8, 4)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(base / "hf").eval()
    ours = cca_jax.from_pretrained(base / "ours", attention="full")
    text = _greedy(ours, SEQ)                          # BOS + the model's own continuation
    rand = np.random.default_rng(0).integers(0, h["vocab_size"], SEQ).tolist()
    for name, ids in (("greedy", text), ("random", rand)):
        ref = fx.llama2c_forward(h, w, ids)            # llama2.c convention, float64
        hf = _torch_logits(hf_model, [ids])[0]
        me = np.asarray(ours(jnp.asarray([ids])))[0]
        e_fix, e_conv = np.abs(hf - ref).max(), np.abs(me - hf).max()
        print(f"\nstories260K {name}: |HF fixture - llama2.c numpy| = {e_fix:.2e}, "
              f"|ours - HF| = {e_conv:.2e} (max |logit| {np.abs(ref).max():.1f})")
        # float32 noise grows with |logits| (~22 here): on random tokens allow 1e-5 relative.
        tol = TOL if name == "greedy" else 1e-5 * np.abs(ref).max()
        assert e_fix < tol and e_conv < tol
    # The permutation matters: HF with llama2.c's raw (interleaved) wq/wk rows is far off.
    with torch.no_grad():
        for i, layer in enumerate(hf_model.model.layers):
            layer.self_attn.q_proj.weight.copy_(torch.from_numpy(w["wq"][i].copy()))
            layer.self_attn.k_proj.weight.copy_(torch.from_numpy(w["wk"][i].copy()))
    unpermuted = np.abs(_torch_logits(hf_model, [text])[0] - fx.llama2c_forward(h, w, text))
    print(f"stories260K without the wq/wk permutation: {unpermuted.max():.2f}")
    assert unpermuted.max() > 0.1
    logp = jax.nn.log_softmax(jnp.asarray(_ours(base / "ours", [text], attention="cca",
                                                group_size=16, window_size=64))[0], -1)
    nll = -np.mean([float(logp[t - 1, text[t]]) for t in range(1, len(text))])
    logp_full = jax.nn.log_softmax(jnp.asarray(_ours(base / "ours", [text],
                                                     attention="full"))[0], -1)
    nll_full = -np.mean([float(logp_full[t - 1, text[t]]) for t in range(1, len(text))])
    print(f"stories260K perplexity on its greedy continuation ({len(text) - 1} tokens): "
          f"full {np.exp(nll_full):.3f}, cca(g=16, s=64) {np.exp(nll):.3f}")
    assert np.exp(nll_full) < 5.0        # a random model gives hundreds (vocab 512)
