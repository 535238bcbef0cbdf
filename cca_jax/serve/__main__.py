"""Serve a checkpoint over HTTP with OpenAI's API (FastAPI + uvicorn).

    python -m cca_jax.serve --ckpt DIR --max-batch 8 --max-len 4096

POST /v1/completions and /v1/chat/completions (the tokenizer's chat template), GET /v1/models
and /health (503 while the programs compile at start-up, 200 after). Requests share one
batched KV cache of --max-batch rows x --max-len positions (continuous batching:
cca_jax/serve/engine.py); --max-queue more may wait for a row, beyond that the server answers
503 with Retry-After. Compiled programs are kept in the persistent compilation cache, so a
second start with the same settings loads them. SIGINT / SIGTERM stop taking connections,
let requests in flight finish (up to --shutdown-timeout seconds, then cancel them) and exit
(status 0, 130 after Ctrl-C). If the engine fails (its programs do not compile, the device
runs out of memory), the server stops and exits with status 1 and the error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from cca_jax.cli import (UsageError, add_checkpoint_arg, add_model_args, attention_overrides,
                         check_checkpoint, enable_compile_cache, mesh_from_args)
from cca_jax.serve.engine_config import EngineConfig

DEFAULTS = EngineConfig()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cca_jax.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arg(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                    "127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    ap.add_argument("--model-name", default=None, metavar="NAME", help="the model id clients "
                    "send and /v1/models lists (default: the checkpoint directory's name)")
    ap.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch, metavar="B",
                    help=f"rows of the KV cache: requests generating at once (default: "
                    f"{DEFAULTS.max_batch})")
    ap.add_argument("--max-len", type=int, default=None, metavar="N",
                    help="positions per row: a request's prompt + max_tokens must fit; at "
                    "most the model's max_position_embeddings (default: "
                    f"{DEFAULTS.max_len} or max_position_embeddings, the smaller)")
    ap.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size, metavar="N",
                    help="prompt tokens per prefill chunk while no request is decoding "
                    f"(default: {DEFAULTS.chunk_size})")
    ap.add_argument("--decode-chunk-size", type=int, default=None, metavar="N",
                    help="prompt tokens per prefill chunk while requests are decoding: one "
                    "such chunk runs between two decode steps, so it bounds their "
                    "inter-token time (default: --chunk-size)")
    ap.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                    help="while requests are decoding, run the largest prefill chunk (of the "
                    "lengths from --decode-chunk-size doubling up to --chunk-size, all "
                    "compiled at start-up) whose measured time plus a decode step's stays "
                    "within MS; needs --decode-chunk-size below --chunk-size (default: "
                    "always --decode-chunk-size)")
    ap.add_argument("--prefill-rows", type=int, default=DEFAULTS.prefill_rows, metavar="P",
                    help="requests one prefill chunk carries at most (default: "
                    f"{DEFAULTS.prefill_rows})")
    ap.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue, metavar="Q",
                    help="requests that may wait for a free row; more get 503 with "
                    f"Retry-After (default: {DEFAULTS.max_queue})")
    ap.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                    help="positions the model may run, over the checkpoint's own (raise it, "
                    "usually with a fine-tune at that length, to serve longer contexts) "
                    "(default: the checkpoint's)")
    ap.add_argument("--unroll-chunk-tokens", type=int, default=DEFAULTS.unroll_chunk_tokens,
                    metavar="N", help="on a GPU, prefill chunks of up to N tokens (times "
                    "--prefill-rows) run their layers unrolled: faster turns (7-19%% at the "
                    "7B shape), but each compiles about twice as long at first start; "
                    "larger chunks scan the layers; 0 scans every chunk, the quickest cold "
                    f"start (default: {DEFAULTS.unroll_chunk_tokens})")
    ap.add_argument("--parallel-compile", action="store_true",
                    help="at start-up, compile the prefill and decode programs in threads "
                    "at once instead of one after another (not yet measured faster)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                    help="on SIGINT/SIGTERM, seconds requests in flight may take to finish "
                    "before they are cancelled (default: 30)")
    add_model_args(ap)
    return ap


def _check_args(a) -> None:
    for name in ("max_batch", "max_len", "chunk_size", "decode_chunk_size", "prefill_rows",
                 "group_size", "window_size", "max_position_embeddings"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value}.")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {a.max_queue}.")
    if a.unroll_chunk_tokens < 0:
        raise UsageError(f"--unroll-chunk-tokens must be >= 0, got {a.unroll_chunk_tokens}.")
    if a.decode_chunk_size is not None and a.decode_chunk_size > a.chunk_size:
        raise UsageError(f"--decode-chunk-size ({a.decode_chunk_size}) must be <= "
                         f"--chunk-size ({a.chunk_size}).")
    if a.itl_target_ms is not None:
        if not a.itl_target_ms > 0:
            raise UsageError(f"--itl-target-ms must be a positive number, got "
                             f"{a.itl_target_ms}.")
        if a.decode_chunk_size is None or a.decode_chunk_size >= a.chunk_size:
            raise UsageError("--itl-target-ms chooses among chunk lengths from "
                             "--decode-chunk-size up to --chunk-size: give a "
                             "--decode-chunk-size below --chunk-size.")
    if a.prefill_rows > a.max_batch:
        raise UsageError(f"--prefill-rows ({a.prefill_rows}) must be <= --max-batch "
                         f"({a.max_batch}).")
    if not 0 <= a.port < 65536:
        raise UsageError(f"--port must lie in [0, 65535], got {a.port}.")


def engine_config(a, max_len: int) -> EngineConfig:
    """The engine's settings from parsed arguments (`max_len` resolved against the model)."""
    return EngineConfig(max_batch=a.max_batch, max_len=max_len, chunk_size=a.chunk_size,
                        decode_chunk_size=a.decode_chunk_size, itl_target_ms=a.itl_target_ms,
                        prefill_rows=a.prefill_rows, max_queue=a.max_queue,
                        unroll_chunk_tokens=a.unroll_chunk_tokens,
                        parallel_compile=a.parallel_compile)


def build_server(a):
    """The uvicorn server for parsed arguments (the model is loaded; nothing compiled yet:
    the engine compiles when the server starts)."""
    import uvicorn

    from cca_jax.model import inference_layers
    from cca_jax.pretrained import from_pretrained
    from cca_jax.serve.app import ServerSettings, create_app
    from cca_jax.serve.engine import Engine
    from cca_jax.tokenizer import load_tokenizer

    _check_args(a)
    ckpt = check_checkpoint(a.ckpt)
    mesh = mesh_from_args(a)
    enable_compile_cache(a)
    tokenizer = load_tokenizer(ckpt)
    try:
        overrides = attention_overrides(a)
        if a.max_position_embeddings is not None:
            overrides["max_position_embeddings"] = a.max_position_embeddings
        model = from_pretrained(ckpt, dtype=a.dtype, **overrides)
        model = inference_layers(model, consume=True)   # GEMMs tuned once a shape
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"cannot load the checkpoint {ckpt}: {e}") from None
    eos = model.config.eos_token_id
    if eos is None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
    max_len = a.max_len or min(DEFAULTS.max_len, model.config.max_position_embeddings)
    config = engine_config(a, max_len)
    try:
        engine = Engine(model, config, eos=eos, mesh=mesh)
    except ValueError as e:
        raise UsageError(str(e).replace("max_len", "--max-len").replace(
            "load the model with a larger max_position_embeddings",
            "pass a larger --max-position-embeddings")) from None
    settings = ServerSettings(model_name=a.model_name or ckpt.resolve().name,
                              shutdown_timeout_s=a.shutdown_timeout)
    app = create_app(engine, tokenizer, settings)
    att = model.config.attention
    print(f"serving {settings.model_name!r} ({att.kind} attention, KV cache "
          f"{engine.kv_cache_bytes / 2**20:.1f} MiB for {a.max_batch} x {max_len}) on "
          f"http://{a.host}:{a.port}; /health answers 503 until the programs are compiled",
          file=sys.stderr, flush=True)
    return uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level="info",
                                         timeout_graceful_shutdown=a.shutdown_timeout))


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        server = build_server(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again (inside
    # its event loop): these handlers only note it, for the exit status: 0 after SIGTERM (a
    # supervisor's stop), 130 after Ctrl-C.
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    engine = server.config.app.state.engine
    threading.Thread(target=_exit_when_the_engine_fails, args=(engine, server), daemon=True,
                     name="cca-jax-engine-watch").start()
    server.run()
    if engine.error is not None:
        print(f"error: the engine failed ({type(engine.error).__name__}: {engine.error}); "
              "the traceback is in the log above.", file=sys.stderr)
        return 1
    return 130 if signal.SIGINT in received else 0


def _exit_when_the_engine_fails(engine, server) -> None:
    """A server whose engine has failed (at start-up or later) can serve nothing: shut it
    down, so that the process ends with an error a supervisor sees, instead of answering
    503 for ever."""
    engine.stopped.wait()
    if engine.error is not None:
        server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
