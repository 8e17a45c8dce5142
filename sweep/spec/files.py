"""Reading study spec files: the TOML decode, ``extends`` merging, and typed access to the result.

Everything that goes wrong here is a :class:`SpecError` whose single line names the file and the
key, so the validation in :mod:`sweep.spec.studyspec` and :mod:`sweep.spec.components` (and the
replay's command-line options, read like a spec table) report mistakes the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STUDIES_DIR = Path(__file__).resolve().parents[1] / "studies"
# A study name becomes a file name, a storage key, a path under the artifacts and text in exported programs:
# letters, digits, '.', '_' and '-' only, and never a bare '.' or '..'.
_STUDY_NAME = re.compile(r"[A-Za-z0-9._-]+")


class SpecError(ValueError):
    """A study spec that cannot be used; the message is one line naming the file and the key."""


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a study, or None when it can."""
    if not _STUDY_NAME.fullmatch(name) or name in (".", ".."):
        return f"a study name is letters, digits, '.', '_' and '-' (not '.' or '..'), got {name!r}"
    return None


def resolve_path(name_or_path: str | os.PathLike[str]) -> Path:
    """``NAME`` means ``sweep/studies/NAME.toml``; anything ending in .toml is a path."""
    text = os.fspath(name_or_path)
    if text.endswith(".toml") or os.sep in text:
        return Path(text)
    if problem := name_problem(text):
        raise SpecError(f"{problem} (or give a path to a .toml)")
    return STUDIES_DIR / f"{text}.toml"


def shipped_studies() -> list[str]:
    """The names of the study specs in ``sweep/studies/``."""
    return sorted(p.stem for p in STUDIES_DIR.glob("*.toml"))


def missing_spec(path: Path) -> str:
    """The one line for a spec that is not there: a name (``sweep/studies/NAME.toml``) says the studies there
    are; a path says itself once."""
    if path.parent.resolve() == STUDIES_DIR.resolve() and path.suffix == ".toml":
        return (f"no such study spec {path.stem!r} in sweep/studies/; the studies there: "
                f"{', '.join(shipped_studies()) or 'none'} (or give a path to a .toml)")
    return f"no such study spec {path}"


def read_spec_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Decode a spec file, merged over the spec it ``extends`` (tables merge, values replace).

    ``chain`` is the files that extend this one, innermost last (for messages and cycle checks).
    """
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        if chain:
            raise SpecError(f"{chain[-1]}: extends: no such study spec {path}") from None
        raise SpecError(missing_spec(path)) from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: invalid TOML: {e}") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start})") from None
    base_name = data.pop("extends", None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise SpecError(f"{path}: extends: must be a study name or a path")
    # A bare name is a sibling spec; a relative path is relative to the extending file.
    if os.sep in base_name or base_name.endswith(".toml"):
        base_path = Path(base_name) if Path(base_name).is_absolute() else path.parent / base_name
    else:
        base_path = path.parent / f"{base_name}.toml"
    if base_path.resolve() in {p.resolve() for p in (*chain, path)}:
        raise SpecError(f"{path}: extends: cycle through {base_path}")
    return _merge(read_spec_file(base_path, (*chain, path)), data)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge; a table naming a different ``name`` (another sampler or pruner) or ``type`` (another
    objective or parameter kind) replaces its base."""
    out = dict(base)
    for k, v in over.items():
        old = out.get(k)
        if isinstance(v, Mapping) and isinstance(old, Mapping) and all(
                v.get(tag, old.get(tag)) == old.get(tag) for tag in ("name", "type")):
            out[k] = _merge(dict(old), v)
        else:
            out[k] = v
    return out


class SpecReader:
    """Typed access to decoded TOML that turns every mismatch into a one-line SpecError."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, key: str, message: str) -> SpecError:
        text = f"{self.path}: {key}: {message}" if key else f"{self.path}: {message}"
        # Keys are any TOML string: a quoted key with a line break must not break the one-line rule.
        return SpecError("".join(c if c.isprintable() else repr(c)[1:-1] for c in text))

    def table(self, value: Any, key: str, allowed: set[str] | None) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(key, "must be a table")
        if allowed is not None:
            for k in value:
                if k not in allowed:
                    where = f"{key}.{k}" if key else k
                    raise self.error(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return dict(value)

    def string(self, t: Mapping[str, Any], key: str, default: Any = ...) -> Any:
        v = self._get(t, key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, str):
            raise self.error(key, f"must be a string, got {v!r}")
        return v

    def choice(self, t: Mapping[str, Any], key: str, choices: tuple[str, ...], default: Any = ...) -> str:
        v = self.string(t, key, default)
        if v not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}, got {v!r}")
        return v

    def integer(self, t: Mapping[str, Any], key: str, low: int | None = None, default: Any = ...) -> Any:
        v = self._get(t, key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.error(key, f"must be an integer, got {v!r}")
        if low is not None and v < low:
            raise self.error(key, f"must be >= {low}, got {v}")
        return v

    def number(self, t: Mapping[str, Any], key: str, low: float | None = None, strict: bool = False,
               default: Any = ...) -> Any:
        v = self._get(t, key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise self.error(key, f"must be a finite number, got {v!r}")
        if low is not None and (v <= low if strict else v < low):
            raise self.error(key, f"must be {'>' if strict else '>='} {low}, got {v}")
        return float(v)

    def _get(self, t: Mapping[str, Any], key: str, default: Any) -> Any:
        leaf = key.rsplit(".", 1)[-1]
        if leaf in t:
            return t[leaf]
        if default is ...:
            raise self.error(key, "missing")
        return default


def spec_hash(path: str | os.PathLike[str]) -> str:
    """A short hash of the study spec as loaded (``extends`` merged; comments and layout ignored).

    Two trials with the same hash ran under the same spec, whatever file names or formatting.
    """
    try:
        data = read_spec_file(Path(path), ())
    except SpecError:  # the file went away after it was loaded; say so rather than stop a sweep
        return "unknown"
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
