"""cca_jax.generate and cca_jax.sampling: sampling rules, batched generation with EOS, parity
with transformers' greedy generate (stories260K), the Llama 2 tokenizer, the CLI.

Speed: one tiny float32 model (module fixture) for the API tests; the stories260K and CLI
checkpoints are converted once per module; torch runs on one thread (it fights JAX for the
two cores otherwise).
"""

from __future__ import annotations

import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cca_jax.generate as gen
import cca_jax.generate.__main__ as gen_cli
from cca_jax.config import LlamaConfig
from cca_jax.generate import _advance, generate, stream_generate
from cca_jax.generate.__main__ import main
from cca_jax.model import LlamaForCausalLM
from cca_jax.sampling import sample
from cca_jax.tokenizer import TextStream, load_tokenizer
from tests import hf_fixtures as fx

LLAMA2_TOKENIZER = fx.DATA_DIR / "llama2_tokenizer.model"


# ---- sampling ------------------------------------------------------------------------------

# one worker runs the whole module: its module-scoped fixtures are built once, not per worker
pytestmark = pytest.mark.xdist_group("generate")


def random_logits(rows=64, vocab=50, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 3, (rows, vocab)), jnp.float32)


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = random_logits()
    greedy = np.asarray(sample(logits, jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), -1))
    for seed in range(3):
        k1 = sample(logits, jax.random.PRNGKey(seed), temperature=1.5, top_k=1)
        np.testing.assert_array_equal(np.asarray(k1), greedy)
    # top_p so small that only the most likely token's mass counts: greedy too.
    tiny_p = sample(logits, jax.random.PRNGKey(0), temperature=1.0, top_p=1e-6)
    np.testing.assert_array_equal(np.asarray(tiny_p), greedy)


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    logits = random_logits()
    draw = lambda seed, **kw: np.asarray(sample(logits, jax.random.PRNGKey(seed),  # noqa: E731
                                                temperature=2.0, **kw))
    np.testing.assert_array_equal(draw(7), draw(7))
    assert (draw(7) != draw(8)).any()
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    for seed in range(5):
        got = draw(seed, top_k=3)
        assert all(t in row for t, row in zip(got, top3))
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, both drawn.
    probs = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    got = np.asarray(sample(probs, jax.random.PRNGKey(1), temperature=1.0, top_p=0.7))
    assert set(got.tolist()) == {0, 1}
    assert abs((got == 0).mean() - 0.5 / 0.8) < 0.04
    # Temperature: frequencies follow softmax(logits / T).
    got = np.asarray(sample(probs, jax.random.PRNGKey(2), temperature=2.0))
    want = np.sqrt([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(np.bincount(got, minlength=4) / 4000, want / want.sum(), atol=0.03)


def test_bad_sampling_settings():
    logits = random_logits(2)
    for kw, msg in ((dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"),
                    (dict(top_p=1.5), "top_p"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=msg):
            sample(logits, jax.random.PRNGKey(0), **kw)


# ---- generate on a tiny model ----------------------------------------------------------------

TINY = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   dtype="float32", param_dtype="float32",
                   attention={"kind": "cca", "group_size": 4, "window_size": 6,
                              "implementation": "naive"})   # model(ids): the dense reference
PROMPTS = [[5, 9, 2], list(range(10, 23)), [7]]       # 3, 13 and 1 tokens
NEW = 20


@pytest.fixture(scope="module")
def tiny():
    model = LlamaForCausalLM(TINY, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)   # sharper attention than the 0.02 init
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim > 1 else p, params))
    greedy = generate(model, PROMPTS, max_new_tokens=NEW, stop_at_eos=False)
    return model, greedy


def test_greedy_generate_is_the_argmax_of_a_full_forward(tiny):
    """Each greedy token is the argmax of one full forward over prompt + generated tokens
    (teacher forcing: no cache involved), for a batch of prompts of 3, 13 and 1 tokens; the
    cache and window (g = 4, s = 6) boundaries are crossed many times."""
    model, greedy = tiny
    assert [len(g) for g in greedy] == [NEW] * 3
    rows = [p + g for p, g in zip(PROMPTS, greedy)]
    width = max(map(len, rows))
    ids = np.zeros((3, width), np.int32)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    graphdef, state = nnx.split(model)   # right padding: causal, earlier positions unaffected
    logits = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(ids)))
    for b, (p, g) in enumerate(zip(PROMPTS, greedy)):
        assert logits[b, len(p) - 1: len(p) + NEW - 1].argmax(-1).tolist() == g


def test_rows_stop_at_eos_and_generation_compiles_once(tiny):
    """A row that emits EOS ends with it; the others go on. The decode step is not compiled
    again for another generate call of the same shapes."""
    model, greedy = tiny
    eos = greedy[0][3]
    list(stream_generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos))
    compiled = _advance._cache_size()
    out = [[] for _ in PROMPTS]
    for tokens, emitted in stream_generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos):
        for b in np.flatnonzero(emitted):
            out[b].append(int(tokens[b]))
    for b, g in enumerate(greedy):
        want = g[: g.index(eos) + 1] if eos in g else g
        assert out[b] == want
    assert out[0][-1] == eos and len(out[0]) <= 4
    assert _advance._cache_size() == compiled
    # Without stopping, the same tokens as before.
    again = list(stream_generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos,
                                 stop_at_eos=False))
    assert [[int(t[b]) for t, _ in again] for b in range(3)] == greedy


def test_sampled_generation_is_seeded(tiny):
    model, _ = tiny
    kw = dict(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.95)
    a = generate(model, PROMPTS, seed=3, **kw)
    assert a == generate(model, PROMPTS, seed=3, **kw)
    assert a != generate(model, PROMPTS, seed=4, **kw)


def test_generate_bad_inputs(tiny):
    model, _ = tiny
    cases = [(([[]],), dict(max_new_tokens=2), "prompt 0 is empty"),
             (([[1, 99]],), dict(max_new_tokens=2), r"lie in \[0, 61\)"),
             (([1, 2],), dict(max_new_tokens=2), "list of token ids"),
             (("hello",), dict(max_new_tokens=2), "list of token-id lists"),
             (([[1]],), dict(max_new_tokens=-1), "max_new_tokens"),
             (([[1] * 10],), dict(max_new_tokens=8, max_len=16), "exceeds max_len=16"),
             (([[1] * 250],), dict(max_new_tokens=8), "max_position_embeddings=256"),
             (([[1]],), dict(max_new_tokens=2, top_p=2.0), "top_p")]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            generate(model, *args, **kw)
    assert generate(model, [[1, 2]], max_new_tokens=0) == [[]]


def test_every_program_compiles_before_the_clocks_start(tiny, monkeypatch):
    """The time to first token and the decode rate hold no compilation: every prefill,
    sampling and decode step program (also the step that pools, first run at step 2 here:
    positions 5, 6, 7 with g = 4) compiles before the timed prefill starts, and its time is
    reported on its own (`compile_seconds`). A max_len no other test uses: fresh programs."""
    model, _ = tiny
    phase, events = ["compile"], []

    def listener(name, secs, **kw):
        if name.startswith("/jax/core/compile/"):
            events.append((phase[-1], name))

    real_prefill, real_loop = gen.prefill, gen.decode_loop

    def timed_prefill(*args, **kw):    # the time to first token starts here
        phase.append("prefill")
        return real_prefill(*args, **kw)

    def loop(*args, **kw):             # and ends before the decode loop, which compiles first
        phase.append("compile")
        yield from real_loop(*args, **kw)

    monkeypatch.setattr(gen, "prefill", timed_prefill)
    monkeypatch.setattr(gen, "decode_loop", loop)
    stats = gen.GenerationStats()
    steps = stream_generate(model, [[5, 9, 2, 7, 11]], max_new_tokens=12, max_len=88,
                            chunk_size=2, stats=stats, stop_at_eos=False)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        next(steps)
        phase.append("decode")
        rest = list(steps)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(rest) == 11 and phase == ["compile", "prefill", "compile", "decode"]
    assert [e for e in events if e[0] != "compile"] == [], events
    assert ("compile", "/jax/core/compile/backend_compile_duration") in events
    assert stats.compile_seconds > 0 and stats.time_to_first_token > 0
    assert stats.decode_tokens == 11 and stats.decode_seconds > 0


def test_stats_name_the_cache_when_nothing_is_generated(tiny):
    """With max_new_tokens 0 (or a prompt that fills max_len) the stats still give the
    cache's max_len and size, not 0."""
    from cca_jax.kv_cache import cache_bytes, init_cache
    model, _ = tiny
    for max_len, want in ((None, 64), (5, 5)):
        stats = gen.GenerationStats()
        assert list(stream_generate(model, [[5, 9, 2, 7, 11]], max_new_tokens=0,
                                    max_len=max_len, stats=stats)) == []
        assert stats.max_len == want
        assert stats.kv_cache_bytes == cache_bytes(init_cache(model.config, 1, want))
        assert stats.full_attention_kv_cache_bytes > 0


# ---- stories260K: parity with transformers -----------------------------------------------------

@pytest.fixture(scope="module")
def torch_one_thread():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(before)


def test_greedy_equals_transformers_generate_on_stories260k(stories, torch_one_thread):
    """Full attention, float32: our batched greedy generation (prompts of 1, 7 and 21 tokens
    in one batch, EOS = 2 stops a row) equals transformers' greedy `generate` per prompt."""
    import transformers

    import cca_jax
    torch = torch_one_thread
    ours_model = cca_jax.from_pretrained(stories / "ours", attention="full")
    rng = np.random.default_rng(0)
    prompts = [[1], [1, *rng.integers(3, 512, 6).tolist()], [1, *rng.integers(3, 512, 20).tolist()]]
    ours = generate(ours_model, prompts, max_new_tokens=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories / "hf").eval()
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist()
        assert o == want


# ---- tokenizer and CLI -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama2_tokenizer_dir(tmp_path_factory):
    """A directory with config.json and the Llama 2 tokenizer.model only."""
    if not LLAMA2_TOKENIZER.exists():
        pytest.skip(f"{LLAMA2_TOKENIZER} not found (shared test data is absent)")
    d = tmp_path_factory.mktemp("tok")
    shutil.copy(LLAMA2_TOKENIZER, d / "tokenizer.model")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


@pytest.fixture(scope="module")
def llama2_tokenizer(llama2_tokenizer_dir):
    return load_tokenizer(llama2_tokenizer_dir)


TEXT = "Once upon a time, Lily's cat said:\n\n  \"naïve über 😀 日本語\" -- 3.14 ok."


def test_text_round_trips_through_the_llama2_tokenizer(llama2_tokenizer):
    """BOS first (as transformers tokenizes for LLaMA 2); streamed detokenization prints the
    text back exactly, spaces, newlines and multi-byte characters split over byte tokens
    included, whatever the split between prompt and generated tokens."""
    tok = llama2_tokenizer
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1 and ids[1] != 1
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    for split in (1, 2, 5, len(ids) // 2):
        out = io.StringIO()
        stream = TextStream(tok, ids[:split], out)
        pieces = []
        for t in ids[split:]:
            before = out.getvalue()
            stream.put(t)
            pieces.append(out.getvalue()[len(before):])
            assert "\ufffd" not in out.getvalue()
        stream.put(tok.eos_token_id)               # special tokens print nothing
        stream.end()
        prefix = tok.decode(ids[:split], skip_special_tokens=True)
        assert prefix + out.getvalue() == TEXT + "\n", (split, pieces)


@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory, llama2_tokenizer, torch_one_thread):
    """A tiny random LLaMA with the Llama 2 vocabulary, converted, with tokenizer.json and
    tokenizer_config.json (as HF checkpoints ship them)."""
    from convert.hf_to_flax import convert_hf_to_flax
    base = tmp_path_factory.mktemp("cli")
    fx.make_tiny_hf("llama2", base / "hf", vocab_size=32000, bos_token_id=1, eos_token_id=2)
    llama2_tokenizer.save_pretrained(base / "hf")
    convert_hf_to_flax(base / "hf", base / "ours", verbose=False)
    assert (base / "ours" / "tokenizer.json").is_file()
    return base / "ours"


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generates_end_to_end(cli_ckpt, capsys, monkeypatch):
    """Streams the continuation as text (what the tokenizer decodes the new ids to), and
    reports prompt tokens, time to first token, decode speed and cache size on stderr.
    --attention/--group-size/--window-size override the checkpoint's settings."""
    seen = {}
    real = gen.stream_generate

    def spy(model, input_ids, **kw):
        seen.update(prompt=input_ids[0], attention=model.config.attention, tokens=[])
        for tokens, emitted in real(model, input_ids, **kw):
            if emitted[0]:
                seen["tokens"].append(int(tokens[0]))
            yield tokens, emitted

    monkeypatch.setattr(gen_cli, "stream_generate", spy)
    code, out, err = run_cli(["--ckpt", cli_ckpt, "--prompt", "Once upon a time",
                              "--max-new-tokens", 12, "--greedy", "--attention", "cca",
                              "--group-size", 2, "--window-size", 3, "--chunk-size", 4], capsys)
    assert code == 0, err
    tok = load_tokenizer(cli_ckpt)
    assert seen["prompt"] == tok("Once upon a time")["input_ids"] and seen["prompt"][0] == 1
    assert (seen["attention"].kind, seen["attention"].group_size,
            seen["attention"].window_size) == ("cca", 2, 3)
    assert len(seen["tokens"]) == 12 or seen["tokens"][-1] == 2
    text = tok.decode(seen["prompt"][-4:] + seen["tokens"], skip_special_tokens=True)
    assert out == text[len(tok.decode(seen["prompt"][-4:], skip_special_tokens=True)):] + "\n"
    for line in ("prompt tokens: 5", "compilation:", "time to first token:", "tokens/s",
                 "KV cache:"):
        assert line in err, err


def test_cli_names_the_cache_when_nothing_is_generated(cli_ckpt, capsys):
    """--max-new-tokens 0, or a prompt (5 tokens) that fills --max-len: the report gives the
    real max_len, not 0, and says why nothing was generated."""
    for argv, max_len in ((["--max-new-tokens", 0], 64), (["--max-len", 5], 5)):
        code, out, err = run_cli(["--ckpt", cli_ckpt, "--prompt", "Once upon a time"] + argv,
                                 capsys)
        assert code == 0, err
        assert f"for max_len={max_len} " in err and "nothing to generate" in err, err


def test_cli_bad_inputs(cli_ckpt, tmp_path, capsys):
    no_tok = tmp_path / "no_tok"
    shutil.copytree(cli_ckpt, no_tok)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (no_tok / f).unlink(missing_ok=True)
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("  \n")
    base = ["--max-new-tokens", 4]
    cases = [
        (["--ckpt", tmp_path / "nope", "--prompt", "hi"], "does not exist"),
        (["--ckpt", tmp_path, "--prompt", "hi"], "No config.json"),
        (["--ckpt", no_tok, "--prompt", "hi"], "no tokenizer in"),
        (["--ckpt", cli_ckpt, "--prompt", ""], "the prompt is empty"),
        (["--ckpt", cli_ckpt, "--prompt-file", empty_file], "the prompt is empty"),
        (["--ckpt", cli_ckpt, "--prompt-file", tmp_path / "missing.txt"], "cannot read"),
        (["--ckpt", cli_ckpt, "--prompt", "a b c d e f g h", "--max-len", 4],
         r"the prompt is \d+ tokens, longer than --max-len 4"),
        (["--ckpt", cli_ckpt, "--prompt", "hi", "--greedy", "--temperature", 0.7], "contradict"),
        (["--ckpt", cli_ckpt, "--prompt", "hi", "--temperature", 1, "--top-p", 0], "--top-p"),
        (["--ckpt", cli_ckpt, "--prompt", "hi", "--group-size", 0], "--group-size"),
    ]
    import re
    for argv, msg in cases:
        code, out, err = run_cli(base + argv, capsys)
        assert code == 2 and re.search(msg, err), (argv, err)
        assert err.startswith("error: ") and "Traceback" not in err
    with pytest.raises(SystemExit):   # argparse: --prompt or --prompt-file is required
        main(["--ckpt", str(cli_ckpt)])
