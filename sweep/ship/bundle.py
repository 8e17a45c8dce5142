"""Pack the ``model`` and ``kernels`` packages into one Python file behind an import hook.

The competition takes a single ``train.py``; it must run the very code the sweep trained, not a copy
kept by hand. :func:`collect` reads the packages' sources as they are on disk (what ``python -m
model.train`` imports), :func:`render` writes them into the file as string literals, verbatim when
they fit the upload limit and zlib-compressed otherwise, ahead of the hook in
:mod:`sweep.ship.bundle_boot` and the caller's own code. Nothing here imports the packages it packs.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
UPLOAD_LIMIT_BYTES = 262_144  # the competition's limit on train.py
PACKAGES = ("model", "kernels")
TEST_ONLY = frozenset({"kernels._fake_nki"})  # stand-ins the test suite swaps in; never imported by a run
ENCODINGS = ("text", "zlib")


class BundleError(ValueError):
    """The bundle cannot be built (too large, unreadable source); one line."""


@dataclass(frozen=True)
class Module:
    name: str  # dotted
    is_package: bool
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def collect(root: Path = REPO_ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Module]:
    """Every module of ``packages`` under ``root`` except the test-only ones, packages first."""
    modules = []
    for pkg in packages:
        base = root / pkg
        if not (base / "__init__.py").is_file():
            raise BundleError(f"{base}: not a package (no __init__.py)")
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if "__pycache__" in rel.parts:
                continue
            is_package = rel.name == "__init__"
            name = ".".join(rel.parts[:-1] if is_package else rel.parts)
            if name in TEST_ONLY:
                continue
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise BundleError(f"{path}: cannot read: {e}") from None
            modules.append(Module(name, is_package, source))
    return sorted(modules, key=lambda m: (m.name.count("."), m.name))


def bundle_id(modules: list[Module]) -> str:
    """A digest of the names and sources: two bundles with one id hold the same code."""
    h = hashlib.sha256()
    for m in modules:
        h.update(f"{m.name}\0{int(m.is_package)}\0{m.sha256}\0".encode())
    return h.hexdigest()[:16]


def text_literal(source: str) -> str:
    """A triple-quoted literal that evaluates to ``source`` exactly and still reads as the code."""
    if "\r" in source or "\0" in source or not source.endswith("\n"):
        return repr(source)  # line-ending normalisation would alter it; a trailing quote would end it early
    literal = '"""' + source.replace("\\", "\\\\").replace('"""', '\\"\\"\\"') + '"""'
    if ast.literal_eval(literal) != source:  # pragma: no cover - the escaping above is exhaustive
        return repr(source)
    return literal


def compressed_literal(source: str) -> str:
    data = base64.b85encode(zlib.compress(source.encode("utf-8"), 9)).decode("ascii")
    return f"unpack({data!r})"


def boot_source() -> str:
    """The hook's code (sweep/ship/bundle_boot.py without its docstring)."""
    text = (Path(__file__).with_name("bundle_boot.py")).read_text(encoding="utf-8")
    doc = ast.parse(text).body[0]
    lines = text.splitlines(keepends=True)
    return "".join(lines[doc.end_lineno:]).lstrip("\n")


def modules_block(modules: list[Module], encoding: str) -> str:
    """``BUNDLE_ID`` and ``BUNDLED_MODULES = {name: (is package, source)}`` as Python source."""
    literal = text_literal if encoding == "text" else compressed_literal
    parts = [f"BUNDLE_ID = {bundle_id(modules)!r}\n", "BUNDLED_MODULES = {\n"]
    for m in modules:
        parts.append(f"# ---- {m.name} ({'package' if m.is_package else 'module'}, sha256 {m.sha256[:16]})\n")
        parts.append(f"{m.name!r}: ({m.is_package}, {literal(m.source)}),\n")
    parts.append("}\n")
    return "".join(parts)


def render(head: str, tail: str, modules: list[Module], limit: int | None = None,
           encoding: str = "auto") -> tuple[str, str]:
    """``head`` (docstring, early settings), the hook, the modules, the hook's installation, ``tail``.

    Returns the file's text and the encoding used: ``text`` when it fits ``limit`` bytes, else
    ``zlib``; raises BundleError when even that is too large (``limit`` defaults to the competition's).
    ``encoding`` forces one.
    """
    limit = UPLOAD_LIMIT_BYTES if limit is None else limit
    if encoding not in ("auto", *ENCODINGS):
        raise BundleError(f"encoding must be auto, text or zlib, got {encoding!r}")
    tried = []
    for enc in ENCODINGS if encoding == "auto" else (encoding,):
        text = "".join([
            head.rstrip("\n"), "\n\n",
            "# ---- the import hook (sweep/ship/bundle_boot.py) ", "-" * 45, "\n", boot_source(), "\n\n",
            "# ---- the bundled packages, as they were on disk at export ", "-" * 36, "\n",
            modules_block(modules, enc), "\n",
            "install(BUNDLED_MODULES, BUNDLE_ID, os.path.join(os.path.dirname(os.path.abspath(globals().get("
            "'__file__') or 'train.py')), '_bundled_' + BUNDLE_ID))\n\n",
            tail.lstrip("\n"),
        ])
        size = len(text.encode("utf-8"))
        if size <= limit:
            return text, enc
        tried.append(f"{enc} {size:,}")
    raise BundleError(f"train.py would be {' / '.join(tried)} bytes, over the upload limit of {limit:,}")
