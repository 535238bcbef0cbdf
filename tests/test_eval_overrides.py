"""The eval CLI: --rope-theta (a model evaluated as extended, before fine-tuning), labels."""

from __future__ import annotations

import pytest

from cca_jax.eval import common
from cca_jax.eval.__main__ import build_parser
from cca_jax.cli import UsageError


def _loaded_overrides(monkeypatch, tmp_path, *flags):
    seen = {}
    monkeypatch.setattr(common, "check_checkpoint", lambda path: path)
    monkeypatch.setattr("cca_jax.pretrained.from_pretrained",
                        lambda path, dtype=None, **kw: seen.update(kw) or "model")
    a = build_parser().parse_args(["ppl", "--ckpt", str(tmp_path), "--text-file", "x",
                                   "--seq-len", "8", *flags])
    assert common.load_model(a) == "model"
    return seen


def test_rope_theta_reaches_the_model(monkeypatch, tmp_path):
    seen = _loaded_overrides(monkeypatch, tmp_path, "--rope-theta", "1e6",
                             "--max-position-embeddings", "32768")
    assert seen["rope_theta"] == 1e6 and seen["max_position_embeddings"] == 32768
    assert "rope_theta" not in _loaded_overrides(monkeypatch, tmp_path)


def test_non_positive_rope_theta_is_refused(monkeypatch, tmp_path):
    with pytest.raises(UsageError, match="--rope-theta must be > 0"):
        _loaded_overrides(monkeypatch, tmp_path, "--rope-theta", "0")


def test_labels_name_cca_sinks_and_read_old_records_as_plain_cca():
    new = {"attention": "cca", "group_size": 16, "window_size": 1024, "sink_tokens": 4,
           "attention_format": common.ATTENTION_RECORD_FORMAT}
    assert common.attention_label(new) == "cca g=16 s=1024 N=4"
    assert common.attention_label({**new, "sink_tokens": 0}) == "cca g=16 s=1024"
    old = {k: v for k, v in new.items() if k != "attention_format"}
    assert common.attention_label(old) == "cca g=16 s=1024"
    assert common.attention_label({**old, "attention": "streaming"}) == "streaming N=4 W=1024"
