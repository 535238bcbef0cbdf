"""The fine-tuning command line: --help from TrainConfig, negative numbers, TOML errors, and
what a local data preparation prints. All of it runs before any compute (seconds)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from train import finetune
from train.config import TrainConfig, parse_args
from train.data import ByteTokenizer, make_batches


def _help_entries(capsys, argv=()) -> dict[str, str]:
    """`--help` as {flag: its text, whitespace collapsed}."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + text)
    out = {}
    for entry in filter(str.strip, entries):
        head = entry.split()[0].rstrip(",")
        out[head] = " ".join(entry.split())
    return out


def test_help_gives_every_flag_a_description_default_and_choices(capsys):
    entries = _help_entries(capsys)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in entries, flag
        text = entries[flag]
        # a description beyond the flag and its metavar
        words = text.replace(flag, "").replace(f.name.upper(), "").split()
        assert len(words) >= 4, text
        if f.default not in (None, ""):
            assert f"(default: {f.default})" in text, text
    assert "(default: the checkpoint's own)" in entries["--attention"]
    assert "{all,attention,qkv}" in entries["--trainable"]
    assert "{cca,full,sliding,streaming}" in entries["--attention"]
    assert "{none,full,save_dots,save_attention}" in entries["--remat"]
    # a preset's defaults are what --help shows with it
    assert "(default: 128)" in _help_entries(capsys, ["--preset", "tiny"])["--seq-len"]


def test_negative_numbers_are_values(capsys):
    """`--lr -1e-3` reaches TrainConfig's own check (argparse alone said "expected one
    argument"); a negative value where one is valid is taken as it is."""
    assert finetune.main(["--preset", "tiny", "--out", "x", "--lr", "-1e-3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --lr must be > 0, got -0.001.\n", err
    with pytest.raises(ValueError, match="--adam-b1 and --adam-b2 must be in"):
        parse_args(["--preset", "tiny", "--out", "x", "--adam-b1", "-.5"])
    cfg = parse_args(["--preset", "tiny", "--out", "x", "--mesh", "fsdp=-1", "--lr", "1e-3"])
    assert (cfg.mesh, cfg.lr) == ("fsdp=-1", 1e-3)


def test_toml_errors_name_the_file_and_line(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\nseq_len 32\n')
    assert finetune.main(["--config", str(toml), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(toml) in err and "line 2" in err, err
    toml.write_text('preset = "tiny"\nseq_len = "long"\n')
    with pytest.raises(ValueError, match=r"run.toml: seq_len = 'long' is not an int"):
        parse_args(["--config", str(toml), "--out", "x"])
    with pytest.raises(ValueError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.toml"), "--out", "x"])
    assert not (tmp_path / "o").exists()


def test_local_data_preparation_is_not_called_a_download(tmp_path, capfd):
    """TFDS announces every preparation as "Downloading and preparing dataset"; a local file
    is prepared, not downloaded, and the message says so."""
    book = tmp_path / "book.txt"
    book.write_text("A short book. " * 50)
    next(make_batches(str(book), ByteTokenizer(), seq_len=32, batch_size=1,
                      cache_dir=str(tmp_path / "cache")))
    out, err = capfd.readouterr()
    assert "download" not in (out + err).lower(), out + err
    assert "data: preparing 1 local file(s) once into the cache" in err
