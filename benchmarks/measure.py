"""Timing and error measures shared by the benchmark scripts, and the stamp every result
record carries (`stamp`: commit, device, jax version, date, command)."""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cca_jax.blocks import parse_option

# The settings every benchmark compares: the paper's CCA and its baselines with the same
# raw window.
PAPER_PATTERNS = {
    "full": parse_option("full"),
    "sliding": parse_option("sliding", window_size=1024),
    "streaming": parse_option("streaming", window_size=1024, sink_tokens=4),
    "cca": parse_option("cca", group_size=16, window_size=1024),
}


ROOT = Path(__file__).resolve().parents[1]
STAMP_KEYS = ("commit", "device", "jax", "date", "command")


def commit() -> str:
    """The repository's short commit hash, "-dirty" when tracked files differ from it;
    outside a git checkout (a `git archive` tree on a remote machine) the `CCA_COMMIT`
    environment variable, else "unknown"."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("CCA_COMMIT", "unknown")


def command(argv=None) -> str:
    """The command line that ran this script, as the README writes it."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", str(script), *args])


def stamp(argv=None) -> dict:
    """What every benchmark record carries: commit, device, jax version, date and command."""
    dev = jax.devices()[0]
    record = {"commit": commit(), "device": getattr(dev, "device_kind", str(dev)),
              "jax": jax.__version__, "date": datetime.date.today().isoformat(),
              "command": command(argv)}
    if os.environ.get("XLA_FLAGS"):     # they change what is measured
        record["xla_flags"] = os.environ["XLA_FLAGS"]
    return record


def median_ms(fn, args, *, warmup: int = 1, iters: int | None = None, max_s: float = 0.5,
              max_iters: int = 20) -> float:
    """Median wall milliseconds of `fn(*args)` after `warmup` calls. `iters=None` sizes the
    count from one timed call: about `max_s` seconds in all, 3 to `max_iters` runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if iters is None:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = time.perf_counter() - start
        iters = int(max(3, min(max_iters, max_s / max(once, 1e-4))))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rel_l2(a, b) -> float:
    """|a - b| / |b| in float32 (L2 norms)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def row_error(got, want) -> float:
    """The largest over rows (the last axis: one position and head) of `max |got - want|`
    relative to the row's L2 norm, in float64: one wrong row does not hide among right ones
    as it does in `rel_l2`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norm = np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
    return float(np.max(np.abs(got - want).max(-1) / norm))


def read_records(paths) -> list:
    """The records of earlier `<out>.json` files, concatenated (for `--merge`)."""
    import json

    records = []
    for path in paths:
        with open(path) as f:
            records += json.load(f)
    return records


# When this process imported the module: results files older than this predate the run.
_RUN_STARTED = time.time()
RESULT_SUFFIXES = (".json", ".md")


def claim_output(out: str, suffixes=RESULT_SUFFIXES) -> None:
    """Refuse, before measuring, to write over results already there (`out + suffix`): a
    benchmark never overwrites earlier results, committed ones included. The run may then
    rewrite its own files as it goes."""
    for path in (out + suffix for suffix in suffixes):
        if os.path.exists(path):
            raise SystemExit(f"{path} already exists, and a benchmark never overwrites "
                             "earlier results: pass --out with a new path, or move that "
                             "file away first.")


def check_not_older(out: str, suffixes=RESULT_SUFFIXES) -> None:
    """The last guard before writing `out + suffix`: no such file may predate this run."""
    for path in (out + suffix for suffix in suffixes):
        if os.path.exists(path) and os.path.getmtime(path) < _RUN_STARTED:
            raise SystemExit(f"{path} was written before this run started, and a benchmark "
                             "never overwrites earlier results: pass --out with a new path.")


def write_results(out: str, records: list, table: str) -> None:
    """Print the markdown table; write `<out>.json` (the records, each made with `stamp()`'s
    keys) and `<out>.md` (the table): new files, or this run's own (`claim_output`)."""
    import json

    print(table)
    check_not_older(out)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(records, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(table)


def round_robin(calls: dict, rounds: int, warmups: int = 2) -> dict:
    """name -> median milliseconds of `fn(*args)` for `calls` = {name: (fn, args)}: after
    `warmups` calls of each, `rounds` rounds of one call of each in turn, so that clock and
    power drift hit every program alike."""
    return {name: statistics.median(t)
            for name, t in round_robin_times(calls, rounds, warmups).items()}


def paired_ratio(times: list[float], base: list[float]) -> dict:
    """The ratio of two programs' times round by round (`round_robin_times` lists: both
    timed in the same rounds, so drift cancels): median and the 10th/90th percentiles."""
    ratios = sorted(a / b for a, b in zip(times, base))
    pick = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
    return dict(median=statistics.median(ratios), p10=pick(0.1), p90=pick(0.9))


def round_robin_times(calls: dict, rounds: int, warmups: int = 2) -> dict:
    """name -> the milliseconds of each round (`round_robin`'s rounds, in order)."""
    times = {name: [] for name in calls}
    for fn, args in calls.values():
        for _ in range(warmups):
            jax.block_until_ready(fn(*args))
    for _ in range(rounds):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def add_cca_shape_args(ap) -> None:
    """The shape flags of the CCA attention probes: --length --hq --hkv --d --g --s (default
    the 128K GQA case: 131072 tokens, 32 query and 8 KV heads of 128, g 16, s 1024)."""
    for flag, default in (("--length", 131072), ("--hq", 32), ("--hkv", 8), ("--d", 128),
                          ("--g", 16), ("--s", 1024)):
        ap.add_argument(flag, type=int, default=default)


def table_heading(title: str, record: dict) -> list:
    """The first lines of a results table: what, and where, when and how it was measured
    (from a `stamp`ed record)."""
    return [f"{title}, {record['device']}, jax {record['jax']}, {record['date']}, "
            f"commit {record['commit']}", f"Command: `{record['command']}`", ""]
