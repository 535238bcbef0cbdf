"""Generate text from a checkpoint, streamed to stdout.

    python -m cca_jax.generate --ckpt DIR --prompt "Once upon a time" --max-new-tokens 64

streams the continuation to stdout as text; the prompt tokens, compilation time (every
program is compiled before the clocks start), time to first token, decode speed and KV cache
size go to stderr. `--attention/--group-size/--window-size/--sink-tokens`
override the checkpoint's attention settings (CCA's inference flexibility); `--mesh`
(e.g. `data=2,tensor=4`) shards the parameters and the KV cache over several devices.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cca_jax.cli import (UsageError, add_checkpoint_arg, add_model_args, attention_overrides,
                         check_checkpoint, enable_compile_cache, mesh_from_args)
from cca_jax.generate import LENGTH_BUCKET, GenerationStats, stream_generate
from cca_jax.prefill import DEFAULT_CHUNK_SIZE
from cca_jax.sampling import check_sampling
from cca_jax.tokenizer import TextStream, load_tokenizer


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cca_jax.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arg(ap)
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

    mesh = mesh_from_args(a)
    enable_compile_cache(a)
    from cca_jax.model import inference_layers
    from cca_jax.pretrained import from_pretrained
    try:
        model = from_pretrained(ckpt, dtype=a.dtype, **attention_overrides(a))
        model = inference_layers(model, consume=True)   # GEMMs tuned once a shape
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
                chunk_size=a.chunk_size, stats=stats, mesh=mesh):
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
