"""The optimizer recipe as configured, and gradient accumulation equal to one large batch.

* The defaults are the paper's recipe (AdamW, lr 2e-5, 20 warm-up steps from 0 then constant,
  b2 = 0.95, no weight decay, global-norm clipping at 2.0).
* `make_optimizer` follows every field of the config: three steps against AdamW written out
  in numpy (clipping, the warm-up's learning rates, both moments with b1 and b2, bias
  correction, decoupled weight decay), with non-default values so that a field ignored or
  swapped shows.
* `make_grad_fn` / `make_train_step` over `[grad_accum, B / grad_accum, L]` micro-batches
  give the loss, gradients and update of one `[1, B, L]` batch, with loss masks that count
  different numbers of tokens per micro-batch (a mean of per-micro-batch means would not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from train import step as steps
from train.config import TrainConfig


def test_defaults_are_the_papers_recipe():
    cfg = TrainConfig(out="unused", preset="tiny")
    assert (cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.max_grad_norm, cfg.adam_b1,
            cfg.adam_b2) == (2e-5, 20, 0.0, 2.0, 0.9, 0.95)
    schedule = steps.lr_schedule(cfg)
    assert [float(schedule(i)) for i in (0, 5, 10, 20, 21, 999)] == pytest.approx(
        [0.0, 0.5e-5, 1e-5, 2e-5, 2e-5, 2e-5])


CFG = TrainConfig(out="unused", preset="tiny", lr=0.1, warmup_steps=2, max_grad_norm=0.5,
                  adam_b1=0.8, adam_b2=0.9, weight_decay=0.1)
GRADS = [np.array([3.0, -4.0, 0.0], np.float32),      # norm 5: clipped to 0.5
         np.array([0.1, 0.2, -0.2], np.float32),      # norm 0.3: kept
         np.array([-0.3, 0.0, 0.4], np.float32)]      # norm 0.5: kept (at the limit)


def _adamw_by_hand(params, grads, cfg, eps=1e-8):
    """numpy AdamW after global-norm clipping, lr warmed up linearly from 0."""
    p = params.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    out = []
    for i, g in enumerate(grads):
        g = g.astype(np.float64)
        g = g * min(1.0, cfg.max_grad_norm / np.linalg.norm(g))
        m = cfg.adam_b1 * m + (1 - cfg.adam_b1) * g
        v = cfg.adam_b2 * v + (1 - cfg.adam_b2) * g * g
        m_hat, v_hat = m / (1 - cfg.adam_b1 ** (i + 1)), v / (1 - cfg.adam_b2 ** (i + 1))
        lr = cfg.lr * min(i / cfg.warmup_steps, 1.0)        # step i uses lr(i): 0 at step 0
        p = p - lr * (m_hat / (np.sqrt(v_hat) + eps) + cfg.weight_decay * p)
        out.append(p.copy())
    return out


def test_optimizer_follows_the_config():
    params = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
    tx = steps.make_optimizer(CFG)
    state = tx.init(params)
    want = _adamw_by_hand(np.asarray(params["w"]), GRADS, CFG)
    got = []
    for g in GRADS:
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, updates)
        got.append(np.asarray(params["w"]))
    np.testing.assert_array_equal(got[0], [0.5, -1.0, 2.0])   # warm-up: lr 0 at step 0
    err = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
    assert err < 1e-6, err                                     # float32 against float64
    # The fields matter: another b2 (or no clipping) gives other parameters.
    for change in (dict(adam_b2=0.999), dict(max_grad_norm=100.0), dict(adam_b1=0.9),
                   dict(weight_decay=0.0), dict(warmup_steps=4)):
        other = _adamw_by_hand(np.array([0.5, -1.0, 2.0]), GRADS,
                               TrainConfig(**{**CFG.to_dict(), **change}))
        assert np.abs(other[-1] - want[-1]).max() > 1e-4, change


# ---- gradient accumulation --------------------------------------------------------------------

SEQ, BATCH = 16, 4


def _setup(cfg, tx):
    model_cfg = LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            dtype="float32", param_dtype="float32", max_position_embeddings=SEQ,
                            attention=dict(kind="full", implementation="naive"))
    model = LlamaForCausalLM(model_cfg, rngs=nnx.Rngs(0))
    graphdef, model_state = nnx.split(model)
    apply = steps.model_apply(graphdef, model_state)
    return apply, steps.init_state(steps.params_of(model), cfg, tx)


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 37, (BATCH, SEQ + 1)).astype(np.int32)
    seg = np.ones((BATCH, SEQ), np.int32)
    seg[:, 9:] = 2                                       # two documents per row
    pos = np.where(seg == 1, np.arange(SEQ), np.arange(SEQ) - 9).astype(np.int32)
    mask = np.ones((BATCH, SEQ), np.float32)
    mask[0, 3:] = 0                                      # micro-batch 0: 3 + 16 tokens,
    mask[2, :] = 0                                       # micro-batch 1: 0 + 16 tokens
    mask[2, 0] = 1                                       # ... 1 + 16
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], segment_ids=seg, positions=pos,
                loss_mask=mask)


def test_gradient_accumulation_equals_one_large_batch():
    """`make_train_step` on `[2, 2, L]` micro-batches against one `[1, 4, L]` batch, with an
    optimizer whose update is the gradient itself (`make_train_step` takes the optimizer;
    the configured AdamW is checked above): the same loss, token count, gradient norm and
    gradients. The mean is over all 36 tokens, not over the micro-batches' means."""
    cfg = TrainConfig(out="unused", preset="tiny", seq_len=SEQ, batch_size=BATCH, grad_accum=2,
                      loss_chunk=8)
    gradient = optax.stateless(lambda updates, params: updates)   # new params = p + grads
    apply, state = _setup(cfg, gradient)
    batch = _batch()
    one = {k: v[None] for k, v in batch.items()}                        # [1, 4, L]
    accum = {k: v.reshape(2, BATCH // 2, *v.shape[1:]) for k, v in batch.items()}  # [2, 2, L]
    step = jax.jit(steps.make_train_step(apply, cfg, gradient))

    def run(batches):
        new, metrics = step(state, batches)
        grads = jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64),
                             new.trainable, state.trainable)
        return {k: float(v) for k, v in metrics.items()}, grads, int(new.step)

    m1, g1, step1 = run(one)
    m2, g2, step2 = run(accum)
    assert step1 == step2 == 1
    assert m1["tokens"] == m2["tokens"] == batch["loss_mask"].sum() == 36
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2) > 0
    assert max(float(np.abs(a).max()) for a in leaves1) > 1e-3       # real gradients
    for a, b in zip(leaves1, leaves2):
        np.testing.assert_allclose(b, a, atol=2e-7 + 1e-5 * float(np.abs(a).max()))
    norm = np.sqrt(sum(float(np.sum(a * a)) for a in leaves1))
    assert m1["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # Each micro-batch alone (the other's mask zeroed: the same program): the mean of their
    # means is not the loss of the whole batch, which counts tokens.
    means = []
    for i in range(2):
        mask = accum["loss_mask"].copy()
        mask[1 - i] = 0
        means.append(run(dict(accum, loss_mask=mask))[0]["loss"])
    assert abs(np.mean(means) - m1["loss"]) > 1e-3, (means, m1["loss"])
