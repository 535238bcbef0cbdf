"""cca_jax.eval: the perplexity protocol against a direct computation, the passkey / needle
generator and its scoring, the Lost in the Middle prompt and normalization, the CLI.

Speed: one tiny float32 model (Llama 2 vocabulary, 512 positions) saved once per module with
the real Llama 2 tokenizer; the CLI tests reuse it.
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.eval import mdqa, passkey
from cca_jax.eval.__main__ import main
from cca_jax.eval.ppl import perplexity, window_starts
from cca_jax.model import LlamaForCausalLM
from tests import hf_fixtures as fx

LLAMA2_TOKENIZER = fx.DATA_DIR / "llama2_tokenizer.model"
# one worker runs the whole module: its module-scoped fixtures are built once, not per worker
pytestmark = pytest.mark.xdist_group("eval")


NQ_ORACLE = fx.DATA_DIR / "nq-open-oracle.jsonl.gz"
KV_DATA = fx.DATA_DIR / "kv-retrieval-75_keys.jsonl.gz"
TINY = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2, dtype="float32", param_dtype="float32",
                   attention=dict(kind="cca", group_size=4, window_size=8))


def _random_model(cfg=TINY):
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)   # sharper than the 0.02 init: ppl far from uniform
    nnx.update(model, jax.tree.map(lambda p: p * 8.0 if p.ndim > 1 else p, params))
    return model


@pytest.fixture(scope="module")
def model():
    return _random_model()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model):
    """The tiny model saved in our format, with the Llama 2 tokenizer.model beside it."""
    if not LLAMA2_TOKENIZER.exists():
        pytest.skip(f"{LLAMA2_TOKENIZER} not found (shared test data is absent)")
    from cca_jax.checkpoint import save_pretrained

    d = tmp_path_factory.mktemp("eval") / "ckpt"
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    save_pretrained(d, jax.tree.map(np.asarray, params), model.config)
    shutil.copy(LLAMA2_TOKENIZER, d / "tokenizer.model")
    from cca_jax.tokenizer import load_tokenizer
    load_tokenizer(d).save_pretrained(d)   # tokenizer.json: the CLI skips the slow conversion
    return d


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from cca_jax.tokenizer import load_tokenizer
    return load_tokenizer(ckpt)


# ---- perplexity ------------------------------------------------------------------------------

_forward = nnx.jit(lambda m, ids: m(ids))


def _direct_ppl(model, ids, n, stride=None):
    """exp(mean NLL) from full logits of each window, written from the protocol's words."""
    step = n if stride is None else stride
    first = 1 if stride is None else n - stride      # first scored index within a window
    nll = []
    for start in range(0, len(ids) - n + 1, step):
        w = ids[start:start + n]
        logp = jax.nn.log_softmax(_forward(model, jnp.asarray([w]))[0], -1)
        nll += [-float(logp[k - 1, w[k]]) for k in range(first, n)]
    return math.exp(np.mean(nll)), len(nll)


def test_ppl_equals_a_direct_computation_and_drops_the_remainder(model):
    n = 32
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 3 * n + 11)
    got = perplexity(model, ids, n, batch_size=2, chunk=8, progress=False)
    want, count = _direct_ppl(model, ids.tolist(), n)
    assert got.windows == 3 and got.scored_tokens == count == 3 * (n - 1)
    assert got.ppl == pytest.approx(want, rel=1e-5)
    assert np.isfinite(got.ppl) and got.ppl > 5
    assert sum(b["tokens"] for b in got.by_position) == count
    assert [(b["lo"], b["hi"]) for b in got.by_position] == [(1, 9), (9, 17), (17, 25), (25, 32)]


def test_strided_ppl_scores_the_last_stride_tokens_of_overlapping_windows(model):
    n, stride = 32, 12
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, 80)
    got = perplexity(model, ids, n, stride, batch_size=3, chunk=16, progress=False)
    want, count = _direct_ppl(model, ids.tolist(), n, stride)
    assert window_starts(80, n, stride).tolist() == [0, 12, 24, 36, 48]
    assert got.windows == 5 and got.scored_tokens == count == 5 * stride
    assert got.ppl == pytest.approx(want, rel=1e-5)


def test_chunked_equals_unchunked_for_every_batch_size(model):
    ids = np.random.default_rng(2).integers(0, TINY.vocab_size, 200)
    ref = perplexity(model, ids, 64, chunk=64, batch_size=1, progress=False).ppl
    for chunk, batch in ((24, 2),):      # 24 does not divide 64: a padded last chunk
        got = perplexity(model, ids, 64, chunk=chunk, batch_size=batch, progress=False).ppl
        assert got == pytest.approx(ref, rel=1e-5)


def test_ppl_protocol_errors(model):
    ids = np.arange(100)
    for kwargs, match in ((dict(seq_len=1), "seq_len must be an int >= 2"),
                          (dict(seq_len=32, stride=32), r"stride must be an int in \[1, seq_len - 1\] = \[1, 31\]"),
                          (dict(seq_len=200), "fewer than one window"),
                          (dict(seq_len=32, chunk=0), "chunk must be a positive int")):
        with pytest.raises(ValueError, match=match):
            perplexity(model, ids, progress=False, **kwargs)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        perplexity(model, np.arange(600), 600, progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        perplexity(model, np.full(40, TINY.vocab_size), 32, progress=False)


# ---- passkey / needle ------------------------------------------------------------------------

@pytest.mark.parametrize("task", passkey.TASKS)
def test_passkey_samples_are_seeded_fit_the_length_and_put_the_needle_at_the_depth(
        tokenizer, task):
    a = passkey.make_sample(tokenizer, task, 600, 0.5, seed=3, index=0)
    assert a == passkey.make_sample(tokenizer, task, 600, 0.5, seed=3, index=0)
    others = {passkey.make_sample(tokenizer, task, 600, 0.5, seed=s).answer for s in range(8)}
    assert len(others) > 4 and a.answer.isdigit()
    assert len(a.answer) == (5 if task == "passkey" else 7)
    for length in (300, 600, 1000):
        s = passkey.make_sample(tokenizer, task, length, 0.25, seed=0)
        per_filler = len(tokenizer(passkey.FILLER, add_special_tokens=False)["input_ids"])
        assert length - per_filler - 2 <= len(s.input_ids) <= length
        assert s.input_ids == tokenizer(s.prompt)["input_ids"]
    for depth in (0.0, 0.3, 0.5, 1.0):
        s = passkey.make_sample(tokenizer, task, 800, depth, seed=1)
        intro, rest = s.prompt.split(" ", 1)[0], s.prompt
        assert intro and s.answer in rest
        # the needle follows round(depth * n) of the n filler sentences
        needle_at = s.prompt.index(s.answer)
        before = s.prompt[:needle_at].count(passkey.FILLER)
        assert before == s.needle_after == round(depth * s.filler_sentences)
        assert abs(before / s.filler_sentences - depth) <= 0.5 / s.filler_sentences + 1e-9
        assert s.prompt.count(passkey.FILLER) == s.filler_sentences
    with pytest.raises(ValueError, match="too short"):
        passkey.make_sample(tokenizer, task, 20, 0.5, seed=0)
    with pytest.raises(ValueError, match="depth must lie in"):
        passkey.make_sample(tokenizer, task, 600, 1.5, seed=0)


def test_exact_match():
    em = passkey.exact_match
    assert em("71432", "71432") and em(" 71432.", "71432") and em("\n71432 is it", "71432")
    assert not em("714321", "71432") and not em("The key is 71432", "71432")
    assert not em("7143", "71432") and not em("", "71432")


# ---- multi-document QA -----------------------------------------------------------------------

def test_mdqa_normalization_follows_the_benchmark():
    norm = mdqa.normalize_answer
    assert norm("The  Eiffel-Tower!") == "eiffeltower"       # punctuation goes before articles
    assert norm("An apple, a day; THE end.") == "apple day end"
    assert norm("Theater of the absurd") == "theater of absurd"   # whole words only
    assert norm("  Wilhelm\tConrad\nRöntgen ") == "wilhelm conrad röntgen"
    em = mdqa.best_subspan_em
    assert em("It was Wilhelm Conrad Röntgen, in 1901.", ["Wilhelm Conrad Röntgen"])
    assert em("the answer: U.S.A", ["USA", "America"]) and not em("Germany", ["USA"])
    # only the first line counts: copying the context below it earns nothing
    assert mdqa.score({"question": "q", "answers": ["Paris"], "ctxs": [{}]},
                      "I don't know\nParis") is False
    assert mdqa.score({"question": "q", "answers": ["Paris"], "ctxs": [{}]}, " paris.\n") is True
    assert mdqa.score({"ordered_kv_records": [], "key": "k", "value": "AB-12"},
                      '"ab-12"') is True


def test_mdqa_prompts_are_the_benchmark_format():
    docs = [{"title": "first doc", "text": "first doc text"},
            {"title": "second doc", "text": "second doc text", "isgold": True}]
    assert mdqa.qa_prompt("test question", docs) == (
        "Write a high-quality answer for the given question using only the provided search "
        "results (some of which might be irrelevant).\n\n"
        "Document [1](Title: first doc) first doc text\n"
        "Document [2](Title: second doc) second doc text\n\n"
        "Question: test question\nAnswer:")
    record = {"question": "test question", "answers": ["x"], "ctxs": docs}
    assert mdqa.prompt_and_gold(record)[1] == 1
    pairs = [["k1", "v1"], ["k2", "v2"], ["k3", "v3"]]
    assert mdqa.kv_prompt(pairs, "k2") == (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n"
        'JSON data:\n{"k1": "v1",\n "k2": "v2",\n "k3": "v3"}\n\nKey: "k2"\n'
        "Corresponding value:")
    with pytest.raises(ValueError, match="expected a Lost in the Middle record"):
        mdqa.record_format({"text": "x"})


def test_mdqa_reads_the_shared_data():
    for path, fmt in ((NQ_ORACLE, "qa"), (KV_DATA, "kv")):
        if not path.exists():
            pytest.skip(f"{path} not found (shared test data is absent)")
        records = mdqa.read_records(path, limit=3)
        assert len(records) == 3 and {mdqa.record_format(r) for r in records} == {fmt}
        prompt, gold = mdqa.prompt_and_gold(records[0])
        assert gold is not None and prompt.endswith(("Answer:", "Corresponding value:"))


# ---- CLI -------------------------------------------------------------------------------------

def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_ppl_json_table_and_plot(ckpt, model, tokenizer, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text(fx.DATA_DIR.joinpath("pg19_10146.txt").read_text()[20000:24000]
                    if (fx.DATA_DIR / "pg19_10146.txt").exists() else "Once upon a time. " * 200)
    out = tmp_path / "r" / "ppl.json"
    code, stdout, err = run_cli(["ppl", "--ckpt", ckpt, "--text-file", text, "--seq-len", 128,
                                 "--chunk", 64, "--batch-size", 2, "--json", out, "--plot",
                                 tmp_path / "ppl.png", "--no-progress"], capsys)
    assert code == 0, err
    record = json.loads(out.read_text())
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    want = perplexity(model, ids, 128, chunk=64, batch_size=2, progress=False).ppl
    assert record["ppl"] == pytest.approx(want, rel=1e-5)
    assert record["attention"] == "cca" and record["windows"] == len(ids) // 128
    assert {"environment", "by_position", "scored_tokens"} <= set(record)
    assert "| cca g=4 s=8 | 128 |" in stdout and (tmp_path / "ppl.png").stat().st_size > 1000


def _stub_generate(monkeypatch, tokenizer, answer_for):
    """Replace `cca_jax.generate.generate` (what the passkey and mdqa evaluations call) by a
    stub that reads each prompt and answers `answer_for(prompt_text, prompt_ids)`: a model
    that is right exactly where the test says. Returns the prompts it saw."""
    import cca_jax.generate

    seen = []

    def generate(model, input_ids, *, max_new_tokens, **kw):
        out = []
        for ids in input_ids:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            seen.append((text, list(ids)))
            new = tokenizer(answer_for(text, ids), add_special_tokens=False)["input_ids"]
            assert len(new) <= max_new_tokens, (len(new), max_new_tokens)
            out.append(list(new))
        return out

    monkeypatch.setattr(cca_jax.generate, "generate", generate)
    return seen


def test_cli_passkey_scores_and_tabulates(ckpt, tokenizer, tmp_path, capsys, monkeypatch):
    """A stub model that finds the pass key when the needle is in the first half of the
    prompt, or when the prompt is the longer one: right at depth 0 (both lengths) and at
    depth 1 of the 300-token prompts only. The record, its cells and the depth x length table
    (with its mean row) say exactly that."""
    import re

    def answer(text, ids):
        key = re.search(r"The pass key is (\d+)\.", text)
        early = key.start() < len(text) / 2
        return f" {key[1]}. The end." if early or len(ids) > 250 else " 12345."

    seen = _stub_generate(monkeypatch, tokenizer, answer)
    out = tmp_path / "pk.json"
    code, stdout, err = run_cli(["passkey", "--ckpt", ckpt, "--lengths", "200,300", "--depths",
                                 "0,1", "--samples", 2, "--batch-size", 2, "--json", out,
                                 "--plot", tmp_path / "pk.png", "--no-progress",
                                 "--attention", "sliding", "--window-size", 16], capsys)
    assert code == 0, err
    assert len(seen) == 8 and all(len(ids) <= n for (_, ids), n in
                                  zip(seen, [200] * 4 + [300] * 4))
    record = json.loads(out.read_text())
    assert record["attention"] == "sliding" and len(record["results"]) == 8
    cells = {(c["length"], c["depth"]): (c["samples"], c["accuracy"])
             for c in record["by_length_depth"]}
    assert cells == {(200, 0.0): (2, 1.0), (200, 1.0): (2, 0.0), (300, 0.0): (2, 1.0),
                     (300, 1.0): (2, 1.0)}
    assert record["accuracy"] == 0.75
    for r in record["results"]:
        assert r["correct"] == r["prediction"].lstrip().startswith(r["answer"])
    table = stdout[stdout.index("| depth \\ length | 200 | 300 |"):]
    assert table.splitlines()[2:5] == ["| 0 | 1 | 1 |", "| 1 | 0 | 1 |", "| mean | 0.5 | 1 |"]
    assert (tmp_path / "pk.png").stat().st_size > 1000


def test_cli_mdqa_scores_and_tabulates(ckpt, tokenizer, tmp_path, capsys, monkeypatch):
    """A stub model that answers the first and third questions (a gold answer, then more
    lines the benchmark's first-line rule drops) and not the second: accuracy 2/3, per
    record and in the table by gold position."""
    if not NQ_ORACLE.exists():
        pytest.skip(f"{NQ_ORACLE} not found")
    records = mdqa.read_records(NQ_ORACLE, limit=3)

    def answer(text, ids):
        i = next(i for i, r in enumerate(records) if r["question"] in text)
        gold = records[i]["answers"][0]
        return f" {gold}\nQuestion: something else" if i != 1 else " I do not know"

    seen = _stub_generate(monkeypatch, tokenizer, answer)
    out = tmp_path / "mdqa.json"
    code, stdout, err = run_cli(["mdqa", "--ckpt", ckpt, "--data", NQ_ORACLE, "--limit", 3,
                                 "--max-new-tokens", 32, "--batch-size", 2, "--json", out,
                                 "--no-progress"], capsys)
    assert code == 0, err
    assert len(seen) == 3
    record = json.loads(out.read_text())
    assert record["examples"] == 3 and record["format"] == "qa"
    assert [r["correct"] for r in record["results"]] == [True, False, True]
    assert record["accuracy"] == pytest.approx(2 / 3)
    golds = [mdqa.prompt_and_gold(r)[1] for r in records]
    assert [r["gold_position"] for r in record["results"]] == golds
    want = {}
    for gold, ok in zip(golds, (1, 0, 1)):
        want.setdefault(gold, []).append(ok)
    assert [(p["gold_position"], p["examples"], p["accuracy"])
            for p in record["by_gold_position"]] == [
        (k, len(v), sum(v) / len(v)) for k, v in sorted(want.items())]
    assert "| all | 3 | 0.6667 |" in stdout


def test_cli_bad_inputs(ckpt, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    short = tmp_path / "short.txt"
    short.write_text("Only a few words.")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "no question"}\n')
    cases = [
        (["ppl", "--ckpt", tmp_path / "nope", "--text-file", short, "--seq-len", 8],
         "does not exist (--ckpt)"),
        (["ppl", "--ckpt", ckpt, "--text-file", tmp_path / "missing.txt", "--seq-len", 8],
         "cannot read --text-file"),
        (["ppl", "--ckpt", ckpt, "--text-file", empty, "--seq-len", 8], "is empty"),
        (["ppl", "--ckpt", ckpt, "--text-file", short, "--seq-len", 1024],
         "exceeds the model's max_position_embeddings=512"),
        (["ppl", "--ckpt", ckpt, "--text-file", short, "--seq-len", 64], "fewer than one window"),
        (["ppl", "--ckpt", ckpt, "--text-file", short, "--seq-len", 4, "--stride", 4],
         "--stride must be an int in"),
        (["passkey", "--ckpt", ckpt, "--lengths", 300, "--depths", "0,2"],
         "--depths must lie in [0, 1]"),
        (["passkey", "--ckpt", ckpt, "--lengths", 30], "too short for the passkey task"),
        (["passkey", "--ckpt", ckpt, "--lengths", 600], "exceed the model's"),
        (["mdqa", "--ckpt", ckpt, "--data", tmp_path / "none.jsonl"], "does not exist"),
        (["mdqa", "--ckpt", ckpt, "--data", bad_json], "expected a Lost in the Middle record"),
        (["ppl", "--ckpt", ckpt, "--text-file", short, "--seq-len", 4, "--group-size", 0],
         "--group-size must be an integer >= 1"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and message in err, (argv, err)
