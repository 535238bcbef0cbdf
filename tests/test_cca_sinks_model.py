"""CCA with attention sinks (SPEC section 6) through the rest of the library: sequence
sharding on 8 simulated CPU devices, the KV cache (property 6: decode and chunked prefill equal
one forward), the config (old config.json files load as plain CCA) and the CLI flags."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cca_jax.attention import run_attention
from cca_jax.blocks import CCA
from cca_jax.config import CCA_CONFIG_KEY, AttentionConfig, LlamaConfig
from tests.cca_sinks_cases import (
    LOGIT_TOL,
    make_inputs,
    make_segments,
    max_err,
    out_and_grads,
    tiny_model)


# ---- sequence sharding -----------------------------------------------------------------------

def _sharded_case(mesh_shape, packed, zigzag):
    from cca_jax.attention.sequence_parallel import sequence_sharded_attention
    from cca_jax.sharding import make_mesh
    mesh = make_mesh(mesh_shape, devices=jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    pat = CCA(3, 7, 9)                  # N > s; halo s + g - 2 = 8 <= chunks of 12
    q, k, v, ct = make_inputs(2, 192, 4, 2, 8, seed=11)
    seg = jnp.asarray(make_segments(2, 192, (20, 100, 131))) if packed else None
    sharded = jax.jit(out_and_grads(lambda q, k, v: sequence_sharded_attention(
        q, k, v, pat, mesh=mesh, segment_ids=seg, zigzag=zigzag)))
    plain = jax.jit(out_and_grads(lambda q, k, v: run_attention(
        q, k, v, pat, implementation="xla", segment_ids=seg)))
    for got, want in zip(jax.tree.leaves(sharded(q, k, v, ct)),
                         jax.tree.leaves(plain(q, k, v, ct))):
        assert max_err(got, want) < 2e-5


def test_sequence_sharded_with_sinks():
    """8 shards, zigzag, packed rows (documents cross shard boundaries; the sinks of a
    document live on the shard of its start): outputs and gradients equal one device's."""
    _sharded_case({"sequence": 8}, packed=True, zigzag=True)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,packed,zigzag", [
    ({"sequence": 8}, False, True), ({"data": 2, "sequence": 4}, True, False),
    ({"sequence": 4}, False, False)])
def test_sequence_sharded_with_sinks_more_layouts(mesh_shape, packed, zigzag):
    _sharded_case(mesh_shape, packed, zigzag)


# ---- the KV cache: decode and chunked prefill equal one forward (property 6) ---------------


def test_property_6_decode_and_chunked_prefill_equal_one_forward():
    """g = 4, s = 6, N = 3, G = 2; rows of 29, 18 and 24 tokens: prompts of 5, 9 and 0
    tokens prefilled in chunks of 4 then decoded token by token, and every row prefilled in
    chunks of 4 (sinks, groups and windows cross the chunks); logits at every position equal
    one forward of the model (naive attention), both leave the same cache, and its first
    slots hold the sinks' raw keys and values."""
    from flax import nnx

    from cca_jax.decode import decode_step
    from cca_jax.prefill import prefill
    from cca_jax.kv_cache import init_cache
    model = tiny_model(kind="cca", group_size=4, window_size=6, sink_tokens=3)
    cfg = model.config
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 29)).astype(np.int32)
    lengths, prompts = np.array([29, 18, 24]), np.array([5, 9, 0])
    ref = np.asarray(jax.jit(lambda ids: model(ids))(jnp.asarray(ids)))
    cache = init_cache(cfg, 3, 32)
    assert cache.num_slots == 3 + (32 - 3 - 6) // 4 and cache.ring == 10
    cache, _, logits = prefill(model, cache, ids[:, :9], prompts, chunk_size=4,
                               return_all_logits=True)
    for b, n in enumerate(prompts[:2]):       # row 2 has no prompt
        assert max_err(np.asarray(logits)[b, :n], ref[b, :n]) < LOGIT_TOL
    # Row 1 (9 tokens): the ring still holds positions 0 .. 8; slots 0 .. 2 are the sinks'
    # raw (RoPE'd) keys and values, copied per query head (query head h reads KV head h // 2).
    for raw, slot in ((cache.k, cache.ck), (cache.v, cache.cv)):
        sinks = np.repeat(np.asarray(raw[:, 1, :3]), 2, axis=2)
        np.testing.assert_array_equal(np.asarray(slot[:, 1, :3]), sinks)
    state = nnx.split(model)
    for step in range(int((lengths - prompts).max())):
        pos = prompts + step
        active = pos < lengths
        tokens = ids[np.arange(3), np.minimum(pos, 28)]
        out, cache = decode_step(state, cache, jnp.asarray(tokens), jnp.asarray(active))
        for b in np.flatnonzero(active):
            assert max_err(np.asarray(out)[b], ref[b, pos[b]]) < LOGIT_TOL, (b, pos[b])
    whole = init_cache(cfg, 3, 32)
    whole, _, logits = prefill(model, whole, ids, lengths, chunk_size=4,
                               return_all_logits=True)
    for b, n in enumerate(lengths):
        assert max_err(np.asarray(logits)[b, :n], ref[b, :n]) < LOGIT_TOL
    np.testing.assert_array_equal(np.asarray(whole.lengths), lengths)
    for name in ("k", "v", "ck", "cv"):
        assert max_err(getattr(cache, name), getattr(whole, name)) < 1e-5, name


# ---- configuration, config.json and the CLI flags -------------------------------------------

OLD_CCA_RECORD = {"kind": "cca", "group_size": 16, "window_size": 1024, "sink_tokens": 4,
                  "pooling": "cca", "implementation": "auto"}
HF = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_defaults_per_option():
    assert AttentionConfig().sink_tokens == 0 and AttentionConfig().pattern == CCA(16, 1024)
    assert AttentionConfig(kind="streaming").sink_tokens == 4
    assert AttentionConfig(kind="cca", sink_tokens=4).pattern.sink_tokens == 4
    c = LlamaConfig(**HF)
    assert c.replace(attention="streaming").attention.sink_tokens == 4   # its own default
    s8 = c.replace(attention="streaming", sink_tokens=8)
    assert s8.attention.sink_tokens == 8
    assert s8.replace(attention="cca").attention.sink_tokens == 0        # cca's default
    assert s8.replace(window_size=9).attention.sink_tokens == 8          # same option: kept
    sinks = c.replace(sink_tokens=4)
    assert sinks.attention.pattern == CCA(16, 1024, 4)
    assert sinks.replace(attention="cca").attention.sink_tokens == 4
    with pytest.raises(ValueError, match="sink_tokens"):
        c.replace(sink_tokens=-1)


def test_old_cca_config_json_loads_as_plain_cca_and_new_ones_round_trip(tmp_path):
    """A config.json written before sinks applied to cca (no "format", sink_tokens 4 from
    the streaming default) loads with 0 sinks; streaming's 4 stay; a new cca config with
    sinks round-trips through config.json, with the format marker written."""
    old = LlamaConfig.from_hf_dict({**HF, CCA_CONFIG_KEY: OLD_CCA_RECORD})
    assert old.attention.sink_tokens == 0 and old.attention.pattern == CCA(16, 1024)
    old_streaming = LlamaConfig.from_hf_dict(
        {**HF, CCA_CONFIG_KEY: dict(OLD_CCA_RECORD, kind="streaming", sink_tokens=6)})
    assert old_streaming.attention.sink_tokens == 6
    # Overrides (the CLI flags) still apply to an old file.
    assert LlamaConfig.from_hf_dict({**HF, CCA_CONFIG_KEY: OLD_CCA_RECORD},
                                    sink_tokens=4).attention.sink_tokens == 4
    new = LlamaConfig(**HF).replace(sink_tokens=4, group_size=8, window_size=64)
    written = new.to_hf_dict()
    assert written[CCA_CONFIG_KEY]["format"] == 2 and written[CCA_CONFIG_KEY]["sink_tokens"] == 4
    (tmp_path / "config.json").write_text(json.dumps(written))
    back = LlamaConfig.from_pretrained_dir(tmp_path)
    assert back == new and back.attention.pattern == CCA(8, 64, 4)
    plain = LlamaConfig(**HF)
    assert LlamaConfig.from_hf_dict(plain.to_hf_dict()) == plain
    with pytest.raises(ValueError, match="update cca-jax"):
        LlamaConfig.from_hf_dict({**HF, CCA_CONFIG_KEY: dict(OLD_CCA_RECORD, format=99)})


def test_cli_flags_reach_cca():
    """--sink-tokens with --attention cca in generate / eval (shared flags) and
    train.finetune: the model config they build runs CCA with sinks."""
    import argparse

    from cca_jax.cli import add_attention_args, attention_overrides
    from train.config import TrainConfig
    ap = argparse.ArgumentParser()
    add_attention_args(ap)
    a = ap.parse_args(["--attention", "cca", "--group-size", "8", "--sink-tokens", "4"])
    cfg = LlamaConfig(**HF).replace(**attention_overrides(a))
    assert cfg.attention.pattern == CCA(8, 1024, 4)
    plain = LlamaConfig(**HF).replace(**attention_overrides(ap.parse_args(["--attention",
                                                                           "cca"])))
    assert plain.attention.sink_tokens == 0
    train = TrainConfig(out="x", preset="tiny", attention="cca", sink_tokens=4)
    assert LlamaConfig(**HF).replace(**train.model_overrides()).attention.sink_tokens == 4


@pytest.mark.slow
def test_converter_records_sinks(tmp_path):
    """convert.hf_to_flax's settings (what --sink-tokens passes) are recorded in the
    converted config.json and load back."""
    from convert.hf_to_flax import convert_hf_to_flax
    from tests.hf_fixtures import make_tiny_hf
    make_tiny_hf("llama2", tmp_path / "hf")
    out = convert_hf_to_flax(tmp_path / "hf", tmp_path / "ours", attention="cca",
                             group_size=4, window_size=16, sink_tokens=4, verbose=False)
    record = json.loads((out / "config.json").read_text())[CCA_CONFIG_KEY]
    assert record["sink_tokens"] == 4 and record["format"] == 2
    assert (LlamaConfig.from_pretrained_dir(out).attention.pattern == CCA(4, 16, 4))

