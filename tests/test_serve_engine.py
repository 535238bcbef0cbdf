"""The serving engine and CLI without a server: continuous batching over a tiny model
(generate()'s greedy tokens through parallel compiles, a mesh and the ITL-target chunk
picker), the engine's configuration and its CLI flags, the compile-cache flags, and the trace
benchmark's code paths.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]


def test_engine_unrolls_its_small_chunks_on_gpus_only(monkeypatch):
    """`EngineConfig.unrolls`: on a GPU, prefill chunks of up to `unroll_chunk_tokens`
    tokens (prefill_rows x chunk) run their layers unrolled; larger ones, every chunk on
    other backends, and every chunk with 0 keep the scan (`generate` always does)."""
    from cca_jax.serve import engine, engine_config
    cfg = engine_config.EngineConfig(chunk_size=4096, decode_chunk_size=256)
    assert cfg.unroll_chunk_tokens == 2048                        # the default
    assert not cfg.unrolls(256)                                   # this CPU
    monkeypatch.setattr(engine_config.jax, "default_backend", lambda: "gpu")
    assert cfg.unrolls(256) and cfg.unrolls(2048) and not cfg.unrolls(4096)
    assert dataclasses.replace(cfg, prefill_rows=4).unrolls(512)         # 2048 tokens
    assert not dataclasses.replace(cfg, prefill_rows=4).unrolls(1024)    # 4096 tokens
    assert not dataclasses.replace(cfg, unroll_chunk_tokens=0).unrolls(1)
    with pytest.raises(ValueError, match="unroll_chunk_tokens must be an int >= 0"):
        dataclasses.replace(cfg, unroll_chunk_tokens=-1).check()
    # and the engine's prefill program is called so
    calls = []

    def program(*args, unroll):
        calls.append((args[3].shape, unroll))
        return np.zeros(args[3].shape[0], np.int32), None, args[1]
    monkeypatch.setattr(engine.programs, "prefill_and_sample", program)
    fake = types.SimpleNamespace(config=cfg, mesh=None, _model_state=None, _cache=None)
    fake._settings = lambda seqs: engine.Engine._settings(fake, seqs)
    for chunk in (256, 4096):
        engine.Engine._run_prefill(fake, None, np.zeros((1, chunk), np.int32),
                                   np.zeros(1, np.int32), [None])
    assert calls == [((1, 256), True), ((1, 4096), False)]


def test_compile_cache_flags(tmp_path, monkeypatch):
    from cca_jax.cli import add_compile_cache_args, default_compile_cache_dir
    import argparse

    ap = argparse.ArgumentParser()
    add_compile_cache_args(ap)
    monkeypatch.setenv("CCA_JAX_CACHE_DIR", str(tmp_path))
    assert default_compile_cache_dir() == tmp_path / "jax-compile"
    assert ap.parse_args([]).compile_cache is None
    assert ap.parse_args(["--no-compile-cache"]).no_compile_cache
    with pytest.raises(SystemExit):
        ap.parse_args(["--no-compile-cache", "--compile-cache", "x"])
    monkeypatch.delenv("CCA_JAX_CACHE_DIR")
    assert default_compile_cache_dir() == Path.home() / ".cache" / "cca-jax" / "jax-compile"
    assert json.dumps(str(default_compile_cache_dir()))


@pytest.mark.slow   # ~25 s: the benchmark's code path (the H200 run is its real use)
def test_serve_trace_benchmark_small_mode(tmp_path):
    """benchmarks/serve_trace.py --small: the H200 trace's code path on a tiny model, in
    process (no start-time children)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.serve_trace import main

    out = tmp_path / "trace"
    assert main(["--small", "--attention", "cca", "--no-start-times", "--out", str(out)]) == 0
    rec = json.loads(out.with_suffix(".json").read_text())[0]
    assert rec["errors"] == 0 and rec["generated_tokens"] == 8 * 8
    assert not rec["partial"] and rec["completed"] == 8 and rec["startup_s"] > 0
    assert rec["compilations_since_ready"] == 0 and rec["max_rows_busy"] >= 2
    assert rec["ttft_p95_s"] >= rec["ttft_p50_s"] > 0 and rec["itl_p50_ms"] > 0
    assert {"device", "jax", "date", "command", "commit"} <= set(rec)
    assert "| cca | 4 |" in out.with_suffix(".md").read_text()
    # the engine's step times: each request's first token comes from its last prefill
    # chunk, every other one from a decode step; every prompt token went through a chunk
    times = rec["step_times"]
    assert times["decode_tokens"] == rec["generated_tokens"] - rec["requests"]
    from benchmarks.serve_trace import SMALL, make_requests
    assert times["prefill_tokens"] == sum(len(p) for _, p, _ in make_requests(SMALL, 256))
    assert times["prefill_chunks"] >= rec["requests"] and times["decode_steps"] >= 8
    assert 1 <= rec["rows_per_step"] <= 4 and rec["step_decode_tokens_per_s"] > 0
    assert rec["decode_step_ms"] > 0 and rec["prefill_chunk_ms"] > 0
    assert rec["host_ms_per_turn"] >= 0 and times["turns"] >= times["decode_steps"]


def test_serve_trace_deadline_reports_what_was_served():
    """--deadline: a trace that cannot finish in time returns its measurements so far, marked
    partial, instead of nothing (an engine stub: request 0 ends after two tokens, request 1
    gets one token and never ends)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.serve_trace import serve_trace

    class Stub:
        def submit(self, request, on_event):
            on_event(1, None)
            if len(request.prompt) == 3:
                on_event(2, None)
                on_event(None, "length")

    requests = [(0.0, [1, 2, 3], 2), (0.0, [4, 5], 2)]
    got = serve_trace(Stub(), requests, deadline_s=0.05)
    assert got["partial"] and got["completed"] == 1 and got["errors"] == 0
    assert got["generated_tokens"] == 3 and got["itl_p50_ms"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("unstacked", [False, True], ids=["stacked", "unstacked"])
def test_engine_over_a_mesh_equals_generate(unstacked):
    """The engine over the devices (rows over data, heads over tensor 2; the sharding table)
    gives each request generate()'s greedy tokens, prefilling 2 rows of 4 at a time; also
    with the layers unstacked as the CLIs hold them on a GPU (`unstack_layers`), against
    generate() on the stacked model."""
    from cca_jax.config import LlamaConfig
    from cca_jax.generate import generate
    from cca_jax.model import LlamaForCausalLM, unstack_layers
    from cca_jax.serve.engine import Engine
    from cca_jax.serve.engine_config import EngineConfig
    from cca_jax.sharding import make_mesh, parse_mesh

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      dtype="float32", param_dtype="float32", eos_token_id=None,
                      attention={"kind": "cca", "group_size": 4, "window_size": 6})
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 40, 1, 17, 70, 9)]
    want = [generate(model, [p], max_new_tokens=10, max_len=128)[0] for p in prompts]
    if unstacked:
        model = unstack_layers(model)
    engine = Engine(model, EngineConfig(max_batch=4, max_len=128, chunk_size=16,
                                        prefill_rows=2),
                    mesh=make_mesh(parse_mesh("data=-1,tensor=2")))
    assert _served(engine, prompts, 10) == want
    assert engine.stats()["compilations_since_ready"] == 0


def _tiny_engine_model():
    """A tiny float32 CCA model (max_len 96) and two prompts, 3 and 39 tokens, for engines
    built in a test."""
    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      dtype="float32", param_dtype="float32", eos_token_id=None,
                      attention={"kind": "cca", "group_size": 4, "window_size": 6})
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(1)), [[5, 6, 7], list(range(1, 40))]


def _served(engine, prompts, max_tokens: int) -> list[list[int]]:
    """Start `engine`, submit every prompt at once, wait for all, shut it down: the tokens
    each got (the engine must not have failed)."""
    import threading

    from cca_jax.serve.engine import Request
    got, done = [[] for _ in prompts], threading.Semaphore(0)

    def listener(i):
        def on_event(token, reason):
            done.release() if token is None else got[i].append(token)
        return on_event
    engine.start()
    try:
        for i, p in enumerate(prompts):
            engine.submit(Request(p, max_tokens=max_tokens), listener(i))
        for _ in prompts:
            assert done.acquire(timeout=120)
    finally:
        engine.shutdown()
    assert engine.error is None
    return got


def test_parallel_compile_compiles_each_program_once_and_serves_generates_tokens():
    """`parallel_compile`: the prefill and decode programs lowered, then compiled in threads
    at once; the warm-up's calls find them in jit's cache (as many compilations at start-up
    as one after another, none after ready), and requests get generate()'s greedy tokens."""
    from cca_jax.generate import generate
    from cca_jax.serve.engine import Engine
    from cca_jax.serve.engine_config import EngineConfig

    model, prompts = _tiny_engine_model()
    want = [generate(model, [p], max_new_tokens=6, max_len=96)[0] for p in prompts]
    counts = {}
    for parallel in (False, True):
        jax.clear_caches()
        engine = Engine(model, EngineConfig(max_batch=2, max_len=96, chunk_size=16,
                                            decode_chunk_size=8, parallel_compile=parallel))
        assert _served(engine, prompts, 6) == want, parallel
        stats = engine.stats()
        assert stats["compilations_since_ready"] == 0
        counts[parallel] = stats["compilations_at_startup"]
    assert counts[True] == counts[False] > 0, counts


@pytest.mark.parametrize("flags,message", [
    (["--chunk-size", "16", "--decode-chunk-size", "32"],
     r"--decode-chunk-size \(32\) must be <= --chunk-size \(16\)"),
    (["--decode-chunk-size", "0"], "--decode-chunk-size must be a positive integer"),
    (["--max-batch", "2", "--prefill-rows", "3"], r"--prefill-rows \(3\) must be <= --max-batch"),
    (["--itl-target-ms", "40"], "--itl-target-ms .*give a --decode-chunk-size below"),
    (["--decode-chunk-size", "8", "--itl-target-ms", "0"], "--itl-target-ms must be a positive"),
    (["--unroll-chunk-tokens", "-1"], "--unroll-chunk-tokens must be >= 0"),
])
def test_cli_rejects_bad_chunk_and_row_settings(flags, message, capsys):
    """Checked before the checkpoint loads: exit 2 with the flag and the fix."""
    from cca_jax.serve.__main__ import main
    assert main(["--ckpt", "does-not-matter", *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_flags_map_onto_the_engine_config():
    """Every engine flag reaches `EngineConfig` (one source of truth), and a default flag
    leaves the config's default."""
    from cca_jax.serve.__main__ import build_parser, engine_config
    from cca_jax.serve.engine_config import EngineConfig
    flags = ["--ckpt", "x", "--max-batch", "3", "--chunk-size", "64", "--decode-chunk-size",
             "16", "--itl-target-ms", "30", "--prefill-rows", "2", "--max-queue", "5",
             "--unroll-chunk-tokens", "0", "--parallel-compile"]
    assert engine_config(build_parser().parse_args(flags), 96) == EngineConfig(
        max_batch=3, max_len=96, chunk_size=64, decode_chunk_size=16, itl_target_ms=30.0,
        prefill_rows=2, max_queue=5, unroll_chunk_tokens=0, parallel_compile=True)
    assert engine_config(build_parser().parse_args(["--ckpt", "x"]), 96) == \
        EngineConfig(max_len=96)


def test_pick_interleaved_chunk():
    """Of the chunk lengths whose running time fits the turn's budget: the smallest that
    holds the rest of the prompt, else the largest; the smallest length if none fits (an
    unmeasured length never fits)."""
    from cca_jax.serve.engine_config import pick_interleaved_chunk
    sizes, ms = (256, 512, 1024, 2048), {256: 6.0, 512: 9.0, 1024: 15.0, 2048: 28.0}
    assert pick_interleaved_chunk(sizes, ms, 20.0, 100_000) == 1024
    assert pick_interleaved_chunk(sizes, ms, 20.0, 300) == 512
    assert pick_interleaved_chunk(sizes, ms, 20.0, 100) == 256
    assert pick_interleaved_chunk(sizes, ms, 5.0, 100_000) == 256          # none fits
    assert pick_interleaved_chunk(sizes, {256: 6.0}, 50.0, 100_000) == 256   # unmeasured
    assert pick_interleaved_chunk(sizes, ms, 50.0, 100_000) == 2048


def test_itl_target_config():
    """`itl_target_ms` compiles the doublings of decode_chunk_size up to chunk_size, and
    needs a decode_chunk_size below chunk_size."""
    from cca_jax.serve.engine_config import EngineConfig
    cfg = EngineConfig(chunk_size=2048, decode_chunk_size=256, itl_target_ms=40.0)
    assert cfg.interleaved_chunk_sizes == cfg.chunk_sizes == (256, 512, 1024, 2048)
    assert EngineConfig(chunk_size=600, decode_chunk_size=256,
                        itl_target_ms=40).interleaved_chunk_sizes == (256, 512, 600)
    assert dataclasses.replace(cfg, itl_target_ms=None).chunk_sizes == (256, 2048)
    for bad, says in [(dict(itl_target_ms=0.0), "positive number"),
                      (dict(itl_target_ms=True), "positive number"),
                      (dict(decode_chunk_size=None), "decode_chunk_size below chunk_size"),
                      (dict(decode_chunk_size=2048), "decode_chunk_size below chunk_size")]:
        with pytest.raises(ValueError, match=says):
            dataclasses.replace(cfg, **bad).check()


@pytest.mark.parametrize("target_ms,chunks", [(1e9, 3), (1e-9, 10)], ids=["loose", "tight"])
def test_itl_target_picks_the_interleaved_chunk(target_ms, chunks):
    """A 39-token prompt prefilled while another row decodes, with chunk lengths 4, 8, 16: a
    target every length fits runs 16 + 16 + 8 (the smallest holding the last 7), one no
    length fits runs 4s. No program compiles after start-up, and both answers are
    generate()'s."""
    from cca_jax.generate import generate
    from cca_jax.serve.engine import Engine
    from cca_jax.serve.engine_config import EngineConfig

    model, prompts = _tiny_engine_model()
    want = [generate(model, [p], max_new_tokens=40, max_len=96)[0] for p in prompts]
    engine = Engine(model, EngineConfig(max_batch=2, max_len=96, chunk_size=16,
                                        decode_chunk_size=4, itl_target_ms=target_ms))
    assert _served(engine, prompts, 40) == want
    stats = engine.stats()
    assert stats["compilations_since_ready"] == 0
    assert stats["step_times"]["interleaved_chunks"] == chunks
    assert stats["step_times"]["interleaved_tokens"] == 39
    assert set(stats["program_ms"]) == {"4", "8", "16", "decode"}


def test_serve_trace_start_children_take_the_trace_flags_and_another_max_len(monkeypatch):
    """The start-time children get the trace's flags; the third one (`other_len_start_s`) a
    shorter `--max-len`, so that every program compiles anew against a filled cache."""
    sys.path.insert(0, str(ROOT))
    import benchmarks.serve_trace as serve_trace

    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        return types.SimpleNamespace(stdout='noise\n{"ready": true}\n')
    monkeypatch.setattr(serve_trace.subprocess, "run", run)
    args = serve_trace.build_parser().parse_args(
        ["--small", "--attention", "cca", "--chunk-size", "16", "--max-len", "256"])
    trace = dataclasses.replace(serve_trace.SMALL, max_len=256)
    for max_len in (None, serve_trace.other_max_len(trace)):
        assert serve_trace.start_time("cca", args, "/tmp/cache", max_len) >= 0
    value = lambda cmd, flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert [value(c, "--max-len") for c in commands] == ["256", "192"]
    for cmd in commands:
        assert "--start-only" in cmd and "--small" in cmd
        assert value(cmd, "--chunk-size") == "16" and value(cmd, "--compile-cache") == "/tmp/cache"
