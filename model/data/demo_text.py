"""The offline demo corpus: English text that every Python installation ships, as parquet shards.

Texts, about 3.3 MB in all with CPython 3.11:
- every topic of the interactive help (pydoc_data.topics);
- the docstrings of the standard library's modules, read from their source files with `ast` (nothing is
  imported): a module's own docstring, each top-level function's with its signature, and each class's
  with its methods' signatures and docstrings;
- the block comments of each of those files (runs of two or more comment lines).
Each text is cut at paragraph breaks into documents of at most DOC_CHARS characters. Each document
goes to one of SHARDS shards by a hash of its key (file, line, kind, part), so the split depends neither
on traversal order nor on numpy; within a shard documents are sorted by key. The same standard
library therefore gives the same texts on every machine; a distribution that splits the standard
library into several packages (Debian's python3-tk, ...) may give a slightly different set. The last
shard is the validation shard, as for any source.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from model.data.files import build_once

__all__ = ["DEMO_VERSION", "SHARDS", "build_demo_corpus", "demo_documents"]

DEMO_VERSION = 1
SHARDS = 8
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SKIP_FILES = {"pydoc_data/topics.py"}  # imported below instead: parsing 750 kB of one literal is slow
# Documents are cut at paragraph breaks to at most this many characters (about 200 tokens): the
# kit-style packing crops documents longer than a row and drops the rest, and the demo trains with short
# rows (128-256 tokens), so long documents would mostly go to waste.
DOC_CHARS = 800


def _split(text: str, limit: int = DOC_CHARS) -> list[str]:
    """`text` cut at blank lines into pieces of at most `limit` characters; longer paragraphs stay whole."""
    pieces: list[str] = []
    current = ""
    for para in text.split("\n\n"):
        if current and len(current) + 2 + len(para) > limit:
            pieces.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        pieces.append(current)
    return pieces


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{prefix} {node.name}({ast.unparse(node.args)})"


def _class_text(node: ast.ClassDef, module: str) -> str:
    parts = [f"class {module}.{node.name}"]
    doc = ast.get_docstring(node)
    if doc:
        parts.append(doc)
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            method_doc = ast.get_docstring(item)
            if method_doc:
                parts.append(f"{_signature(item)}\n{method_doc}")
    return "\n\n".join(parts) if len(parts) > 1 else ""


def _module_documents(path: Path, rel: str) -> Iterator[tuple[str, str]]:
    """(key, text) for the docstrings and comment blocks of one source file."""
    source = path.read_bytes()
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    try:
        tree = ast.parse(source, filename=rel)
    except (SyntaxError, ValueError):  # e.g. lib2to3 test data written in Python 2
        return
    doc = ast.get_docstring(tree)
    if doc:
        yield f"{rel}:0:module", f"Module {module}\n\n{doc}"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield f"{rel}:{node.lineno}:def", f"{_signature(node)}\n\n{doc}"
        elif isinstance(node, ast.ClassDef):
            text = _class_text(node, module)
            if text:
                yield f"{rel}:{node.lineno}:class", text

    blocks: list[str] = []
    run: list[str] = []
    for line in source.decode("utf-8", "replace").splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith(("#!", "# -*-")):
            run.append(stripped.lstrip("#").strip())
        else:
            if len(run) >= 2:
                blocks.append(" ".join(w for w in run if w))
            run = []
    for part, text in enumerate(_split("\n\n".join(blocks))):
        yield f"{rel}:comments:{part}", text


def demo_documents(stdlib: Path | None = None, max_files: int | None = None) -> Iterator[tuple[str, str]]:
    """(key, text) of every demo document, in a fixed order; max_files limits the source files read."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for part, text in enumerate(_split(topics[name].strip())):
            yield f"pydoc_data/topics:{name}:{part}", text
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    count = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        if _SKIP_PARTS.intersection(rel.split("/")) or rel in _SKIP_FILES:
            continue
        if max_files is not None and count >= max_files:
            break
        count += 1
        for key, text in _module_documents(path, rel):
            for part, piece in enumerate(_split(text)):
                yield f"{key}:{part}", piece


def _shard_of(key: str, shards: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % shards


def build_demo_corpus(
    out_dir: str | Path, shards: int = SHARDS, max_files: int | None = None, stdlib: Path | None = None
) -> Path:
    """Write the demo corpus to out_dir/shard_0000N.parquet once (locked, atomic); returns out_dir.

    Nothing is downloaded. Concurrent callers wait for the first one and then share its files.
    """
    out = Path(out_dir)

    def build(tmp: Path) -> None:
        buckets: list[list[tuple[str, str]]] = [[] for _ in range(shards)]
        for key, text in demo_documents(stdlib, max_files):
            if text:
                buckets[_shard_of(key, shards)].append((key, text))
        tmp.mkdir(parents=True)
        shards_info: dict[str, dict[str, object]] = {}
        manifest = {"version": DEMO_VERSION, "python": sys.version.split()[0], "shards": shards_info}
        for i, bucket in enumerate(buckets):
            bucket.sort()
            table = pa.table({"text": [t for _, t in bucket], "key": [k for k, _ in bucket]})
            name = f"shard_{i:05d}.parquet"
            pq.write_table(table, tmp / name, row_group_size=1024, compression="zstd")
            texts = [t for _, t in bucket]
            shard_sha = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
            shards_info[name] = {"documents": len(texts), "chars": sum(map(len, texts)), "sha": shard_sha}
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    build_once(out, build)
    return out
