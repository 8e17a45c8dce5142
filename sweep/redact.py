"""Passwords out of storage URLs and out of any text that may hold one.

Both the sweep and ``infra/`` apply these to whatever they print, log, raise or store, so this module
imports nothing of ours (it ranks below the store and infra alike).
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

QUERY_SECRETS = frozenset({"password"})  # libpq and the drivers also take the password as ?password=


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (journal URLs pass unchanged)."""
    if url.startswith("journal:"):  # a file path, whatever '@' or ':' it holds (bare paths have no '://')
        return url
    parts = _userinfo(url)
    if parts is not None and ":" in parts[1]:
        scheme, userinfo, rest = parts
        url = f"{scheme}{userinfo.split(':', 1)[0]}:***@{rest}"
    return _mask_query(url)


def _mask_query(url: str) -> str:
    """``url`` with the value of every password query parameter replaced by ``***``."""
    base, mark, query = url.partition("?")
    if not mark:
        return url
    pairs = [f"{p.partition('=')[0]}=***" if unquote(p.partition("=")[0]).lower() in QUERY_SECRETS else p
             for p in query.split("&")]
    return base + mark + "&".join(pairs)


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


def query_passwords(url: str) -> list[str]:
    """The passwords a URL gives as query parameters (``?password=``), decoded, as SQLAlchemy reads them."""
    if url.startswith("journal:") or "?" not in url:
        return []
    try:
        query = make_url(url).query
    except (ArgumentError, ValueError):
        query = {}
    found = [v for k, vs in query.items() if k.lower() in QUERY_SECRETS
             for v in ((vs,) if isinstance(vs, str) else vs)]
    # A URL SQLAlchemy cannot parse still has its query string read by hand, so nothing slips through.
    for pair in url.partition("?")[2].split("&"):
        key, _, value = pair.partition("=")
        if unquote(key).lower() in QUERY_SECRETS and value:
            found.append(value)
    return [v for v in found if v]


def scrub(text: str, url: str | None) -> str:
    """Remove the URL's password from arbitrary text (an error message, a log line)."""
    if not url:
        return text
    for secret in [password(url) or "", *query_passwords(url)]:
        forms = {secret, unquote(secret), quote(unquote(secret), safe=""), quote(secret, safe="")}
        for form in sorted(forms, key=len, reverse=True):
            if form:
                text = text.replace(form, "***")
    return text
