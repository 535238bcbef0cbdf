"""Ctrl-C and kills of `python -m train.finetune`, each at a point the test picks.

One run directory goes through the whole story, each step a process of its own, stopped where
`train.testing.pause_point` pauses it (the test waits for "paused at <point>" and signals):
1. SIGKILL just before the first checkpoint is saved (steps 1-2 logged, nothing saved);
2. the same command: Ctrl-C (SIGINT) after step 3, step 2 being saved;
3. the same command: SIGKILL in the final export, OUT/final complete but not in place;
4. the same command, to the end.
Each process has 2 CPU devices and a shared compilation cache (the steps compile once).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from train.testing import PAUSE_ENV

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--preset", "tiny", "--seq-len", "64", "--steps", "4", "--save-every", "2"]
TIMEOUT_S = 600


def _env(cache: Path, pause: str | None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    env.pop(PAUSE_ENV, None)
    if pause is not None:
        env[PAUSE_ENV] = pause
    return env


def finetune(args: list[str], cache: Path, pause: str | None = None,
             sig: int | None = None) -> tuple[int, str]:
    """Run the CLI; with `pause`, send `sig` once it says "paused at <pause>".
    Returns (exit status, stdout and stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "train.finetune", *args],
                            env=_env(cache, pause), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # as a shell starts it: SIGINT raises KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines = []
    try:
        if pause is not None:
            for line in proc.stdout:
                lines.append(line)
                if line.rstrip().endswith(f"paused at {pause}"):   # maybe after a bar
                    proc.send_signal(sig)
                    break
            else:
                pytest.fail(f"never paused at {pause!r}:\n" + "".join(lines)[-3000:])
        lines.append(proc.communicate()[0])
    finally:
        watchdog.cancel()
        proc.kill()
    return proc.returncode, "".join(lines)


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    base = tmp_path_factory.mktemp("interrupts")
    out, cache = base / "run", base / "jax_cache"
    args = ARGS + ["--out", str(out)]
    seen = {"args": args, "out": out}
    code, log = finetune(args, cache, "save 2", signal.SIGKILL)
    assert code == -signal.SIGKILL, log[-3000:]
    seen["killed_before_save"] = _steps(out)
    seen["sigint"] = finetune(args, cache, "step 3", signal.SIGINT)
    seen["after_sigint"] = _steps(out)
    code, log = finetune(args, cache, "export", signal.SIGKILL)
    assert code == -signal.SIGKILL, log[-3000:]
    seen["killed_in_export"] = sorted(p.name for p in out.iterdir())
    seen["last"] = finetune(args, cache)
    return seen


def test_ctrl_c_exits_130_with_one_line_naming_checkpoint_and_command(story):
    code, log = story["sigint"]
    assert code == 130, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    head, _, command = last.partition("; resume from it with: ")
    assert head == f"interrupted: the last complete checkpoint is step 2 of {story['out']}", last
    assert shlex.split(command) == ["python", "-m", "train.finetune", *story["args"]], last


def test_kill_before_the_first_checkpoint_leaves_no_duplicate_metrics(story):
    assert story["killed_before_save"] == [1, 2]    # logged, never saved
    assert story["after_sigint"] == [1, 2, 3]       # the rerun started over: 1-2 once
    code, log = story["last"]
    assert code == 0, log[-3000:]
    assert _steps(story["out"]) == [1, 2, 3, 4]


def test_kill_during_the_final_export_keeps_no_partial_export(story):
    out = story["out"]
    assert "final" not in story["killed_in_export"]     # not in place until complete
    code, log = story["last"]
    assert code == 0, log[-3000:]
    assert json.loads((out / "final" / "trained_steps.json").read_text()) == {"step": 4}
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints", "data_cache", "final", "hf", "metrics.jsonl", "run_config.json"]
    assert {p.name for p in (out / "hf").iterdir()} >= {"config.json", "model.safetensors"}
