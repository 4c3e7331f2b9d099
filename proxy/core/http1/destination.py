"""Where a request asked to go, read from its request-target alone (RFC 9110 §9.3.6, RFC 9112 §3.2).

The Host header never decides it. The common targets are read by one compiled
expression each; every other target, valid or not, by the general parse, which
words every refusal (``HttpError(400)``).

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from egressd.names.authority import AuthorityError, Colons, Fault, parse_authority
from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.http1.syntax import HttpError


@dataclass(slots=True)
class Destination:
    """Where a request asked to go, from its request-target alone.

    ``scheme`` is "connect" or "http". ``host`` is the target's text, not
    normalised (case and a trailing dot kept), IPv6 without brackets.
    ``path`` is the origin-form (path and query) to send upstream, "" for
    CONNECT.
    """

    scheme: str
    host: str
    port: int
    path: str


_REG_NAME: Final = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_TEXT: Final = re.compile(r"[0-9A-Fa-f:.]+")


def request_destination(head: RequestHead) -> Destination:
    """The destination named by the request-target; HttpError(400) if it names none.

    1. CONNECT needs authority-form ``host:port`` (RFC 9110 §9.3.6), port
       mandatory, no userinfo and no path;
    2. every other method needs absolute-form ``http://authority/path?query``
       (RFC 9112 §3.2.2), port 80 by default; ``https://`` must use CONNECT,
       origin-form and asterisk-form are for origin servers, not proxies.

    The parse is strict and done here rather than with ``urllib.parse``, whose
    leniency (``\\``, ``@`` and ``#`` handling) is how URL confusion starts.
    """
    # The common target, whole in one expression; any other goes to the general parse below.
    target = head.target
    if head.method == "CONNECT":
        match = _CONNECT_TARGET.fullmatch(target)
        if match is not None and 0 < (port := int(match[2])) <= 65535:
            return Destination("connect", match[1], port, "")
    else:
        match = _HTTP_TARGET.fullmatch(target)
        if match is not None:
            port = 80 if match[2] is None else int(match[2])
            if 0 < port <= 65535:
                path = match[3]
                return Destination("http", match[1], port, path if path[:1] == "/" else "/" + path)
    return _request_destination(head)


# The fast path's targets: a reg-name host (what ``_request_host`` takes unbracketed) and a port
# of 1 to 5 digits, for CONNECT; for absolute-form, ``http`` in any case, the same authority
# with an optional port, and a path or query without a fragment. Leading zeros in a port are
# read as ``parse_port`` reads them. Anything else, valid or not, is the general parse's.
_CONNECT_TARGET: Final = re.compile(r"([A-Za-z0-9._-]+):([0-9]{1,5})")
_HTTP_TARGET: Final = re.compile(r"[Hh][Tt][Tt][Pp]://([A-Za-z0-9._-]+)(?::([0-9]{1,5}))?((?:[/?][^#]*+)?)")


def _request_destination(head: RequestHead) -> Destination:
    """``request_destination`` for any target: every one the fast path did not take, and every refusal."""
    target = head.target
    if head.method == "CONNECT":
        host, port = _authority(target, None)
        return Destination("connect", host, port, "")
    scheme, sep, rest = target.partition("://")
    if not sep:
        if target.startswith("/") or target == "*":
            raise HttpError(400, "a proxy request needs an absolute URI like http://host/path")
        raise HttpError(400, "invalid request target")
    # RFC 3986 §3.1: schemes are case-insensitive.
    scheme = scheme.lower()
    if scheme == "https":
        raise HttpError(400, "https URLs go through a CONNECT tunnel, not absolute-form")
    if scheme != "http":
        raise HttpError(400, "unsupported URI scheme")
    cut = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter, 0, cut)
        if found >= 0:
            cut = found
    authority, path = rest[:cut], rest[cut:]
    # RFC 9110 §7.1: a fragment is never part of a request-target.
    if "#" in path:
        raise HttpError(400, "fragment in request target")
    if not path.startswith("/"):
        path = "/" + path
    host, port = _authority(authority, 80)
    return Destination("http", host, port, path)


_AUTHORITY_FAULTS: Final = {
    Fault.BRACKET: "invalid IPv6 address in request target",
    Fault.AFTER_BRACKET: "invalid authority in request target",
    Fault.MISSING_PORT: "CONNECT needs host:port",
    Fault.PORT: "invalid port in request target",
    Fault.PORT_RANGE: "invalid port in request target",
}


def _authority(text: str, default_port: int | None) -> tuple[str, int]:
    """Host and port of an authority; ``default_port`` None makes the port mandatory."""
    if "@" in text:
        # userinfo lets "http://allowed.example@evil.example/" read as either host.
        raise HttpError(400, "userinfo in request target is not allowed")
    try:
        return parse_authority(text, default_port, colons=Colons.FIRST, host=_request_host, host_first=True)
    except AuthorityError as error:
        raise HttpError(400, _AUTHORITY_FAULTS[error.fault]) from error


def _request_host(text: str) -> str:
    """The host as written, brackets dropped; checked for syntax only (the decision normalises it)."""
    if text.startswith("["):
        host = text[1:-1]
        if ":" not in host or not _IPV6_TEXT.fullmatch(host):
            raise HttpError(400, "invalid IPv6 address in request target")
        return host
    if not _REG_NAME.fullmatch(text):
        raise HttpError(400, "invalid host in request target")
    return text

