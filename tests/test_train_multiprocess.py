"""Two processes of `python -m train.finetune` on localhost, with the default exports.

Each process has 2 CPU devices (gloo collectives between them): a 2-step run, then the same
command with `--steps 3` (every process restores the checkpoint), each ending with OUT/final
and the Hugging Face export OUT/hf. One process with 4 devices runs the same 3 steps: the
reference. (tests/test_train_sharded.py has a slow test of two processes over a sequence
axis that crosses them.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.xla_flags import xla_flags

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--preset", "tiny", "--seq-len", "64", "--save-every", "2"]
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def finetune(args: list[str], logs: Path, cache: Path, processes: int,
             devices: int) -> list[tuple[int, str]]:
    """`python -m train.finetune ARGS` as `processes` processes of `devices` CPU devices each;
    [(exit status, output)] per process."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices=devices),
           "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    if processes > 1:
        args = args + ["--coordinator", f"127.0.0.1:{_free_port()}",
                       "--num-processes", str(processes)]
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(processes):
        with open(logs / f"process{i}.log", "w") as log:   # files: no pipe fills up
            ids = ["--process-id", str(i)] if processes > 1 else []
            procs.append(subprocess.Popen([sys.executable, "-m", "train.finetune", *args, *ids],
                                          env=env, cwd=REPO, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(code, (logs / f"process{i}.log").read_text()) for i, code in enumerate(codes)]


def _ok(results):
    assert [code for code, _ in results] == [0] * len(results), "\n\n".join(
        log[-3000:] for _, log in results)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _hf_logits(hf: Path) -> np.ndarray:
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = torch.tensor(np.random.default_rng(0).integers(0, 258, (2, 24)))
    with torch.no_grad():
        return model(ids).logits.numpy()


# Six (two) minutes alone on 2 CPU cores (2026-12-04), pushing the default run past 15 minutes:
# out of the default run until it is made faster (`pytest -m slow` runs it).
@pytest.mark.slow
def test_two_processes_finish_export_and_resume(tmp_path):
    """One test (a fixture shared by several could run once per xdist worker)."""
    pytest.importorskip("transformers")
    multi, single, cache = tmp_path / "multi", tmp_path / "single", tmp_path / "jax_cache"
    # Both processes exit 0: process 0 used to restore the checkpoint for the Hugging Face
    # export alone, while process 1 waited at the end of the run, and both crashed.
    for steps in (2, 3):
        _ok(finetune(ARGS + ["--steps", str(steps), "--out", str(multi)],
                     tmp_path / f"logs-multi-{steps}", cache, processes=2, devices=2))
    _ok(finetune(ARGS + ["--steps", "3", "--out", str(single)], tmp_path / "logs-single",
                 cache, processes=1, devices=4))
    # OUT/hf gives the logits of one process's export.
    got, want = _hf_logits(multi / "hf"), _hf_logits(single / "hf")
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The --steps 3 rerun restored step 2 in both processes: each step logged once, with the
    # losses of one uninterrupted process; the step-2 export is kept aside.
    assert [r["step"] for r in _metrics(multi)] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in _metrics(multi)],
                               [r["loss"] for r in _metrics(single)], rtol=1e-5)
    assert json.loads((multi / "final" / "trained_steps.json").read_text()) == {"step": 3}
    assert json.loads((multi / "final-step2" / "trained_steps.json").read_text()) == {"step": 2}
    assert (multi / "hf-step2" / "config.json").is_file()
