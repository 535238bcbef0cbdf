"""Text generation through the KV cache: the Python API and the CLI.

    from cca_jax.generate import generate
    new_ids = generate(model, [[1, 450, 4996], [1, 9038]], max_new_tokens=32)

runs every prompt in one batch (each row at its own position, group boundary and ring state):
a chunked prefill (`cca_jax.decode.prefill`), then one jitted step per token (`decode_loop`:
`cca_jax.decode.decode_step` and the sampling of `cca_jax.sampling` in one program, compiled
once, dispatched ahead of the host). Rows that emit an end-of-sequence token stop (they keep
their cache and feed padding).

    python -m cca_jax.generate --ckpt DIR --prompt "Once upon a time" --max-new-tokens 64

streams the continuation to stdout as text; the prompt tokens, compilation time (every
program is compiled before the clocks start), time to first token, decode speed and KV cache
size go to stderr. `--attention/--group-size/--window-size/--sink-tokens`
override the checkpoint's attention settings (CCA's inference flexibility).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax import blocks
from cca_jax.decode import (DECODE_COMPILER_OPTIONS, DEFAULT_CHUNK_SIZE, compile_prefill,
                            decode_step_traced, prefill)
from cca_jax.kv_cache import cache_bytes, cache_shapes, full_cache_bytes, init_cache
from cca_jax.padding import round_up
from cca_jax.sampling import check_sampling, sample

# Prompt widths and default max_len are rounded up to this, so prompts of similar lengths
# share one compiled prefill and decode step.
LENGTH_BUCKET = 64
_FROM_CONFIG = object()


@dataclasses.dataclass
class GenerationStats:
    """Filled in by `stream_generate` as it runs (seconds, tokens, bytes). Every program
    (prefill chunks, sampling, each decode step program) is compiled before the clocks start,
    so the times below hold no compilation."""
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    max_len: int = 0
    compile_seconds: float = 0.0         # compiling the prefill, sampling and decode programs
    time_to_first_token: float = 0.0     # prefill + first sample
    decode_tokens: int = 0      # tokens after each row's first, all rows together
    decode_seconds: float = 0.0  # wall time from the first tokens to the last ones
    kv_cache_bytes: int = 0
    full_attention_kv_cache_bytes: int = 0


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),)


def _check_prompts(input_ids, vocab_size: int) -> list[list[int]]:
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of token-id lists, one per prompt "
                         f"(e.g. [[1, 450, 4996]]), got {type(input_ids).__name__}.")
    prompts = []
    for i, row in enumerate(input_ids):
        row = np.asarray(row).tolist() if hasattr(row, "shape") else row
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(row).__name__}; "
                             "tokenize text first (or pass [[ids...]] for one prompt).")
        if not row:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS).")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in row):
            raise ValueError(f"prompt {i} must hold ints only.")
        if min(row) < 0 or max(row) >= vocab_size:
            raise ValueError(f"prompt {i}: token ids must lie in [0, {vocab_size}) (vocab_size), "
                             f"got min {min(row)} max {max(row)}: is the tokenizer the "
                             "model's own?")
        prompts.append([int(t) for t in row])
    return prompts


def resolve_max_len(prompt_len: int, max_new_tokens: int, max_len, max_positions: int) -> int:
    """The cache's max_len: `max_len` if given (checked), else prompt + new tokens rounded up
    to `LENGTH_BUCKET` (within max_position_embeddings)."""
    need = prompt_len + max_new_tokens
    if max_len is None:
        if need > max_positions:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
                f"exceeds the model's max_position_embeddings={max_positions}. Generate fewer "
                "tokens, or raise max_position_embeddings (from_pretrained(..., "
                "max_position_embeddings=N)) for longer contexts.")
        return min(round_up(need, LENGTH_BUCKET), max_positions)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}.")
    if need > max_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{need} exceeds max_len={max_len}: raise max_len or generate fewer.")
    return max_len


def stream_generate(model, input_ids, *, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    stop_at_eos: bool = True, max_len: int | None = None,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, eos_token_id=_FROM_CONFIG,
                    stats: GenerationStats | None = None,
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`generate`, one step at a time: yields `(tokens [B], emitted [B] bool)` per step, where
    `emitted[b]` says whether `tokens[b]` is part of prompt `b`'s output (False once it
    finished). `eos_token_id`: default `model.config.eos_token_id` (an int or a tuple)."""
    cfg = model.config
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}.")
    check_sampling(temperature, top_k, top_p)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    prompts = _check_prompts(input_ids, cfg.vocab_size)
    eos = _eos_ids(cfg.eos_token_id if eos_token_id is _FROM_CONFIG else eos_token_id)
    stats = stats if stats is not None else GenerationStats()
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    stats.prompt_tokens = lengths.tolist()
    max_len = resolve_max_len(longest, max_new_tokens, max_len, cfg.max_position_embeddings)
    cfg.check_length(max_len)
    batch = len(prompts)
    stats.max_len = max_len
    stats.kv_cache_bytes = cache_bytes(cache_shapes(cfg, batch, max_len))
    stats.full_attention_kv_cache_bytes = full_cache_bytes(cfg, batch, max_len)
    if max_new_tokens == 0:
        return
    width = min(round_up(longest, LENGTH_BUCKET), max_len)
    ids = np.zeros((batch, width), np.int32)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    pad = cfg.pad_token_id
    pad = pad if pad is not None and 0 <= pad < cfg.vocab_size else 0

    cache = init_cache(cfg, batch, max_len)
    chunk_size = min(chunk_size, width)
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    start = time.perf_counter()   # compile the prefill's programs and sampling's, untimed
    compile_prefill(model, cache, ids, lengths, chunk_size=chunk_size)
    key = jax.random.PRNGKey(seed)
    sample(jnp.zeros((batch, cfg.vocab_size), jnp.float32), jax.random.fold_in(key, 0),
           **settings).block_until_ready()
    stats.compile_seconds += time.perf_counter() - start

    start = time.perf_counter()
    cache, logits = prefill(model, cache, ids, lengths, chunk_size=chunk_size)
    tokens = sample(logits, jax.random.fold_in(key, 0), **settings)
    tokens.block_until_ready()
    stats.time_to_first_token = time.perf_counter() - start
    yield from decode_loop(model, cache, tokens, lengths, max_new_tokens=max_new_tokens,
                           key=key, stop_at_eos=stop_at_eos, eos=eos, pad=pad, stats=stats,
                           **settings)


@functools.partial(jax.jit, donate_argnames=("cache",),
                   static_argnames=("sampling", "stop_at_eos", "pool_slots"),
                   compiler_options=dict(DECODE_COMPILER_OPTIONS))
def _advance(model_state, cache, tokens, done, step, key, eos, pad, *, sampling,
             stop_at_eos, pool_slots):
    """One token per row, on the device: rows whose last token was an EOS finish (they feed
    `pad` and write nothing), the others decode it; the next tokens are sampled with the key
    of `step + 1`. -> (next tokens, done, step + 1, cache)."""
    if stop_at_eos:
        done = done | jnp.isin(tokens, eos)
    logits, cache = decode_step_traced(model_state, cache, jnp.where(done, pad, tokens),
                                       ~done, pool_slots=pool_slots)
    nxt = sample(logits, jax.random.fold_in(key, step + 1), **dict(sampling))
    return nxt, done, step + 1, cache


def _step_programs(pattern, positions, steps: int, num_slots: int) -> list[bool]:
    """The `pool_slots` values of the `_advance` programs that `steps` decode steps from
    `positions` (one per row) can run: without pooling (any step, once rows finish), and with
    it if some step completes a slot the cache stores."""
    if steps < 1:
        return []
    if not num_slots:
        return [False]
    t = np.asarray(positions)[None, :] + np.arange(steps)[:, None]
    return [False] + ([True] if blocks.completes_slot(pattern, t, num_slots).any() else [])


def decode_loop(model, cache, tokens, lengths, *, max_new_tokens: int, key,
                temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, stop_at_eos: bool = True, eos=(), pad: int = 0,
                stats: GenerationStats | None = None
                ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield `(tokens [B], emitted [B])` for `max_new_tokens` steps from the first sampled
    `tokens` (device array) after a prefill that left row `b` at position `lengths[b]`.

    Pipelined: step n + 1 is dispatched before the tokens of step n are read back, so the
    device never waits for the host (a stop at EOS is seen one step late: that step is
    computed and dropped). Steps where no running row completes a slot skip pooling
    (`decode_step(pool_slots=False)`, decided from the host's positions): a second program.
    Every program the loop can run is compiled before the first step (`stats.compile_seconds`);
    `stats.decode_seconds` is the wall time from the first tokens to the last. The cache is
    consumed.
    """
    from flax import nnx

    stats = stats if stats is not None else GenerationStats()
    model_state = nnx.split(model)
    pattern, num_slots = cache.pattern, cache.num_slots
    sampling = tuple(dict(temperature=temperature, top_k=top_k, top_p=top_p).items())
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)
    positions = np.asarray(lengths, np.int64).copy()   # of the token each row feeds next
    done_dev = jnp.zeros(len(positions), bool)
    step_dev = jnp.zeros((), jnp.int32)
    host_done = np.zeros(len(positions), bool)
    static = dict(sampling=sampling, stop_at_eos=bool(stop_at_eos and eos))
    start = time.perf_counter()
    for pool in _step_programs(pattern, positions, max_new_tokens - 1, num_slots):
        _advance.lower(model_state, cache, tokens, done_dev, step_dev, key, eos_ids, pad,
                       pool_slots=pool, **static).compile()
    stats.compile_seconds += time.perf_counter() - start
    first_out = None
    for step in range(max_new_tokens):
        nxt = None
        if step < max_new_tokens - 1:
            running = positions[~host_done]
            pool = bool(num_slots and blocks.completes_slot(pattern, running, num_slots).any())
            nxt = _advance(model_state, cache, tokens, done_dev, step_dev, key, eos_ids, pad,
                           pool_slots=pool, **static)
            cache = nxt[3]
        emitted = ~np.asarray(done_dev)
        out = np.asarray(tokens)
        if first_out is None:
            first_out = time.perf_counter()
        else:
            stats.decode_tokens += int(emitted.sum())
            stats.decode_seconds = time.perf_counter() - first_out
        yield out, emitted
        if stop_at_eos and eos:
            host_done = ~emitted | np.isin(out, eos)
        else:
            host_done = ~emitted
        if nxt is None or host_done.all():
            return
        tokens, done_dev, step_dev = nxt[0], nxt[1], nxt[2]
        positions += 1


def generate(model, input_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_at_eos: bool = True, max_len: int | None = None,
             chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[list[int]]:
    """New token ids per prompt.

    model: a `LlamaForCausalLM` (e.g. `cca_jax.from_pretrained(dir)`), any attention option.
    input_ids: a list of token-id lists, any lengths (one batch). temperature 0 is greedy;
    otherwise top_k / top_p filter before a seeded draw (`seed`, jax.random). With
    `stop_at_eos`, a prompt's output ends with the model's EOS token (config.eos_token_id)
    when it emits one. max_len: the cache's capacity in tokens (default: the longest prompt
    plus max_new_tokens, rounded up). chunk_size: prefill chunk (memory: cache + one chunk).
    """
    prompts = _check_prompts(input_ids, model.config.vocab_size)
    out: list[list[int]] = [[] for _ in prompts]
    for tokens, emitted in stream_generate(
            model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=stop_at_eos, max_len=max_len,
            chunk_size=chunk_size):
        for row in np.flatnonzero(emitted):
            out[row].append(int(tokens[row]))
    return out


# ---- CLI ---------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class UsageError(Exception):
    """Bad input the user can fix; printed as `error: ...` with exit status 2."""


def check_checkpoint(ckpt) -> Path:
    """The checkpoint directory `--ckpt` names, or a UsageError saying what to pass."""
    from cca_jax.checkpoint import find_config

    path = Path(ckpt)
    if not path.is_dir():
        raise UsageError(f"checkpoint directory {path} does not exist (--ckpt).")
    try:
        find_config(path)
    except FileNotFoundError as e:
        raise UsageError(f"{e} Is --ckpt a converted checkpoint "
                         "(python -m convert.hf_to_flax) or a train/ export?") from None
    return path


def find_tokenizer_dir(ckpt: Path) -> Path:
    """The directory holding the checkpoint's tokenizer (its own, or config.json's)."""
    candidates = [ckpt]
    from cca_jax.checkpoint import find_config
    try:
        candidates.append(find_config(ckpt).parent)
    except FileNotFoundError:
        pass
    for d in candidates:
        if any((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    raise UsageError(
        f"no tokenizer in {ckpt}: expected {' or '.join(TOKENIZER_FILES)} there. "
        "convert.hf_to_flax copies them from the Hugging Face checkpoint; copy them in by hand "
        "for checkpoints converted without one.")


def load_tokenizer(ckpt: Path):
    """`transformers.AutoTokenizer` from the checkpoint's files, offline.

    A bare SentencePiece `tokenizer.model` (no tokenizer.json / tokenizer_config.json, as
    llama.c-style and hand-assembled checkpoints have) is a LLaMA/Mistral tokenizer, which
    puts BOS first (`add_bos_token=True`, the default of transformers' LlamaTokenizer and
    what Meta's own encoder does); transformers 5 would load it without that rule, so it is
    set here. With a tokenizer_config.json / tokenizer.json their own settings apply.
    """
    from transformers import AutoTokenizer

    where = find_tokenizer_dir(ckpt)
    kwargs = {}
    if not any((where / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        kwargs["add_bos_token"] = True
    try:
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True, **kwargs)
    except Exception as e:  # transformers raises many types for unreadable tokenizers
        raise UsageError(f"could not load the tokenizer in {where}: {e}") from None


class TextStream:
    """Incremental detokenization: decode the generated ids (after a few prompt tokens, so
    the first word keeps its leading space) and print only the new suffix. Text that ends in
    an incomplete character (U+FFFD from a partial byte sequence) waits for the next token."""

    CONTEXT = 4

    def __init__(self, tokenizer, prompt_ids: list[int], out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.context = list(prompt_ids[-self.CONTEXT:])
        self.prefix = self._decode(self.context)
        self.ids: list[int] = []
        self.printed = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str:
        full = self._decode(self.context + self.ids)
        return full[len(self.prefix):] if full.startswith(self.prefix) else self._decode(self.ids)

    def put(self, token: int) -> None:
        self.ids.append(int(token))
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self._emit(text)

    def end(self) -> None:
        self._emit(self.text())
        self.out.write("\n")
        self.out.flush()

    def _emit(self, text: str) -> None:
        new = text[len(self.printed):] if text.startswith(self.printed) else ""
        if new:
            self.out.write(new)
            self.out.flush()
        self.printed = text if text.startswith(self.printed) else self.printed


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


ATTENTION_FLAGS = ("attention", "group_size", "window_size", "sink_tokens")


def add_attention_args(ap: argparse.ArgumentParser) -> None:
    """The attention flags every inference CLI shares (generate, cca_jax.eval)."""
    ap.add_argument("--attention", choices=("cca", "full", "sliding", "streaming"),
                    default=None, help="attention option: cca (core tokens plus a local "
                    "window), full, sliding (a window), streaming (sinks plus a window) "
                    "(default: the checkpoint's)")
    ap.add_argument("--group-size", type=int, default=None, metavar="G",
                    help="CCA group size g: one core token per G tokens (default: the "
                    "checkpoint's)")
    ap.add_argument("--window-size", type=int, default=None, metavar="W",
                    help="local window in tokens: CCA's s, sliding's and streaming's W "
                    "(default: the checkpoint's)")
    ap.add_argument("--sink-tokens", type=int, default=None, metavar="N",
                    help="attention sinks: the first N tokens stay visible, raw, to every "
                    "later query (streaming's sinks; cca's, SPEC 6, 0 = the paper's CCA) "
                    "(default: the checkpoint's)")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The flags that change how a checkpoint runs: its attention option and its dtype."""
    add_attention_args(ap)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="parameter and activation dtype (default: the checkpoint's)")


def attention_overrides(a) -> dict:
    """`from_pretrained` overrides from parsed attention flags (the ones given)."""
    return {k: getattr(a, k) for k in ATTENTION_FLAGS if getattr(a, k) is not None}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cca_jax.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, metavar="DIR", help="converted checkpoint "
                    "directory (convert.hf_to_flax output, or a train.finetune export such as "
                    "OUT/final) with its tokenizer (required)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (required: this or "
                     "--prompt-file)")
    src.add_argument("--prompt-file", metavar="FILE", help="file holding the prompt text, "
                     "UTF-8 (required: this or --prompt)")
    ap.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                    help="tokens to generate; fewer where --max-len or the model's "
                    "max_position_embeddings ends first (default: 128)")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding, which is also "
                    "what runs without --temperature (default: off)")
    ap.add_argument("--temperature", type=float, default=None, metavar="T",
                    help="sampling temperature: > 0 samples, 0 is greedy (default: greedy)")
    ap.add_argument("--top-k", type=int, default=None, metavar="K",
                    help="sample among the K most likely tokens only (default: all tokens)")
    ap.add_argument("--top-p", type=float, default=None, metavar="P",
                    help="nucleus sampling: the most likely tokens whose probability "
                    "reaches P, 0 < P <= 1 (default: 1, all tokens)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling draws "
                    "(default: 0)")
    add_model_args(ap)
    ap.add_argument("--max-len", type=int, default=None, metavar="N",
                    help="KV cache capacity in tokens, prompt included (default: prompt + "
                    f"--max-new-tokens, rounded up to a multiple of {LENGTH_BUCKET})")
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, metavar="N",
                    help="prefill chunk in tokens: memory is the cache plus one chunk "
                    f"(default: {DEFAULT_CHUNK_SIZE})")
    return ap


def _read_prompt(a) -> str:
    if a.prompt_file is not None:
        try:
            text = Path(a.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file {a.prompt_file}: {e.strerror}.") from None
    else:
        text = a.prompt
    if not text.strip():
        raise UsageError("the prompt is empty: pass some text with --prompt or --prompt-file.")
    return text


def _check_args(a) -> None:
    for name in ("max_new_tokens",):
        if getattr(a, name) < 0:
            raise UsageError(f"--max-new-tokens must be >= 0, got {getattr(a, name)}.")
    for name in ("group_size", "window_size", "max_len", "chunk_size"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v}.")
    if a.sink_tokens is not None and a.sink_tokens < 0:
        raise UsageError(f"--sink-tokens must be >= 0, got {a.sink_tokens}.")
    if a.greedy and a.temperature not in (None, 0.0):
        raise UsageError("--greedy and --temperature > 0 contradict each other; pick one.")
    try:
        check_sampling(0.0 if a.temperature is None else a.temperature, a.top_k, a.top_p)
    except ValueError as e:
        raise UsageError(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p")) from None


def run(a, out=None, err=None) -> int:
    """The CLI on parsed arguments; raises UsageError for bad input."""
    out, err = out or sys.stdout, err or sys.stderr
    _check_args(a)
    ckpt = check_checkpoint(a.ckpt)
    text = _read_prompt(a)
    tokenizer = load_tokenizer(ckpt)
    prompt_ids = list(tokenizer(text)["input_ids"])
    if a.max_len is not None and len(prompt_ids) > a.max_len:
        raise UsageError(f"the prompt is {len(prompt_ids)} tokens, longer than --max-len "
                         f"{a.max_len}: raise --max-len or shorten the prompt.")
    new_tokens = a.max_new_tokens
    if a.max_len is not None and len(prompt_ids) + new_tokens > a.max_len:
        new_tokens = a.max_len - len(prompt_ids)
        print(f"note: generating {new_tokens} tokens to stay within --max-len {a.max_len}",
              file=err)

    from cca_jax.pretrained import from_pretrained
    try:
        model = from_pretrained(ckpt, dtype=a.dtype, **attention_overrides(a))
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"cannot load the checkpoint {ckpt}: {e}") from None
    cfg = model.config
    if len(prompt_ids) > cfg.max_position_embeddings:
        raise UsageError(f"the prompt is {len(prompt_ids)} tokens, more than the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}.")
    if a.max_len is None and len(prompt_ids) + new_tokens > cfg.max_position_embeddings:
        new_tokens = cfg.max_position_embeddings - len(prompt_ids)
        print(f"note: generating {new_tokens} tokens to stay within max_position_embeddings="
              f"{cfg.max_position_embeddings}", file=err)
    att = cfg.attention
    print(f"attention: {att.kind} (group_size={att.group_size}, window_size={att.window_size}"
          f", sink_tokens={att.sink_tokens})", file=err)
    print(f"prompt tokens: {len(prompt_ids)}", file=err)
    stats = GenerationStats()
    stream = TextStream(tokenizer, prompt_ids, out)
    temperature = 0.0 if a.greedy or a.temperature is None else a.temperature
    try:
        for tokens, emitted in stream_generate(
                model, [prompt_ids], max_new_tokens=new_tokens, temperature=temperature,
                top_k=a.top_k, top_p=a.top_p, seed=a.seed, max_len=a.max_len,
                chunk_size=a.chunk_size, stats=stats):
            if emitted[0]:
                stream.put(int(tokens[0]))
    except ValueError as e:
        raise UsageError(str(e)) from None
    stream.end()
    generated = len(stream.ids)
    if new_tokens:
        print(f"compilation: {stats.compile_seconds:.3f} s (prefill, sampling and decode "
              "programs, before any timing)", file=err)
        print(f"time to first token: {stats.time_to_first_token:.3f} s (prefill and the first "
              "sample)", file=err)
    if stats.decode_tokens:
        rate = stats.decode_tokens / max(stats.decode_seconds, 1e-9)
        print(f"decode: {rate:.1f} tokens/s ({stats.decode_tokens} tokens after the first in "
              f"{stats.decode_seconds:.3f} s)", file=err)
    elif new_tokens == 0:
        print("decode: nothing to generate (--max-new-tokens 0, or the prompt fills the "
              "cache: raise --max-len)", file=err)
    else:
        print(f"decode: {generated} token(s) generated, too few to time decoding", file=err)
    print(f"KV cache: {_size(stats.kv_cache_bytes)} for max_len={stats.max_len} "
          f"(full attention: {_size(stats.full_attention_kv_cache_bytes)})", file=err)
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return run(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
