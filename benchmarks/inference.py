"""Long-context inference through the KV cache: time to first token, decode speed, cache size.

    python benchmarks/inference.py --impl cca --contexts 32768,131072 --out /tmp/inf_cca
    python benchmarks/inference.py --impl full --contexts 32768,131072 --out /tmp/inf_full
    python benchmarks/inference.py --impl hf_sdpa --contexts 32768,131072 --out /tmp/inf_hf
    python benchmarks/inference.py --impl cca --contexts 131072 --batch 16 --no-prefill ...
    python benchmarks/inference.py --impl cca --contexts 1048576 --chunk 65536 ...
    python benchmarks/inference.py --merge /tmp/inf_*.json --out benchmarks/results/inference_h200

One attention option (or transformers' sdpa LLaMA) per process, so each peak memory is its
own. A LLaMA-2-7B-shaped model with random bf16 weights (`--shape tiny` for a CPU check).
For each context C (B prompts of C random tokens):
  * time to first token: `cca_jax.prefill.prefill` of the prompts (in chunks of `--chunk`;
    default one chunk) into a fresh cache, plus the greedy first token, measured on a second
    run (the first compiles; its time is recorded as `first_call_s`);
  * decode: greedy steps after that prefill through `cca_jax.generate.decode_loop`, as
    `generate` runs them (pipelined; pooling only in steps that complete a slot): the mean
    time between tokens over `--decode-tokens` steps after `--decode-warmup` steps
    (`decode_ms_per_token`, all B rows advancing together: aggregate tokens/s =
    1000 B / decode_ms_per_token; the median too). transformers' loop syncs every step
    (its own `generate` does as well): the median step after two warm-up steps;
  * KV cache bytes (`kv_cache.cache_bytes`) and the device's peak memory of the process.
`--no-prefill` skips the prefill: the cache is created with every row's length set to C (its
keys/values zeros; a decode step reads every visible entry whatever the values, so the step
time is that of a real C-token context) - for batches whose prefill would take minutes.
`hf_sdpa`: transformers' `LlamaForCausalLM` (attn_implementation="sdpa", bf16, on the GPU):
`model(ids, use_cache=True)` then one-token steps with its past_key_values.
`--ckpt DIR`: a converted or fine-tuned checkpoint (its own attention settings) in place of
the random model.

Writes `<out>.json` (records: impl, context, batch, ttft_s, first_call_s,
decode_ms_per_token, tokens_per_s, kv_cache_bytes, full_kv_cache_bytes, peak_gib, chunk,
device, versions, date, command; with `--check-chunk N`: the largest logit difference and
argmax agreement between one prefill and a prefill in chunks of N) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.measure import (PAPER_PATTERNS, claim_output, read_records,  # noqa: E402
                                write_results)

# Model shapes (random weights): the paper's LLaMA-2-7B, and a tiny one for CPU checks.
SHAPES = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    # head dims 80 and 96 (zero-padded to the 128-wide kernels; the decode kernel reads the
    # cache in place, masked): phi-2's and phi-3-mini's widths as LLaMA-family shapes
    "d80-2.7b": dict(vocab_size=32000, hidden_size=2560, intermediate_size=10240,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "d96-3.8b": dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, dtype="float32",
                 param_dtype="float32"),
}
OUR_IMPLS = ("cca", "full", "sliding", "streaming")
DECODE_WARMUP = 2


def _gib(n: int) -> float:
    return round(n / 2**30, 2)


def _max_len(context: int, decode_tokens: int) -> int:
    return -(-(context + decode_tokens) // 64) * 64


def _where(extra: dict) -> dict:
    from benchmarks.measure import stamp
    return dict(stamp(), **extra)


def decode_times(model, cache, token, context: int, steps: int) -> list[float]:
    """ms between tokens of `steps` greedy steps of `generate.decode_loop` (as generate runs:
    pipelined, pooling only in steps that complete a slot) from `cache` at `context`."""
    import jax
    import numpy as np

    from cca_jax.generate import decode_loop

    times, last = [], time.perf_counter()
    for _ in decode_loop(model, cache, token, np.full(token.shape[0], context),
                         max_new_tokens=steps, key=jax.random.PRNGKey(0), stop_at_eos=False):
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    return times


def load_checkpoint(path: str, max_len: int, dtype: str):
    """A converted or fine-tuned checkpoint in `dtype`, with its own attention settings, able
    to hold `max_len` positions."""
    from cca_jax.checkpoint import find_config
    from cca_jax.config import LlamaConfig
    from cca_jax.pretrained import from_pretrained

    stored = LlamaConfig.from_pretrained_dir(find_config(path))
    return from_pretrained(path, dtype=dtype, max_position_embeddings=max(
        stored.max_position_embeddings, max_len))


def bench_ours(kind: str, args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cca_jax.config import LlamaConfig
    from cca_jax.decode import decode_implementation, offset_implementation
    from cca_jax.prefill import prefill
    from cca_jax.kv_cache import cache_bytes, full_cache_bytes, init_cache
    from cca_jax.model import LlamaForCausalLM, inference_layers

    contexts = [int(c) for c in args.contexts.split(",")]
    steps = args.decode_warmup + args.decode_tokens
    if args.ckpt:
        model = load_checkpoint(args.ckpt, _max_len(max(contexts), steps), args.dtype)
        cfg, kind = model.config, model.config.attention.kind
    else:
        p = PAPER_PATTERNS[kind]
        cfg = LlamaConfig(**SHAPES[args.shape],
                          max_position_embeddings=_max_len(max(contexts), steps),
                          attention=dict(kind=kind, group_size=p.group_size,
                                         window_size=p.window_size, sink_tokens=p.sink_tokens,
                                         implementation=args.implementation))
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    if not args.stacked_layers:   # as the generate and serve CLIs hold it
        model = inference_layers(model, consume=True)
    decode_impl = decode_implementation(cfg)
    rng = np.random.default_rng(0)
    records = []
    for context in contexts:
        max_len = _max_len(context, steps)
        chunk = args.chunk or context
        ids = rng.integers(0, cfg.vocab_size, (args.batch, context)).astype(np.int32)

        def fresh_prefill():
            start = time.perf_counter()
            cache = init_cache(cfg, args.batch, max_len)
            cache, logits = prefill(model, cache, ids, chunk_size=chunk)
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            token.block_until_ready()
            return cache, token, time.perf_counter() - start

        rec = dict(impl=kind, implementation=cfg.attention.implementation, context=context,
                   batch=args.batch, chunk=chunk,
                   model=args.ckpt or args.shape, stacked_layers=not model.layers_unstacked,
                   offset_impl=offset_implementation(cfg), decode_impl=decode_impl)
        if args.no_prefill:
            cache = init_cache(cfg, args.batch, max_len)
            cache = cache.replace(lengths=jnp.full((args.batch,), context, jnp.int32))
            token = jnp.zeros((args.batch,), jnp.int32)
            rec.update(ttft_s=None, first_call_s=None)
        else:
            cache, token, first_s = fresh_prefill()
            rec["first_call_s"] = round(first_s, 3)
            if args.prefill_runs > 1:
                del cache
                cache, token, ttft = fresh_prefill()
            else:
                ttft = first_s
            rec["ttft_s"] = round(ttft, 3)
            if args.check_chunk and args.check_chunk < context:
                # The same prompt in chunks at an offset: the first token's logits agree.
                _, one = prefill(model, init_cache(cfg, args.batch, max_len), ids,
                                 chunk_size=context)
                _, chunked = prefill(model, init_cache(cfg, args.batch, max_len), ids,
                                     chunk_size=args.check_chunk)
                rec["chunked_logits_max_abs_diff"] = float(jnp.abs(one - chunked).max())
                rec["chunked_same_argmax"] = bool(
                    (jnp.argmax(one, -1) == jnp.argmax(chunked, -1)).all())
                rec["check_chunk"] = args.check_chunk
            print(f"{kind} C={context} B={args.batch}: first call {first_s:.2f} s, "
                  f"TTFT {ttft:.3f} s", flush=True)
        # Decode as generate runs it (cca_jax.generate.decode_loop: pipelined, pooling only
        # in steps that complete a slot): the mean time between tokens over --decode-tokens
        # steps after --decode-warmup steps (which compile both step programs).
        times = decode_times(model, cache, token, context, steps)
        steady = times[args.decode_warmup:]
        ms = statistics.mean(steady)
        stats = jax.devices()[0].memory_stats() or {}
        rec.update(decode_ms_per_token=round(ms, 3),
                   decode_ms_median=round(statistics.median(steady), 3),
                   decode_first_steps_ms=round(times[0] + times[1], 1), decode_steps=len(steady),
                   tokens_per_s=round(1e3 * args.batch / ms, 1),
                   kv_cache_bytes=cache_bytes(cache),
                   full_kv_cache_bytes=full_cache_bytes(cfg, args.batch, max_len),
                   peak_gib=_gib(stats.get("peak_bytes_in_use", 0)), **_where({}))
        print(json.dumps(rec), flush=True)
        records.append(rec)
        del cache
    return records


def bench_hf_sdpa(args) -> list[dict]:
    import numpy as np
    import torch
    import transformers

    contexts = [int(c) for c in args.contexts.split(",")]
    shape = dict(SHAPES[args.shape])
    shape.pop("dtype", None), shape.pop("param_dtype", None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.LlamaConfig(
        **shape, max_position_embeddings=_max_len(max(contexts), args.decode_tokens))
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    layers, hkv = hf_cfg.num_hidden_layers, hf_cfg.num_key_value_heads
    head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads
    records = []
    with torch.no_grad():
        def fresh_prefill(ids):
            sync()
            start = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1)
            sync()
            return out.past_key_values, token, time.perf_counter() - start

        for context in contexts:
            ids = torch.as_tensor(rng.integers(0, hf_cfg.vocab_size, (args.batch, context)),
                                  device=device)
            past, token, first_s = fresh_prefill(ids)
            ttft = first_s
            if args.prefill_runs > 1:
                del past
                past, token, ttft = fresh_prefill(ids)
            print(f"hf_sdpa C={context}: first call {first_s:.2f} s, TTFT {ttft:.3f} s",
                  flush=True)
            times = []
            for _ in range(args.decode_tokens):
                sync()
                start = time.perf_counter()
                out = model(token[:, None], past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1)
                sync()
                times.append((time.perf_counter() - start) * 1e3)
            ms = statistics.median(times[DECODE_WARMUP:] or times)
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
            max_len = context + args.decode_tokens
            rec = dict(impl="hf_sdpa", context=context, batch=args.batch, chunk=context,
                       first_call_s=round(first_s, 3), ttft_s=round(ttft, 3),
                       decode_ms_per_token=round(ms, 3), decode_first_step_ms=round(times[0], 1),
                       tokens_per_s=round(1e3 * args.batch / ms, 1),
                       kv_cache_bytes=2 * layers * args.batch * max_len * hkv * head_dim * 2,
                       full_kv_cache_bytes=2 * layers * args.batch * max_len * hkv * head_dim * 2,
                       peak_gib=_gib(peak), torch=torch.__version__,
                       transformers=transformers.__version__, **_where({}))
            print(json.dumps(rec), flush=True)
            records.append(rec)
            del past
    return records


def table(records: list[dict]) -> list[str]:
    """Markdown rows; "x full" divides by the fastest full-attention record of the same
    context and batch (TTFT and decode separately: merged tables may hold several)."""
    code = any("code" in r for r in records)
    lines = ["| impl | context | batch | chunk | TTFT s | x full | decode ms/token | "
             "x full | tokens/s | KV cache GiB | % of full's | peak GiB |" + (" code |" * code),
             "| --- " * (12 + code) + "|"]

    def fastest_full(r, key):
        times = [f[key] for f in records if f["impl"] == "full" and f[key]
                 and (f["context"], f["batch"]) == (r["context"], r["batch"])]
        return min(times, default=None)

    for r in records:
        ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}"
        full_ttft, full_dec = fastest_full(r, "ttft_s"), fastest_full(r, "decode_ms_per_token")
        x_ttft = f"{full_ttft / r['ttft_s']:.2f}x" if full_ttft and r["ttft_s"] else "-"
        x_dec = f"{full_dec / r['decode_ms_per_token']:.2f}x" if full_dec else "-"
        share = 100 * r["kv_cache_bytes"] / r["full_kv_cache_bytes"]
        lines.append(f"| {r['impl']} | {r['context']} | {r['batch']} | {r['chunk']} | {ttft} | "
                     f"{x_ttft} | {r['decode_ms_per_token']:.2f} | {x_dec} | "
                     f"{r['tokens_per_s']:.0f} | {_gib(r['kv_cache_bytes']):.2f} | "
                     f"{share:.1f}% | {r['peak_gib']:.1f} |" + (f" {r.get('code', '')} |" * code))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=(*OUR_IMPLS, "hf_sdpa"), default="cca")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: one chunk)")
    ap.add_argument("--decode-tokens", type=int, default=32,
                    help="timed decode steps (their mean is decode_ms_per_token)")
    ap.add_argument("--decode-warmup", type=int, default=20,
                    help="untimed steps first: more than g, so both step programs compile")
    ap.add_argument("--prefill-runs", type=int, default=2,
                    help="1: the TTFT includes compilation; 2: a second, warm run")
    ap.add_argument("--check-chunk", type=int, default=0,
                    help="also prefill in chunks of this size and compare the logits")
    ap.add_argument("--no-prefill", action="store_true",
                    help="time decode on a cache whose lengths are set to the context")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--implementation", default="auto",
                    help="the attention implementation of --shape's model (default: auto); "
                    "prefill chunks and decode steps use that backend's entries")
    ap.add_argument("--ckpt", default=None,
                    help="a converted or fine-tuned checkpoint instead of --shape's random "
                         "weights; its own attention settings replace --impl")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="--ckpt's parameter and activation dtype (default bfloat16)")
    ap.add_argument("--stacked-layers", action="store_true",
                    help="keep the layers stacked as training does, not as the CLIs hold them "
                    "for inference (`model.inference_layers`): a comparison")
    ap.add_argument("--out", default="benchmarks/results/inference_h200")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="instead of measuring, combine earlier --out JSON files into --out")
    args = ap.parse_args(argv)
    claim_output(args.out)
    if args.merge:
        records = read_records(args.merge)
    elif args.impl == "hf_sdpa":
        records = bench_hf_sdpa(args)
    else:
        records = bench_ours(args.impl, args)
    first = records[0]
    versions = f"jax {first['jax']}" + "".join(
        f"; {k} {first[k]}" for k in ("torch", "transformers") if k in first)
    header = [f"# Long-context inference on {first['device']}", "",
              f"- date: {first['date']}; {versions}",
              *[f"- command: `{c}`" for c in sorted({r['command'] for r in records})],
              *[f"- checkpoint (its own attention settings): `{m}`" for m in sorted(
                  {r.get("model", "llama2-7b") for r in records} - set(SHAPES))],
              "- otherwise LLaMA-2-7B shape, random bf16 weights; cca g = 16, s = 1024; "
              "sliding W = 1024;"
              " streaming N = 4, W = 1024; greedy; TTFT = prefill + first token (warm run); "
              "decode = mean time between tokens of a pipelined loop (ours), median step (hf); "
              "rows with TTFT '-' were measured "
              "on a cache whose lengths were set to the context (--no-prefill); x full: "
              "against the fastest full-attention row of the same context and batch", ""]
    write_results(args.out, records, "\n".join(header + table(records)) + "\n")


if __name__ == "__main__":
    main()
