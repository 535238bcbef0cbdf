"""Streaming readers and writers of Hugging Face weight files, plus atomic output directories.

Reading: `open_hf_weights(dir)` finds `model.safetensors`, sharded safetensors with their
`model.safetensors.index.json`, or `pytorch_model*.bin` (with or without index), and returns a
`WeightReader` that loads ONE tensor at a time as numpy (bf16 via `ml_dtypes`). Safetensors are
parsed here (8-byte header size, JSON header, raw bytes) and read with `seek` + `readinto`, so
nothing is memory-mapped and a truncated file is caught before any data is used.

Writing: `SafetensorsShardWriter` plans every shard's header up front from (name, shape, dtype)
and then accepts tensors in any order, writing each at its offset; peak memory is the tensor
being written. `AtomicOutputDir` builds output in a temporary sibling directory and renames it
into place only when everything succeeded; it refuses an output that overlaps an input.
Progress is a tqdm bar (`progress_bar`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import ml_dtypes
import numpy as np
from tqdm import tqdm

# safetensors dtype code <-> numpy dtype.
ST_DTYPES = types.MappingProxyType({
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
})
NP_TO_ST = types.MappingProxyType({v: k for k, v in ST_DTYPES.items()})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


class ConversionError(ValueError):
    """Bad input to a conversion (the message says what is wrong and how to fix it)."""


# ---- reading -------------------------------------------------------------------------------
# The safetensors format caps its JSON header at 100 MB (the library's HeaderTooLarge).
MAX_SAFETENSORS_HEADER = 100_000_000
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def _not_safetensors(path: Path, why: str) -> ConversionError:
    return ConversionError(f"{path} is not a safetensors file ({why}). Point at the "
                           "checkpoint's own weight files, or re-download or re-export it.")


def _read_safetensors_header(f, path: Path, size: int) -> tuple[dict, int]:
    """(tensor entries, data start) of the safetensors file open as `f` (`size` bytes): an
    8-byte little-endian header length, then a JSON object. A file that does not start so is
    refused as not a safetensors file, one whose header or data run past its end as
    truncated."""
    raw = f.read(9)
    if len(raw) < 9:
        raise _not_safetensors(path, f"{size} bytes, too short for a header")
    (n,) = struct.unpack("<Q", raw[:8])
    if raw[8:9] != b"{" or not 2 <= n <= MAX_SAFETENSORS_HEADER:
        raise _not_safetensors(path, "it does not start with a safetensors header: an 8-byte "
                                     "length, then a JSON object")
    if 8 + n > size:
        raise ConversionError(f"{path} is truncated: header claims {n} bytes, the file "
                              f"has {size}. Re-download or re-export it.")
    try:
        header = json.loads(raw[8:] + f.read(n - 1))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _not_safetensors(path, f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _not_safetensors(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, e in header.items():
        if not isinstance(e, dict) or not _ENTRY_KEYS <= e.keys():
            raise _not_safetensors(path, f"header entry {name!r} lacks "
                                         f"{sorted(_ENTRY_KEYS)}")
    return header, 8 + n


class _SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            header, self.data_start = _read_safetensors_header(f, path, size)
        self.entries = header
        self.shapes = {k: tuple(e["shape"]) for k, e in header.items()}
        self.dtypes = {k: ST_DTYPES.get(e["dtype"]) for k, e in header.items()}
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.data_start + end > size:
            raise ConversionError(
                f"{path} is truncated: tensors need {self.data_start + end} bytes, the file has "
                f"{size}. Re-download or re-export it.")

    def read(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if e["dtype"] not in ST_DTYPES:
            raise ConversionError(f"{self.path}: tensor {name} has unsupported dtype "
                                  f"{e['dtype']}; supported: {sorted(ST_DTYPES)}.")
        dtype = ST_DTYPES[e["dtype"]]
        start, end = e["data_offsets"]
        out = np.empty(e["shape"], dtype)
        if out.nbytes != end - start:
            raise ConversionError(f"{self.path}: tensor {name} has {end - start} bytes for shape "
                                  f"{e['shape']} {e['dtype']} (corrupt header).")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + start)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != out.nbytes:
            raise ConversionError(f"{self.path}: short read of {name} (truncated file).")
        return out


class WeightReader:
    """name -> numpy tensor, one at a time, over the weight files of a HF checkpoint."""

    def __init__(self, files: dict[str, object], shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, np.dtype | None], description: str):
        self._where = files            # tensor name -> file object
        self.shapes = shapes           # tensor name -> shape
        self.dtypes = dtypes           # tensor name -> numpy dtype (None: unsupported)
        self.description = description

    def names(self) -> list[str]:
        return list(self.shapes)

    def read(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ConversionError(f"The checkpoint ({self.description}) has no tensor {name!r}.")
        return self._where[name].read(name)


class _TorchBinFile:
    def __init__(self, path: Path):
        import torch  # only needed for pytorch_model*.bin checkpoints
        try:
            self._sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise ConversionError(f"{path} cannot be read by torch.load ({type(e).__name__}: "
                                  f"{e}); it may be truncated.") from None
        self.shapes = {k: tuple(v.shape) for k, v in self._sd.items()}
        self.dtypes = {k: _numpy_dtype(v.dtype) for k, v in self._sd.items()}

    def read(self, name: str) -> np.ndarray:
        import torch
        t = self._sd[name].detach().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return t.numpy().copy()


def _numpy_dtype(torch_dtype) -> np.dtype:
    import torch
    if torch_dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty(0, dtype=torch_dtype).numpy().dtype


def _index_files(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise ConversionError(f"{index} is not a valid weight index ({e}).") from None
    return sorted(set(weight_map.values()))


def open_hf_weights(hf_dir: str | os.PathLike) -> WeightReader:
    """A reader over the weights in `hf_dir` (safetensors preferred over .bin)."""
    d = Path(hf_dir)
    candidates = ("model.safetensors.index.json", "model.safetensors",
                  "pytorch_model.bin.index.json", "pytorch_model.bin")
    for fname in candidates:
        p = d / fname
        if not p.exists():
            continue
        shards = _index_files(p) if fname.endswith(".json") else [fname]
        missing = [s for s in shards if not (d / s).exists()]
        if missing:
            raise ConversionError(f"{p} lists shard files that are missing in {d}: {missing}.")
        opener = _SafetensorsFile if "safetensors" in fname else _TorchBinFile
        where, shapes, dtypes = {}, {}, {}
        for s in shards:
            f = opener(d / s)
            for name in f.shapes:
                where[name] = f
            shapes.update(f.shapes)
            dtypes.update(f.dtypes)
        return WeightReader(where, shapes, dtypes, f"{d}/{fname}")
    raise FileNotFoundError(
        f"No weights in {d}: expected model.safetensors, model.safetensors.index.json with its "
        "shards, pytorch_model.bin or pytorch_model.bin.index.json.")


# ---- writing -------------------------------------------------------------------------------
class SafetensorsShardWriter:
    """Writes tensors, in any order, into pre-planned safetensors shards (+ index if > 1)."""

    def __init__(self, out_dir: Path, specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                 max_shard_bytes: int = 5 * 2**30):
        self.out_dir = out_dir
        shards: list[list[tuple[str, tuple[int, ...], np.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in specs:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), np.dtype(dtype)))
            size += nbytes
        n = len(shards)
        self.where: dict[str, tuple[Path, int, tuple[int, ...], np.dtype]] = {}
        self.files: list[Path] = []
        self.total_bytes = 0
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype in shard:
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                header[name] = {"dtype": NP_TO_ST[dtype], "shape": list(shape),
                                "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            path = out_dir / fname
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(blob)) + blob)
                f.truncate(8 + len(blob) + offset)
            for name, shape, dtype in shard:
                start = 8 + len(blob) + header[name]["data_offsets"][0]
                self.where[name] = (path, start, shape, dtype)
            self.files.append(path)
            self.total_bytes += offset
        self.written: set[str] = set()
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.where[name][0].name for name, _, _ in specs}}
            (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def write(self, name: str, array: np.ndarray) -> None:
        path, start, shape, dtype = self.where[name]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise ConversionError(f"{name}: planned {shape} {dtype}, got {array.shape} "
                                  f"{array.dtype}.")
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self.written.add(name)

    def close(self) -> None:
        missing = set(self.where) - self.written
        if missing:
            raise ConversionError(f"{len(missing)} planned tensors were never written: "
                                  f"{sorted(missing)[:5]}...")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


# ---- output directory and progress --------------------------------------------------------
def check_output_dir(out: str | os.PathLike, inputs: Iterable[str | os.PathLike],
                     force: bool = False) -> Path:
    """Refuse an output that is, contains or lies inside an input, whatever `force` says.

    Paths are compared after resolving symlinks. `force` only allows replacing an existing
    output that shares nothing with the inputs. Returns the absolute output path.
    """
    out = Path(out).absolute()
    real_out = out.resolve()
    for inp in inputs:
        real_in = Path(inp).resolve()
        if real_out == real_in:
            how = "is"
        elif real_in in real_out.parents:
            how = "lies inside"
        elif real_out in real_in.parents:
            how = "contains"
        else:
            continue
        raise ConversionError(
            f"Output {out} {how} the input {inp} (real paths {real_out} and {real_in}); "
            "writing there would destroy the input, so it is refused even with --force. "
            "Choose an output directory outside the input.")
    if out.exists() and not force:
        raise FileExistsError(f"Output {out} already exists; pass --force (force=True) to "
                              "replace it.")
    return out


class AtomicOutputDir:
    """`with AtomicOutputDir(out, inputs, force) as tmp:` build in `tmp`; renamed to `out` on
    success.

    `out` must not overlap any of `inputs` (`check_output_dir`). An existing `out` is refused
    unless `force` (then replaced only after success). On any error the temporary directory
    is removed, so nothing that looks complete is left behind.
    """

    def __init__(self, out: str | os.PathLike, inputs: Iterable[str | os.PathLike],
                 force: bool = False):
        self.inputs = list(inputs)
        self.out = check_output_dir(out, self.inputs, force)
        self.force = force

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            check_output_dir(self.out, self.inputs, self.force)  # nothing changed meanwhile
        except Exception:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def progress_bar(total_bytes: int, desc: str, verbose: bool = True) -> tqdm:
    """A byte-counting tqdm bar on stderr (tensors read or written; silent if not verbose).
    Advance it with `bar.update(nbytes)`; `bar.set_postfix_str(name)` names the tensor."""
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not verbose, file=sys.stderr, dynamic_ncols=True)


def cli_parser(prog: str, doc: str, out_help: str) -> argparse.ArgumentParser:
    """The converters' shared command line: --out, --force, --quiet (inputs added by each)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, metavar="DIR", help=out_help)
    ap.add_argument("--force", action="store_true", help="replace an existing --out, "
                    "never one that overlaps the input (default: off, an existing --out is "
                    "refused)")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bar or summary (default: off)")
    return ap


def run_cli(ap, argv, convert: Callable[[Any], Any]) -> int:
    """Parse `argv` with `ap`, run `convert(args)`; a clear one-line error and exit status 1
    for what the user can fix."""
    args = ap.parse_args(argv)
    try:
        convert(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
