"""benchmarks/passkey_scratch.py: the passkey data is deterministic and puts the key where
asked; a tiny train-and-evaluate run works on CPU; (slow) full attention learns the task."""

import json

import numpy as np
import pytest

from benchmarks import passkey_scratch as pk


def tiny_config(tmp_path, **changes) -> pk.ExperimentConfig:
    """A CPU-sized experiment: seconds, not minutes."""
    values = dict(out=str(tmp_path / "passkey_tiny"), seq_len=64, window_size=16, group_size=4,
                  sink_tokens=2, layers=1, hidden=32, heads=2, kv_heads=2, dtype="float32",
                  implementation="xla", key_len=3, num_digits=4, filler_period=4, steps=2,
                  batch_size=2, warmup_steps=1, first_doc_len=16, eval_samples=2,
                  eval_depths=2)
    values.update(changes)
    return pk.ExperimentConfig(**values)


@pytest.mark.parametrize("shared_digits", [False, True])
def test_documents_are_deterministic_from_the_seed(shared_digits):
    task = pk.TaskSpec(shared_digits=shared_digits)
    depths = np.linspace(0, 1, 7)
    a = pk.make_documents(np.random.default_rng(7), 300, depths, task)
    b = pk.make_documents(np.random.default_rng(7), 300, depths, task)
    c = pk.make_documents(np.random.default_rng(8), 300, depths, task)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.keys, b.keys)
    assert not np.array_equal(a.keys, c.keys)
    assert a.tokens.max() < task.vocab_size and a.tokens.min() > 0


@pytest.mark.parametrize("shared_digits", [False, True])
def test_key_lies_at_the_requested_depth(shared_digits):
    task = pk.TaskSpec(key_len=5, shared_digits=shared_digits)
    doc_len, depths = 1000, np.array([0.0, 0.1, 0.5, 0.9, 1.0])
    docs = pk.make_documents(np.random.default_rng(0), doc_len, depths, task)
    last = doc_len - task.tail_len - task.needle_len   # the needle right before the query
    np.testing.assert_array_equal(docs.needle_pos, np.rint(depths * last))
    assert docs.needle_pos[-1] + task.needle_len == docs.query_pos == doc_len - task.tail_len
    np.testing.assert_array_equal(docs.distance, docs.query_pos - docs.needle_pos - 1)
    for tokens, key, needle in zip(docs.tokens, docs.keys, docs.needle_pos):
        assert tokens[needle] == pk.KEY_MARK
        np.testing.assert_array_equal(tokens[needle + 1:needle + 1 + task.key_len], key)
        assert tokens[docs.query_pos] == pk.QUERY_MARK
        np.testing.assert_array_equal(tokens[docs.query_pos + 1:], key)
        # Markers and digits appear nowhere else: the needle is the only copy of the key.
        assert (tokens < task.first_filler).sum() == 2 * (1 + task.key_len)
        if shared_digits:
            assert len(set(key.tolist())) == task.key_len
        else:   # digit i comes from position i's own alphabet
            slots = (key - pk.FIRST_DIGIT) // task.num_digits
            np.testing.assert_array_equal(slots, np.arange(task.key_len))


def test_training_batch_packs_documents_with_answers_only(tmp_path):
    cfg = tiny_config(tmp_path, steps=8, final_fraction=0.25)
    assert cfg.doc_lengths() == (16, 32, 64)
    assert [cfg.doc_len_at(s) for s in range(8)] == [16, 16, 16, 32, 32, 32, 64, 64]
    first, again = pk.training_batch(cfg, 0), pk.training_batch(cfg, 0)
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert not np.array_equal(first["input_ids"], pk.training_batch(cfg, 1)["input_ids"])
    ids, mask = first["input_ids"], first["loss_mask"]
    assert ids.shape == (cfg.batch_size, cfg.seq_len)
    np.testing.assert_array_equal(first["segment_ids"][0], np.repeat(np.arange(4), 16))
    np.testing.assert_array_equal(first["positions"][0], np.tile(np.arange(16), 4))
    assert mask.sum() == cfg.batch_size * 4 * cfg.key_len
    rows, cols = np.nonzero(mask)
    # Each answer position's target is the next token (the key digit after it).
    np.testing.assert_array_equal(first["targets"][rows, cols], ids[rows, cols + 1])
    assert (ids[rows, cols + 1] < cfg.task.first_filler).all()


def test_evaluation_documents_are_held_out_and_at_each_depth(tmp_path):
    cfg = tiny_config(tmp_path, eval_depths=3)
    docs = [pk.evaluation_documents(cfg, i) for i in range(3)]
    for d, depth in zip(docs, (0.0, 0.5, 1.0)):
        assert d.tokens.shape == (cfg.eval_samples, cfg.seq_len)
        assert (d.needle_pos == pk.needle_position(cfg.seq_len, depth, cfg.task)).all()
    np.testing.assert_array_equal(docs[1].tokens, pk.evaluation_documents(cfg, 1).tokens)


def test_cli_flags_map_onto_the_config(tmp_path):
    cfg = pk.parse_args(["--seq-len", "1024", "--window-size", "64", "--no-shared-digits",
                         "--lr", "0.002", "--attentions", "full,cca",
                         "--out", str(tmp_path / "passkey_x")])
    assert (cfg.seq_len, cfg.window_size, cfg.lr, cfg.shared_digits) == (1024, 64, 0.002, False)
    assert cfg.attention_list == ("full", "cca")
    with pytest.raises(ValueError, match="passkey"):
        pk.ExperimentConfig(out=str(tmp_path / "results"))
    with pytest.raises(ValueError, match="attentions"):
        pk.ExperimentConfig(attentions="full,dense")


class _StubModel:
    """What `_accuracy_fn` calls: hidden states that are one-hot rows of a chosen token per
    position, and the identity as the output head, so the argmax is that token."""

    def __init__(self, vocab, predict):
        self.vocab, self.predict = vocab, predict

    def hidden_states(self, ids, segment_ids, positions):
        import jax
        return jax.nn.one_hot(self.predict(ids), self.vocab)

    def logits(self, hidden):
        return hidden


def test_accuracy_is_the_teacher_forced_argmax_of_the_whole_key(tmp_path):
    """`_accuracy_fn` scores the predictions at the key_len positions before the last one
    (each predicting the next key digit) and counts a document only if all are right: a stub
    predicting each next token scores every document, one predicting the current token
    none, and one with a single wrong digit in document 1 fails that document only."""
    import jax.numpy as jnp

    cfg = tiny_config(tmp_path, eval_samples=3)
    docs = pk.evaluation_documents(cfg, 1)
    vocab = cfg.task.vocab_size
    ids = jnp.asarray(docs.tokens)
    zeros = jnp.zeros_like(ids)
    keys = jnp.asarray(docs.keys)

    def score(predict):
        correct = pk._accuracy_fn(lambda trainable, frozen: _StubModel(vocab, predict),
                                  cfg.key_len)
        return np.asarray(correct({}, {}, ids, zeros, zeros, keys)).tolist()

    def next_token(ids):
        return jnp.roll(ids, -1, axis=1)

    def one_wrong(ids):
        return next_token(ids).at[1, -3].set(pk.QUERY_MARK)   # document 1, one digit wrong

    assert score(next_token) == [True, True, True]
    assert score(lambda ids: ids) == [False, False, False]
    assert score(one_wrong) == [True, False, True]


@pytest.mark.slow
def test_tiny_run_trains_and_evaluates_on_cpu(tmp_path, monkeypatch):
    """Two training steps, then the evaluation with a stub scorer that is right on the
    documents whose needle lies in the first half (depth 0) and on the second document of
    each batch: 2 of 2 at depth 0, 1 of 2 at depth 1. The records, the JSON and the markdown
    table say 1.00 and 0.50 at the right depths. The training is real: its first loss is a
    random model's, about ln(vocab)."""
    cfg = tiny_config(tmp_path, attentions="cca")
    real = pk._accuracy_fn

    def stub_accuracy_fn(apply, key_len):
        real(apply, key_len)                       # still built (compiled by its first call)
        import jax.numpy as jnp

        def correct(trainable, frozen, ids, segment_ids, positions, keys):
            needle = jnp.argmax(ids == pk.KEY_MARK, axis=1)
            return (needle < ids.shape[1] // 2) | (jnp.arange(ids.shape[0]) == 1)
        return correct

    monkeypatch.setattr(pk, "_accuracy_fn", stub_accuracy_fn)
    records = pk.run_experiment(cfg, progress=False)
    assert [r["depth"] for r in records] == [0.0, 1.0]
    assert [r["accuracy"] for r in records] == [1.0, 0.5]
    for i, r in enumerate(records):
        docs = pk.evaluation_documents(cfg, i)
        assert r["distance"] == int(docs.distance[0])
        assert r["beyond_window"] == (r["distance"] >= cfg.window_size)
        assert r["attention"] == "cca" and r["train_steps"] == 2 and r["samples"] == 2
        assert r["params"] > 0 and r["implementation"] == "xla"
        assert len(r["loss_curve"]) == 2 and np.all(np.isfinite(r["loss_curve"]))
        assert abs(r["loss_curve"][0] - np.log(cfg.task.vocab_size)) < 0.5
        assert r["final_loss"] == pytest.approx(np.mean(r["loss_curve"]), abs=1e-4)
    assert records[0]["distance"] > cfg.window_size > records[1]["distance"]
    assert json.loads((tmp_path / "passkey_tiny.json").read_text()) == records
    table = (tmp_path / "passkey_tiny.md").read_text()
    assert "| depth | distance | cca |" in table
    assert f"| 0.0 | {records[0]['distance']}* | 1.00 |" in table
    assert f"| 1.0 | {records[1]['distance']} | 0.50 |" in table


@pytest.mark.slow
def test_full_attention_learns_to_retrieve_beyond_the_window(tmp_path):
    """The task is learnable at CPU scale: full attention retrieves at every depth, sliding
    only where the key lies within its window."""
    cfg = tiny_config(tmp_path, seq_len=128, window_size=16, layers=2, hidden=64, heads=4,
                      kv_heads=4, key_len=4, num_digits=10, filler_period=8, steps=150,
                      batch_size=16, lr=3e-3, warmup_steps=10, final_fraction=0.3,
                      eval_samples=16, eval_depths=5, attentions="full,sliding")
    records = pk.run_experiment(cfg, progress=False)
    far = [r for r in records if r["distance"] >= 2 * cfg.window_size]
    assert far
    assert min(r["accuracy"] for r in far if r["attention"] == "full") >= 0.9
    assert max(r["accuracy"] for r in far if r["attention"] == "sliding") <= 0.2
