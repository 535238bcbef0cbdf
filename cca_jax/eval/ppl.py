"""Long-document perplexity, chunked so that it runs at 128K tokens.

The protocol (`perplexity(model, ids, seq_len, stride)`):
- `ids`: the document's tokens (text tokenized as-is, no special tokens added);
- windows of `seq_len` tokens, each scored on its own (a fresh context);
  - default: consecutive, non-overlapping windows; the remainder is dropped; every window
    scores its tokens 2..N, each predicted from the tokens before it in the window;
  - `stride=S` (the strided variant): windows start every S tokens (overlapping when
    S < N - 1; every window fits whole) and each scores only its last S tokens, so every
    scored token sees at least N - S tokens of context;
- ppl = exp(mean negative log-likelihood over all scored tokens).

Logits never exist for a whole window: the final hidden states are cut into chunks of
`chunk` positions and `cca_jax.losses.chunk_cross_entropy` (the training loss) gives each
chunk's summed NLL, which is also the perplexity-by-position curve.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cca_jax.sharding import mesh_context, shard_model

DEFAULT_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """ppl and its parts; `by_position[i]`: the scored tokens at window positions [lo, hi)."""
    ppl: float
    mean_nll: float
    scored_tokens: int
    windows: int
    seq_len: int
    stride: int | None
    document_tokens: int
    by_position: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def window_starts(n_tokens: int, seq_len: int, stride: int | None = None) -> np.ndarray:
    """First token of every window that fits whole in `n_tokens` tokens."""
    check_protocol(n_tokens, seq_len, stride)
    step = seq_len if stride is None else stride
    return np.arange(0, n_tokens - seq_len + 1, step, dtype=np.int64)


def first_scored(seq_len: int, stride: int | None = None) -> int:
    """Index (0-based, within a window) of the first scored token: 1, or N - S."""
    return 1 if stride is None else seq_len - stride


def check_protocol(n_tokens: int, seq_len: int, stride: int | None) -> None:
    """ValueError naming the fix when the document cannot be scored this way."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (a window needs a token to predict "
                         f"from and one to score), got {seq_len!r}.")
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int)
                               or not 1 <= stride < seq_len):
        raise ValueError(f"stride must be an int in [1, seq_len - 1] = [1, {seq_len - 1}] "
                         f"(a window's first token has no context to be predicted from), "
                         f"got {stride!r}.")
    if n_tokens < seq_len:
        raise ValueError(f"the document has {n_tokens} tokens, fewer than one window of "
                         f"seq_len={seq_len}: lower the window length or give more text.")


def window_arrays(ids: np.ndarray, starts: Sequence[int], seq_len: int,
                  stride: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, loss mask), each `[len(starts), seq_len]`: position t predicts
    token t + 1 of its window; the mask keeps the scored tokens only."""
    idx = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len)
    inputs = ids[idx].astype(np.int32)
    targets = np.zeros_like(inputs)
    targets[:, :-1] = inputs[:, 1:]
    mask = np.zeros(inputs.shape, np.float32)
    mask[:, first_scored(seq_len, stride) - 1:seq_len - 1] = 1.0
    return inputs, targets, mask


def chunk_nll_fn(model, chunk: int):
    """A jitted `(state, inputs, targets, mask) -> (nll sums [n_chunks], counts [n_chunks])`
    over window positions cut into chunks of `chunk` (one compile per batch shape)."""
    from flax import nnx

    from cca_jax.losses import chunk_cross_entropy

    graphdef, _ = nnx.split(model)

    @jax.jit
    def fn(state, inputs, targets, mask):
        m = nnx.merge(graphdef, state)
        return chunk_cross_entropy(m.hidden_states(inputs), m.output_weight(), targets, mask,
                                   chunk)

    return fn


def perplexity(model, ids: Sequence[int] | np.ndarray, seq_len: int, stride: int | None = None,
               *, batch_size: int = 1, chunk: int = DEFAULT_CHUNK,
               progress: bool = True, mesh=None) -> PerplexityResult:
    """Perplexity of `model` on the token ids of one document (see the module docstring).

    batch_size: windows per forward pass; chunk: positions whose float32 logits exist at once
    (memory: batch_size * chunk * vocab floats), also the resolution of `by_position`.
    mesh: run over its devices (parameters placed by `sharding.shard_model`, the forward
    traced and run under it so activations follow the table).
    """
    from flax import nnx

    ids = np.asarray(ids, np.int64).reshape(-1)
    cfg = model.config
    starts = window_starts(len(ids), seq_len, stride)
    for name, v in (("batch_size", batch_size), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}: use a shorter window, or raise "
                         "max_position_embeddings (a long-context fine-tune, rope scaling).")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}) (vocab_size), got "
                         f"[{ids.min()}, {ids.max()}]: is the tokenizer the model's own?")
    chunk = min(chunk, seq_len)
    batch_size = min(batch_size, len(starts))
    if mesh is not None:
        shard_model(model, mesh)
    fn = chunk_nll_fn(model, chunk)
    state = nnx.state(model)
    n_chunks = -(-seq_len // chunk)
    sums, counts = np.zeros(n_chunks), np.zeros(n_chunks)
    batches = range(0, len(starts), batch_size)
    for b0 in tqdm(batches, desc=f"ppl@{seq_len}", unit="batch", disable=not progress):
        rows = list(starts[b0:b0 + batch_size])
        real = len(rows)
        rows += [rows[0]] * (batch_size - real)      # pad the last batch: one compile
        inputs, targets, mask = window_arrays(ids, rows, seq_len, stride)
        mask[real:] = 0.0
        with mesh_context(mesh):   # the model's activation constraints; jit's cache key
            s, c = fn(state, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask))
        sums += np.asarray(s, np.float64)
        counts += np.asarray(c, np.float64)
    total = int(counts.sum())
    mean = float(sums.sum() / total)
    by_position = [   # scored tokens at window positions [lo, hi) (0-based)
        {"lo": i * chunk + 1, "hi": min((i + 1) * chunk + 1, seq_len), "tokens": int(c),
         "ppl": float(math.exp(s / c)) if c else None}
        for i, (s, c) in enumerate(zip(sums, counts))]
    return PerplexityResult(ppl=float(math.exp(mean)), mean_nll=mean, scored_tokens=total,
                            windows=len(starts), seq_len=seq_len, stride=stride,
                            document_tokens=len(ids), by_position=by_position)


# ---- the `ppl` subcommand -------------------------------------------------------------------

def read_token_file(path) -> np.ndarray:
    """Token ids from `.npy` or `.json` (a list of ids, or of lists of ids, concatenated)."""
    import json
    from pathlib import Path

    from cca_jax.cli import UsageError

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--token-file {path} does not exist.")
    if path.suffix == ".npy":
        ids = np.load(path)
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if data and all(isinstance(x, list) for x in data):
            data = [t for row in data for t in row]
        ids = np.asarray(data)
    else:
        raise UsageError(f"--token-file {path}: expected a .npy or .json file of token ids.")
    if ids.dtype.kind not in "iu":
        raise UsageError(f"--token-file {path} must hold integer token ids, got {ids.dtype}.")
    return ids.reshape(-1)


def read_text_tokens(a) -> np.ndarray:
    """--text-file as-is through the checkpoint's tokenizer, without special tokens."""
    from pathlib import Path

    from cca_jax.cli import UsageError
    from cca_jax.eval.common import load_checkpoint_tokenizer

    try:
        text = Path(a.text_file).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --text-file {a.text_file}: {e.strerror}.") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--text-file {a.text_file} is not UTF-8 ({e}): convert it, e.g. "
                         "`iconv -f latin1 -t utf-8`.") from None
    if not text.strip():
        raise UsageError(f"--text-file {a.text_file} is empty: give a document to score.")
    tokenizer = load_checkpoint_tokenizer(a)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)


def run_ppl(a) -> tuple[dict[str, Any], str]:
    """`python -m cca_jax.eval ppl`: (JSON record with key `ppl`, markdown table)."""
    from cca_jax.cli import UsageError, mesh_from_args
    from cca_jax.eval.common import (attention_label, attention_record, check_checkpoint,
                                     load_model)

    check_checkpoint(a.ckpt)
    ids = read_token_file(a.token_file) if a.token_file else read_text_tokens(a)
    model = load_model(a)
    limit = model.config.max_position_embeddings
    if a.seq_len > limit:
        raise UsageError(f"--seq-len {a.seq_len} exceeds the model's max_position_embeddings="
                         f"{limit}: use --seq-len <= {limit}, or --max-position-embeddings "
                         f"{a.seq_len} for a model fine-tuned (or rope-scaled) that long.")
    try:
        result = perplexity(model, ids, a.seq_len, a.stride, batch_size=a.batch_size,
                            chunk=a.chunk, progress=not a.no_progress, mesh=mesh_from_args(a))
    except ValueError as e:
        msg = str(e).replace("seq_len", "--seq-len").replace("stride", "--stride")
        raise UsageError(msg.replace("batch_size", "--batch-size")) from None
    source = a.text_file or a.token_file
    record = {"task": "ppl", "ckpt": str(a.ckpt), "source": str(source),
              **attention_record(model.config), **result.to_json()}
    from cca_jax.eval.common import markdown_table
    table = markdown_table(
        ["attention", "seq_len", "stride", "windows", "scored tokens", "ppl"],
        [[attention_label(attention_record(model.config)), a.seq_len, a.stride or "-",
          result.windows, result.scored_tokens, result.ppl]])
    return record, table


