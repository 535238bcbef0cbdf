"""Every code block of the README runs as written (python blocks and shell commands, in order,
in one fresh directory), except the install and test commands that CI itself runs. A shell
command ending in `&` (the server) runs in the background until the last block has run, then
gets SIGTERM and must exit cleanly."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("pip install", "python -m pytest")


def blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(python|bash)\n(.*?)```", text, flags=re.S)


def commands(script: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", script)
    lines = [re.split(r"\s{2,}#", line)[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith(SKIP)]


@pytest.mark.long
def test_readme_blocks_run_as_written(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags()}
    found = blocks()
    assert sum(kind == "python" for kind, _ in found) >= 3 and len(found) >= 6
    background = []
    try:
        for kind, body in found:
            runs = [[sys.executable, "-c", body]] if kind == "python" else [
                shlex.split(cmd) for cmd in commands(body)]
            for argv in runs:
                if argv[0] == "python":
                    argv[0] = sys.executable
                if argv[-1] == "&":
                    log = open(tmp_path / f"background-{len(background)}.log", "w")
                    background.append((argv, log, subprocess.Popen(
                        argv[:-1], cwd=tmp_path, env=env, stdout=log,
                        stderr=subprocess.STDOUT)))
                    continue
                done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=600)
                assert done.returncode == 0, f"{' '.join(argv)[:200]}\n{done.stderr[-3000:]}"
        for argv, log, proc in background:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
            log.close()
            assert code == 0, f"{' '.join(argv)[:200]}\n{Path(log.name).read_text()[-3000:]}"
    finally:
        for _, _, proc in background:
            if proc.poll() is None:
                proc.kill()
    assert (tmp_path / "runs" / "tiny" / "metrics.jsonl").exists()
    assert (tmp_path / "tiny-cca-hf" / "config.json").exists()


def test_spec_copy_is_current():
    """docs/SPEC.md is the project's SPEC verbatim (the shared one wins; refresh the copy)."""
    shared = ROOT.parent / "shared" / "SPEC.md"
    if not shared.exists():
        pytest.skip("no shared/SPEC.md beside the repository")
    assert (ROOT / "docs" / "SPEC.md").read_text() == shared.read_text(), (
        "docs/SPEC.md differs from ../shared/SPEC.md: copy it again")
