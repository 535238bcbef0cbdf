"""Which values of a compiled program are big: read an optimized HLO dump and list them.

    python benchmarks/research/hlo_big_values.py DUMP.hlo[.gz] [--min-mib 64] [--top 30]

A program that should update a large donated buffer in place (the KV cache) but copies it
shows the copy here: a `copy`, a fusion or a convert whose result is as big as a cache
array. The entry computation's parameters that outputs alias are listed too (an unaliased
donated cache is a new output buffer of the cache's size). Reads dumps of
`serve_step_probe.py --hlo`, `sinks_cost.py --profile`, or `Compiled.as_text()` of any program.
"""

from __future__ import annotations

import argparse
import gzip
import math
import re
import sys

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
# `%name = dtype[dims]{layout} opcode(`: one instruction's result (tuples are skipped).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ALIAS = re.compile(r"\{([\d, ]*)\}:\s*\((\d+),\s*\{[\d, ]*\},\s*([\w\-]+)\)")
_FUSION_BODY = re.compile(r"\bfusion\(.*\bcalls=%?([\w.\-]+)")
# Results that are views or names of buffers made elsewhere, not new bytes.
_VIEWS = frozenset({"parameter", "get-tuple-element", "bitcast", "tuple", "constant"})


def read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def big_values(text: str, min_bytes: int) -> list[dict]:
    """Buffers of at least `min_bytes` the program makes (instructions outside fusion bodies,
    views left out), biggest first, each with the computation it is in."""
    bodies = set(_FUSION_BODY.findall(text))
    found, computation = [], ""
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line[:1].isspace():      # headers start the line, instructions indent
            computation = head.group(2)
            continue
        m = _INSTRUCTION.match(line)
        if not m or computation in bodies:
            continue
        name, dtype, dims, opcode = m.groups()
        if dtype not in _BYTES or opcode in _VIEWS:
            continue
        shape = tuple(int(x) for x in dims.split(",") if x)
        size = math.prod(shape) * _BYTES[dtype]
        if size >= min_bytes:
            found.append(dict(name=name, opcode=opcode, dtype=dtype, shape=shape, bytes=size,
                              computation=computation))
    return sorted(found, key=lambda x: -x["bytes"])


def aliases(text: str) -> list[tuple[str, int, str]]:
    """(output index, parameter number, kind) of the module's input/output aliases."""
    first = text.splitlines()[0] if text else ""
    start = first.find("input_output_alias={")
    if start < 0:
        return []
    return [(out.strip(), int(param), kind) for out, param, kind in
            _ALIAS.findall(first[start:])]


def report(text: str, min_bytes: int, top: int) -> str:
    values = big_values(text, min_bytes)
    lines = [f"{len(values)} values of at least {min_bytes / 2**20:.0f} MiB"]
    for v in values[:top]:
        lines.append(f"  {v['bytes'] / 2**20:10.1f} MiB  {v['opcode']:<24} {v['dtype']}"
                     f"{list(v['shape'])}  {v['name']}  (in {v['computation']})")
    pairs = aliases(text)
    lines.append(f"{len(pairs)} outputs alias a parameter: " +
                 ", ".join(f"out {o} <- param {p} ({k})" for o, p, k in pairs))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+", help="optimized HLO text files (.gz or plain)")
    ap.add_argument("--min-mib", type=float, default=64.0)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    for path in args.dumps:
        print(f"== {path}")
        print(report(read(path), int(args.min_mib * 2**20), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
