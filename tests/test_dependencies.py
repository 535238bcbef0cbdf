"""The declared dependency bounds, and the orbax versions inside them.

`.ci/run`'s second stage installs every dependency at its lower bound (`.ci/oldest.txt`) and runs
a subset of the suite there; these tests keep that file equal to `pyproject.toml`'s bounds, and
run the save path of an orbax older than the installed one (no `deepcopy_host_arrays`), as
orbax 0.11.17-0.12.4 are.
"""

from __future__ import annotations

import functools
import re
import tomllib
import warnings
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from cca_jax import checkpoint
from cca_jax.checkpoint import restore_params, save_tree

ROOT = Path(__file__).resolve().parents[1]
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(>=|==)\s*([0-9][^,;\s]*)\s*$")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, tuple[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for req in project["dependencies"] + project["optional-dependencies"]["test"]:
        m = _REQ.match(req)
        assert m, f"pyproject.toml: {req!r} is not NAME>=VERSION or NAME==VERSION"
        out[_name(m[1])] = (m[2], m[3])
    return out


def _oldest() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f".ci/oldest.txt: {line!r} is not NAME==VERSION"
            out[_name(name.strip())] = version.strip()
    return out


def test_oldest_versions_file_pins_every_declared_bound():
    declared, oldest = _declared(), _oldest()
    assert sorted(oldest) == sorted(declared)
    for name, (op, version) in declared.items():
        # "0.12.2" == "0.12.2"; a bound ">=6" is pinned as "6.0.0", ">=2.0" as "2.0.0".
        pin = oldest[name]
        norm = lambda v: tuple(int(x) for x in v.split("."))
        pad = lambda t: t + (0,) * (3 - len(t))
        assert pad(norm(pin)) == pad(norm(version)), (
            f"{name}: pyproject.toml says {op}{version}, .ci/oldest.txt pins {pin}")


@pytest.fixture
def old_orbax_numpy_handler(monkeypatch):
    """orbax's NumpyHandler as 0.11.17-0.12.4 have it, for our handler: no
    `deepcopy_host_arrays` keyword, and a copy of every array (the installed orbax's default).
    (The installed orbax's own subclasses still get the keyword they pass.)"""
    handler = ocp.type_handlers.NumpyHandler
    new_init = handler.__init__

    def old_init(self, *args, **kwargs):
        if isinstance(self, checkpoint._LazyArrayHandler) and "deepcopy_host_arrays" in kwargs:
            raise TypeError("NumpyHandler.__init__() got an unexpected keyword argument "
                            "'deepcopy_host_arrays'")
        new_init(self, *args, **kwargs)

    monkeypatch.setattr(handler, "__init__", old_init)
    # What cca_jax.checkpoint found at import, had this been the installed orbax.
    monkeypatch.setattr(checkpoint, "ORBAX_COPIES_LEAVES", True, raising=False)
    # A fresh warn-once for this test (and the process's own back after it).
    monkeypatch.setattr(checkpoint, "_warn_copies_once",
                        functools.cache(checkpoint._warn_copies_once.__wrapped__))


def test_save_on_an_orbax_without_deepcopy_host_arrays(tmp_path, old_orbax_numpy_handler):
    tree = {"embed_tokens": {"embedding": np.arange(12, dtype=np.float32).reshape(4, 3)},
            "layers": checkpoint.LazyArray((2, 3), np.float32, lambda: np.ones((2, 3), np.float32)),
            "step": 3}
    with pytest.warns(UserWarning, match="copies each array.*twice the largest"):
        save_tree(tmp_path / "a", tree)
    with warnings.catch_warnings():      # once per process
        warnings.simplefilter("error")
        save_tree(tmp_path / "b", tree)
    out = restore_params(tmp_path / "b")
    assert np.array_equal(out["embed_tokens"]["embedding"], tree["embed_tokens"]["embedding"])
    assert np.array_equal(out["layers"], np.ones((2, 3), np.float32))


def test_the_keyword_is_what_old_orbax_lacks(tmp_path, old_orbax_numpy_handler, monkeypatch):
    """The control: passing `deepcopy_host_arrays` there is the H200's TypeError."""
    monkeypatch.setattr(checkpoint, "ORBAX_COPIES_LEAVES", False)
    with pytest.raises(TypeError, match="deepcopy_host_arrays"):
        save_tree(tmp_path / "a", {"x": np.ones(3, np.float32)})


def test_orbax_without_the_keyword_is_detected(old_orbax_numpy_handler):
    assert checkpoint._numpy_handler_copies(ocp.type_handlers.NumpyHandler)


def test_installed_orbax_is_detected():
    handler = ocp.type_handlers.NumpyHandler
    assert checkpoint.ORBAX_COPIES_LEAVES == checkpoint._numpy_handler_copies(handler)
