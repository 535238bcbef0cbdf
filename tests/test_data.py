"""The fine-tuning data pipeline (train.data): sources, tokenizers, packing, resume, errors."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import grain
import numpy as np
import pytest

import train.data as data
from train.data import (ByteTokenizer, build_row, check_vocab, frame_document, make_batches,
                        make_tokenizer)
from train.data import sources
from train.data.packing import PackIterDataset

# one worker runs the whole module: its module-scoped fixtures are built once, not per worker
pytestmark = pytest.mark.xdist_group("data")


LLAMA_MODEL = Path(__file__).resolve().parents[2] / "shared" / "data" / "llama2_tokenizer.model"
BYTE = ByteTokenizer()
KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def write_jsonl(path: Path, records, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(KEYS) == set(y)
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def rows_of(batches):
    """The batches' rows in order, each a dict of [seq_len] arrays."""
    return [{k: b[k][i] for k in KEYS} for b in batches for i in range(len(b["input_ids"]))]


def pack(docs, seq_len, n_rows):
    ds = PackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(), seq_len)
    return take(iter(ds), n_rows)


# ---------------------------------------------------------------------------------- packing


def test_rows_of_a_hand_made_example():
    # BOS 100, EOS 101; rows of seq_len + 1 = 6 tokens cut across documents.
    d1 = frame_document(np.array([1, 2]), 100, 101)               # 100 1 2 101
    d2 = frame_document(np.array([3, 4, 5, 6, 7, 8]), 100, 101)   # 100 3 .. 8 101
    d3 = frame_document(np.array([9]), 100, 101)                  # 100 9 101
    rows = pack([d1, d2, d3, d1, d2], seq_len=5, n_rows=4)
    expect = [  # input_ids, targets, segment_ids, positions, loss_mask
        ([100, 1, 2, 101, 100], [1, 2, 101, 100, 3], [1, 1, 1, 1, 2], [0, 1, 2, 3, 0],
         [1, 1, 1, 0, 1]),
        # d2 continues at its real offset 2; its EOS is the row's target-only last token.
        ([4, 5, 6, 7, 8], [5, 6, 7, 8, 101], [1, 1, 1, 1, 1], [2, 3, 4, 5, 6], [1, 1, 1, 1, 1]),
        ([100, 9, 101, 100, 1], [9, 101, 100, 1, 2], [1, 1, 1, 2, 2], [0, 1, 2, 0, 1],
         [1, 1, 0, 1, 1]),
        # Only d1's EOS is left for this row: a one-token segment at position 3, masked.
        ([101, 100, 3, 4, 5], [100, 3, 4, 5, 6], [1, 2, 2, 2, 2], [3, 0, 1, 2, 3],
         [0, 1, 1, 1, 1]),
    ]
    for row, exp in zip(rows, expect):
        for k, v in zip(KEYS, exp):
            np.testing.assert_array_equal(row[k], v, err_msg=k)
        assert row["loss_mask"].dtype == np.float32
        assert all(row[k].dtype == np.int32 for k in KEYS[:4])


def test_no_bos_and_target_only_document_start():
    # Without BOS (Qwen2-style), a document's first token is its first text token.
    d1 = frame_document(np.array([1, 2, 3]), None, 9)   # 1 2 3 9
    d2 = frame_document(np.array([4, 5]), None, 9)      # 4 5 9
    rows = pack([d1, d2, d1, d2], seq_len=3, n_rows=3)
    # Rows: 1 2 3 9 | 4 5 9 1 (d1's first token only a target) | 2 3 9 4
    np.testing.assert_array_equal(rows[0]["input_ids"], [1, 2, 3])
    np.testing.assert_array_equal(rows[1]["input_ids"], [4, 5, 9])
    np.testing.assert_array_equal(rows[1]["positions"], [0, 1, 2])
    np.testing.assert_array_equal(rows[1]["loss_mask"], [1, 1, 0])
    np.testing.assert_array_equal(rows[2]["input_ids"], [2, 3, 9])
    np.testing.assert_array_equal(rows[2]["positions"], [1, 2, 3])  # d1 from its offset 1
    np.testing.assert_array_equal(rows[2]["segment_ids"], [1, 1, 1])


def test_build_row_single_piece():
    row = build_row([(np.arange(7, dtype=np.int32), 10, False)], seq_len=6)
    np.testing.assert_array_equal(row["positions"], np.arange(10, 16))
    np.testing.assert_array_equal(row["targets"], np.arange(1, 7))
    assert row["loss_mask"].all()


def check_stream(rows, seq_len):
    """Row invariants against the token stream they were cut from; returns the documents."""
    stream = []
    for r in rows:
        assert all(r[k].shape == (seq_len,) for k in KEYS)
        np.testing.assert_array_equal(r["targets"][:-1], r["input_ids"][1:])
        stream += list(r["input_ids"]) + [int(r["targets"][-1])]
    # Documents are the stream split after each EOS; recompute what each input must carry.
    docs, cur, offset = [], [], []
    for t in stream:
        offset.append(len(cur))
        cur.append(t)
        if t == BYTE.eos_id:
            docs.append(cur)
            cur = []
    assert stream[0] == BYTE.bos_id
    for i, r in enumerate(rows):
        base = i * (seq_len + 1)
        pos = offset[base:base + seq_len]
        np.testing.assert_array_equal(r["positions"], pos)
        np.testing.assert_array_equal(r["loss_mask"], [0.0 if t == BYTE.eos_id else 1.0
                                                       for t in r["input_ids"]])
        starts = np.array([j > 0 and p == 0 for j, p in enumerate(pos)])
        np.testing.assert_array_equal(r["segment_ids"], 1 + np.cumsum(starts))
    return docs


def test_every_token_once_in_order_across_epochs(tmp_path, cache):
    rng = np.random.default_rng(0)
    texts = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(n)))
             for n in rng.integers(1, 60, 23)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    seq_len, batch = 16, 3
    total = sum(len(t) + 2 for t in texts)
    n_batches = 2 * total // (seq_len + 1) // batch + 2     # a bit over two epochs
    rows = rows_of(take(make_batches(str(src), BYTE, seq_len=seq_len, batch_size=batch,
                                     seed=3, cache_dir=cache), n_batches))
    docs = check_stream(rows, seq_len)
    n = len(texts)
    assert len(docs) >= 2 * n
    as_text = [bytes(d[1:-1]).decode() for d in docs]
    assert sorted(as_text[:n]) == sorted(texts)          # epoch 1: each document once
    assert sorted(as_text[n:2 * n]) == sorted(texts)     # epoch 2: again, in a new order
    assert as_text[:n] != as_text[n:2 * n]
    assert all(d[0] == BYTE.bos_id and d[-1] == BYTE.eos_id for d in docs)


# --------------------------------------------------------------------- determinism, resume


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(1)
    recs = [{"text": f"doc {i}: " + "xyz " * int(rng.integers(0, 40))} for i in range(12)]
    return str(write_jsonl(d / "c.jsonl", recs))


def test_same_seed_same_batches(corpus, cache):
    a = take(make_batches(corpus, BYTE, seq_len=32, batch_size=2, seed=5, cache_dir=cache), 12)
    b = take(make_batches(corpus, BYTE, seq_len=32, batch_size=2, seed=5, cache_dir=cache), 12)
    c = take(make_batches(corpus, BYTE, seq_len=32, batch_size=2, seed=6, cache_dir=cache), 12)
    assert_batches_equal(a, b)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))


@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_exact_resume(corpus, cache, k):
    kw = dict(seq_len=24, batch_size=2, seed=11, cache_dir=cache)
    full = take(make_batches(corpus, BYTE, **kw), k + 6)
    it = make_batches(corpus, BYTE, **kw)
    take(it, k)
    state = json.loads(json.dumps(it.get_state()))   # as a checkpoint would store it
    resumed = make_batches(corpus, BYTE, **kw)
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 6), full[k:])
    # Restoring an iterator that has already moved on works too.
    it.set_state(state)
    assert_batches_equal(take(it, 2), full[k:k + 2])


def test_resume_refuses_other_settings(corpus, cache):
    state = make_batches(corpus, BYTE, seq_len=24, batch_size=2, cache_dir=cache).get_state()
    other = make_batches(corpus, BYTE, seq_len=32, batch_size=2, cache_dir=cache)
    with pytest.raises(ValueError, match="seq_len"):
        other.set_state(state)
    with pytest.raises(ValueError, match="version"):
        other.set_state({"grain": {}})


# ---------------------------------------------------------------------------- local sources


def first_texts(source, cache, n_batches=4, **kw):
    """The decoded documents of the first rows (byte tokens)."""
    rows = rows_of(take(make_batches(source, BYTE, seq_len=64, batch_size=2, cache_dir=cache,
                                     **kw), n_batches))
    stream = bytes(0 if t == BYTE.eos_id else int(t)  # EOS -> NUL; BOS dropped
                   for r in rows for t in list(r["input_ids"]) + [r["targets"][-1]]
                   if t != BYTE.bos_id)
    return stream.decode("utf-8", errors="replace").split("\0")


def test_txt_file_is_one_document(tmp_path, cache):
    (tmp_path / "a.txt").write_text("héllo wörld, " * 5)
    texts = first_texts(str(tmp_path / "a.txt"), cache)
    assert texts[0] == "héllo wörld, " * 5 and texts[1] == "héllo wörld, " * 5


def test_directory_of_txt_and_jsonl(tmp_path, cache):
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.txt").write_text("first file")
    (tmp_path / "sub" / "two.txt").write_text("second file")
    write_jsonl(tmp_path / "sub" / "three.jsonl.gz", [{"text": "third"}, {"text": "fourth"}],
                gz=True)
    (tmp_path / "notes.md").write_text("ignored")
    (tmp_path / ".hidden.txt").write_text("ignored too")
    texts = first_texts(str(tmp_path), cache)
    assert sorted(texts[:4]) == ["first file", "fourth", "second file", "third"]


def test_jsonl_gz_with_text_field(tmp_path, cache):
    p = write_jsonl(tmp_path / "d.jsonl.gz", [{"body": "alpha", "id": 1}, {"body": "  "},
                                              {"body": "beta", "id": 2}], gz=True)
    texts = first_texts(str(p), cache, text_field="body")
    assert sorted(texts[:2]) == ["alpha", "beta"]   # the blank record is dropped


def test_cache_is_reused_and_refreshed_on_change(tmp_path, cache, monkeypatch):
    p = tmp_path / "book.txt"
    p.write_text("version one")
    calls = []
    real = sources.prepare_local

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(sources, "prepare_local", spy)
    assert first_texts(str(p), cache)[0] == "version one"
    record_files = list(Path(calls[0]).rglob("*.array_record*"))
    stamp = [f.stat().st_mtime_ns for f in record_files]
    assert first_texts(str(p), cache)[0] == "version one"
    assert calls[1] == calls[0]                                        # same cache entry
    assert [f.stat().st_mtime_ns for f in record_files] == stamp      # not rewritten
    p.write_text("version two!")
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    assert first_texts(str(p), cache)[0] == "version two!"
    assert calls[2] != calls[0]


def test_builtin_source(cache, monkeypatch):
    rows = rows_of(take(make_batches("builtin", BYTE, seq_len=128, batch_size=1,
                                     cache_dir=cache), 1))
    assert rows[0]["input_ids"][0] == BYTE.bos_id
    if sources.PG19_BOOK.is_file():   # the Gutenberg header is stripped
        assert b"Project Gutenberg" not in bytes(rows[0]["input_ids"][1:])
    # Without ../shared, the text shipped in the package.
    monkeypatch.setattr(sources, "PG19_BOOK", Path("/nonexistent/pg19.txt"))
    texts = first_texts("builtin", cache, n_batches=1)
    assert texts[0].startswith("The Keeper of the Northern Light")
    assert len(sources.BUILTIN_TEXT.read_bytes()) > 3000


# ----------------------------------------------------------------------------- TFDS by name


@pytest.fixture(scope="module")
def tfds_corpus(tmp_path_factory):
    """A TFDS data set, prepared in array_record, under a data_dir of its own."""
    import tensorflow_datasets as tfds

    class CcaTestCorpus(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"content": tfds.features.Text(), "n": np.int32}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(6), "test": self._generate_examples(2)}

        def _generate_examples(self, count):
            for i in range(count):
                yield str(i), {"content": f"record number {i}", "n": i}

    d = str(tmp_path_factory.mktemp("tfds"))
    CcaTestCorpus(data_dir=d, file_format="array_record").download_and_prepare()
    return d


def test_tfds_source_by_name(tfds_corpus):
    texts = first_texts("tfds:cca_test_corpus", None, data_dir=tfds_corpus, text_field="content")
    assert sorted(texts[:6]) == [f"record number {i}" for i in range(6)]
    texts = first_texts("tfds:cca_test_corpus:test", None, data_dir=tfds_corpus,
                        text_field="content")
    assert sorted(texts[:2]) == ["record number 0", "record number 1"]


@pytest.mark.parametrize("source, kw, match", [
    ("tfds:no_such_dataset_xyz", {}, "unknown TFDS data set 'no_such_dataset_xyz'"),
    ("tfds:cca_test_corpus", {"data_dir": "EMPTY"}, "not prepared.*download_and_prepare"),
    ("tfds:cca_test_corpus:validation", {}, r"no split 'validation'.*\['test', 'train'\]"),
    ("tfds:cca_test_corpus", {"text_field": "text"}, r"no feature 'text'.*\['content', 'n'\]"),
    ("tfds:cca_test_corpus", {"text_field": "n"}, "not text"),
    ("tfds:", {}, "names no data set"),
])
def test_tfds_errors(tfds_corpus, tmp_path, source, kw, match):
    kw = {"data_dir": tfds_corpus, "text_field": "content", **kw}
    if kw["data_dir"] == "EMPTY":
        kw["data_dir"] = str(tmp_path)
    with pytest.raises(ValueError, match=match):
        make_batches(source, BYTE, seq_len=8, batch_size=1, **kw)


# ---------------------------------------------------------------------------- local errors


def test_local_source_errors(tmp_path, cache):
    def err(source, match, **kw):
        with pytest.raises(ValueError, match=match):
            make_batches(source, BYTE, seq_len=8, batch_size=1, cache_dir=cache, **kw)

    err(str(tmp_path / "missing.jsonl"), "does not exist")
    (tmp_path / "empty.txt").write_text(" \n\t\n")
    err(str(tmp_path / "empty.txt"), "holds no text")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "   "}])
    err(str(tmp_path / "blank.jsonl"), "holds no text")
    (tmp_path / "emptydir").mkdir()
    err(str(tmp_path / "emptydir"), "holds no .txt")
    (tmp_path / "data.csv").write_text("a,b")
    err(str(tmp_path / "data.csv"), "is not .txt")
    write_jsonl(tmp_path / "other.jsonl", [{"body": "x"}])
    err(str(tmp_path / "other.jsonl"), r"no string field 'text'.*\['body'\].*text_field")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    err(str(tmp_path / "bad.jsonl"), "bad.jsonl:1 is not a JSON object")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    err(str(tmp_path / "latin.txt"), "not UTF-8")
    err("", "data source must be")


@pytest.mark.parametrize("kw, match", [
    ({"seq_len": 1}, "seq_len must be an integer >= 2"),
    ({"seq_len": 8.0}, "seq_len must be an integer"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"seed": -1}, "seed"),
])
def test_argument_errors(kw, match, cache):
    kw = {"seq_len": 8, "batch_size": 1, **kw}
    with pytest.raises(ValueError, match=match):
        make_batches("builtin", BYTE, cache_dir=cache, **kw)


# ------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer():
    tok = make_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, data.Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert tok.encode("aé") == [97, 195, 169]
    assert tok.decode(tok.encode("aé") + [257]) == "aé"
    check_vocab(tok, 258)
    with pytest.raises(ValueError, match="258 ids but the model's vocab_size is 256"):
        check_vocab(tok, 256)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    if not LLAMA_MODEL.is_file():
        pytest.skip("../shared/data/llama2_tokenizer.model is absent")
    d = tmp_path_factory.mktemp("llama_tok")
    shutil.copy(LLAMA_MODEL, d / "tokenizer.model")
    return d


def test_hf_tokenizer_offline(llama_dir, cache):
    tok = make_tokenizer(str(llama_dir))
    assert isinstance(tok, data.Tokenizer)
    assert tok.encode("Once upon a time") == [9038, 2501, 263, 931]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 32000)
    assert 2 not in tok.encode("a </s> b")   # special-token text stays text
    check_vocab(tok, 32000)
    with pytest.raises(ValueError, match="32000 ids.*vocab_size is 258"):
        check_vocab(tok, 258)
    rows = rows_of(take(make_batches("builtin", tok, seq_len=64, batch_size=2,
                                     cache_dir=cache), 1))
    assert rows[0]["input_ids"][0] == 1 and rows[0]["input_ids"].max() < 32000


def test_tokenizer_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="holds no tokenizer"):
        make_tokenizer(str(tmp_path))


# -------------------------------------------------------------------------------- the bench


def test_bench_cli(cache, capsys, tmp_path):
    """The printed rate and the JSON record count what was timed: batches after the first,
    each batch_size x seq_len tokens, over the timed seconds (batch 2: a rate that forgot the
    batch size would be half)."""
    import re

    from train.data.__main__ import main

    out_file = tmp_path / "bench.jsonl"
    main(["--bench", "--seconds", "0.2", "--seq-len", "256", "--batch-size", "2",
          "--cache-dir", cache, "--out", str(out_file)])
    out = capsys.readouterr().out
    m = re.search(r"then (\d+) batches in ([\d.]+) s: ([\d,]+) tokens/s", out)
    assert m, out
    batches, seconds, rate = int(m[1]), float(m[2]), int(m[3].replace(",", ""))
    assert batches >= 1 and seconds >= 0.2
    assert rate == pytest.approx(batches * 2 * 256 / seconds, rel=0.05)   # seconds: 2 decimals
    record = json.loads(out_file.read_text())
    assert (record["batches"], record["batch_size"], record["seq_len"]) == (batches, 2, 256)
    assert record["tokens_per_s"] == pytest.approx(
        record["batches"] * 2 * 256 / record["seconds"], rel=0.05)
    assert abs(record["tokens_per_s"] - rate) <= 1
    main(["--bench", "--seconds", "0.2", "--seq-len", "256", "--cache-dir", cache, "--out",
          str(out_file)])                                   # --out appends
    assert len(out_file.read_text().splitlines()) == 2
