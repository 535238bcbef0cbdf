"""`python -m cca_jax.eval --rope-theta`: a model evaluated as extended, before fine-tuning."""

from __future__ import annotations

import pytest

from cca_jax.eval import common
from cca_jax.eval.__main__ import build_parser
from cca_jax.generate import UsageError


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
