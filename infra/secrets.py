"""The study database URL: from ``SWEEP_STORAGE``, or from a secret that never touches the cluster config.

Order: ``SWEEP_STORAGE`` (the project-wide contract) wins; else ``SWEEP_DB_SECRET`` (or
``--secret-id``) names where the credentials live:

- ``file:PATH``: a local file (the head node's own PostgreSQL writes ``~/.trnsweep/db.json``);
- anything else: an AWS Secrets Manager secret id or ARN.

A secret holds either a URL (``postgresql+psycopg2://user:pass@host:5432/db``) or RDS-style JSON
``{"username", "password", "host", "port", "dbname"}`` (``engine`` is checked if present; ``url``
also works). RDS-managed master secrets carry only username and password: the host and database
then come from ``SWEEP_DB_HOST`` / ``SWEEP_DB_NAME`` (or ``--db-host`` / ``--db-name``).

The resolved URL goes into a child process's environment (``python -m infra with-db -- CMD``) and
is printed only redacted: passwords never appear in output, errors or the Ray cluster config.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from infra.aws import BadInput, InfraError, client, error_code, region, translate
from sweep.redact import redact as sweep_redact
from sweep.redact import scrub as sweep_scrub

ENV_STORAGE = "SWEEP_STORAGE"
ENV_SECRET = "SWEEP_DB_SECRET"
ENV_HOST = "SWEEP_DB_HOST"
ENV_NAME = "SWEEP_DB_NAME"
DEFAULT_DBNAME = "postgres"
DEFAULT_PORT = 5432
_DRIVER = "postgresql+psycopg2"


@dataclass(frozen=True)
class Resolved:
    """A database URL and where it came from (for messages; the source never holds the password)."""

    url: str
    source: str


def redact(url: str) -> str:
    """The URL with its password replaced: the sweep's redaction, plus a fallback for malformed URLs.

    A hand-written URL with an unquoted '/' or '@' in the password defeats a strict parser; here
    the user information is everything between '://' and the *last* '@', so it is still hidden.
    """
    out = sweep_redact(url)
    secret = _password(url)
    if secret and secret in out:
        scheme, rest = url.split("://", 1)
        userinfo, host = rest.rsplit("@", 1)
        out = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"
    return out


def _password(url: str) -> str | None:
    if "://" not in url:
        return None
    rest = url.split("://", 1)[1]
    if "@" not in rest:
        return None
    userinfo = rest.rsplit("@", 1)[0]
    return userinfo.split(":", 1)[1] if ":" in userinfo and userinfo.split(":", 1)[1] else None


def scrub(text: str, url: str) -> str:
    """``text`` without the URL's password in any of its spellings."""
    text = sweep_scrub(text, url)
    secret = _password(url)
    if secret:
        for form in sorted({secret, unquote(secret), quote(unquote(secret), safe="")}, key=len, reverse=True):
            if form:
                text = text.replace(form, "***")
    return text


def resolve(env: Mapping[str, str] | None = None, secret_id: str | None = None, region_name: str | None = None,
            host: str | None = None, dbname: str | None = None, sm: Any = None) -> Resolved | None:
    """The URL in force, or None when nothing is configured (the sweep then uses its local default)."""
    env = os.environ if env is None else env
    if env.get(ENV_STORAGE) and not secret_id:
        return Resolved(env[ENV_STORAGE], ENV_STORAGE)
    ref = secret_id or env.get(ENV_SECRET)
    if not ref:
        return None
    defaults = {"host": host or env.get(ENV_HOST), "dbname": dbname or env.get(ENV_NAME)}
    if ref.startswith("file:"):
        path = Path(ref[len("file:"):]).expanduser()
        text = _read_file(path)
        return Resolved(url_from_secret(text, str(path), defaults), f"file {path}")
    if sm is None:
        sm = client("secretsmanager", region(region_name))
    text = read_secret(sm, ref)
    return Resolved(url_from_secret(text, f"secret {ref}", defaults), f"secret {ref}")


def _read_file(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file (the head's PostgreSQL writes it during `ray up`)") from None
    except OSError as e:
        raise InfraError(f"{path}: cannot read: {e.strerror}") from None


def read_secret(sm: Any, secret_id: str) -> str:
    """The secret's current value as text (SecretString, or SecretBinary decoded as UTF-8)."""
    from botocore.exceptions import BotoCoreError, ClientError

    what = f"secret {secret_id}"
    try:
        out = sm.get_secret_value(SecretId=secret_id)
    except ClientError as e:
        if error_code(e) == "ResourceNotFoundException":
            raise BadInput(f"{what}: not found in {sm.meta.region_name}") from None
        raise translate(e, what) from None
    except BotoCoreError as e:
        raise translate(e, what) from None
    if out.get("SecretString") is not None:
        return str(out["SecretString"])
    raw = out.get("SecretBinary")
    if raw is None:
        raise BadInput(f"{what}: holds no value")
    try:
        data = raw if isinstance(raw, bytes) else base64.b64decode(raw)
        return data.decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise BadInput(f"{what}: binary value is not UTF-8 text") from None


def url_from_secret(text: str, source: str, defaults: Mapping[str, str | None] | None = None) -> str:
    """A SQLAlchemy URL from a secret's text. Messages name keys, never values."""
    defaults = defaults or {}
    text = text.strip()
    if not text:
        raise BadInput(f"{source}: empty")
    if not text.startswith(("{", "[")):
        return _check_url(text, source)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # The decoder's message carries a position, never the document.
        raise BadInput(f"{source}: neither a URL nor valid JSON (line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{source}: JSON must be an object with username, password, host, port, dbname")
    for key in ("url", "uri", ENV_STORAGE):
        if isinstance(data.get(key), str):
            return _check_url(data[key], f"{source}: {key}")
    engine = str(data.get("engine", "postgres")).lower()
    if engine not in ("postgres", "postgresql", "aurora-postgresql"):
        raise BadInput(f"{source}: engine {engine!r} is not PostgreSQL")
    fields = {
        "username": data.get("username", data.get("user")),
        "password": data.get("password"),
        "host": data.get("host") or defaults.get("host"),
        "dbname": data.get("dbname") or data.get("database") or defaults.get("dbname") or DEFAULT_DBNAME,
    }
    missing = [k for k, v in fields.items() if not v]
    if missing:
        hint = f" (set {ENV_HOST} or pass --db-host for RDS-managed secrets)" if "host" in missing else ""
        raise BadInput(f"{source}: missing {', '.join(missing)}{hint}")
    port = data.get("port", DEFAULT_PORT)
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise BadInput(f"{source}: port must be a number") from None
    user, password = quote(str(fields["username"]), safe=""), quote(str(fields["password"]), safe="")
    url = f"{_DRIVER}://{user}:{password}@{fields['host']}:{port}/{quote(str(fields['dbname']), safe='')}"
    sslmode = data.get("sslmode")
    return f"{url}?sslmode={quote(str(sslmode), safe='')}" if sslmode else url


def _check_url(url: str, source: str) -> str:
    url = url.strip()
    if "://" not in url:
        raise BadInput(f"{source}: not a database URL (expected postgresql+psycopg2://user:password@host/db)")
    scheme = url.split("://", 1)[0]
    if not scheme.startswith("postgresql"):
        raise BadInput(f"{source}: scheme {scheme!r} is not PostgreSQL")
    return url


def check_connection(url: str, timeout_s: int = 10) -> str:
    """Connect and ask the server's version; errors are scrubbed of the password."""
    try:
        import sqlalchemy

        connect_args = {"connect_timeout": timeout_s} if url.startswith("postgresql") else {}
        engine = sqlalchemy.create_engine(url, connect_args=connect_args, poolclass=sqlalchemy.pool.NullPool)
        try:
            with engine.connect() as conn:
                version = conn.execute(sqlalchemy.text("SHOW server_version")).scalar()
        finally:
            engine.dispose()
    except Exception as e:  # noqa: BLE001 - any driver failure becomes one scrubbed line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InfraError(f"database {redact(url)}: {scrub(first, url)}") from None
    return str(version)
