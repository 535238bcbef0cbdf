"""Test session set-up: 8 simulated CPU devices for the sharding tests and fast compiles
(`tests/xla_flags.py`), before jax loads; and
the persistent compilation cache (the CLIs', on by default, and the tests' own) in one
temporary directory, never in the user's ~/.cache (CCA_JAX_CACHE_DIR, inherited by the
workers and the CLIs the tests start)."""

import atexit
import os
import shutil
import tempfile

if "CCA_JAX_CACHE_DIR" not in os.environ:
    _cache_root = tempfile.mkdtemp(prefix="cca-jax-test-cache-")
    os.environ["CCA_JAX_CACHE_DIR"] = _cache_root
    atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
# The tests' own compiles share that cache too (both workers and the CLIs they start): the
# same small programs recur across tests, e.g. each server of the serve tests.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.environ["CCA_JAX_CACHE_DIR"], "jax-compile"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

from tests.xla_flags import COMPILE_FAST  # noqa: E402

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in _flags and shutil.which("nvidia-smi") is None:
    _flags += " " + COMPILE_FAST     # CPU-only machines: GPU code keeps XLA's optimisation
os.environ["XLA_FLAGS"] = _flags.strip()


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """stories260K as a HF checkpoint (`hf/`) and converted (`ours/`), once per module."""
    from tests import hf_fixtures as fx
    if not fx.STORIES.exists():
        pytest.skip(f"{fx.STORIES} not found (shared test data is absent)")
    from convert.hf_to_flax import convert_hf_to_flax
    base = tmp_path_factory.mktemp("stories")
    fx.stories260k_to_hf(fx.STORIES, base / "hf")
    convert_hf_to_flax(base / "hf", base / "ours", verbose=False)
    return base


def pytest_collection_modifyitems(items):
    """Tests marked `long` first (a stable sort): pytest-xdist hands tests out in collection
    order, and the README test (about 3 minutes) collected late left one worker running it
    alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
