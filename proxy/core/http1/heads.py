"""HTTP/1.1 message heads parsed, and the body framing each declares (RFC 9112 §2 to §6).

``parse_request_head`` and ``parse_response_head`` take the bytes read so far and
return a head once it is whole (None: read more); ``request_body_kind`` and
``response_body_kind`` say how the body after it ends.

The common head is read by a fast path (a few compiled expressions, run in C) that
accepts a strict subset of what the general parser accepts, with the same result;
every other input, valid or not, goes to the general parser, which decides it and
words every refusal.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Final

from egressd.proxy.core.http1.framing import NO_BODY, UNTIL_CLOSE, BodyKind, declared_framing
from egressd.proxy.core.http1.syntax import CLIENT, LINE_BYTES, OWS, TCHAR, UPSTREAM, Faults, HttpError

_NAME_BYTES: Final = TCHAR + b"\n"  # names are checked joined by LF
_HEAD_BYTES: Final = LINE_BYTES + b"\r\n"
# RFC 9112 §2.2 says to ignore "at least one" empty line before the start line;
# a few cover clients that send CRLF after a body, more is garbage.
_MAX_LEADING_EMPTY_LINES: Final = 4


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
                head.framing = declared_framing(head.headers, head.version, CLIENT)
            else:
                head.framing = NO_BODY
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
    split = _split_head(buf, max_bytes, CLIENT)
    if split is None:
        return None
    lines, consumed = split
    parts = lines[0].split(" ")
    # RFC 9112 §3: exactly "method SP request-target SP HTTP-version"; any
    # other whitespace is where parsers disagree, so it is refused.
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not method or method.encode("latin-1").translate(None, TCHAR):
        raise HttpError(400, "invalid method")
    # Controls other than HTAB are already gone, SP was split on: what is left
    # to refuse in a target is HTAB and non-ASCII (RFC 3986 §2).
    if not target or not target.isascii() or "\t" in target:
        raise HttpError(400, "invalid request target")
    headers, keys = _fields(lines, CLIENT)
    head = RequestHead(method, target, _version(version, CLIENT), headers)
    # RFC 9112 §3.2: more than one Host is a 400; the transparent listener
    # routes by Host, so two would be two answers to "where to".
    if keys.count("host") > 1:
        raise HttpError(400, "more than one Host header")
    if "content-length" in keys or "transfer-encoding" in keys:
        declared_framing(head.headers, head.version, CLIENT)
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
            head.framing = declared_framing(head.headers, head.version, UPSTREAM)
        else:
            head.framing = NO_BODY
        if "\nconnection:" not in lowered:
            head.persists = version == "HTTP/1.1"
        return head, consumed
    return _parse_response_head(buf, max_bytes)


def _parse_response_head(
    buf: bytes | bytearray | memoryview, max_bytes: int
) -> tuple[ResponseHead, int] | None:
    """``parse_response_head`` for any input: every head the fast path did not take, and every refusal."""
    split = _split_head(buf, max_bytes, UPSTREAM)
    if split is None:
        return None
    lines, consumed = split
    # RFC 9112 §4: "HTTP-version SP status-code SP [reason-phrase]"; a
    # missing final SP before an empty reason is common and harmless.
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if len(code) != 3 or not code.isascii() or not code.isdigit() or code[0] not in "12345":
        raise HttpError(502, "invalid status code from upstream")
    headers, keys = _fields(lines, UPSTREAM)
    head = ResponseHead(_version(version, UPSTREAM), int(code), reason, headers)
    if "content-length" in keys or "transfer-encoding" in keys:
        declared_framing(head.headers, head.version, UPSTREAM)
    return head, consumed


def _split_head(
    buf: bytes | bytearray | memoryview, max_bytes: int, faults: Faults
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


def _version(raw: str, faults: Faults) -> str:
    """The HTTP-version (RFC 9112 §2.3); only 1.0 and 1.1 are accepted."""
    if raw == "HTTP/1.1" or raw == "HTTP/1.0":
        return raw
    if _VERSION_SYNTAX.fullmatch(raw):
        raise HttpError(faults.version, "HTTP version not supported")
    raise HttpError(faults.malformed, "invalid HTTP version")


def _fields(lines: list[str], faults: Faults) -> tuple[list[tuple[str, str]], list[str]]:
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



def _connection_options(headers: list[tuple[str, str]]) -> set[str]:
    """The lowercased options listed in every Connection field (RFC 9110 §7.6.1)."""
    options: set[str] = set()
    for name, value in headers:
        if len(name) == 10 and name.lower() == "connection":
            for option in value.split(","):
                options.add(option.strip(OWS).lower())
    return options



def request_body_kind(head: RequestHead) -> tuple[BodyKind, int]:
    """How the request body is framed, and its length for LENGTH (else 0).

    A request without Content-Length or Transfer-Encoding has no body (RFC
    9112 §6.3 item 7); a request is never read until close.
    """
    framing = head.framing
    return framing if framing is not None else declared_framing(head.headers, head.version, CLIENT)


def response_body_kind(head: ResponseHead, request_method: str) -> tuple[BodyKind, int]:
    """How the response body is framed, and its length for LENGTH (else 0).

    RFC 9112 §6.3, in order: a response to HEAD, any 1xx, 204 and 304 have
    no body, nor a 2xx to CONNECT (the connection becomes a tunnel); then
    chunked, then Content-Length; otherwise the body runs until the upstream
    closes, and the client connection cannot be kept alive.
    """
    status = head.status
    if request_method == "HEAD" or status < 200 or status == 204 or status == 304:
        return NO_BODY
    if request_method == "CONNECT" and status < 300:
        return NO_BODY
    framing = head.framing
    if framing is None:
        framing = declared_framing(head.headers, head.version, UPSTREAM)
    return UNTIL_CLOSE if framing is NO_BODY else framing

