"""Issue 14, experiment 2: does CCA retrieve beyond its local window when trained from scratch?

    python benchmarks/passkey_scratch.py --time-budget-s 90 \\
        --out benchmarks/results/passkey_scratch_h200          # one H200, about 6-7 minutes
    python benchmarks/passkey_scratch.py --seq-len 512 --window-size 64 --group-size 8 \\
        --layers 2 --hidden 128 --heads 4 --kv-heads 4 --dtype float32 --implementation xla \\
        --first-doc-len 16 --steps 200 --lr 3e-3 --out /tmp/passkey_cpu   # the CPU-sized check

Trains the same small LLaMA (`cca_jax.model.LlamaForCausalLM`, random init, same seed) once
per attention option (full, cca, sliding, streaming) on a synthetic passkey task, with the same
data, steps and optimizer (`train.step`), then measures retrieval accuracy by depth.

The task (integer tokens, no tokenizer; `make_documents`): a document is a periodic filler
pattern (low entropy, like the classic "The grass is green..." passkey prompt), with a
needle `KEY d1..dn` at a chosen depth and ends in `QUERY d1..dn`. The loss is on the n answer
digits only (each predicted from the tokens before it). Training packs several documents
into each row (`segment_ids`, positions restart per document) so that a curriculum over
document lengths (short first, `seq_len` last) keeps one compiled step shape.

Evaluation: one document of `seq_len` tokens per row, the needle at depths 0, 0.1, .., 1.0,
held-out seeds; a sample is correct when the teacher-forced argmax at every answer position
equals the key (exact match of the whole key; with teacher forcing this equals greedy
decoding whenever the key is right). `distance` is the number of tokens from the first key
digit to the query marker: a query sees the key raw within one layer only when distance <
window (sliding, streaming, cca's local window).

Writes `<out>.json` (records: attention, seq_len, depth, distance, accuracy, samples,
train_steps, train_s, final_loss, params, ...), `<out>.md` (the table) and `<out>.png` (if
matplotlib is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ATTENTIONS = ("full", "cca", "sliding", "streaming")

# Token ids: two markers, the digits, then the filler tokens.
KEY_MARK = 1
QUERY_MARK = 2
FIRST_DIGIT = 3


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The passkey documents: key length, digit and filler alphabets.

    By default each key position has its own `num_digits` digit tokens (like a key written
    "a3 b7 c1 d9 e2"): the answer's i-th digit is the document's one token of position i, a
    lookup one attention layer can learn quickly. `shared_digits` uses one alphabet for all
    positions (no digit twice in a key), which needs a two-layer induction circuit.
    """

    key_len: int = 5
    num_digits: int = 10
    filler_period: int = 16      # filler tokens, repeated in order (period = alphabet size)
    shared_digits: bool = False

    @property
    def digit_tokens(self) -> int:
        return self.num_digits * (1 if self.shared_digits else self.key_len)

    @property
    def first_filler(self) -> int:
        return FIRST_DIGIT + self.digit_tokens

    @property
    def vocab_size(self) -> int:
        """Markers, digits and filler, rounded up to a multiple of 8."""
        used = self.first_filler + self.filler_period
        return -(-used // 8) * 8

    @property
    def tail_len(self) -> int:
        """`QUERY d1..dn` at the end of every document."""
        return 1 + self.key_len

    @property
    def needle_len(self) -> int:
        """`KEY d1..dn`."""
        return 1 + self.key_len

    def min_doc_len(self) -> int:
        return self.needle_len + self.tail_len + 1


@dataclasses.dataclass(frozen=True)
class PasskeyDocuments:
    """`n` documents of one length: tokens, keys, where the needles and the answers are."""

    tokens: np.ndarray           # int32 [n, doc_len]
    keys: np.ndarray             # int32 [n, key_len], digit token ids
    needle_pos: np.ndarray       # int [n], index of each KEY marker
    query_pos: int               # index of the QUERY marker (the same in every document)

    @property
    def answer_positions(self) -> np.ndarray:
        """Positions whose next-token targets are the key digits (QUERY, d1..d_{n-1})."""
        return self.query_pos + np.arange(self.keys.shape[1])

    @property
    def distance(self) -> np.ndarray:
        """Tokens from the first key digit to the query marker, per document."""
        return self.query_pos - (self.needle_pos + 1)


def needle_position(doc_len: int, depth, task: TaskSpec):
    """Index of the KEY marker for a relative depth in [0, 1] (0: first token, 1: just before
    the query); `depth` may be an array."""
    last = doc_len - task.tail_len - task.needle_len
    return np.rint(np.clip(depth, 0.0, 1.0) * last).astype(np.int64)


def make_documents(rng: np.random.Generator, doc_len: int, depths: np.ndarray,
                   task: TaskSpec) -> PasskeyDocuments:
    """One passkey document of `doc_len` tokens per entry of `depths` (the needle's relative
    position), drawn from `rng`: periodic filler, `KEY d1..dn` at the depth, `QUERY d1..dn`
    at the end."""
    if doc_len < task.min_doc_len():
        raise ValueError(f"a document needs at least {task.min_doc_len()} tokens, got {doc_len}.")
    n = len(depths)
    phase = rng.integers(task.filler_period, size=(n, 1))
    tokens = (task.first_filler
              + (np.arange(doc_len)[None] + phase) % task.filler_period).astype(np.int32)
    if task.shared_digits:
        digits = np.argsort(rng.random((n, task.num_digits)), axis=1)[:, :task.key_len]
    else:
        digits = (np.arange(task.key_len) * task.num_digits
                  + rng.integers(task.num_digits, size=(n, task.key_len)))
    keys = (FIRST_DIGIT + digits).astype(np.int32)
    needle = needle_position(doc_len, np.asarray(depths, np.float64), task)
    query = doc_len - task.tail_len
    rows = np.arange(n)[:, None]
    tokens[rows[:, 0], needle] = KEY_MARK
    tokens[rows, needle[:, None] + 1 + np.arange(task.key_len)] = keys
    tokens[:, query] = QUERY_MARK
    tokens[:, query + 1:] = keys
    return PasskeyDocuments(tokens, keys, needle, query)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: the model, the task, the training budget (equal for every attention),
    the evaluation and where results go. Every field is a CLI flag (`--seq-len` ...)."""

    out: str = "benchmarks/results/passkey_scratch"
    attentions: str = ",".join(ATTENTIONS)
    # attention settings (the paper's: g = 16, s = W = 1024; streaming adds 4 sinks)
    seq_len: int = 16384
    group_size: int = 16
    window_size: int = 1024
    sink_tokens: int = 4
    implementation: str = "auto"
    # model (about 25M parameters by default)
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    intermediate: int = 0        # 0: 2.75 x hidden, rounded up to a multiple of 64
    rope_theta: float = 500000.0
    dtype: str = "bfloat16"      # activations (and matmul inputs)
    param_dtype: str = "float32"  # parameters; Adam moments are float32 either way
    remat: str = "none"
    # task
    key_len: int = 5
    num_digits: int = 10
    filler_period: int = 16
    shared_digits: bool = False   # one digit alphabet for every key position (harder)
    # training (the same for every attention)
    steps: int = 400
    batch_size: int = 8          # rows of seq_len tokens per step
    lr: float = 1e-3
    warmup_steps: int = 30
    max_grad_norm: float = 1.0
    first_doc_len: int = 32      # curriculum start: short documents teach the lookup fast
    final_fraction: float = 0.3  # share of steps on documents of seq_len tokens
    time_budget_s: float = 0.0   # per attention: stop training after this many seconds
    #                              (not counting the compiling first step); 0: no limit
    seed: int = 0
    # evaluation
    eval_samples: int = 16       # per depth
    eval_depths: int = 11        # 0, 0.1, ..., 1.0
    eval_seed: int = 1_000_003

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need("passkey" in os.path.basename(self.out),
             f"--out {self.out!r}: result files are named with 'passkey' (issue 14).")
        need(set(self.attention_list) <= set(ATTENTIONS) and self.attention_list,
             f"--attentions must be a comma list of {ATTENTIONS}, got {self.attentions!r}.")
        for name in ("seq_len", "group_size", "window_size", "sink_tokens", "layers", "hidden",
                     "heads", "kv_heads", "key_len", "num_digits", "filler_period", "steps",
                     "batch_size", "eval_samples", "eval_depths"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1.")
        need(not self.shared_digits or self.num_digits >= self.key_len,
             "--shared-digits needs --num-digits >= --key-len (no digit twice in a key).")
        need(self.eval_depths >= 2, "--eval-depths must be >= 2 (0 and 1 at least).")
        need(0.0 < self.final_fraction <= 1.0, "--final-fraction must lie in (0, 1].")
        need(self.seq_len % self.doc_lengths()[0] == 0,
             f"--seq-len {self.seq_len} must be a multiple of the first document length "
             f"{self.doc_lengths()[0]} (the curriculum doubles it up to seq_len).")
        need(self.doc_lengths()[0] >= self.task.min_doc_len(),
             f"--first-doc-len must be >= {self.task.min_doc_len()}.")

    @property
    def attention_list(self) -> tuple[str, ...]:
        return tuple(a for a in self.attentions.split(",") if a)

    @property
    def task(self) -> TaskSpec:
        return TaskSpec(self.key_len, self.num_digits, self.filler_period, self.shared_digits)

    @property
    def intermediate_size(self) -> int:
        return self.intermediate or -(-int(2.75 * self.hidden) // 64) * 64

    def doc_lengths(self) -> tuple[int, ...]:
        """The curriculum's document lengths: first_doc_len doubling up to seq_len."""
        first = min(self.first_doc_len, self.seq_len)
        lengths = [first]
        while lengths[-1] * 2 <= self.seq_len:
            lengths.append(lengths[-1] * 2)
        if lengths[-1] != self.seq_len:
            lengths.append(self.seq_len)
        return tuple(lengths)

    def doc_len_at(self, step: int) -> int:
        """Document length of training step `step`: the earlier stages share the first
        (1 - final_fraction) of the steps equally, then seq_len."""
        lengths = self.doc_lengths()
        final_start = int(round(self.steps * (1 - self.final_fraction)))
        if len(lengths) == 1 or step >= final_start:
            return lengths[-1]
        per_stage = final_start / (len(lengths) - 1)
        return lengths[min(int(step / per_stage), len(lengths) - 2)]

    def depths(self) -> np.ndarray:
        return np.linspace(0.0, 1.0, self.eval_depths)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- data -------------------------------------------------------------------------------

def training_batch(cfg: ExperimentConfig, step: int) -> dict[str, np.ndarray]:
    """Rows `[batch_size, seq_len]` of packed documents for `step` (deterministic from
    `cfg.seed` and `step`; depths uniform): input_ids, targets, loss_mask (answers only),
    segment_ids, positions (restarting at each document)."""
    rng = np.random.default_rng([cfg.seed, step])
    doc_len = cfg.doc_len_at(step)
    per_row = cfg.seq_len // doc_len
    docs = make_documents(rng, doc_len, rng.random(cfg.batch_size * per_row), cfg.task)
    targets = np.zeros_like(docs.tokens)
    targets[:, docs.answer_positions] = docs.keys
    loss_mask = np.zeros(docs.tokens.shape, np.float32)
    loss_mask[:, docs.answer_positions] = 1.0
    shape = (cfg.batch_size, cfg.seq_len)
    return {"input_ids": docs.tokens.reshape(shape), "targets": targets.reshape(shape),
            "loss_mask": loss_mask.reshape(shape),
            "segment_ids": np.broadcast_to(np.repeat(np.arange(per_row, dtype=np.int32),
                                                     doc_len), shape),
            "positions": np.broadcast_to(np.tile(np.arange(doc_len, dtype=np.int32), per_row),
                                         shape)}


def evaluation_documents(cfg: ExperimentConfig, depth_index: int) -> PasskeyDocuments:
    """`eval_samples` held-out documents of `seq_len` tokens at depth number `depth_index`."""
    rng = np.random.default_rng([cfg.eval_seed, depth_index])
    depths = np.full(cfg.eval_samples, cfg.depths()[depth_index])
    return make_documents(rng, cfg.seq_len, depths, cfg.task)


# ---- model and training -----------------------------------------------------------------

def model_config(cfg: ExperimentConfig, attention: str):
    """The LlamaConfig of this experiment for one attention option."""
    from cca_jax.config import LlamaConfig

    base = LlamaConfig(vocab_size=cfg.task.vocab_size, hidden_size=cfg.hidden,
                       intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                       num_key_value_heads=cfg.kv_heads, rope_theta=cfg.rope_theta,
                       max_position_embeddings=cfg.seq_len, dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, remat=cfg.remat)
    return base.replace(attention=attention, group_size=cfg.group_size,
                        window_size=cfg.window_size,
                        sink_tokens=cfg.sink_tokens if attention == "streaming" else None,
                        implementation=cfg.implementation)


def train_config(cfg: ExperimentConfig):
    """The `train.config.TrainConfig` whose optimizer and step `train.step` builds: AdamW
    (float32 moments), linear warmup then constant lr, no weight decay, clipping."""
    from train.config import TrainConfig

    # `preset` only marks a randomly initialised model; `out` is never written by train.step.
    return TrainConfig(out=cfg.out, preset="tiny", seq_len=cfg.seq_len,
                       batch_size=cfg.batch_size, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                       max_grad_norm=cfg.max_grad_norm, weight_decay=0.0, steps=cfg.steps,
                       seed=cfg.seed, loss_chunk=min(cfg.seq_len, 2048), remat=cfg.remat,
                       dtype=cfg.dtype)


def _accuracy_fn(apply, key_len: int):
    """`correct(trainable, frozen, ids, segment_ids, positions, keys) -> bool [B]`: the
    teacher-forced argmax at the answer positions (the `key_len` tokens before the last one)
    equals the whole key."""
    import jax
    import jax.numpy as jnp

    def correct(trainable, frozen, ids, segment_ids, positions, keys):
        model = apply(trainable, frozen)
        hidden = model.hidden_states(ids, segment_ids, positions)
        answers = hidden[:, -key_len - 1:-1]
        predicted = jnp.argmax(model.logits(answers), axis=-1)
        return jnp.all(predicted == keys, axis=-1)

    return jax.jit(correct)


def run_attention_option(cfg: ExperimentConfig, attention: str, *, progress: bool = True
                         ) -> list[dict]:
    """Train a fresh model with `attention` and evaluate it: one record per depth."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm import tqdm

    from cca_jax.attention import resolve_implementation
    from cca_jax.model import LlamaForCausalLM
    from train import step as train_step_lib

    model_cfg = model_config(cfg, attention)
    model = LlamaForCausalLM(model_cfg, rngs=nnx.Rngs(cfg.seed))
    params = train_step_lib.params_of(model)
    num_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
    graphdef, model_state = nnx.split(model)
    apply = train_step_lib.model_apply(graphdef, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_state))
    tcfg = train_config(cfg)
    tx = train_step_lib.make_optimizer(tcfg)
    state = jax.jit(functools.partial(train_step_lib.init_state, cfg=tcfg, tx=tx))(params)
    del model, params, model_state
    step_fn = jax.jit(train_step_lib.make_train_step(apply, tcfg, tx), donate_argnums=(0,))

    compile_s = train_s = 0.0
    losses: list[float] = []
    steps_done = 0
    bar = tqdm(range(cfg.steps), desc=f"{attention:>9}", unit="step", disable=not progress,
               leave=False)
    batch = training_batch(cfg, 0)
    for step in bar:
        start = time.perf_counter()
        state, metrics = step_fn(state, {k: v[None] for k, v in batch.items()})  # accum 1
        if step + 1 < cfg.steps:
            batch = training_batch(cfg, step + 1)   # on the host while the device works
        loss = float(metrics["loss"])               # waits for the step
        elapsed = time.perf_counter() - start
        if step == 0:
            compile_s = elapsed                     # the first call compiles (counted apart)
        else:
            train_s += elapsed
        losses.append(loss)
        steps_done = step + 1
        bar.set_postfix(loss=f"{loss:.3f}", doc=cfg.doc_len_at(step))
        if cfg.time_budget_s and train_s > cfg.time_budget_s:
            break
    bar.close()

    correct_fn = _accuracy_fn(apply, cfg.key_len)
    # One document per row, with segment ids as in training (the same kernels run).
    zeros = jnp.zeros((cfg.eval_samples, cfg.seq_len), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(cfg.seq_len, dtype=jnp.int32), zeros.shape)
    eval_start = time.perf_counter()
    implementation = resolve_implementation(
        cfg.implementation, pattern=model_cfg.attention.pattern, head_dim=model_cfg.head_dim,
        dtype=model_cfg.jnp_dtype, packed=True)
    final_loss = float(np.mean(losses[-10:]))
    records = []
    for i, depth in enumerate(cfg.depths()):
        docs = evaluation_documents(cfg, i)
        hits = np.asarray(correct_fn(state.trainable, state.frozen, jnp.asarray(docs.tokens),
                                     zeros, positions, jnp.asarray(docs.keys)))
        records.append(dict(
            attention=attention, seq_len=cfg.seq_len, depth=round(float(depth), 3),
            distance=int(docs.distance[0]),
            beyond_window=bool(docs.distance[0] >= cfg.window_size),
            accuracy=float(hits.mean()), samples=len(hits), train_steps=steps_done,
            train_s=round(train_s, 1), compile_s=round(compile_s, 1),
            final_loss=round(final_loss, 4), params=num_params,
            loss_curve=[round(x, 4) for x in losses[::max(1, len(losses) // 50)]],
            group_size=cfg.group_size if attention == "cca" else None,
            window_size=None if attention == "full" else cfg.window_size,
            sink_tokens=cfg.sink_tokens if attention == "streaming" else None,
            implementation=implementation))
    eval_s = time.perf_counter() - eval_start
    for r in records:
        r["eval_s"] = round(eval_s, 1)
    return records


def summary_line(records: list[dict], window: int) -> str:
    """One line per attention: budget, loss, accuracy within and beyond the window."""
    r0 = records[0]
    near = [r["accuracy"] for r in records if not r["beyond_window"]]
    far = [r["accuracy"] for r in records if r["beyond_window"]]
    mean = lambda xs: f"{np.mean(xs):.2f}" if xs else "-"  # noqa: E731
    return (f"{r0['attention']:>9}: {r0['train_steps']} steps in {r0['train_s']:.0f} s "
            f"(+{r0['compile_s']:.0f} s compile, {r0['eval_s']:.0f} s eval), final loss "
            f"{r0['final_loss']:.3f}; accuracy within window {mean(near)}, beyond "
            f"(distance >= {window}) {mean(far)}")


# ---- results ----------------------------------------------------------------------------

def results_table(records: list[dict], cfg: ExperimentConfig, meta: dict) -> str:
    """Markdown: accuracy by depth (rows) and attention (columns), with the budget."""
    attentions = list(dict.fromkeys(r["attention"] for r in records))
    by = {(r["attention"], r["depth"]): r for r in records}
    depths = sorted({r["depth"] for r in records})
    first = {a: next(r for r in records if r["attention"] == a) for a in attentions}
    lines = [f"# Passkey retrieval, trained from scratch ({meta['device']})", "",
             f"- date: {meta['date']}; jax {meta['jax']}; command: `{meta['command']}`",
             f"- model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads "
             f"({cfg.kv_heads} KV), {first[attentions[0]]['params'] / 1e6:.1f}M parameters, "
             f"{cfg.param_dtype} parameters, {cfg.dtype} activations, vocab "
             f"{cfg.task.vocab_size}",
             f"- attention: cca g = {cfg.group_size}, s = {cfg.window_size}; sliding W = "
             f"{cfg.window_size}; streaming {cfg.sink_tokens} sinks + W = {cfg.window_size}",
             f"- task: periodic filler (period {cfg.filler_period}), key of {cfg.key_len} "
             f"digits (of {cfg.num_digits}), loss on the answer digits only",
             f"- training, the same for every attention: {cfg.steps} steps of "
             f"{cfg.batch_size} x {cfg.seq_len} tokens (documents packed; lengths "
             f"{', '.join(map(str, cfg.doc_lengths()))}, the last for {cfg.final_fraction:.0%} "
             f"of the steps), AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}), seed {cfg.seed}"
             + (f", stop after {cfg.time_budget_s:.0f} s" if cfg.time_budget_s else ""),
             f"- evaluation: {cfg.eval_samples} held-out documents of {cfg.seq_len} tokens per "
             "depth; exact match of the whole key by teacher-forced argmax; distance = tokens "
             "from the first key digit to the query (* : beyond the window)", "",
             "| depth | distance | " + " | ".join(attentions) + " |",
             "| --- | --- | " + " | ".join("---" for _ in attentions) + " |"]
    for depth in depths:
        r = by[(attentions[0], depth)]
        star = "*" if r["beyond_window"] else ""
        cells = [f"{by[(a, depth)]['accuracy']:.2f}" for a in attentions]
        lines.append(f"| {depth:.1f} | {r['distance']}{star} | " + " | ".join(cells) + " |")
    lines += ["", "| attention | implementation | train steps | train s | compile s | "
              "final loss |", "| --- | --- | --- | --- | --- | --- |"]
    for a in attentions:
        r = first[a]
        lines.append(f"| {a} | {r['implementation']} | {r['train_steps']} | {r['train_s']} | "
                     f"{r['compile_s']} | {r['final_loss']} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], cfg: ExperimentConfig, path: str) -> str | None:
    """Accuracy against distance, one line per attention, the window marked. Returns the
    path, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written.")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for a in dict.fromkeys(r["attention"] for r in records):
        rs = sorted((r for r in records if r["attention"] == a), key=lambda r: r["distance"])
        ax.plot([r["distance"] for r in rs], [r["accuracy"] for r in rs], marker="o", label=a)
    ax.axvline(cfg.window_size, color="gray", linestyle="--", label=f"window {cfg.window_size}")
    ax.set_xlabel("distance from the key to the query (tokens)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"Passkey retrieval at {cfg.seq_len} tokens, trained from scratch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_experiment(cfg: ExperimentConfig, *, progress: bool = True) -> list[dict]:
    """Every attention in turn (same data, init and budget); writes the results."""
    from benchmarks.measure import stamp, write_results

    meta = stamp()
    records: list[dict] = []
    for attention in cfg.attention_list:
        ours = run_attention_option(cfg, attention, progress=progress)
        print(summary_line(ours, cfg.window_size), flush=True)
        records += [{**r, **meta} for r in ours]
    write_results(cfg.out, records, results_table(records, cfg, meta))
    plot(records, cfg, cfg.out + ".png")
    return records


def parse_args(argv=None) -> ExperimentConfig:
    """ExperimentConfig from flags (one per field)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(ExperimentConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            ap.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction)
        else:
            ap.add_argument(flag, type=type(f.default), default=f.default)
    return ExperimentConfig(**vars(ap.parse_args(argv)))


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from benchmarks.measure import claim_output
    claim_output(cfg.out, suffixes=(".json", ".md", ".png"))
    run_experiment(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
