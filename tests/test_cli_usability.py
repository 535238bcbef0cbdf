"""What a user meets first: one-line messages for bad files and bad token ids, help text on
every flag of the generate, eval and convert CLIs, a .gitignore that hides what the README
writes, and plots that read well at the edges (a narrow log axis, an unscored first bucket,
one mdqa position). Cheap: no model is compiled here."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

# one worker runs the whole module: its module-scoped fixtures are built once, not per worker
pytestmark = pytest.mark.xdist_group("cli_usability")


ROOT = Path(__file__).resolve().parents[1]


# ---- safetensors: random bytes are not a safetensors file ------------------------------------

def _reader_error(path: Path) -> str:
    from convert.hf_io import ConversionError, open_hf_weights
    with pytest.raises(ConversionError) as info:
        open_hf_weights(path.parent)
    return str(info.value)


def test_random_bytes_are_not_a_safetensors_file(tmp_path):
    """Random bytes (whose first 8 read as a length of ~3.4e18) are named as not a safetensors
    file, not as a truncated one; a real file cut inside its header is still truncated."""
    from safetensors.numpy import save_file

    bad = tmp_path / "random" / "model.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    msg = _reader_error(bad)
    assert "is not a safetensors file" in msg and "header claims" not in msg, msg
    assert "\n" not in msg
    empty = tmp_path / "empty" / "model.safetensors"   # fewer than 9 bytes
    empty.parent.mkdir()
    empty.write_bytes(b"\x02\x00")
    assert "is not a safetensors file" in _reader_error(empty)

    cut = tmp_path / "cut" / "model.safetensors"
    cut.parent.mkdir()
    save_file({"w": np.ones((4, 4), np.float32)}, str(cut))
    header = int.from_bytes(cut.read_bytes()[:8], "little")
    cut.write_bytes(cut.read_bytes()[:8 + header // 2])
    assert "is truncated: header claims" in _reader_error(cut)


def test_converter_names_a_random_weight_file_in_one_line(tmp_path, capsys):
    from convert.hf_to_flax import main
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=16,
        intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, torch_dtype="float32")))
    (hf / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(1000))
    assert main(["--hf", str(hf), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is not a safetensors file" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


# ---- the model: token ids of the wrong dtype or shape ------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    from flax import nnx

    from cca_jax import LlamaConfig
    from cca_jax.model import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))  # no weights


@pytest.mark.parametrize("ids,fix", [
    (jnp.ones((1, 5), jnp.float32), r"dtype float32 shape \(1, 5\).*astype\(jnp\.int32\)"),
    (jnp.ones((1, 5), bool), r"dtype bool shape \(1, 5\)"),
    (jnp.arange(5), r"dtype int32 shape \(5,\).*ids\[None\]"),
    (np.ones((1, 2, 3), np.int32), r"shape \(1, 2, 3\)"),
    ([[1, 2, 3]], r"not a list.*jnp\.asarray"),
])
def test_bad_token_ids_name_the_expected_dtype_and_shape(small_model, ids, fix):
    with pytest.raises(ValueError) as info:
        small_model(ids)
    msg = str(info.value)
    assert msg.startswith("input_ids must be integer token ids (int32) of shape [batch, seq]")
    assert re.search(fix, msg) and "ArrayImpl" not in msg and "\n" not in msg, msg


# ---- help text on every flag -------------------------------------------------------------------

def _parsers() -> dict[str, argparse.ArgumentParser]:
    from cca_jax.eval.__main__ import build_parser as eval_parser
    from cca_jax.generate.__main__ import build_parser as generate_parser
    from convert.flax_to_hf import build_parser as flax_to_hf_parser
    from convert.hf_to_flax import build_parser as hf_to_flax_parser
    out = {"generate": generate_parser(), "convert.hf_to_flax": hf_to_flax_parser(),
           "convert.flax_to_hf": flax_to_hf_parser()}
    for action in eval_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({f"eval {name}": p for name, p in action.choices.items()})
    return out


STATES = re.compile(r"\((?:[^()]*; )?(?:default: [^)]+|required[^)]*)\)")


def test_every_cli_flag_says_what_it_does_its_default_and_choices():
    """Each flag of generate, eval {ppl,passkey,mdqa} and both converters has help that states
    its default, or that it is required (`(default: ...)` / `(required...)`); choices show in
    --help."""
    parsers = _parsers()
    assert {"eval ppl", "eval passkey", "eval mdqa"} <= parsers.keys()
    missing = []
    for name, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1]
            if not action.help or len(action.help) < 12 or not STATES.search(action.help):
                missing.append(f"{name} {flag}: {action.help!r}")
            if action.choices:
                assert "{" + ",".join(action.choices) + "}" in parser.format_help()
    assert not missing, "\n".join(missing)


# ---- .gitignore: what the README writes -----------------------------------------------------

def readme_outputs() -> set[str]:
    """Top-level paths the README's code blocks write, read from the blocks themselves."""
    text = (ROOT / "README.md").read_text()
    found = set()
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        found.update(re.findall(r"--(?:out|json|plot)\s+([^\s\\]+)", block))
        found.update(re.findall(r"save_pretrained\(\"([^\"]+)\"\)", block))
        found.update(re.findall(r"Path\(\"([^\"]+)\"\)\.write_text", block))
    return {p for p in found if not p.isupper()}    # not placeholders such as OUT


def test_gitignore_covers_what_the_readme_writes():
    """Every file or directory a README command writes is ignored by git (after following
    the README, `git status` shows nothing new); result files under benchmarks/ are not."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = readme_outputs()
    assert {"runs/tiny", "tiny-hf", "tiny-ours", "tiny-cca-hf", "story.txt", "qa.jsonl",
            "ppl.json", "ppl.png", "passkey.json"} <= outputs, outputs
    # A file inside each output (a directory pattern matches only what lies in it).
    probe = sorted(f"{p}/config.json" if "." not in Path(p).name else p for p in outputs)
    done = subprocess.run([git, "check-ignore", "--no-index", *probe], cwd=ROOT,
                          capture_output=True, text=True)
    assert set(done.stdout.split()) == set(probe), set(probe) - set(done.stdout.split())
    kept = ["benchmarks/results/new.json", "benchmarks/results/new.png", "docs/x.json"]
    done = subprocess.run([git, "check-ignore", "--no-index", *kept], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.stdout == "", done.stdout


# ---- plots --------------------------------------------------------------------------------------

def _tick_labels(path: Path, draw) -> tuple:
    """Draw into `path` with `draw(record)`, returning the figure's first axes (kept open)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cca_jax.eval import plots

    seen = {}
    real_save = plots._save

    def keep(fig, p):
        seen["ax"] = fig.axes[0]
        fig.canvas.draw()
        seen["labels"] = [t.get_text() for t in fig.axes[0].get_yticklabels()
                          if t.get_visible() and t.get_text()]
        seen["texts"] = [t.get_text() for t in fig.axes[0].texts]
        seen["xlabel"] = fig.axes[0].get_xlabel()
        seen["xlim"] = fig.axes[0].get_xlim()
        seen["bars"] = [(r.get_x(), r.get_width(), r.get_height())
                        for r in fig.axes[0].patches]
        real_save(fig, p)

    plots._save = keep
    try:
        draw()
    finally:
        plots._save = real_save
        plt.close("all")
    assert path.stat().st_size > 1000
    return seen


def test_ppl_plot_has_plain_log_ticks_and_names_the_unscored_front(tmp_path):
    """A narrow log axis (ppl 517-522, inside one decade) is labelled with plain numbers, not
    `5.2 x 10^2`; with --stride, the positions no window scores are named on the plot."""
    from cca_jax.eval import plots
    record = {"task": "ppl", "attention": "full", "ppl": 519.0, "windows": 12, "seq_len": 256,
              "stride": 128, "by_position": [
                  {"lo": 1, "hi": 65, "tokens": 0, "ppl": None},
                  {"lo": 65, "hi": 129, "tokens": 12, "ppl": 521.8},
                  {"lo": 129, "hi": 193, "tokens": 768, "ppl": 520.2},
                  {"lo": 193, "hi": 256, "tokens": 756, "ppl": 517.3}]}
    out = tmp_path / "ppl.png"
    seen = _tick_labels(out, lambda: plots.plot_record(record, out))
    assert len(seen["labels"]) >= 3, seen["labels"]
    assert all(re.fullmatch(r"\d+(\.\d+)?", t) for t in seen["labels"]), seen["labels"]
    assert "positions 1-127, not scored" in seen["xlabel"] and "last 128" in seen["xlabel"]
    wide = dict(record, stride=None, by_position=[
        {"lo": 1 + 64 * i, "hi": 65 + 64 * i, "tokens": 9, "ppl": v}
        for i, v in enumerate((600.0, 80.0, 12.0))])
    seen = _tick_labels(out, lambda: plots.plot_record(wide, out))
    assert {"20", "50", "100", "200", "500"} <= set(seen["labels"]), seen["labels"]
    assert "not scored" not in seen["xlabel"]


def test_mdqa_plot_of_one_position_is_a_labelled_bar(tmp_path):
    """One gold position: a bar centred on an integer tick with its accuracy written on it,
    not a dot on an x axis of -0.04..0.04."""
    from cca_jax.eval import plots
    record = {"task": "mdqa", "format": "qa", "attention": "full", "examples": 1,
              "accuracy": 0.0, "by_gold_position": [
                  {"gold_position": 0, "examples": 1, "accuracy": 0.0}]}
    out = tmp_path / "mdqa.png"
    seen = _tick_labels(out, lambda: plots.plot_record(record, out))
    (x, width, height), = seen["bars"]
    assert x + width / 2 == 0 and width >= 0.5 and height == 0.0
    lo, hi = seen["xlim"]
    assert lo <= -0.5 and hi >= 0.5
    assert any(t.startswith("0.00") and "n=1" in t for t in seen["texts"]), seen["texts"]
