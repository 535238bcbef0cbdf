"""Is a refactor of the Mosaic GPU kernels a no-op? Their modules, lowered for CUDA on any
machine (no GPU), compared between two source trees.

    python benchmarks/research/mosaic_modules.py --against OLD_TREE [--grad] [--out DIR]
        [--d 128 --hq 32 --hkv 8 --length 8192 --slots 512] [--tiling JSON]

Lowers `blocked_attention_mosaic_gpu` (with `--grad`, its backward too) in this tree and in
OLD_TREE (e.g. `git archive <commit> cca_jax pallas_kernels | tar -x -C DIR`), each in its own
process, and records each Mosaic GPU module as it stands before serialization, after MLIR's
canonicalize and cse, without source locations. Per kernel it says whether the two texts are
equal; else which of the loops that issue wgmma are the old tree's (SSA names ignored), and
how the op counts differ. Where the hot loops are equal, a timing difference between the
trees is not in them. With `--out`, each module's text is written there (`old_<kernel>.mlir`,
`new_<kernel>.mlir`) for `diff`.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SSA = re.compile(r"%[A-Za-z0-9_#:\-]+")
_OP = re.compile(r"(?:= |^\s*)([a-z_]+\.[a-z_.]+)")


def _canonical_text(module) -> str:
    """The module's text after MLIR's canonicalize and cse passes (on a copy), locations
    left out: `x + 0`, constant remainders and repeated index arithmetic folded, as the
    kernel's compilation folds them anyway."""
    from jax._src.lib.mlir import ir, passmanager
    text = module.operation.get_asm(enable_debug_info=False)
    copy = ir.Module.parse(text, context=module.context)
    passmanager.PassManager.parse("builtin.module(canonicalize,cse)",
                                  context=module.context).run(copy.operation)
    return copy.operation.get_asm(enable_debug_info=False)


def capture_modules(run) -> list[str]:
    """The text of every Mosaic GPU module `run()` lowers, locations left out."""
    from jax.experimental.mosaic.gpu import core
    serde = getattr(core, "_run_serde_pass", None)
    if serde is None:
        raise SystemExit("this jax's Mosaic GPU has no _run_serde_pass to observe modules at; "
                         "run the probe under the jax it was written for (0.10.2)")
    texts = []

    def observed(module, *args, serialize=False, **kwargs):
        if serialize:
            texts.append(_canonical_text(module))
        return serde(module, *args, serialize=serialize, **kwargs)
    core._run_serde_pass = observed
    try:
        run()
    finally:
        core._run_serde_pass = serde
    return texts


def _lower(args) -> list[str]:
    """The modules of one lowering in the tree this process imports. Not through
    `tests/mosaic_gpu_cases.lowered_text`: an archived tree may hold no tests, and an old
    one's helper takes other arguments; the kernels' entry is what both trees share."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.mosaic_gpu import blocked_attention_mosaic_gpu
    tiling = json.loads(args.tiling)
    shape = jax.ShapeDtypeStruct
    q = shape((1, args.length, args.hq, args.d), jnp.bfloat16)
    kv = shape((1, args.length, args.hkv, args.d), jnp.bfloat16)
    slots = shape((1, args.slots, args.hq, args.d), jnp.bfloat16)
    bounds = shape((1, args.length), jnp.int32)

    def forward(*a):
        return blocked_attention_mosaic_gpu(*a, **tiling)
    fn = forward
    if args.grad:
        fn = jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)),
                      argnums=(0, 1, 2, 3, 4))
    lowered = jax.jit(fn).trace(q, kv, kv, slots, slots, bounds, bounds, bounds)
    return capture_modules(lambda: lowered.lower(lowering_platforms=("cuda",)))


def module_name(text: str) -> str:
    match = re.match(r"module @(\S+)", text)
    return match.group(1) if match else "unnamed"


def _named(texts: list[str]) -> list[tuple[str, str]]:
    """(name, text) of each module, a repeated name numbered in lowering order."""
    seen = collections.Counter()
    named = []
    for text in texts:
        name = module_name(text)
        seen[name] += 1
        named.append((name if seen[name] == 1 else f"{name}#{seen[name]}", text))
    return named


def wgmma_loops(text: str) -> list[str]:
    """Digests of the `scf.for` loops that issue wgmma, SSA names ignored, in order."""
    lines = [_SSA.sub("%v", line) for line in text.splitlines()]
    digests = []
    for i, line in enumerate(lines):
        if "scf.for" not in line or "iter_args" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and not (lines[j].startswith(" " * indent + "}")
                                      and len(lines[j]) - len(lines[j].lstrip()) == indent):
            j += 1
        body = [x.strip() for x in lines[i:j + 1]]
        if any("wgmma" in x for x in body):
            digests.append(hashlib.sha256("\n".join(body).encode()).hexdigest()[:12])
    return digests


def summary(name: str, text: str) -> dict:
    ops = collections.Counter(m.group(1) for line in text.splitlines()
                              for m in [_OP.search(line)] if m)
    return {"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "loops": wgmma_loops(text), "ops": dict(ops)}


def compare(old: dict, new: dict) -> str:
    """One line: how kernel `new` differs from `old` (same name)."""
    if old["sha256"] == new["sha256"]:
        return "identical"
    shared = sum((collections.Counter(old["loops"]) & collections.Counter(new["loops"]))
                 .values())
    loops = ("the same wgmma loops, in the same order" if old["loops"] == new["loops"] else
             f"{shared} of its {len(new['loops'])} wgmma loops as in the old tree's "
             f"{len(old['loops'])}" + (" (reordered)" if shared == len(new["loops"])
                                       == len(old["loops"]) else ""))
    delta = {op: new["ops"].get(op, 0) - old["ops"].get(op, 0)
             for op in sorted(set(old["ops"]) | set(new["ops"]))}
    delta = ", ".join(f"{op} {d:+d}" for op, d in delta.items() if d)
    return f"{loops}; ops {delta or 'the same counts'}"


def _child(args) -> int:
    named = _named(_lower(args))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name, text in named:
            path = os.path.join(args.out, f"{args.label}_{name}.mlir")
            with open(path, "x") as f:     # never over an earlier run's text
                f.write(text)
    json.dump([summary(name, text) for name, text in named], sys.stdout)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="the other source tree (its cca_jax, pallas_kernels)")
    ap.add_argument("--grad", action="store_true", help="the backward kernels too")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--tiling", default="{}", help="JSON keywords of the kernels' entry")
    ap.add_argument("--out", help="a new directory for the modules' texts")
    ap.add_argument("--label", default="new", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if not args.against or not os.path.isdir(os.path.join(args.against, "pallas_kernels")):
        raise SystemExit("--against must name a source tree with pallas_kernels/ in it")
    if args.out and os.path.exists(args.out):
        raise SystemExit(f"{args.out} exists: pass --out with a new directory")
    forwarded = list(argv if argv is not None else sys.argv[1:])
    results = {}
    for label, tree in (("old", os.path.abspath(args.against)), ("new", _REPO)):
        cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--child",
               "--label", label]
        env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"lowering in {tree} failed:\n{done.stderr[-3000:]}")
        results[label] = {s["name"]: s for s in json.loads(done.stdout)}
    for name in sorted(set(results["old"]) | set(results["new"])):
        old, new = results["old"].get(name), results["new"].get(name)
        verdict = ("only in the old tree" if new is None else "only in this tree" if old is None
                   else compare(old, new))
        print(f"{name}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
