"""The script trainer's event lines, signed with a per-trial key (HMAC-SHA256), and their check.

Torch-free, so both ends use this one module: :mod:`model.script.run` signs each line it prints, the
supervisor (:mod:`sweep.run.supervisor`) takes a line as an event only when its signature holds. A line a
team's script writes to its parent's stdout carries none (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any


def sign(key: bytes, event: dict[str, Any]) -> str:
    """``event`` as one JSON line with ``sig``, the signature of its canonical form (sorted keys)."""
    payload = json.dumps(event, sort_keys=True, default=str)
    mac = hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({**json.loads(payload), "sig": mac})


def signed(key: bytes, event: dict[str, Any]) -> bool:
    """Whether ``event`` (a parsed line) carries the signature of its content under ``key``; it loses ``sig``."""
    mac = event.pop("sig", None)
    payload = json.dumps(event, sort_keys=True)
    wanted = hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()
    return isinstance(mac, str) and hmac.compare_digest(mac, wanted)
