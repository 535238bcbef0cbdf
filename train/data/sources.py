"""Document sources, all read as TFDS `array_record` data through `tfds.data_source`.

- `tfds:NAME[:SPLIT]`: a TFDS data set the user has prepared (in array_record format) under
  `data_dir`; documents are its `text_field` feature.
- A path: a `.txt` file (one document), a `.jsonl` / `.jsonl.gz` file (one document per line,
  its `text_field`), or a directory holding such files (searched recursively). They are
  written ONCE into a TFDS data set (`CcaLocalText`, array_record) under
  `cache_dir/<key>`, the key hashing the files' paths, sizes and mtimes, so a changed file is
  prepared again and an unchanged one is not.
- `builtin`: the public-domain book `../shared/data/pg19_10146.txt` (Gutenberg header and
  licence stripped) when it exists beside the repository, else `builtin_text.txt` shipped in
  this package, as a local source.

Blank documents are dropped (locally when preparing, for TFDS sources when packing). A source
with no text at all is an error before any compute.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

LOCAL_NAME = "cca_local_text"
LOCAL_VERSION = "1.0.0"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")
PG19_BOOK = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "pg19_10146.txt"
BUILTIN_TEXT = Path(__file__).resolve().parent / "builtin_text.txt"
DEFAULT_CACHE = Path(os.environ.get("CCA_JAX_DATA_CACHE",
                                    Path.home() / ".cache" / "cca_jax" / "data"))
SOURCE_FORMS = ("'builtin', a .txt/.jsonl/.jsonl.gz file or a directory of them, "
                "or 'tfds:NAME[:SPLIT]'")


def _tfds():
    import tensorflow_datasets as tfds  # imported lazily: ~0.5 s
    return tfds


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in LOCAL_SUFFIXES if name.endswith(s)), None)


def local_files(path: Path) -> list[Path]:
    """The text files a local source names, sorted; ValueError naming the fix if none."""
    if not path.exists():
        raise ValueError(f"data source {str(path)!r} does not exist: give {SOURCE_FORMS}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"data directory {str(path)!r} holds no {'/'.join(LOCAL_SUFFIXES)} "
                             "files: put the training text there in one of those forms")
        return files
    if not _suffix(path):
        raise ValueError(f"data file {str(path)!r} is not {'/'.join(LOCAL_SUFFIXES)}: "
                         f"give {SOURCE_FORMS}")
    return [path]


def strip_gutenberg(text: str) -> str:
    """A Project Gutenberg file's text between its START and END markers, LF line ends.

    The markers look like `*** START OF ... ***` (the title may wrap over lines).
    """
    text = text.replace("\r\n", "\n")
    start = re.search(r"\*\*\* ?START OF.*?\*\*\*", text, re.DOTALL)
    if start:
        text = text[start.end():]
    end = re.search(r"\*\*\* ?END OF", text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def read_documents(files: Sequence[Path], text_field: str,
                   gutenberg: bool = False) -> Iterator[tuple[str, str]]:
    """(key, text) for every non-blank document of local files."""
    for i, path in enumerate(files):
        suffix = _suffix(path)
        if suffix == ".txt":
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{str(path)!r} is not UTF-8 text ({e}): convert it, e.g. "
                                 "`iconv -f latin1 -t utf-8`") from e
            if gutenberg:
                text = strip_gutenberg(text)
            if text.strip():
                yield f"{i}", text
            continue
        opener = gzip.open if suffix == ".jsonl.gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not a JSON object ({e})") from e
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{path}:{n} has no string field {text_field!r} (it has "
                                     f"{fields}): pass text_field= the field with the text")
                if text.strip():
                    yield f"{i}:{n}", text


@functools.cache
def _local_builder_class():
    """The TFDS builder over local files (defined once, on first use, so TFDS loads lazily;
    defining it registers its name with TFDS)."""
    tfds = _tfds()

    class CcaLocalText(tfds.core.GeneratorBasedBuilder):
        """Local .txt / .jsonl(.gz) files as one `train` split of {"text": Text}."""

        VERSION = tfds.core.Version(LOCAL_VERSION)

        def __init__(self, *, files: Sequence[str] = (), text_field: str = "text",
                     gutenberg: bool = False, **kwargs):
            # files may be empty: tfds.data_source builds this class by name only to read.
            self._files = [Path(f) for f in files]
            self._text_field = text_field
            self._gutenberg = gutenberg
            super().__init__(**kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, description="Local text files for cca-jax fine-tuning.",
                features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for key, text in read_documents(self._files, self._text_field, self._gutenberg):
                yield key, {"text": text}

        # TFDS announces every preparation as "Downloading and preparing dataset ...",
        # though nothing is downloaded here: say what happens instead.
        def _log_download_bytes(self):
            print(f"data: preparing {len(self._files)} local file(s) once into the cache "
                  f"{self.data_dir} (later runs reuse it)", file=sys.stderr, flush=True)

        def _log_download_done(self):
            pass

    return CcaLocalText


def cache_key(files: Sequence[Path], text_field: str, gutenberg: bool) -> str:
    """A hash of the files' absolute paths, sizes and mtimes and of how they are read."""
    h = hashlib.sha256()
    entries = []
    for f in files:
        st = f.stat()
        entries.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    h.update(json.dumps({"files": entries, "text_field": text_field, "gutenberg": gutenberg,
                         "version": "1.0.0"}).encode())
    return h.hexdigest()[:20]


def check_documents(files: Sequence[Path], text_field: str, gutenberg: bool = False,
                    label: str = "") -> None:
    """Read every document of local files once, writing nothing: a record that is not JSON,
    lacks `text_field` or is not UTF-8, or a source with no text at all, raises here."""
    if sum(1 for _ in read_documents(files, text_field, gutenberg)) == 0:
        raise ValueError(f"data source {label or str(files[0])!r} holds no text (empty or "
                         "whitespace-only files/records): give a source with text")


def _local_data_dir(files: Sequence[Path], text_field: str, gutenberg: bool,
                    cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir or DEFAULT_CACHE) / cache_key(files, text_field, gutenberg)


def _is_prepared(data_dir: Path) -> bool:
    return (data_dir / LOCAL_NAME / str(LOCAL_VERSION) / "dataset_info.json").is_file()


def prepare_local(files: Sequence[Path], *, text_field: str, cache_dir: str | os.PathLike | None,
                  gutenberg: bool = False, label: str = "") -> str:
    """Prepare local files as a TFDS data set once; returns its data_dir. Every document is
    checked before the first byte of a new cache entry is written."""
    files = list(files)
    data_dir = _local_data_dir(files, text_field, gutenberg, cache_dir)
    if not _is_prepared(data_dir):
        check_documents(files, text_field, gutenberg, label)
        # TFDS writes into an `incomplete.*` folder and renames it when done, so an
        # interrupted preparation is redone rather than read half-written.
        builder = _local_builder_class()(files=[str(f) for f in files], text_field=text_field,
                                         gutenberg=gutenberg, data_dir=str(data_dir),
                                         file_format="array_record")
        builder.download_and_prepare()
    return str(data_dir)


def _base_split(split: str) -> list[str]:
    return [s.split("[")[0].strip() for s in split.split("+")]


def open_tfds(name: str, split: str, data_dir: str | None, text_field: str) -> Sequence[Any]:
    """A prepared TFDS data set's split as a random-access source, checked first."""
    tfds = _tfds()
    if name == LOCAL_NAME:
        _local_builder_class()  # registers the class, so the name resolves
    shown_dir = data_dir or "~/tensorflow_datasets"
    prepare = (f"prepare it once in array_record format, e.g. `python -c \"import "
               f"tensorflow_datasets as tfds; tfds.builder('{name}', data_dir='{shown_dir}', "
               f"file_format='array_record').download_and_prepare()\"` (or `tfds build {name} "
               f"--data_dir {shown_dir} --file_format array_record`), then pass "
               f"data_dir={shown_dir!r}")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise ValueError(f"unknown TFDS data set {name!r} (neither registered nor prepared "
                         f"under {shown_dir}): check the name, or {prepare}") from e
    if not builder.is_prepared():
        raise ValueError(f"TFDS data set {name!r} is not prepared under {shown_dir}: {prepare}")
    file_format = str(getattr(builder.info, "file_format", "") or "")
    if "array_record" not in file_format.lower():
        raise ValueError(f"TFDS data set {name!r} under {shown_dir} is prepared as "
                         f"{file_format or 'tfrecord'}, which needs TensorFlow to read: "
                         f"{prepare}")
    splits = sorted(builder.info.splits.keys())
    for s in _base_split(split):
        if s not in splits:
            raise ValueError(f"TFDS data set {name!r} has no split {s!r}: it has {splits}")
    features = builder.info.features
    keys = sorted(features.keys()) if hasattr(features, "keys") else []
    if text_field not in keys:
        raise ValueError(f"TFDS data set {name!r} has no feature {text_field!r} (it has "
                         f"{keys}): pass text_field= the feature with the text")
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)


def resolve_source(source: str, *, data_dir: str | None, text_field: str,
                   cache_dir: str | None) -> tuple[Sequence[Any], str]:
    """(random-access records, the record field holding the text) for a source string."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"data source must be {SOURCE_FORMS}, got {source!r}")
    if source.startswith("tfds:"):
        name, _, split = source[len("tfds:"):].partition(":")
        if not name:
            raise ValueError(f"data source {source!r} names no data set: use 'tfds:NAME[:SPLIT]'")
        src = open_tfds(name, split or "train", data_dir, text_field)
        if len(src) == 0:
            raise ValueError(f"data source {source!r} is empty: give a split with documents")
        return src, text_field
    files, field, gutenberg = _local_source(source, text_field)
    local_dir = prepare_local(files, text_field=field, cache_dir=cache_dir, gutenberg=gutenberg,
                              label=source)
    return open_tfds(LOCAL_NAME, "train", local_dir, "text"), "text"


def _local_source(source: str, text_field: str) -> tuple[list[Path], str, bool]:
    """(files, the text field in them, whether Gutenberg markers are stripped) of a local
    source: "builtin" or a path."""
    if source == "builtin":
        if PG19_BOOK.is_file():
            return [PG19_BOOK], "text", True
        return [BUILTIN_TEXT], "text", False
    return local_files(Path(source).expanduser()), text_field, False


def is_prepared_local(source: str, *, text_field: str, cache_dir: str | None) -> bool | None:
    """For a local source: whether `cache_dir` already holds it prepared (reading it then
    writes nothing). None for a `tfds:` source, which is never prepared here."""
    if not isinstance(source, str) or not source or source.startswith("tfds:"):
        return None
    files, field, gutenberg = _local_source(source, text_field)
    return _is_prepared(_local_data_dir(files, field, gutenberg, cache_dir))


def check_local_source(source: str, *, text_field: str) -> None:
    """Every check of a local source's preparation, writing nothing (reads each document)."""
    files, field, gutenberg = _local_source(source, text_field)
    check_documents(files, field, gutenberg, label=source)
