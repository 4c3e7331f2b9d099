"""The heads sent onward: a request's to the upstream, a response's to the client (RFC 9110 §7.6.1).

Hop-by-hop fields and the fields a Connection field names are dropped (never the
framing ones: framing is ours to keep consistent), one Content-Length is kept,
and ``Connection`` says what we decided.
"""

from __future__ import annotations

from typing import Final

from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.heads import RequestHead, ResponseHead
from egressd.proxy.core.http1.syntax import OWS

# RFC 9110 §7.6.1 hop-by-hop fields, plus the de-facto Proxy-Connection and
# the proxy authentication pair, which concern us and never the next hop.
_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
    }
)
# Framing is ours to keep consistent: a peer that names Content-Length or
# Transfer-Encoding in Connection must not make us drop it and desync.
_FRAMING_FIELDS: Final = frozenset({"content-length", "transfer-encoding"})


def _forward_fields(headers: list[tuple[str, str]], drop: frozenset[str], drop_egress: bool) -> str:
    """The field lines to send on, each ending in CRLF: no hop-by-hop fields, one Content-Length.

    One pass for the common head; the fields a Connection field names (which may come after
    them) are dropped by a second pass only when one of them is there.
    """
    lines: list[str] = []
    connection: str | None = None
    have_length = False
    for name, value in headers:
        key = name.lower()
        if key in drop:
            if key == "connection":  # always in drop: hop-by-hop
                connection = value if connection is None else f"{connection},{value}"
            continue
        if key == "content-length":
            # Parsing allowed only identical duplicates ("42, 42"); send one.
            if have_length:
                continue
            have_length = True
            value = value.partition(",")[0].strip(OWS)
        # key.startswith("x-egress-"), by comparisons: the strings after that prefix in order.
        elif drop_egress and "x-egress-" <= key < "x-egress.":
            continue
        lines.append(f"{name}: {value}\r\n")
    if connection is not None:
        named = {option.strip(OWS).lower() for option in connection.split(",")} - _FRAMING_FIELDS - drop
        for name, _ in headers:
            if name.lower() in named:
                return _forward_fields(headers, drop | named, drop_egress)
    return "".join(lines)


_REQUEST_DROP: Final = _HOP_BY_HOP | {"host"}


# What a WebSocket upgrade's head ends with, both ways (RFC 6455 §4.1, §4.2.2), in place of keep-alive.
_UPGRADE: Final = "Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n"


def forward_request_head(head: RequestHead, dest: Destination, upgrade: bool = False) -> bytes:
    """The head to send upstream for an absolute-form request to ``dest``.

    ``METHOD origin-form HTTP/1.1``, Host rewritten to the destination (RFC
    9112 §3.2: first, and replacing the client's), hop-by-hop fields and the
    fields named in Connection removed (never the framing ones), and
    ``Connection: keep-alive`` for our upstream connection (``upgrade``: the
    WebSocket upgrade the client asked for, in its place). ``head`` must come
    from ``parse_request_head`` and ``dest`` be an "http" destination, or an
    "https" one: a request inside an inspected connection (its port 443 by default).
    """
    scheme = dest.scheme
    if scheme != "http" and scheme != "https":
        raise ValueError("only http requests and those inside an inspected connection are forwarded")
    host = f"[{dest.host}]" if ":" in dest.host else dest.host
    port = "" if dest.port == (80 if scheme == "http" else 443) else f":{dest.port}"
    fields = _forward_fields(head.headers, _REQUEST_DROP, drop_egress=False)
    start = f"{head.method} {dest.path} HTTP/1.1\r\nHost: {host}{port}\r\n"
    end = _UPGRADE if upgrade else "Connection: keep-alive\r\n\r\n"
    return f"{start}{fields}{end}".encode("latin-1")


def forward_response_head(head: ResponseHead, client_keep_alive: bool, upgrade: bool = False) -> bytes:
    """The head to send the client for an upstream response.

    Hop-by-hop fields and those named in Connection removed (never the
    framing ones), every ``X-Egress-*`` field removed so no origin can forge
    a decision, and ``Connection: keep-alive`` or ``close`` as the caller
    decided (close whenever the body is read until close). ``head`` must come
    from ``parse_response_head``. ``upgrade``: a 101 switching to WebSocket,
    which says so in place of ``Connection``.
    """
    fields = _forward_fields(head.headers, _HOP_BY_HOP, drop_egress=True)
    if upgrade:
        return f"HTTP/1.1 {head.status} {head.reason}\r\n{fields}{_UPGRADE}".encode("latin-1")
    connection = "keep-alive" if client_keep_alive else "close"
    return f"HTTP/1.1 {head.status} {head.reason}\r\n{fields}Connection: {connection}\r\n\r\n".encode("latin-1")


def asks_websocket(head: RequestHead) -> bool:
    """Whether the request asks for a WebSocket upgrade (RFC 6455 §4.1): a GET naming ``websocket`` in
    Upgrade and ``upgrade`` in Connection."""
    if head.method != "GET" or not names_websocket(head.get_all("Upgrade")):
        return False
    connection = head.get_all("Connection")
    return any(token.strip(" \t").lower() == "upgrade" for value in connection for token in value.split(","))


def names_websocket(values: list[str]) -> bool:
    """Whether an Upgrade field's values name ``websocket``."""
    return any(token.strip(" \t").lower() == "websocket" for value in values for token in value.split(","))
