"""The attention floor's import rules (DESIGN.md "Floors"), checked on the source text.

`pallas_kernels/` imports nothing from `cca_jax` but the visibility package (`blocks`) and
leaf helpers (`padding`, `remat`'s residual names); `blocks` (its modules in one order) and
the leaf helpers import nothing else from the project; the attention package
imports only downwards, at module level, except the optional kernel packages (the one
allowed lazy import); backends live in one registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAF_HELPERS = ("cca_jax.padding", "cca_jax.remat")
KERNEL_MAY_IMPORT = {"cca_jax.blocks", *LEAF_HELPERS}
ATTENTION_MAY_IMPORT = ("cca_jax.attention", "cca_jax.blocks", "cca_jax.sharding",
                        *LEAF_HELPERS)


def _imports(path: Path):
    """(module, top_level) for every import in `path`; `from cca_jax import blocks` reads as
    cca_jax.blocks."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in ("cca_jax", "pallas_kernels"):
                for alias in node.names:
                    yield f"{node.module}.{alias.name}", id(node) in top
            else:
                yield node.module, id(node) in top


def _project(name: str) -> bool:
    return name.split(".")[0] in ("cca_jax", "pallas_kernels", "train", "convert", "benchmarks")


def test_kernels_import_only_the_visibility_module():
    for path in sorted((ROOT / "pallas_kernels").rglob("*.py")):
        for name, _ in _imports(path):
            if name.startswith("cca_jax"):
                assert name in KERNEL_MAY_IMPORT, f"{path.relative_to(ROOT)} imports {name}"


def test_blocks_and_leaf_helpers_import_nothing_from_the_project():
    for module in LEAF_HELPERS:
        path = ROOT / (module.replace(".", "/") + ".py")
        for name, _ in _imports(path):
            assert not _project(name), f"{module} imports {name}"
    for path in sorted((ROOT / "cca_jax" / "blocks").glob("*.py")):
        for name, _ in _imports(path):
            assert not _project(name) or name.startswith("cca_jax.blocks."), (
                f"{path.relative_to(ROOT)} imports {name}")


def test_the_visibility_modules_import_in_one_order():
    """Inside `cca_jax.blocks`: `_arith` at the bottom, then `options`; `rows`,
    `block_walks` and `cache` read those two only (no module imports its peers)."""
    may = {"_arith": set(), "options": {"_arith"}, "rows": {"_arith", "options"},
           "block_walks": {"_arith", "options"}, "cache": {"_arith", "options"}}
    folder = ROOT / "cca_jax" / "blocks"
    assert {p.stem for p in folder.glob("*.py")} == {*may, "__init__"}
    for module, allowed in may.items():
        found = {name.rsplit(".", 1)[1] for name, _ in _imports(folder / f"{module}.py")
                 if name.startswith("cca_jax.blocks.")}
        assert found <= allowed, f"cca_jax.blocks.{module} imports {found - allowed}"


def test_attention_imports_point_down_and_only_kernels_lazily():
    for path in sorted((ROOT / "cca_jax" / "attention").glob("*.py")):
        for name, top_level in _imports(path):
            if not _project(name):
                continue
            where = path.relative_to(ROOT)
            if top_level:
                assert name.startswith(ATTENTION_MAY_IMPORT), f"{where} imports {name}"
            else:
                assert name.startswith("pallas_kernels"), f"{where} lazily imports {name}"


def test_one_registry_of_backends():
    from cca_jax.attention.backends import BACKENDS
    assert set(BACKENDS) == {"naive", "xla", "cudnn", "mosaic_gpu", "pallas_gpu",
                             "pallas_tpu"}
    for path in sorted((ROOT / "cca_jax").rglob("*.py")):
        text = path.read_text()
        for old in ("BLOCKED_IMPLEMENTATIONS", "DECODE_IMPLEMENTATIONS", "IMPLEMENTATIONS ="):
            assert old not in text, f"{path.relative_to(ROOT)} defines {old}"


def test_nothing_below_the_server_imports_it():
    """`cca_jax.serve` sits on top of generation, prefill and decode: imports point down."""
    for top in ("cca_jax", "train", "convert", "pallas_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(ROOT / "cca_jax" / "serve"):
                continue
            for name, _ in _imports(path):
                assert not name.startswith("cca_jax.serve"), (
                    f"{path.relative_to(ROOT)} imports {name}")
