"""What a competition script prints, read as it comes: progress lines, a FAIL line, the summary block.

Torch-free and defensive: the input is whatever a team's script writes to stdout, carriage returns
(autoresearch redraws its progress line with ``\\r``), binary noise or a line of megabytes included.
Nothing here raises on input. Lines end at ``\\n`` or ``\\r``; a line longer than ``max_line`` bytes
keeps its first ``max_line`` bytes and loses the rest. The defaults fit autoresearch's shape::

    step 00042 (12.3%) | loss: 4.123456 | lrm: 1.00 | dt: 120ms | tok/sec: 12,345 | remaining: 1580s
    ---
    val_bpb:          1.234567
    training_seconds: 300.1

The competition kit's baseline (``dialect="kit"``) prints no percentage and no colons::

    step 00010 | loss 4.1234 | lrm 1.000 | dt 0.50s | tok/s 262,144 | remaining_steps 989 |
    remaining_time 1790s | epoch 1      (one line)

so its fraction done comes from ``remaining_time`` (against the trial's budget) and ``remaining_steps``
(against the steps done, where the script caps steps), which the trainer turns into a fraction, and its
divergence is ``RuntimeError: bad loss detected: ...`` (on stderr, which is read too).

Every pattern is configurable (:class:`Patterns`): ``progress`` finds the fraction of the budget done
(a percentage), ``loss`` the training loss, ``val`` (off by default) a validation figure a script prints
while training, ``remaining_time``/``remaining_steps`` what is left, ``fail`` a line that says the run
diverged: in autoresearch's dialect ``FAIL`` at the start of a line, or written in capitals at the end of
one (autoresearch prints it after its unfinished progress line).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_PATTERNS", "DIALECTS", "KIT_PATTERNS", "Patterns", "Progress", "Reader", "summary_value"]

MAX_LINE = 64 * 1024
MAX_SUMMARY_KEYS = 200

DEFAULT_PATTERNS = {
    "progress": r"\(\s*([0-9]+(?:\.[0-9]*)?)\s*%\s*\)",
    "loss": r"\bloss:\s*([-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|nan|inf|infinity))",
    "step": r"^\s*step\s+([0-9]+)",
    "val": "",
    # FAIL opening a line, or (upper case only) ending one: autoresearch prints it onto its progress line,
    # which it redraws with ``\r`` and leaves open (``... remaining: 280s    FAIL``). Not MAX_FAIL, FAILURE_RATE.
    "fail": r"^\s*FAIL\b|(?-i:(?<![A-Z_])FAIL)\s*$",
    "remaining_time": "",
    "remaining_steps": "",
    "charged": "",
}
_NUMBER = r"([-+]?(?:[0-9][0-9,]*(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|nan|inf|infinity))"
KIT_PATTERNS = {
    "progress": "",
    "loss": r"\|\s*loss\s+" + _NUMBER,
    "step": r"^\s*step\s+([0-9]+)",
    "val": "",
    "fail": r"\bbad loss detected\b",
    "remaining_time": r"\|\s*remaining_time\s+([0-9.]+)\s*s?\b",
    "remaining_steps": r"\|\s*remaining_steps\s+([0-9]+)\b",
    "charged": r"\|\s*charged\s+([0-9.]+)\s*s?\b",  # a field some teams add: the charged seconds so far
}
DIALECTS = {"autoresearch": DEFAULT_PATTERNS, "kit": KIT_PATTERNS}
_SUMMARY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)\s*:\s*(.*?)\s*$")


@dataclass(frozen=True)
class Patterns:
    """Compiled patterns; each but ``fail`` has one group holding the figure. An empty pattern is off."""

    progress: re.Pattern[str] | None
    loss: re.Pattern[str] | None
    step: re.Pattern[str] | None
    val: re.Pattern[str] | None
    fail: re.Pattern[str] | None
    remaining_time: re.Pattern[str] | None = None
    remaining_steps: re.Pattern[str] | None = None
    charged: re.Pattern[str] | None = None

    @classmethod
    def build(cls, overrides: dict[str, str] | None = None, dialect: str = "autoresearch") -> Patterns:
        """The dialect's defaults with ``overrides`` (name -> regex); ValueError names an unknown dialect or
        an unknown or broken pattern."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r}: unknown (known: {', '.join(DIALECTS)})")
        raw = dict(DIALECTS[dialect])
        for name, src in (overrides or {}).items():
            if name not in raw:
                raise ValueError(f"output.{name}: unknown pattern (known: {', '.join(raw)})")
            if not isinstance(src, str):
                raise ValueError(f"output.{name}: must be a regular expression string")
            raw[name] = src
        compiled: dict[str, re.Pattern[str] | None] = {}
        for name, src in raw.items():
            try:
                p = re.compile(src, re.IGNORECASE) if src else None
            except re.error as e:
                raise ValueError(f"output.{name}: not a regular expression: {e}") from None
            if p is not None and name != "fail" and p.groups < 1:
                raise ValueError(f"output.{name}: needs a group around the figure, e.g. (...)")
            compiled[name] = p
        return cls(**compiled)


@dataclass
class Progress:
    """One progress line's figures; None where the line had none."""

    progress: float | None = None  # fraction of the budget, 0..1
    loss: float | None = None
    step: int | None = None
    val: float | None = None
    remaining_time: float | None = None  # seconds of the budget left
    remaining_steps: int | None = None
    charged: float | None = None  # seconds charged so far, where the script prints them


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (ValueError, OverflowError):
        return None


def summary_value(text: str) -> Any:
    """A summary value as a number or boolean where it reads as one, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", ""):
        return None
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    v = _number(text) if re.fullmatch(r"[-+]?[0-9.,]+(?:[eE][-+]?[0-9]+)?|[-+]?(?:nan|inf|infinity)", low) else None
    return text if v is None else v


@dataclass
class Reader:
    """Feed raw stdout bytes; take back lines, their figures, the FAIL mark and the summary block."""

    patterns: Patterns = field(default_factory=Patterns.build)
    max_line: int = MAX_LINE
    summary: dict[str, Any] = field(default_factory=dict)
    in_summary: bool = False
    failed_line: str | None = None
    _buf: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> list[tuple[str, Progress | None]]:
        """The lines ``chunk`` completes, decoded (invalid UTF-8 replaced, NULs dropped), each with its
        figures (None for a line that is no progress line, or one inside the summary block)."""
        lines = []
        start = 0
        for m in re.finditer(rb"[\r\n]", chunk):
            self._take(chunk[start:m.start()])
            lines.append(self._emit())
            start = m.end()
        self._take(chunk[start:])
        return [ln for ln in lines if ln[0]]

    def finish(self) -> list[tuple[str, Progress | None]]:
        """The last line, when output ended without a line break."""
        line = self._emit()
        return [line] if line[0] else []

    def _take(self, piece: bytes) -> None:
        room = self.max_line - len(self._buf)
        if len(piece) > room:
            piece = piece[:max(0, room)]
        self._buf += piece

    def _emit(self) -> tuple[str, Progress | None]:
        line = bytes(self._buf).decode("utf-8", "replace").replace("\x00", "").strip()
        self._buf.clear()
        if not line:
            return "", None
        figures = None if self.in_summary else self.progress(line)
        self._summary_line(line)
        return line, figures

    def _summary_line(self, line: str) -> None:
        if line == "---" or re.fullmatch(r"-{3,}", line):
            self.in_summary, self.summary = True, {}
            return
        if self.patterns.fail is not None and self.patterns.fail.search(line) and self.failed_line is None:
            self.failed_line = line[:300]
        if not self.in_summary:
            return
        m = _SUMMARY_LINE.match(line)
        if m and len(self.summary) < MAX_SUMMARY_KEYS:
            self.summary[m[1]] = summary_value(m[2][:1000])

    def progress(self, line: str) -> Progress | None:
        """The figures of one line; None for a line that has none (not a progress line)."""
        p, out, any_found = self.patterns, Progress(), False
        for name in ("progress", "loss", "step", "val", "remaining_time", "remaining_steps", "charged"):
            pat = getattr(p, name)
            m = pat.search(line) if pat is not None else None
            if m is None:
                continue
            v = _number(m[1])
            if v is None:
                continue
            any_found = True
            if name == "progress":
                out.progress = min(1.0, max(0.0, v / 100.0)) if math.isfinite(v) else None
            elif name in ("step", "remaining_steps"):
                setattr(out, name, int(v) if math.isfinite(v) and abs(v) < 2**62 else None)
            else:
                setattr(out, name, v)
        return out if any_found else None
