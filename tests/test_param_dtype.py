"""--param-dtype: float32 master parameters with bfloat16 activations keep small updates.

bfloat16 has 8 bits of mantissa: an AdamW step of lr 1e-5 on a weight of about 0.05 is below
half its spacing and rounds away. A float32 parameter keeps it; the activations still run in
--dtype.
"""

from __future__ import annotations

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from train import step as steps
from train.config import TrainConfig, parse_args

SEQ = 32


def _changed_fraction(param_dtype: str) -> float:
    cfg = TrainConfig(out="unused", preset="tiny", seq_len=SEQ, lr=1e-5, warmup_steps=0,
                      dtype="bfloat16", param_dtype=param_dtype, trainable="qkv")
    model_cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=SEQ, remat="none",
                            attention=dict(kind="cca", group_size=4, window_size=8,
                                           implementation="xla"))
    model_cfg = model_cfg.replace(dtype="bfloat16", **cfg.model_overrides())
    model = LlamaForCausalLM(model_cfg, rngs=nnx.Rngs(0))
    graphdef, model_state = nnx.split(model)
    tx = steps.make_optimizer(cfg)
    state = steps.init_state(steps.params_of(model), cfg, tx)
    before = steps.flatten(state.trainable)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (1, 1, SEQ + 1)).astype(np.int32)
    batch = dict(input_ids=ids[..., :-1], targets=ids[..., 1:],
                 segment_ids=np.ones((1, 1, SEQ), np.int32),
                 positions=np.arange(SEQ, dtype=np.int32)[None, None],
                 loss_mask=np.ones((1, 1, SEQ), np.float32))
    step = jax.jit(steps.make_train_step(steps.model_apply(graphdef, model_state), cfg, tx))
    state, _ = step(state, batch)
    after = steps.flatten(state.trainable)
    assert all(x.dtype == jnp.dtype(param_dtype) for x in after.values())
    changed = sum(int(jnp.sum(after[k] != before[k])) for k in before)
    return changed / sum(x.size for x in before.values())


@pytest.mark.slow   # ~40 s: two short training runs
def test_float32_parameters_keep_the_updates_bfloat16_rounds_away():
    kept = _changed_fraction("float32")
    rounded = _changed_fraction("bfloat16")
    assert kept > 0.9, kept
    assert rounded < 0.5 * kept, (rounded, kept)


def test_param_dtype_flag_reaches_the_model():
    cfg = parse_args(["--out", "x", "--preset", "tiny", "--param-dtype", "float32",
                      "--dtype", "bfloat16"])
    assert cfg.param_dtype == "float32"
    assert cfg.model_overrides()["param_dtype"] == "float32"
    assert "param_dtype" not in TrainConfig(out="x", preset="tiny").model_overrides()
