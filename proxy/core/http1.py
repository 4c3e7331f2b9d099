"""HTTP/1.1 message heads and body framing, without I/O (RFC 9112).

Bytes in, values out. The server reads from its sockets and calls, in order:

1. ``parse_request_head(buf, max_bytes)`` until it returns a head (``None``
   means "read more"); it consumed the bytes it says, the rest is body or
   the next request;
2. ``request_destination(head)``: where the client asked to go, taken from
   the request-target only (the Host header never decides it);
3. ``forward_request_head(head, destination)``: the head sent upstream, and
   ``request_body_kind(head)`` with a ``ChunkedScanner`` to relay the body
   unchanged: bodies are never decoded, we only find where they end;
4. ``parse_response_head``, ``response_body_kind`` and
   ``forward_response_head`` do the same for the answer.

A head that parsed has exactly one framing (RFC 9112 §6.3): every input a
peer could read differently from us (CL and TE together, differing
Content-Lengths, a coding after ``chunked``, obs-fold, bare CR, space before
a colon) is refused, so what we relay as one message is one message to the
upstream too: no request smuggling, no response splitting.

The common head and request-target are read by a fast path (a few compiled
expressions, run in C) that accepts a strict subset of what the general
parser accepts, with the same result; every other input, valid or not, goes
to the general parser, which decides it and words every refusal. A compiled
HTTP parser (httptools/llhttp) was measured and did not pay: its callbacks
cost as much as this path before any of our checks run.

Errors are ``HttpError`` with the status to answer. A request's errors are the
client's fault (400, 431, 501, 505); a response's errors are the upstream's
fault and always carry 502.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Final, NoReturn

from egressd.names.authority import AuthorityError, Colons, Fault, parse_authority


class HttpError(Exception):
    """Malformed or unsupported HTTP; ``detail`` is short and safe to show the client."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status} {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class _Faults:
    """The status to use for each kind of error, by whose fault it is."""

    malformed: int
    too_large: int
    version: int
    coding: int


_CLIENT: Final = _Faults(malformed=400, too_large=431, version=505, coding=501)
_UPSTREAM: Final = _Faults(malformed=502, too_large=502, version=502, coding=502)

# RFC 9110 §5.6.2 tchar, for methods, field names and transfer codings.
_TCHAR: Final = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NAME_BYTES: Final = _TCHAR + b"\n"  # names are checked joined by LF
_HEXDIG: Final = b"0123456789abcdefABCDEF"
# Every byte a line may hold: no controls but HTAB (RFC 9110 §5.5 for field
# values, RFC 9112 §3 for the start line), and a head also holds line ends.
_LINE_BYTES: Final = bytes(b for b in range(256) if b == 0x09 or 0x20 <= b != 0x7F)
_HEAD_BYTES: Final = _LINE_BYTES + b"\r\n"
_OWS: Final = " \t"
# RFC 9112 §2.2 says to ignore "at least one" empty line before the start line;
# a few cover clients that send CRLF after a body, more is garbage.
_MAX_LEADING_EMPTY_LINES: Final = 4
# 18 decimal digits stay below 2**63; anything longer is not a real body.
_MAX_CONTENT_LENGTH_DIGITS: Final = 18


# --- heads -------------------------------------------------------------------


class _Fields:
    """Field access shared by request and response heads."""

    __slots__ = ()
    version: str
    headers: list[tuple[str, str]]
    framing: tuple[BodyKind, int] | None
    persists: bool | None

    # Names are compared by length first: most fields are not the one asked for, and len() is
    # cheaper than lowercasing each of them.

    def get(self, name: str) -> str | None:
        """The first value of field ``name`` (case-insensitive), or None."""
        name = name.lower()
        size = len(name)
        for key, value in self.headers:
            if len(key) == size and key.lower() == name:
                return value
        return None

    def get_all(self, name: str) -> list[str]:
        """Every value of field ``name`` (case-insensitive), in order, not split on commas."""
        name = name.lower()
        size = len(name)
        return [value for key, value in self.headers if len(key) == size and key.lower() == name]

    @property
    def keep_alive(self) -> bool:
        """Whether the connection persists after this message (RFC 9112 §9.3).

        HTTP/1.1 persists unless ``Connection: close``; HTTP/1.0 only with
        ``Connection: keep-alive``. Framing can still force a close (a response
        read until close), which the caller checks with the body kind.
        """
        if self.persists is not None:
            return self.persists
        options = _connection_options(self.headers)
        if "close" in options:
            return False
        return self.version == "HTTP/1.1" or "keep-alive" in options


@dataclass(slots=True)
class RequestHead(_Fields):
    """A parsed request head; header names as received, values without OWS."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    # What the fast path learnt while parsing (``_common_head``), so the fields are not scanned
    # again for it: the framing (``request_body_kind``) and ``keep_alive`` when no Connection field
    # decides it; None when not known (a head built otherwise): worked out from ``headers``.
    framing: tuple[BodyKind, int] | None = field(default=None, compare=False, repr=False)
    persists: bool | None = field(default=None, compare=False, repr=False)
    # The head's text lowercased, from the fast path (None otherwise): a field's absence is one
    # substring test (``"\nexpect:" not in lowered``), no scan of ``headers``. Whoever changes
    # ``headers`` sets it to None.
    lowered: str | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class ResponseHead(_Fields):
    """A parsed response head; header names as received, values without OWS."""

    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    # As ``RequestHead``'s: the framing the fields declare (``response_body_kind`` adds the rules
    # by status and method) and ``keep_alive`` when the parse knew them; else None.
    framing: tuple[BodyKind, int] | None = field(default=None, compare=False, repr=False)
    persists: bool | None = field(default=None, compare=False, repr=False)


# The fast path. A head as nearly every client and server sends it (no empty line before it,
# CRLF line ends, HTTP/1.0 or 1.1, no obs-fold, only printable ASCII in the request-target,
# field names of tchar with the colon straight after) is matched whole by these expressions, in
# C: the start line, then every field line, each starting after a LF (so one match per line, and
# a line that does not match makes the counts differ). They accept a strict subset of what the
# general parser (``_split_head`` and the rest) accepts, with the same result; every other input,
# valid or not, goes to the general parser, which decides it and words every refusal.
# tests/unit/test_http1.py checks the two against each other.
_TCHARS: Final = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_REQUEST_LINE: Final = re.compile(rf"({_TCHARS}++) ([!-~]++) (HTTP/1\.[01])\r\n")
_STATUS_LINE: Final = re.compile(r"(HTTP/1\.[01]) ([1-5][0-9][0-9])(?: ([\t -~\x80-\xff]*+))?\r\n")
# A value without its OWS: runs of VCHAR or obs-text, single-spaced or not (RFC 9110 §5.5).
# The status line's three digits as a number, by lookup: ``int()`` costs several times more.
_STATUS_CODES: Final = {str(code): code for code in range(100, 600)}
_FIELD_LINE: Final = re.compile(
    rf"(?<=\n)({_TCHARS}++):[ \t]*+((?:[!-~\x80-\xff]++(?:[ \t]++[!-~\x80-\xff]++)*+)?)[ \t]*+\r\n"
)


def parse_request_head(
    buf: bytes | bytearray | memoryview, max_bytes: int
) -> tuple[RequestHead, int] | None:
    """Parse the request head at the start of ``buf``.

    Returns ``(head, consumed)`` once the head and its empty line are in
    ``buf`` (``consumed`` counts them and any leading empty lines), None while
    more bytes are needed. Raises ``HttpError``: 431 when no complete head
    fits in ``max_bytes``, 400/501/505 for malformed input. A returned head
    has valid, unambiguous framing (``request_body_kind`` will not raise).
    """
    common = _common_head(buf, max_bytes, _REQUEST_LINE)
    if common is not None:
        line, headers, lowered, consumed = common
        if lowered.count("\nhost:") < 2:
            version = line[3]
            head = RequestHead(line[1], line[2], version, headers)
            head.lowered = lowered
            if "\ncontent-length:" in lowered or "\ntransfer-encoding:" in lowered:
                head.framing = _framing(head, _CLIENT)
            else:
                head.framing = _NO_BODY
            if "\nconnection:" not in lowered:
                head.persists = version == "HTTP/1.1"
            return head, consumed
    return _parse_request_head(buf, max_bytes)


def _common_head(
    buf: bytes | bytearray | memoryview, max_bytes: int, start_line: re.Pattern[str]
) -> tuple[re.Match[str], list[tuple[str, str]], str, int] | None:
    """The fast path: a common head whole, as its start line's match, its fields, its text lowercased
    and the bytes it spans; None for any other head, valid or not (the general parser's)."""
    if isinstance(buf, memoryview):
        return None
    end = buf.find(b"\r\n\r\n", 0, max_bytes)
    if end <= 0:
        return None
    text = buf[: end + 2].decode("latin-1")
    line = start_line.match(text)
    if line is None:
        return None
    start = line.end()
    headers = _FIELD_LINE.findall(text, start)
    if len(headers) != text.count("\n", start):  # a line that is not a plain field line
        return None
    return line, headers, text.lower(), end + 4


def _parse_request_head(
    buf: bytes | bytearray | memoryview, max_bytes: int
) -> tuple[RequestHead, int] | None:
    """``parse_request_head`` for any input: every head the fast path did not take, and every refusal."""
    split = _split_head(buf, max_bytes, _CLIENT)
    if split is None:
        return None
    lines, consumed = split
    parts = lines[0].split(" ")
    # RFC 9112 §3: exactly "method SP request-target SP HTTP-version"; any
    # other whitespace is where parsers disagree, so it is refused.
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not method or method.encode("latin-1").translate(None, _TCHAR):
        raise HttpError(400, "invalid method")
    # Controls other than HTAB are already gone, SP was split on: what is left
    # to refuse in a target is HTAB and non-ASCII (RFC 3986 §2).
    if not target or not target.isascii() or "\t" in target:
        raise HttpError(400, "invalid request target")
    headers, keys = _fields(lines, _CLIENT)
    head = RequestHead(method, target, _version(version, _CLIENT), headers)
    # RFC 9112 §3.2: more than one Host is a 400; the transparent listener
    # routes by Host, so two would be two answers to "where to".
    if keys.count("host") > 1:
        raise HttpError(400, "more than one Host header")
    if "content-length" in keys or "transfer-encoding" in keys:
        _framing(head, _CLIENT)
    return head, consumed


def parse_response_head(
    buf: bytes | bytearray | memoryview, max_bytes: int
) -> tuple[ResponseHead, int] | None:
    """Parse the response head at the start of ``buf``.

    The same contract as ``parse_request_head``, except that every error is
    the upstream's fault and carries status 502. Interim (1xx) responses are
    returned like any other head; the caller reads again after them.
    """
    common = _common_head(buf, max_bytes, _STATUS_LINE)
    if common is not None:
        line, headers, lowered, consumed = common
        version = line[1]
        head = ResponseHead(version, _STATUS_CODES[line[2]], line[3] or "", headers)
        if "\ncontent-length:" in lowered or "\ntransfer-encoding:" in lowered:
            head.framing = _framing(head, _UPSTREAM)
        else:
            head.framing = _NO_BODY
        if "\nconnection:" not in lowered:
            head.persists = version == "HTTP/1.1"
        return head, consumed
    return _parse_response_head(buf, max_bytes)


def _parse_response_head(
    buf: bytes | bytearray | memoryview, max_bytes: int
) -> tuple[ResponseHead, int] | None:
    """``parse_response_head`` for any input: every head the fast path did not take, and every refusal."""
    split = _split_head(buf, max_bytes, _UPSTREAM)
    if split is None:
        return None
    lines, consumed = split
    # RFC 9112 §4: "HTTP-version SP status-code SP [reason-phrase]"; a
    # missing final SP before an empty reason is common and harmless.
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if len(code) != 3 or not code.isascii() or not code.isdigit() or code[0] not in "12345":
        raise HttpError(502, "invalid status code from upstream")
    headers, keys = _fields(lines, _UPSTREAM)
    head = ResponseHead(_version(version, _UPSTREAM), int(code), reason, headers)
    if "content-length" in keys or "transfer-encoding" in keys:
        _framing(head, _UPSTREAM)
    return head, consumed


def _split_head(
    buf: bytes | bytearray | memoryview, max_bytes: int, faults: _Faults
) -> tuple[list[str], int] | None:
    """The lines of the head at the start of ``buf``, and the bytes it spans.

    Lines are ISO-8859-1 text, a line's CR kept at its end; the start line
    is first, the empty line that ends the head is not included.
    """
    if isinstance(buf, memoryview):
        buf = buf[:max_bytes].tobytes()
    limit = min(len(buf), max_bytes)
    start = 0
    for _ in range(_MAX_LEADING_EMPTY_LINES):
        if buf.startswith(b"\r\n", start):
            start += 2
        elif buf.startswith(b"\n", start):
            start += 1
        else:
            break
    else:
        if buf.startswith(b"\n", start) or buf.startswith(b"\r\n", start):
            raise HttpError(faults.malformed, "too many empty lines before the message")
    # The head ends at its first empty line; RFC 9112 §2.2 lets a recipient
    # take a bare LF as a line terminator, so "\n\n" ends it as well as "\n\r\n".
    end = buf.find(b"\n\r\n", start, limit)
    bare = buf.find(b"\n\n", start, end + 2 if end >= 0 else limit)
    if bare >= 0:
        end, consumed = bare, bare + 2
    elif end >= 0:
        consumed = end + 3
    elif len(buf) >= max_bytes:
        raise HttpError(faults.too_large, "message head too large")
    else:
        return None
    block = bytes(buf[start:end])
    if block.translate(None, _HEAD_BYTES):
        raise HttpError(faults.malformed, "control character in message head")
    # RFC 9112 §2.2: a bare CR is refused (the last line's CR is paired with
    # the LF just past the block).
    if b"\r" in block and block.count(b"\r") != block.count(b"\r\n") + block.endswith(b"\r"):
        raise HttpError(faults.malformed, "bare CR in message head")
    text = block.decode("latin-1")
    # Every line after the first starts after a LF: these find obs-fold
    # (RFC 9112 §5.2, which a proxy must reject or unfold) and empty names.
    if "\n " in text or "\n\t" in text:
        raise HttpError(faults.malformed, "obsolete line folding in header")
    if "\n:" in text:
        raise HttpError(faults.malformed, "empty header name")
    lines = text.split("\n")
    lines[0] = lines[0].removesuffix("\r")
    return lines, consumed


_VERSION_SYNTAX: Final = re.compile(r"HTTP/[0-9]\.[0-9]")


def _version(raw: str, faults: _Faults) -> str:
    """The HTTP-version (RFC 9112 §2.3); only 1.0 and 1.1 are accepted."""
    if raw == "HTTP/1.1" or raw == "HTTP/1.0":
        return raw
    if _VERSION_SYNTAX.fullmatch(raw):
        raise HttpError(faults.version, "HTTP version not supported")
    raise HttpError(faults.malformed, "invalid HTTP version")


def _fields(lines: list[str], faults: _Faults) -> tuple[list[tuple[str, str]], list[str]]:
    """The field lines after the start line (RFC 9112 §5), and their lowercased names.

    Folding, empty names and controls were refused with the whole head.
    """
    # A CR can only be the line's last byte, so stripping it with the OWS is exact.
    headers = [
        (name, value.strip(" \t\r"))
        for line in lines[1:]
        for name, colon, value in (line.partition(":"),)
        if colon
    ]
    if len(headers) != len(lines) - 1:
        raise HttpError(faults.malformed, "header line without a colon")
    names = "\n".join(map(itemgetter(0), headers))
    if names.encode("latin-1").translate(None, _NAME_BYTES):
        for name, _ in headers:
            if name[-1] in " \t":
                # RFC 9112 §5.1: whitespace before the colon MUST be rejected.
                raise HttpError(faults.malformed, "whitespace before colon in header")
        raise HttpError(faults.malformed, "invalid header name")
    return headers, names.lower().split("\n")


# --- destination ---------------------------------------------------------------


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


# --- forwarding ------------------------------------------------------------------

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


def _connection_options(headers: list[tuple[str, str]]) -> set[str]:
    """The lowercased options listed in every Connection field (RFC 9110 §7.6.1)."""
    options: set[str] = set()
    for name, value in headers:
        if len(name) == 10 and name.lower() == "connection":
            for option in value.split(","):
                options.add(option.strip(_OWS).lower())
    return options


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
            value = value.partition(",")[0].strip(_OWS)
        # key.startswith("x-egress-"), by comparisons: the strings after that prefix in order.
        elif drop_egress and "x-egress-" <= key < "x-egress.":
            continue
        lines.append(f"{name}: {value}\r\n")
    if connection is not None:
        named = {option.strip(_OWS).lower() for option in connection.split(",")} - _FRAMING_FIELDS - drop
        for name, _ in headers:
            if name.lower() in named:
                return _forward_fields(headers, drop | named, drop_egress)
    return "".join(lines)


_REQUEST_DROP: Final = _HOP_BY_HOP | {"host"}


def forward_request_head(head: RequestHead, dest: Destination) -> bytes:
    """The head to send upstream for an absolute-form request to ``dest``.

    ``METHOD origin-form HTTP/1.1``, Host rewritten to the destination (RFC
    9112 §3.2: first, and replacing the client's), hop-by-hop fields and the
    fields named in Connection removed (never the framing ones), and
    ``Connection: keep-alive`` for our upstream connection. ``head`` must come
    from ``parse_request_head`` and ``dest`` be an "http" destination.
    """
    if dest.scheme != "http":
        raise ValueError("only absolute-form http requests are forwarded")
    host = f"[{dest.host}]" if ":" in dest.host else dest.host
    port = "" if dest.port == 80 else f":{dest.port}"
    fields = _forward_fields(head.headers, _REQUEST_DROP, drop_egress=False)
    start = f"{head.method} {dest.path} HTTP/1.1\r\nHost: {host}{port}\r\n"
    return f"{start}{fields}Connection: keep-alive\r\n\r\n".encode("latin-1")


def forward_response_head(head: ResponseHead, client_keep_alive: bool) -> bytes:
    """The head to send the client for an upstream response.

    Hop-by-hop fields and those named in Connection removed (never the
    framing ones), every ``X-Egress-*`` field removed so no origin can forge
    a decision, and ``Connection: keep-alive`` or ``close`` as the caller
    decided (close whenever the body is read until close). ``head`` must come
    from ``parse_response_head``.
    """
    fields = _forward_fields(head.headers, _HOP_BY_HOP, drop_egress=True)
    connection = "keep-alive" if client_keep_alive else "close"
    return f"HTTP/1.1 {head.status} {head.reason}\r\n{fields}Connection: {connection}\r\n\r\n".encode("latin-1")


# --- body framing -----------------------------------------------------------------


class BodyKind(enum.Enum):
    """How the body after a head ends (RFC 9112 §6.3)."""

    NONE = "none"
    LENGTH = "length"  # exactly N bytes
    CHUNKED = "chunked"  # until the last chunk and trailers: use ChunkedScanner
    UNTIL_CLOSE = "until_close"  # responses only: until the upstream closes


# The answers without a length, made once (an enum member's lookup is not free).
_NO_BODY: Final = (BodyKind.NONE, 0)
_CHUNKED: Final = (BodyKind.CHUNKED, 0)
_UNTIL_CLOSE: Final = (BodyKind.UNTIL_CLOSE, 0)
_LENGTH: Final = BodyKind.LENGTH

# Transfer codings registered with IANA that may precede chunked; we relay
# them untouched, the point is only to refuse names nobody defined.
_KNOWN_CODINGS: Final = frozenset({"gzip", "x-gzip", "deflate", "compress", "x-compress"})


def _framing(head: RequestHead | ResponseHead, faults: _Faults) -> tuple[BodyKind, int]:
    """The framing the head's fields declare, or HttpError if they are ambiguous.

    1. Transfer-Encoding with Content-Length is refused, not resolved: a
       message with both is the classic smuggling vector (RFC 9112 §6.1);
    2. Transfer-Encoding in HTTP/1.0 is faulty framing (RFC 9112 §6.1);
    3. chunked must be the final coding, once (RFC 9112 §6.3 item 4, §7);
    4. Content-Length must be digits, all copies the same (RFC 9110 §8.6).
    """
    lengths: list[str] = []
    codings: list[str] = []
    for name, value in head.headers:
        # By length first: lowercasing every name costs more than len().
        size = len(name)
        if size == 14 and name.lower() == "content-length":
            lengths += value.split(",")
        elif size == 17 and name.lower() == "transfer-encoding":
            codings += value.split(",")
    if codings:
        if lengths:
            raise HttpError(faults.malformed, "both Content-Length and Transfer-Encoding")
        if head.version == "HTTP/1.0":
            raise HttpError(faults.malformed, "Transfer-Encoding in an HTTP/1.0 message")
        # RFC 9110 §5.6.1: empty list elements are ignored.
        names = [coding.strip(_OWS).lower() for coding in codings if coding.strip(_OWS)]
        if not names or names[-1] != "chunked":
            raise HttpError(faults.malformed, "chunked must be the final transfer coding")
        for coding in names[:-1]:
            if coding == "chunked":
                raise HttpError(faults.malformed, "chunked applied more than once")
            if coding not in _KNOWN_CODINGS:
                raise HttpError(faults.coding, "unsupported transfer coding")
        return _CHUNKED
    if lengths:
        value = lengths[0].strip(_OWS)
        for length in lengths[1:]:
            if length.strip(_OWS) != value:
                raise HttpError(faults.malformed, "conflicting Content-Length values")
        if (
            not 0 < len(value) <= _MAX_CONTENT_LENGTH_DIGITS
            or not value.isascii()
            or not value.isdigit()
        ):
            raise HttpError(faults.malformed, "invalid Content-Length")
        return _LENGTH, int(value)
    return _NO_BODY


def request_body_kind(head: RequestHead) -> tuple[BodyKind, int]:
    """How the request body is framed, and its length for LENGTH (else 0).

    A request without Content-Length or Transfer-Encoding has no body (RFC
    9112 §6.3 item 7); a request is never read until close.
    """
    framing = head.framing
    return framing if framing is not None else _framing(head, _CLIENT)


def response_body_kind(head: ResponseHead, request_method: str) -> tuple[BodyKind, int]:
    """How the response body is framed, and its length for LENGTH (else 0).

    RFC 9112 §6.3, in order: a response to HEAD, any 1xx, 204 and 304 have
    no body, nor a 2xx to CONNECT (the connection becomes a tunnel); then
    chunked, then Content-Length; otherwise the body runs until the upstream
    closes, and the client connection cannot be kept alive.
    """
    status = head.status
    if request_method == "HEAD" or status < 200 or status == 204 or status == 304:
        return _NO_BODY
    if request_method == "CONNECT" and status < 300:
        return _NO_BODY
    framing = head.framing
    if framing is None:
        framing = _framing(head, _UPSTREAM)
    return _UNTIL_CLOSE if framing is _NO_BODY else framing


# Longest chunk-size line (size and extensions) and trailer section we relay;
# RFC 9112 §7.1.1 asks recipients to limit extensions, real ones are short.
_MAX_CHUNK_LINE: Final = 4096
_MAX_TRAILER_BYTES: Final = 64 * 1024
# 16 hex digits is 2**64 - 1 bytes; longer sizes are overflow attempts.
_MAX_CHUNK_SIZE_DIGITS: Final = 16


class _Chunk(enum.Enum):
    """Where a ChunkedScanner is in the chunked-body grammar (RFC 9112 §7.1)."""

    SIZE = enum.auto()  # reading a chunk-size line
    DATA = enum.auto()  # skipping chunk data
    DATA_CR = enum.auto()  # expecting the CR after chunk data
    DATA_LF = enum.auto()  # expecting the LF after chunk data
    TRAILER = enum.auto()  # reading trailer lines until the empty one
    DONE = enum.auto()
    FAILED = enum.auto()


# The states as module constants: an Enum member's lookup on its class costs ten times a global's,
# and ``feed`` reads several per framing line.
_SIZE: Final = _Chunk.SIZE
_DATA: Final = _Chunk.DATA
_DATA_CR: Final = _Chunk.DATA_CR
_DATA_LF: Final = _Chunk.DATA_LF
_TRAILER: Final = _Chunk.TRAILER
_DONE: Final = _Chunk.DONE
_FAILED: Final = _Chunk.FAILED


class ChunkedScanner:
    """Find where a chunked body (RFC 9112 §7.1) ends, without decoding it.

    Feed the bytes that follow the head, in any pieces; ``feed`` returns how
    many of them belong to the body, all of them until the piece where the
    body ends. Relay exactly those bytes, then stop when ``done``. Chunk data
    is skipped in O(1) per feed. Framing lines must end in CRLF (no bare LF
    inside a body, unlike heads: there a lenient reader is a smuggling
    vector). Raises ``HttpError(error_status)`` on malformed framing; a
    scanner that raised stays failed.
    """

    __slots__ = ("_state", "_remaining", "_line", "_trailer_budget", "_error_status")

    def __init__(self, error_status: int = 400) -> None:
        self._state = _SIZE
        self._remaining = 0
        self._line = bytearray()
        self._trailer_budget = _MAX_TRAILER_BYTES
        self._error_status = error_status

    @property
    def done(self) -> bool:
        """True once the last chunk and the trailer section have been seen."""
        return self._state is _DONE

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """Scan ``data``; the number of its leading bytes that belong to the body."""
        if self._state is _FAILED:
            raise HttpError(self._error_status, "malformed chunked body")
        pos = 0
        end = len(data)
        text = data if not isinstance(data, memoryview) else None
        while pos < end:
            state = self._state
            if state is _DATA:
                step = min(self._remaining, end - pos)
                pos += step
                self._remaining -= step
                if not self._remaining:
                    self._state = _DATA_CR
            elif state is _DATA_CR and end - pos >= 2:
                if data[pos : pos + 2] != b"\r\n":
                    self._fail("chunk data not followed by CRLF")
                pos += 2
                self._state = _SIZE
            elif state is _DATA_CR:
                if data[pos] != 0x0D:
                    self._fail("chunk data not followed by CRLF")
                pos += 1
                self._state = _DATA_LF
            elif state is _DATA_LF:
                if data[pos] != 0x0A:
                    self._fail("chunk data not followed by CRLF")
                pos += 1
                self._state = _SIZE
            elif state is _DONE:
                break
            else:
                if text is None:
                    # Lines need find(); a memoryview is copied once, only
                    # when a feed reaches a line at all.
                    text = bytes(data)
                pos = self._scan_line(text, pos, end)
        return pos

    def _scan_line(self, text: bytes | bytearray, pos: int, end: int) -> int:
        """Consume up to one line from ``text[pos:end]``; the new position."""
        state = self._state
        limit = _MAX_CHUNK_LINE if state is _SIZE else self._trailer_budget
        room = limit - len(self._line)
        newline = text.find(b"\n", pos, pos + room)
        if newline < 0:
            if end - pos >= room:
                self._fail("chunk line too long" if state is _SIZE else "trailers too large")
            self._line += text[pos:end]
            return end
        if self._line:
            self._line += text[pos : newline + 1]
            line = bytes(self._line)
            self._line.clear()
        else:
            line = bytes(text[pos : newline + 1])
        if len(line) < 2 or line[-2] != 0x0D:
            self._fail("chunk framing line not ended by CRLF")
        content = line[:-2]
        if content.translate(None, _LINE_BYTES):
            self._fail("control character in chunk framing")
        if state is _SIZE:
            self._on_size(content)
        else:
            self._trailer_budget -= len(line)
            self._on_trailer(content)
        return newline + 1

    def _on_size(self, content: bytes) -> None:
        """Read ``chunk-size [ chunk-ext ]``; extensions are relayed, not interpreted."""
        # chunk-ext = *( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] ): BWS may
        # precede the first ";", nothing else may follow the hex digits.
        size, semicolon, _ = content.partition(b";")
        if semicolon:
            size = size.rstrip(b" \t")
        if not 0 < len(size) <= _MAX_CHUNK_SIZE_DIGITS or size.translate(None, _HEXDIG):
            self._fail("invalid chunk size")
        self._remaining = int(size, 16)
        self._state = _DATA if self._remaining else _TRAILER

    def _on_trailer(self, content: bytes) -> None:
        """Check one trailer field line (RFC 9112 §7.1.2); the empty one ends the body."""
        if not content:
            self._state = _DONE
            return
        name, colon, _ = content.partition(b":")
        if not colon or not name or name.translate(None, _TCHAR):
            self._fail("malformed trailer field")

    def _fail(self, detail: str) -> NoReturn:
        self._state = _FAILED
        raise HttpError(self._error_status, detail)
