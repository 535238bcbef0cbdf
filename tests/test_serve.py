"""The OpenAI-compatible server (`python -m cca_jax.serve`): the official `openai` client
against a server this module starts on loopback (completions, chat, streaming, stop strings,
seeds), bad requests and their error objects, a client that disconnects mid-stream, a bounded
load test whose greedy answers must equal `generate()` run one request at a time, compile
counting, a full queue, and shutdown on SIGTERM / SIGINT.

Speed: one tiny float32 checkpoint with the Llama 2 vocabulary; one server for the module
(compiled once; its persistent compilation cache lies in a temporary directory, so the
shutdown tests' servers load their programs from it); prompts in the load test are token ids.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests import hf_fixtures as fx
from tests.xla_flags import xla_flags

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

# one worker runs the whole module: its module-scoped fixtures are built once, not per worker
pytestmark = pytest.mark.xdist_group("serve")


ROOT = Path(__file__).resolve().parents[1]
LLAMA2_TOKENIZER = fx.DATA_DIR / "llama2_tokenizer.model"
MAX_LEN = 256
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
SERVER_FLAGS = ["--max-batch", "4", "--max-len", str(MAX_LEN), "--chunk-size", "16",
                "--decode-chunk-size", "8", "--prefill-rows", "2", "--max-queue", "64"]


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random LLaMA (CCA g=4, s=8) with the Llama 2 tokenizer and a chat template;
    `ckpt.parent / "plain"` is the same without a template."""
    if not LLAMA2_TOKENIZER.exists():
        pytest.skip(f"{LLAMA2_TOKENIZER} not found (shared test data is absent)")
    from cca_jax.checkpoint import save_pretrained
    from cca_jax.config import LlamaConfig
    from cca_jax.model import LlamaForCausalLM
    from cca_jax.tokenizer import load_tokenizer

    base = tmp_path_factory.mktemp("serve")
    d = base / "tiny-chat"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_LEN, dtype="float32", param_dtype="float32",
                      bos_token_id=1, eos_token_id=2,
                      attention={"kind": "cca", "group_size": 4, "window_size": 8})
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    save_pretrained(d, jax.tree.map(lambda p: np.asarray(p) * (4.0 if p.ndim > 1 else 1.0),
                                    params), cfg)
    shutil.copy(LLAMA2_TOKENIZER, d / "tokenizer.model")
    tok = load_tokenizer(d)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    plain = base / "plain"
    shutil.copytree(d, plain)
    (plain / "chat_template.jinja").unlink()
    return d


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from cca_jax.tokenizer import load_tokenizer
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    import cca_jax
    return cca_jax.from_pretrained(ckpt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m cca_jax.serve` in a child process on a free loopback port."""

    def __init__(self, ckpt: Path, cache: Path, log: Path, flags=()):
        self.port, self.log_path = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags()}
        self.log = open(log, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cca_jax.serve", "--ckpt", str(ckpt), "--port",
             str(self.port), "--compile-cache", str(cache), *SERVER_FLAGS, *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout=180.0) -> float:
        """Seconds from the start to the first 200 of /health (503 before)."""
        codes = set()
        while time.perf_counter() - self.started < timeout:
            assert self.proc.poll() is None, self.output()
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                codes.add(r.status_code)
                if r.status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not healthy after {timeout} s (codes {codes}):\n{self.output()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="module")
def server(ckpt, compile_cache, tmp_path_factory):
    srv = Server(ckpt, compile_cache, tmp_path_factory.mktemp("log") / "server.log")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def greedy_ids(model, prompt_ids, max_tokens):
    """What `generate()` gives for this request alone (the reference), EOS dropped."""
    from cca_jax.generate import generate
    out = generate(model, [prompt_ids], max_new_tokens=max_tokens, max_len=MAX_LEN)[0]
    return out[:-1] if out and out[-1] == model.config.eos_token_id else out


def text_of(tokenizer, prompt_ids, ids) -> str:
    from cca_jax.serve.text import CompletionText
    text = CompletionText(tokenizer, prompt_ids)
    return "".join(text.push(t) for t in ids) + text.finish()


# ---- the openai client ------------------------------------------------------------------------

def test_completion_equals_generate(server, client, model, tokenizer):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    prompt = "Once upon a time"
    ids = tokenizer(prompt)["input_ids"]
    got = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12,
                                    temperature=0)
    want = greedy_ids(model, ids, 12)
    assert got.choices[0].text == text_of(tokenizer, ids, want)
    assert got.choices[0].finish_reason == ("length" if len(want) == 12 else "stop")
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)
    assert got.usage.total_tokens == len(ids) + len(want)
    assert got.object == "text_completion" and got.model == "tiny-chat"


def test_streaming_completion_and_chat(client, model, tokenizer):
    whole = client.completions.create(model="tiny-chat", prompt="The cat", max_tokens=10,
                                      temperature=0)
    chunks = list(client.completions.create(model="tiny-chat", prompt="The cat",
                                            max_tokens=10, temperature=0, stream=True))
    assert len(chunks) >= 3
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    messages = [{"role": "user", "content": "Say hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == text_of(tokenizer, ids,
                                                      greedy_ids(model, ids, 8))
    assert chat.usage.prompt_tokens == len(ids)
    parts = list(client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == \
        chat.choices[0].message.content
    assert parts[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(model="tiny-chat", prompt="Hello there", max_tokens=24,
                                     temperature=0).choices[0].text
    assert len(full) > 12
    stop = full[6:9]
    cut = full[:full.find(stop)]
    for stream in (False, True):
        out = client.completions.create(model="tiny-chat", prompt="Hello there",
                                        max_tokens=24, temperature=0, stop=[stop, "@@@"],
                                        stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_equals_generate(client, model, tokenizer):
    from cca_jax.generate import generate

    def draw(seed):
        return client.completions.create(model="tiny-chat", prompt="A dog", max_tokens=10,
                                         temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"top_k": 50}).choices[0].text

    first = draw(7)
    assert draw(7) == first and draw(8) != first
    ids = tokenizer("A dog")["input_ids"]
    want = generate(model, [ids], max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50,
                    seed=7, max_len=MAX_LEN)[0]
    want = want[:-1] if want[-1] == 2 else want
    assert first == text_of(tokenizer, ids, want)


def reference_logprobs(model, prompt_ids, ids):
    """`[len(ids), V]` float64: the model's log-softmax before each of `ids`, from one full
    forward of prompt + ids (the server's come from its cache)."""
    import jax.numpy as jnp
    logits = np.asarray(model(jnp.asarray([list(prompt_ids) + list(ids)])), np.float64)[0]
    shifted = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(ids)]
    shifted = shifted - shifted.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_logprobs_are_the_models_log_softmax(server, client, model, tokenizer):
    """completions `logprobs=3` (whole and streamed) and chat `logprobs` with
    `top_logprobs=2`: each generated token's logprob is the model's log-softmax at its
    position, the alternatives are the likeliest tokens in order (greedy's token first),
    the token texts make up the text, and the offsets count them. Nothing compiles: the
    logprob programs are compiled before ready too."""
    compiled = server.health()["compilations_since_ready"]
    prompt = "Once upon a time"
    ids = tokenizer(prompt)["input_ids"]
    want = greedy_ids(model, ids, 6)
    ref = reference_logprobs(model, ids, want)
    got = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6,
                                    temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text and len(lp.tokens) == len(want)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(want))]
    for i, token in enumerate(want):
        assert abs(lp.token_logprobs[i] - ref[i, token]) < 1e-4, i
        best = np.sort(ref[i])[::-1][:3]
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        np.testing.assert_allclose(top, best[:len(top)], atol=1e-4)
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
    streamed = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6,
                                              temperature=0, logprobs=3, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.text_offset] == lp.text_offset
    np.testing.assert_allclose([x for p in parts for x in p.token_logprobs],
                               lp.token_logprobs, atol=1e-6)
    # sampled: the drawn token's logprob (not the likeliest one's), before temperature
    from cca_jax.generate import generate
    drawn = generate(model, [ids], max_new_tokens=5, temperature=1.5, seed=11,
                     max_len=MAX_LEN)[0]
    drawn = drawn[:-1] if drawn[-1] == 2 else drawn
    ref_drawn = reference_logprobs(model, ids, drawn)
    sampled = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=5,
                                        temperature=1.5, seed=11, logprobs=0)
    lps = sampled.choices[0].logprobs
    assert lps.top_logprobs == [{}] * len(drawn)
    np.testing.assert_allclose(lps.token_logprobs, ref_drawn[np.arange(len(drawn)), drawn],
                               atol=1e-4)
    assert any(ref_drawn[i, t] < ref_drawn[i].max() for i, t in enumerate(drawn))

    messages = [{"role": "user", "content": "Say hi"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    want = greedy_ids(model, chat_ids, 5)
    ref = reference_logprobs(model, chat_ids, want)
    chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert len(content) == len(want) == chat.usage.completion_tokens
    for i, (e, token) in enumerate(zip(content, want)):
        assert abs(e.logprob - ref[i, token]) < 1e-4, i
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.bytes == list(e.token.encode("utf-8")) or len(e.bytes) == 1
    plain = client.chat.completions.create(model="tiny-chat", messages=messages,
                                           max_tokens=5, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * len(want)
    assert client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=5,
                                          temperature=0).choices[0].logprobs is None
    assert server.health()["compilations_since_ready"] == compiled


def test_n_choices_sample_with_consecutive_seeds(client, model, tokenizer):
    """`n = 3` with `seed = 5`: choice i is what `generate(seed=5 + i)` gives, whole and
    streamed (chunks of the choices interleaved, each ending with its own finish reason);
    usage counts the prompt once and every choice's tokens; chat's choices too."""
    from cca_jax.generate import generate
    prompt = "A dog"
    ids = tokenizer(prompt)["input_ids"]
    wants = []
    for i in range(3):
        want = generate(model, [ids], max_new_tokens=6, temperature=1.0, seed=5 + i,
                        max_len=MAX_LEN)[0]
        wants.append(want[:-1] if want[-1] == 2 else want)
    got = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6,
                                    temperature=1.0, seed=5, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [text_of(tokenizer, ids, w) for w in wants]
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == sum(len(w) for w in wants)
    chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6,
                                            temperature=1.0, seed=5, n=3, stream=True,
                                            logprobs=1))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == got.choices[i].text
        assert [c.finish_reason for c in mine].count(None) == len(mine) - 1
        assert mine[-1].finish_reason is not None
        assert "".join(t for c in mine for t in c.logprobs.tokens) == got.choices[i].text
    messages = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4,
                                          temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content   # greedy
    parts = list(client.chat.completions.create(model="tiny-chat", messages=messages,
                                                max_tokens=4, temperature=0, n=2,
                                                stream=True))
    for i in range(2):
        mine = [p.choices[0] for p in parts if p.choices and p.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(p.delta.content or "" for p in mine) == chat.choices[i].message.content


# ---- errors -----------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 40000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_LEN}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": MAX_LEN}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(server.url + path, json={"model": "tiny-chat", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if "max_tokens" in body and body["max_tokens"] == MAX_LEN:
        assert err["code"] == "context_length_exceeded" and str(MAX_LEN) in err["message"]


def test_bad_json_and_unknown_route(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_openai_client_raises_on_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt="x", n=17)
    assert info.value.body["param"] == "n"


# ---- rows: disconnects, load, compilation ----------------------------------------------------

def wait_idle(server, timeout=10.0) -> dict:
    start = time.perf_counter()
    while True:
        h = server.health()
        if (h["rows_busy"] == 0 and h["queued"] == 0) or time.perf_counter() - start > timeout:
            return h


def test_prompts_prefill_in_small_chunks_only_while_rows_decode(server, model, tokenizer):
    """`--decode-chunk-size 8`: a prompt that arrives while nothing decodes runs in chunks of
    `--chunk-size` 16, one that arrives while a row decodes in chunks of 8 (one between two
    decode steps); the second answer is still generate()'s."""
    first = list(range(100, 120))                    # 20 tokens: 2 chunks of 16
    second = list(range(300, 370))                   # 70 tokens: 9 chunks of 8
    before = wait_idle(server)["step_times"]
    body = {"model": "tiny-chat", "max_tokens": MAX_LEN - len(first) - 1, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "prompt": first, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data:")      # the first row decodes from now on
        got = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={**body, "prompt": second, "max_tokens": 4}).json()
        rest = [x for x in lines if x.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    after = wait_idle(server)["step_times"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == 90
    assert after["prefill_chunks"] - before["prefill_chunks"] == 2 + 9
    # the second prompt's 9 chunks ran while the first row decoded: counted apart too
    assert after["interleaved_chunks"] - before["interleaved_chunks"] == 9
    assert after["interleaved_tokens"] - before["interleaved_tokens"] == 70
    # at most one chunk a turn; a turn's wall time holds its programs' and the host's
    spent = {k: after[k] - before[k] for k in ("turns", "turn_seconds", "prefill_seconds",
                                               "decode_seconds")}
    assert spent["turns"] >= 2 + 9, spent
    assert spent["turn_seconds"] >= spent["prefill_seconds"] + spent["decode_seconds"] > 0
    assert got["choices"][0]["text"] == text_of(tokenizer, second,
                                                greedy_ids(model, second, 4))
    from cca_jax.serve.engine_config import EngineConfig
    with pytest.raises(ValueError, match="decode_chunk_size .* must be <= chunk_size"):
        EngineConfig(chunk_size=16, decode_chunk_size=32).check()


def test_engine_unrolls_its_small_chunks_on_gpus_only(monkeypatch):
    """`EngineConfig.unrolls`: on a GPU, prefill chunks of up to `unroll_chunk_tokens`
    tokens (prefill_rows x chunk) run their layers unrolled; larger ones, every chunk on
    other backends, and every chunk with 0 keep the scan (`generate` always does)."""
    from cca_jax.serve import engine, engine_config
    cfg = engine_config.EngineConfig(chunk_size=2048, decode_chunk_size=256)
    assert not cfg.unrolls(256)                                   # this CPU
    monkeypatch.setattr(engine_config.jax, "default_backend", lambda: "gpu")
    assert cfg.unrolls(256) and cfg.unrolls(512) and not cfg.unrolls(2048)
    assert not dataclasses.replace(cfg, prefill_rows=4).unrolls(256)   # 1024 tokens
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
    for chunk in (256, 2048):
        engine.Engine._run_prefill(fake, None, np.zeros((1, chunk), np.int32),
                                   np.zeros(1, np.int32), [None])
    assert calls == [((1, 256), True), ((1, 2048), False)]


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_disconnects_mid_stream_frees_its_row(server, n):
    """A streaming client that goes away frees its row (its `n` rows)."""
    before = wait_idle(server)["finished"].get("cancelled", 0)
    body = {"model": "tiny-chat", "prompt": [1], "max_tokens": MAX_LEN - 1, "temperature": 0,
            "stream": True, "n": n}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got and server.health()["rows_busy"] == n
    h = wait_idle(server)
    assert h["rows_busy"] == 0, h
    assert h["finished"].get("cancelled", 0) == before + n, h


@pytest.mark.long
def test_load_many_concurrent_clients(server, model, tokenizer):
    """32 concurrent clients, 48 greedy requests with prompts of 1-100 tokens and 1-24 new
    tokens on 4 rows: no errors, every answer (token for token, as text) equals generate()'s
    for that request alone, no leaked rows, and no program compiled after start-up."""
    rng = np.random.default_rng(0)
    requests = [(rng.integers(3, 32000, int(rng.integers(1, 101))).tolist(),
                 int(rng.integers(1, 25))) for _ in range(48)]

    def ask(req):
        prompt, max_tokens = req
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny-chat", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0})
        return r.status_code, r.json()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, requests))
    assert time.perf_counter() - start < 60
    for (prompt, max_tokens), (status, body) in zip(requests, answers):
        assert status == 200, body
        want = greedy_ids(model, prompt, max_tokens)
        assert body["usage"]["completion_tokens"] == len(want)
        assert body["choices"][0]["text"] == text_of(tokenizer, prompt, want)
    h = wait_idle(server)
    assert h["rows_busy"] == 0 and h["queued"] == 0, h
    assert h["max_rows_busy"] == 4
    assert h["compilations_since_ready"] == 0, h


# ---- a full queue, no chat template, shutdown ------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_full_queue_no_template_and_shutdown(ckpt, compile_cache, server, tmp_path, sig):
    """A second server (the same model without a chat template, no queue) loads its programs
    from the compilation cache the first one filled (every one: none compiles). With
    its 4 rows busy a request gets 503 + Retry-After; chat gets a 400 naming the missing
    template. On SIGTERM / SIGINT the streams in flight still end with [DONE] and the process
    exits cleanly (0 / 130)."""
    srv = Server(ckpt.parent / "plain", compile_cache, tmp_path / "log",
                 flags=["--max-queue", "0"])
    try:
        srv.wait_healthy()
        warm, cold = srv.health(), server.health()
        assert cold["cache_hits_at_startup"] == 0 and warm["cache_hits_at_startup"] >= 4, warm
        assert warm["cache_hits_at_startup"] == warm["compilations_at_startup"], warm
        # the longest answer the cache allows: the 4 rows must still be busy at the 5th
        # request (a tiny model decodes ~100 tokens/s on a loaded CPU; 200 ran out once)
        body = {"model": "plain", "prompt": [1], "max_tokens": MAX_LEN - 1, "temperature": 0,
                "stream": True}
        with contextlib.ExitStack() as streams:
            lines = []
            for _ in range(4):
                r = streams.enter_context(httpx.stream("POST", srv.url + "/v1/completions",
                                                       json=body, timeout=60))
                lines.append(r.iter_lines())
                assert next(lines[-1]).startswith("data:")
            busy = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False})
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
            chat = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as info:
                chat.chat.completions.create(model="plain", max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
            assert "chat template" in info.value.body["message"]
            srv.proc.send_signal(sig)
            for stream in lines:
                rest = [x for x in stream if x.startswith("data:")]
                assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        code = srv.proc.wait(60)
        assert code == (0 if sig == signal.SIGTERM else 130), srv.output()
        assert "Traceback" not in srv.output(), srv.output()
    finally:
        srv.stop(signal.SIGKILL)


BROKEN_ENGINE_SERVER = """
import sys
from cca_jax.serve.__main__ import main
from cca_jax.serve.engine import Engine

def broken_warm_up(self):
    raise RuntimeError("the warm-up broke")

Engine._warm_up = broken_warm_up
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_fails_stops_the_server_with_its_error(ckpt, tmp_path):
    """An engine that fails (here at start-up: its warm-up raises) leaves a server that can
    serve nothing: the process stops on its own and exits 1 with the error, instead of
    answering 503 for ever."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags()}
    done = subprocess.run([sys.executable, "-c", BROKEN_ENGINE_SERVER, "--ckpt", str(ckpt),
                           "--port", str(free_port()), "--no-compile-cache", *SERVER_FLAGS],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "error: the engine failed (RuntimeError: the warm-up broke)" in done.stderr


# ---- pieces without a server -----------------------------------------------------------------

TEXT = "Once upon a time, Lily's cat said:\n\n  \"naïve über 😀 日本語\" -- 3.14 ok."


def test_completion_text_handles_multibyte_characters_and_stop_strings(tokenizer):
    """Streamed pieces never hold half a character; a stop string spanning tokens cuts the
    text right before it, and nothing that might start it is released early."""
    from cca_jax.serve.text import CompletionText

    ids = tokenizer(TEXT)["input_ids"]
    prompt, gen = ids[:3], ids[3:]
    start = tokenizer.decode(prompt, skip_special_tokens=True)
    rest = TEXT[len(start):]
    for stop, want in (([], rest), (["日本"], rest[:rest.find("日本")]),
                       (["über 😀", "zzz"], rest[:rest.find("über")]), (["ok."], rest[:-3])):
        text = CompletionText(tokenizer, prompt, stop)
        pieces = []
        for t in gen:
            pieces.append(text.push(t))
            if text.stopped:
                break
        pieces.append(text.finish())
        assert "".join(pieces) == want, (stop, pieces)
        assert not any("\ufffd" in p for p in pieces)
        assert text.stopped == bool(stop)


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
