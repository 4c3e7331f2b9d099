"""How a record's values are made plain and safe: secrets dropped, URLs' userinfo cut, enums plain.

Every record builder (``records``, ``approvalrecords``) passes what it is
given through these: a leak into an append-only log cannot be taken back.
Pure.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping


class RecordError(ValueError):
    """A record could not be built from the values given (a caller's bug)."""


# Substrings of key names whose values are never written. Matching substrings
# (not whole names) errs towards dropping: losing a harmless "max_tokens" is
# cheaper than logging a "slack_bot_token".
_SECRET_KEY_PARTS: tuple[str, ...] = (
    "token",
    "password",
    "passwd",
    "credential",
    "secret",
    "authorization",
    "api_key",
    "apikey",
    "cookie",
)

# scheme://userinfo@ — the userinfo part (RFC 3986 §3.2.1) is where proxy
# URLs carry a run's credentials (http://RUN_ID:TOKEN@host:port).
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@\s]*@")


def member(value: object, allowed: frozenset[str], name: str) -> str:
    """``value`` as the plain text of one of ``allowed`` (RecordError otherwise)."""
    text = plain(value)
    if not isinstance(text, str) or text not in allowed:
        raise RecordError(f"{name} must be one of {', '.join(sorted(allowed))}, not {value!r}")
    return text


def plain(value: object) -> object:
    # An Enum member (say a reason code enum) becomes its value: json.dumps
    # would write a str-mixin enum as its value anyway, but a plain Enum
    # would not serialise at all.
    if isinstance(value, enum.Enum):
        return value._value_  # the plain attribute: ``.value`` is a descriptor, slow once per record
    return value


def seconds(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if value.__class__ is float and value - value == 0.0:  # finite: inf - inf and NaN are NaN
        return round(value, 6)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError(f"{name} must be a finite number of seconds, not {value!r}")
    return round(float(value), 6)


def strip_host(host: str | None) -> str | None:
    """Remove userinfo, path, query and fragment from a host string.

    Userinfo goes first, up to the LAST "@": cutting the path first would
    leave the front of a password that contains "/" in the log.
    """
    # Four substring tests: half the cost of a regular expression's search (one per record).
    if host is None or not ("@" in host or "/" in host or "?" in host or "#" in host):
        return host
    host = host.rpartition("@")[2]
    for stop in "/?#":
        host = host.partition(stop)[0]
    return host


def is_secret_key(key: object) -> bool:
    try:
        return _secret_keys[key]
    except (KeyError, TypeError):
        pass
    name = str(key).lower().replace("-", "_")
    secret = any(part in name for part in _SECRET_KEY_PARTS)
    # Records reuse a handful of key names; remember the answers, bounded.
    if len(_secret_keys) >= 1024:
        _secret_keys.clear()
    try:
        _secret_keys[key] = secret
    except TypeError:
        pass  # an unhashable key: answered, not remembered
    return secret


_secret_keys: dict[object, bool] = {}


def scrub_mapping(mapping: Mapping[str, object]) -> dict[str, object]:
    # ``{str(key): scrub(value) for key, value in mapping.items() if not is_secret_key(key)}``, with
    # the common case inline (a str key already judged, a value of a plain type): one per record's extras.
    scrubbed: dict[str, object] = {}
    secret_keys = _secret_keys
    for key, value in mapping.items():
        if key.__class__ is str:
            secret = secret_keys.get(key)
            if secret is None:
                secret = is_secret_key(key)
            if secret:
                continue
        else:
            if is_secret_key(key):
                continue
            key = str(key)
        cls = value.__class__
        if isinstance(value, str) and cls is str:
            if "://" in value:  # only a URL can carry userinfo
                value = _URL_USERINFO.sub(r"\g<scheme>", value)
        elif not (value is None or cls is int or cls is bool or cls is float):
            value = scrub(value)
        scrubbed[key] = value
    return scrubbed


def scrub(value: object) -> object:
    cls = value.__class__
    if value is None or cls is int or cls is bool or cls is float:
        return value
    if isinstance(value, str) and cls is str:
        # Only a URL can carry userinfo; most strings have no "://" at all.
        return _URL_USERINFO.sub(r"\g<scheme>", value) if "://" in value else value
    value = plain(value)
    if isinstance(value, Mapping):
        return scrub_mapping(value)
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [scrub(item) for item in items]
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\g<scheme>", value)
    return value


def approval_summary(approval: Mapping[str, object]) -> dict[str, object]:
    """An approval summary as a record holds it: scrubbed, ``waited_s`` rounded."""
    summary = scrub_mapping(approval)
    waited = summary.get("waited_s")
    if isinstance(waited, float) and math.isfinite(waited):
        summary["waited_s"] = round(waited, 6)
    return summary
