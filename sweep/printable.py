"""Text from trials made safe to print on a terminal: no escape sequences, no carriage returns.

Figures and reasons come from a trial's own output (a script's summary block, an exception's message),
which a script controls. Printed raw, an ANSI escape could recolour, clear or retitle the reader's
terminal, and a '\\r' or a newline could overwrite or forge a line of the sweep's log. Every command's
output goes through :class:`Printable` (sweep/cli.py) and every one-line event through :func:`printable`.
"""

from __future__ import annotations

import re
from typing import Any, TextIO

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST) and the two-character escapes, removed whole so that no
# "[31m" is left behind; C1's CSI (U+009B) and OSC (U+009D) likewise.
_ESCAPE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                     r"|\x1b[@-Z\\-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and newline, DEL, C1


def printable(text: str, multiline: bool = False) -> str:
    """``text`` without escape sequences and control characters; a tab becomes a space, and a newline too
    unless ``multiline`` (a block of lines, not one event's line)."""
    text = _CONTROL.sub("", _ESCAPE.sub("", text)).replace("\t", " ")
    return text if multiline else text.replace("\n", " ")


class Printable:
    """A text stream that writes what it is given through :func:`printable` (lines kept); everything else
    (flush, fileno, getvalue) is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(printable(text, multiline=True))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
