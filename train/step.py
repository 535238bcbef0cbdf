"""The training step: the loss (`cca_jax.losses`), gradient accumulation, the optimizer.

Parameters are nested dicts split into a trainable and a frozen part, so frozen
parameters get neither gradients nor optimizer state. The optimizer updates float32 copies of
the trainable parameters' moments (AdamW moments are float32 whatever the parameter dtype)
and rounds the result back to the parameter dtype.

Sequence sharding: when the mesh splits the sequence and the attention has a bounded window
(cca, sliding, streaming), the model runs with a zigzag `SequenceSharding`
(`sequence_sharding_for`) and every batch is put in zigzag row order once (`in_row_order`):
token ids, targets, positions, segment ids and the loss mask move together, so each row
keeps its own target and mask, and the loss (a masked sum over rows) is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from cca_jax.attention import AttentionPattern, SequenceSharding
from cca_jax.attention.sequence_parallel import halo_rows, sequence_layout
from cca_jax.losses import chunked_cross_entropy
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import LOGICAL_RULES
from train.config import TRAINABLE, TrainConfig

Params = dict[tuple[str, ...], jax.Array]


def params_of(model: LlamaForCausalLM) -> dict:
    """The nested `{name: ... array}` dict of every parameter of `model`."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def flatten(tree: dict, prefix: tuple = ()) -> Params:
    out: Params = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def nest(flat: Params) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def split_trainable(params: dict, trainable: str) -> tuple[dict, dict]:
    """(trainable, frozen) nested dicts by the names in `TRAINABLE[trainable]` (None: all)."""
    names = TRAINABLE[trainable]
    flat = flatten(params)
    train = {p: x for p, x in flat.items() if names is None or any(n in p for n in names)}
    return nest(train), nest({p: x for p, x in flat.items() if p not in train})


def merge_params(trainable: dict, frozen: dict) -> dict:
    """The model's whole nested parameter dict from its trainable and frozen parts."""
    return nest({**flatten(frozen), **flatten(trainable)})


def model_apply(graphdef, abstract_state) -> Callable:
    """`apply(trainable, frozen) -> model` for a model split with `nnx.split`."""
    def apply(trainable: dict, frozen: dict) -> LlamaForCausalLM:
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, merge_params(trainable, frozen))
        return nnx.merge(graphdef, state)
    return apply


BATCH_KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask")


def sequence_sharding_for(mesh: Mesh, pattern: AttentionPattern) -> SequenceSharding | None:
    """The zigzag sequence sharding the model runs with on `mesh`, or None where attention
    stays on the plain path (a sequence axis of 1, or full attention: XLA gathers K/V)."""
    sharding = SequenceSharding(mesh, LOGICAL_RULES["seq"], "zigzag")
    return sharding if sharding.splits(pattern) else None


def check_sequence_split(mesh: Mesh, pattern: AttentionPattern, seq_len: int) -> None:
    """ValueError, naming the fix, where `seq_len` cannot be split over the mesh's sequence
    axis (rows a multiple of the shards, or of 2 x shards for zigzag; window plus group within
    one chunk)."""
    shards = mesh.shape[LOGICAL_RULES["seq"]]
    sharding = sequence_sharding_for(mesh, pattern)
    if sharding is None:
        if seq_len % shards:
            raise ValueError(f"--seq-len {seq_len} is not a multiple of the mesh's sequence "
                             f"axis ({shards}); use a multiple of {shards} or change --mesh.")
        return
    chunks = 2 * shards
    what = (f"attention={pattern.kind!r} on --mesh sequence={shards} (zigzag: {chunks} "
            "chunks a row)")
    if seq_len % chunks:
        raise ValueError(f"--seq-len {seq_len} must be a multiple of {chunks} for {what}; use "
                         f"--seq-len {-(-seq_len // chunks) * chunks}, or change --mesh.")
    halo, chunk = halo_rows(pattern, seq_len, packed=True), seq_len // chunks
    if halo > chunk:
        raise ValueError(
            f"--seq-len {seq_len} gives chunks of {chunk} tokens for {what}, but each chunk "
            f"needs the previous {halo} keys (the window plus group) from one neighbour: use "
            f"--seq-len >= {halo * chunks}, fewer sequence shards in --mesh, or a smaller "
            "--window-size / --group-size.")
    sequence_layout(pattern, seq_len, shards, zigzag=True, packed=True)   # anything else


def in_row_order(batch: dict, sharding: SequenceSharding | None) -> dict:
    """The batch with its last (sequence) axis in the model's row layout, all keys alike."""
    if sharding is None:
        return batch
    order = sharding.row_order(np.shape(batch["input_ids"])[-1])
    return {k: np.asarray(x)[..., order] if k in BATCH_KEYS else x for k, x in batch.items()}


def loss_fn(model: LlamaForCausalLM, batch: dict, chunk: int, document_mask: bool = True):
    """(summed token loss, token count) of one micro-batch. `document_mask=False`: each row
    attends across its documents at positions 0..L-1 (in the model's row order)."""
    if document_mask:
        hidden = model.hidden_states(batch["input_ids"], batch["segment_ids"],
                                     batch["positions"])
    else:
        hidden = model.hidden_states(batch["input_ids"])
    return chunked_cross_entropy(hidden, model.output_weight(), batch["targets"],
                                 batch["loss_mask"], chunk)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant (the paper's recipe)."""
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1)),
         optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(lr_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2,
                    weight_decay=cfg.weight_decay),
    )


class TrainState(NamedTuple):
    step: jax.Array
    trainable: dict
    frozen: dict
    opt_state: Any


def init_state(params: dict, cfg: TrainConfig, tx) -> TrainState:
    train, frozen = split_trainable(params, cfg.trainable)
    opt_state = tx.init(jax.tree.map(lambda x: x.astype(jnp.float32), train))
    return TrainState(jnp.zeros((), jnp.int32), train, frozen, opt_state)


def make_grad_fn(apply, cfg: TrainConfig) -> Callable:
    """`grads(state, batches) -> (loss, token count, grads)`: the mean token loss and its
    float32 gradient w.r.t. the trainable parameters over `[grad_accum, B, L]` batches."""
    def micro(state: TrainState, batch):
        def loss_of(train):
            return loss_fn(apply(train, state.frozen), batch, cfg.loss_chunk,
                           cfg.document_mask)
        (total, count), grads = jax.value_and_grad(loss_of, has_aux=True)(state.trainable)
        return total, count, grads

    def grads_fn(state: TrainState, batches):
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), state.trainable)

        def accumulate(carry, batch):
            total, count, grads = carry
            t, c, g = micro(state, batch)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return (total + t, count + c, grads), None

        (total, count, grads), _ = jax.lax.scan(
            accumulate, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros),
            batches)
        count = jnp.maximum(count, 1.0)
        return total / count, count, jax.tree.map(lambda g: g / count, grads)

    return grads_fn


def make_train_step(apply, cfg: TrainConfig, tx) -> Callable:
    """`step(state, batch) -> (state, metrics)`; batch arrays `[grad_accum, B, L]`."""
    grads_fn = make_grad_fn(apply, cfg)

    def step(state: TrainState, batches):
        loss, count, grads = grads_fn(state, batches)
        master = jax.tree.map(lambda x: x.astype(jnp.float32), state.trainable)
        updates, opt_state = tx.update(grads, state.opt_state, master)
        new = jax.tree.map(lambda p, u: (p.astype(jnp.float32) + u).astype(p.dtype),
                           state.trainable, updates)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        metrics = {"loss": loss, "grad_norm": norm, "tokens": count}
        return TrainState(state.step + 1, new, state.frozen, opt_state), metrics

    return step
