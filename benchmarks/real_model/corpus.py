"""Long documents of real code, offline: the installed Python packages' sources and docs.

Repository-level code is the long-context data that ProLong found best; every machine has
some. Each installed distribution (`importlib.metadata`, files from its RECORD) is one
"repository": its `.py`, `.pyi`, `.md` and `.rst` files, sorted by path, each preceded by a
line naming it, are concatenated and cut at file boundaries into documents of about
`doc_chars` characters. Whole packages are held out for evaluation. Everything is
deterministic for a given set of installed packages, and `manifest.json` records it
(packages, versions, files, characters, tokens and a hash of each document set).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sysconfig
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

SUFFIXES = (".py", ".pyi", ".md", ".rst")
TRAIN_DIR = "train"                 # train.finetune --data points here (JSONL documents)
HELDOUT_CODE = "heldout_code.txt"   # perplexity text (the held-out packages)
MANIFEST = "manifest.json"


def package_files(dist: importlib.metadata.Distribution,
                  max_file_bytes: int) -> list[tuple[str, Path]]:
    """(relative path, absolute path) of a distribution's text sources, sorted by path."""
    found = []
    for f in dist.files or ():
        rel = str(f)
        if not rel.endswith(SUFFIXES) or "__pycache__" in rel or rel.startswith(".."):
            continue
        path = Path(f.locate())
        try:
            if path.is_file() and path.stat().st_size <= max_file_bytes:
                found.append((rel, path))
        except OSError:
            continue
    return sorted(found)


def package_documents(files: list[tuple[str, Path]], doc_chars: int) -> Iterator[str]:
    """The files' text, `# file: <path>` before each, cut into ~doc_chars documents at file
    boundaries (a larger file is a document of its own). Non-UTF-8 files are skipped."""
    parts, size = [], 0
    for rel, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        piece = f"# file: {rel}\n{text.rstrip()}\n\n"
        if parts and size + len(piece) > doc_chars:
            yield "".join(parts)
            parts, size = [], 0
        parts.append(piece)
        size += len(piece)
    if parts:
        yield "".join(parts)


def installed_packages(site_packages: Path) -> list[importlib.metadata.Distribution]:
    """Distributions installed in `site_packages`, sorted by normalized name (one each)."""
    seen = {}
    for dist in importlib.metadata.distributions(path=[str(site_packages)]):
        name = dist.metadata["Name"].lower().replace("_", "-")
        seen.setdefault(name, dist)
    return [seen[n] for n in sorted(seen)]


def _keep(key: str, fraction: float) -> bool:
    """A deterministic pseudo-random choice of documents (by the hash of their key)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def build_corpus(out: Path, tokenizer, *, heldout: tuple[str, ...], doc_chars: int,
                 max_file_bytes: int, eval_code_chars: int, max_chars: int | None = None,
                 site_packages: Path | None = None) -> dict:
    """Write `out/train/*.jsonl`, `out/heldout_code.txt` and `out/manifest.json`.

    `tokenizer`: the model's (a transformers tokenizer), for the token counts. `max_chars`:
    keep a deterministic subset of training documents of about that many characters.
    Returns the manifest. Refuses an `out` that already holds a corpus.
    """
    if (out / MANIFEST).exists():
        raise FileExistsError(f"{out} already holds a corpus ({MANIFEST}); use another dir.")
    site_packages = Path(site_packages or sysconfig.get_paths()["purelib"])
    dists = installed_packages(site_packages)
    names = {d.metadata["Name"].lower().replace("_", "-") for d in dists}
    missing = [p for p in heldout if p not in names]
    if missing:
        raise ValueError(f"held-out packages {missing} are not installed in {site_packages}: "
                         "pass others with --heldout")
    train_docs: dict[str, list[str]] = {}
    heldout_docs: dict[str, list[str]] = {}
    versions = {}
    files_per = {}
    for dist in tqdm(dists, desc="reading packages", unit="pkg"):
        name = dist.metadata["Name"].lower().replace("_", "-")
        files = package_files(dist, max_file_bytes)
        docs = list(package_documents(files, doc_chars))
        if not docs:
            continue
        versions[name], files_per[name] = dist.version, len(files)
        (heldout_docs if name in heldout else train_docs)[name] = docs
    if max_chars is not None:
        total = sum(len(d) for docs in train_docs.values() for d in docs)
        fraction = min(1.0, max_chars / max(total, 1))
        train_docs = {n: [d for i, d in enumerate(docs) if _keep(f"{n}:{i}", fraction)]
                      for n, docs in train_docs.items()}
        train_docs = {n: docs for n, docs in train_docs.items() if docs}

    def tokens(texts: list[str]) -> int:
        return sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])

    (out / TRAIN_DIR).mkdir(parents=True)
    packages = []
    with open(out / TRAIN_DIR / "packages.jsonl", "w") as f:
        for name, docs in tqdm(train_docs.items(), desc="writing + counting", unit="pkg"):
            for doc in docs:
                f.write(json.dumps({"text": doc, "package": name}) + "\n")
            packages.append(_entry(name, versions[name], files_per[name], docs, tokens(docs)))
    heldout_text = "".join(d for n in heldout for d in heldout_docs[n])[:eval_code_chars]
    (out / HELDOUT_CODE).write_text(heldout_text, encoding="utf-8")
    manifest = {
        "site_packages": str(site_packages),
        "suffixes": list(SUFFIXES), "doc_chars": doc_chars, "max_file_bytes": max_file_bytes,
        "max_chars": max_chars,
        "train": {"packages": len(packages),
                  "documents": sum(p["documents"] for p in packages),
                  "chars": sum(p["chars"] for p in packages),
                  "tokens": sum(p["tokens"] for p in packages),
                  "sha256": _digest(d for n in train_docs for d in train_docs[n])},
        "heldout": {"packages": [_entry(n, versions[n], files_per[n], heldout_docs[n],
                                        tokens(heldout_docs[n])) for n in heldout],
                    "eval_chars": len(heldout_text),
                    "eval_tokens": tokens([heldout_text]),
                    "sha256": hashlib.sha256(heldout_text.encode()).hexdigest()},
        "packages": packages,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _entry(name: str, version: str, files: int, docs: list[str], tokens: int) -> dict:
    return {"name": name, "version": version, "files": files, "documents": len(docs),
            "chars": sum(len(d) for d in docs), "tokens": tokens, "sha256": _digest(docs)}


def _digest(docs) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode()).digest())
    return h.hexdigest()
