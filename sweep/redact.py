"""Passwords out of storage URLs and out of any text that may hold one.

Both the sweep and ``infra/`` apply these to whatever they print, log, raise or store, so this module
imports nothing of ours (it ranks below the store and infra alike).
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (journal URLs pass unchanged)."""
    if url.startswith("journal:"):  # a file path, whatever '@' or ':' it holds (bare paths have no '://')
        return url
    parts = _userinfo(url)
    if parts is None or ":" not in parts[1]:
        return url
    scheme, userinfo, rest = parts
    return f"{scheme}{userinfo.split(':', 1)[0]}:***@{rest}"


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """(scheme://, userinfo, host and the rest), splitting at the LAST '@': a password may hold an unquoted
    '/' or '@', and a misplaced split then hides too much rather than too little."""
    m = re.match(r"^([^:/]+(?:\+[^:/]+)?://)(.*)$", url, re.S)
    if not m or "@" not in m.group(2):
        return None
    userinfo, _, rest = m.group(2).rpartition("@")
    return m.group(1), userinfo, rest


def password(url: str) -> str | None:
    """The URL's password as written (percent-encoded or not), or None."""
    parts = _userinfo(url)
    if parts is None or ":" not in parts[1]:
        return None
    return parts[1].split(":", 1)[1] or None


def scrub(text: str, url: str | None) -> str:
    """Remove the URL's password from arbitrary text (an error message, a log line)."""
    if not url:
        return text
    secret = password(url)
    if secret:
        for form in {secret, unquote(secret), quote(unquote(secret), safe="")}:
            if form:
                text = text.replace(form, "***")
    return text
