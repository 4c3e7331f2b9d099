"""The ``state`` setting: a PostgreSQL connection URI, checked before anything dials it, and shown without its
password."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

SCHEMES = ("postgresql", "postgres")


def check(dsn: str) -> str:
    """``dsn`` when it is a PostgreSQL URI egressd can use; ValueError says what is wrong, without the password.

    ``postgresql://[USER[:PASSWORD]@][HOST][:PORT]/DATABASE[?PARAMS]``; the
    host may be left out and given as ``?host=/a/socket/dir``. The database
    must be named: egressd does not guess one.
    """
    try:
        parts = urlsplit(dsn.strip())
        parts.port  # noqa: B018 (parses the port: a bad one raises here)
    except ValueError as exc:
        raise ValueError(f"not a PostgreSQL URI ({exc})") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a PostgreSQL URI: it must start postgresql:// (got {shown_parts(parts)!r})")
    if not parts.path.strip("/"):
        raise ValueError(f"name the database: postgresql://HOST/DATABASE (got {shown_parts(parts)!r})")
    if parts.fragment:
        raise ValueError("a PostgreSQL URI has no #fragment")
    return dsn.strip()


def shown(dsn: str) -> str:
    """``dsn`` as egressd prints it: the password, if any, replaced by ``***``."""
    try:
        return shown_parts(urlsplit(dsn.strip()))
    except ValueError:
        return "(a malformed URI)"


def shown_parts(parts: SplitResult) -> str:
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    query = "&".join(
        f"{key}=***" if key.lower() == "password" else f"{key}={value}" if sep else key
        for key, sep, value in (pair.partition("=") for pair in parts.query.split("&") if pair)
    )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
