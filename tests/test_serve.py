"""The OpenAI-compatible server (`python -m cca_jax.serve`): the official `openai` client
against a server this module starts on loopback (completions, chat, streaming, stop strings,
seeds), bad requests and their error objects, a client that disconnects mid-stream, a bounded
load test whose greedy answers must equal `generate()` run one request at a time, compile
counting, a full queue, and shutdown on SIGTERM / SIGINT. (The engine and CLI without a
server: test_serve_engine.py.)

Speed: one tiny float32 checkpoint with the Llama 2 vocabulary; one server for the module
(compiled once; its persistent compilation cache lies in a temporary directory, so the
shutdown tests' servers load their programs from it); prompts in the load test are token ids.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
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


# ---- incremental detokenization ---------------------------------------------------------------

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
