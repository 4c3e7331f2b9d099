"""The pure HTTP/1.1 layer: heads, destinations, forwarding and body framing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from egressd.proxy.core.http1 import destination as destination_module
from egressd.proxy.core.http1 import heads
from egressd.proxy.core.http1.destination import Destination, request_destination
from egressd.proxy.core.http1.forwarding import forward_request_head, forward_response_head
from egressd.proxy.core.http1.framing import BodyKind, ChunkedScanner
from egressd.proxy.core.http1.heads import (
    RequestHead,
    ResponseHead,
    parse_request_head,
    parse_response_head,
    request_body_kind,
    response_body_kind,
)
from egressd.proxy.core.http1.syntax import HttpError

LIMIT = 64 * 1024


def parse(raw: bytes) -> RequestHead:
    parsed = parse_request_head(raw, LIMIT)
    assert parsed is not None
    head, used = parsed
    assert used == len(raw)
    return head


def parse_response(raw: bytes) -> ResponseHead:
    parsed = parse_response_head(raw, LIMIT)
    assert parsed is not None
    head, used = parsed
    assert used == len(raw)
    return head


def status_of(raw: bytes) -> int:
    with pytest.raises(HttpError) as caught:
        parse_request_head(raw, LIMIT)
    return caught.value.status


def field_names(raw: bytes) -> list[str]:
    """The lowercased field names of a head we produced, read back strictly."""
    lines = raw.split(b"\r\n")
    assert lines[-2:] == [b"", b""]
    return [line.partition(b":")[0].decode().lower() for line in lines[1:-2]]


# --- request heads -----------------------------------------------------------------

VALID_REQUESTS = [
    pytest.param(
        b"GET http://example.com/a?b=c HTTP/1.1\r\nHost: example.com\r\n\r\n",
        RequestHead("GET", "http://example.com/a?b=c", "HTTP/1.1", [("Host", "example.com")]),
        id="an absolute-form GET parses",
    ),
    pytest.param(
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        RequestHead("CONNECT", "example.com:443", "HTTP/1.1", [("Host", "example.com:443")]),
        id="a CONNECT parses",
    ),
    pytest.param(
        b"GET http://a/ HTTP/1.0\r\n\r\n",
        RequestHead("GET", "http://a/", "HTTP/1.0", []),
        id="HTTP/1.0 without fields parses",
    ),
    pytest.param(
        b"GET http://a/ HTTP/1.1\nHost: a\nX-Y: z\n\n",
        RequestHead("GET", "http://a/", "HTTP/1.1", [("Host", "a"), ("X-Y", "z")]),
        id="bare LF line endings are accepted",
    ),
    pytest.param(
        b"GET http://a/ HTTP/1.1\r\nHost: a\n\r\n",
        RequestHead("GET", "http://a/", "HTTP/1.1", [("Host", "a")]),
        id="mixed CRLF and LF line endings are accepted",
    ),
    pytest.param(
        b"\r\n\nGET http://a/ HTTP/1.1\r\n\r\n",
        RequestHead("GET", "http://a/", "HTTP/1.1", []),
        id="leading empty lines are ignored",
    ),
    pytest.param(
        b"GET http://a/ HTTP/1.1\r\nX-Pad: \t spaced\tvalue \t\r\nX-Empty:\r\n\r\n",
        RequestHead("GET", "http://a/", "HTTP/1.1", [("X-Pad", "spaced\tvalue"), ("X-Empty", "")]),
        id="OWS around a value is stripped and HTAB inside it kept",
    ),
    pytest.param(
        b"GET http://a/ HTTP/1.1\r\nX-Latin: caf\xe9\r\n\r\n",
        RequestHead("GET", "http://a/", "HTTP/1.1", [("X-Latin", "caf\xe9")]),
        id="obs-text in a value survives as ISO-8859-1",
    ),
    pytest.param(
        b"GET http://a/ HTTP/1.1\r\nx-MiXeD-case: 1\r\nX-Url: http://b/c:d\r\n\r\n",
        RequestHead(
            "GET", "http://a/", "HTTP/1.1", [("x-MiXeD-case", "1"), ("X-Url", "http://b/c:d")]
        ),
        id="names keep their case and values may hold colons",
    ),
    pytest.param(
        b"POST http://a/ HTTP/1.1\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n",
        RequestHead(
            "POST", "http://a/", "HTTP/1.1", [("Content-Length", "5"), ("content-length", "5")]
        ),
        id="identical duplicate Content-Length fields are accepted",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), VALID_REQUESTS)
def test_valid_request_heads_parse(raw: bytes, expected: RequestHead) -> None:
    assert parse(raw) == expected


INVALID_REQUESTS = [
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 400, id="obs-fold with SP"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\r\n\tb\r\n\r\n", 400, id="obs-fold with HTAB"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\rb\r\n\r\n", 400, id="bare CR in a value"),
    pytest.param(b"GET http://a/ HTTP/1.1\rX: a\r\n\r\n", 400, id="bare CR ending a line"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\r\r\n\r\n", 400, id="CR CR LF"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nHost : a\r\n\r\n", 400, id="space before colon"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nHost\t: a\r\n\r\n", 400, id="tab before colon"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX@Y: a\r\n\r\n", 400, id="@ in a header name"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX Y: a\r\n\r\n", 400, id="space in a header name"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX\xe9: a\r\n\r\n", 400, id="non-ASCII header name"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\n: a\r\n\r\n", 400, id="empty header name"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nNoColon\r\n\r\n", 400, id="header without colon"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\x00b\r\n\r\n", 400, id="NUL in a value"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\x7fb\r\n\r\n", 400, id="DEL in a value"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\nX: a\x1b[0m\r\n\r\n", 400, id="ESC in a value"),
    pytest.param(b"G(T http://a/ HTTP/1.1\r\n\r\n", 400, id="invalid token char in method"),
    pytest.param(b"GET http://a/\r\n\r\n", 400, id="missing version"),
    pytest.param(b"GET http://a/ http/1.1\r\n\r\n", 400, id="lowercase version"),
    pytest.param(b"GET http://a/ HTTP/1\r\n\r\n", 400, id="version without minor"),
    pytest.param(b"GET http://a/ HTTP/2.0\r\n\r\n", 505, id="HTTP/2.0 is not supported"),
    pytest.param(b"GET http://a/ HTTP/1.2\r\n\r\n", 505, id="HTTP/1.2 is not supported"),
    pytest.param(b"GET  http://a/ HTTP/1.1\r\n\r\n", 400, id="two spaces after the method"),
    pytest.param(b"GET http://a/ x HTTP/1.1\r\n\r\n", 400, id="whitespace in the target"),
    pytest.param(b"GET http://a/\tx HTTP/1.1\r\n\r\n", 400, id="HTAB in the target"),
    pytest.param(b"GET http://a/\xff HTTP/1.1\r\n\r\n", 400, id="non-ASCII in the target"),
    pytest.param(b"GET http://a/\x01 HTTP/1.1\r\n\r\n", 400, id="control char in the target"),
    pytest.param(b"GET http://a/ HTTP/1.1 \r\n\r\n", 400, id="trailing space on request line"),
    pytest.param(
        b"GET http://a/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, id="two Host fields"
    ),
    pytest.param(
        b"\r\n" * 5 + b"GET http://a/ HTTP/1.1\r\n\r\n", 400, id="five leading empty lines"
    ),
]


@pytest.mark.parametrize(("raw", "status"), INVALID_REQUESTS)
def test_malformed_request_heads_are_refused(raw: bytes, status: int) -> None:
    assert status_of(raw) == status


SMUGGLING = [
    pytest.param(
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, id="CL and TE together"
    ),
    pytest.param(
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400, id="TE and CL together"
    ),
    pytest.param(b"Content-Length: 5\r\nContent-Length: 6\r\n", 400, id="two differing CL"),
    pytest.param(b"Content-Length: 5, 6\r\n", 400, id="a CL list with differing values"),
    pytest.param(b"Content-Length: 5,\r\n", 400, id="a CL list with an empty element"),
    pytest.param(b"Content-Length: 05\r\nContent-Length: 5\r\n", 400, id="CL 05 versus 5"),
    pytest.param(b"Content-Length: +5\r\n", 400, id="CL with a plus sign"),
    pytest.param(b"Content-Length: -1\r\n", 400, id="negative CL"),
    pytest.param(b"Content-Length: 0x10\r\n", 400, id="hex CL"),
    pytest.param(b"Content-Length: 1_0\r\n", 400, id="CL with an underscore"),
    pytest.param(b"Content-Length: \xb2\r\n", 400, id="CL with a superscript digit"),
    pytest.param(b"Content-Length:\r\n", 400, id="empty CL"),
    pytest.param(b"Content-Length: 1 0\r\n", 400, id="CL with inner space"),
    pytest.param(b"Content-Length: " + b"9" * 19 + b"\r\n", 400, id="absurdly long CL"),
    pytest.param(b"Transfer-Encoding: chunked, identity\r\n", 400, id="TE chunked then identity"),
    pytest.param(b"Transfer-Encoding: xchunked\r\n", 400, id="TE xchunked"),
    pytest.param(b"Transfer-Encoding: chunked;x=1\r\n", 400, id="TE chunked with parameter"),
    pytest.param(b"Transfer-Encoding: identity\r\n", 400, id="TE identity"),
    pytest.param(b"Transfer-Encoding:\r\n", 400, id="empty TE"),
    pytest.param(b"Transfer-Encoding: chunked, chunked\r\n", 400, id="chunked twice"),
    pytest.param(
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        400,
        id="a second TE field after chunked",
    ),
    pytest.param(b"Transfer-Encoding: foo, chunked\r\n", 501, id="unknown coding before chunked"),
    pytest.param(b"Transfer-Encoding : chunked\r\n", 400, id="space before the TE colon"),
    pytest.param(b"Transfer-Encoding:\x0bchunked\r\n", 400, id="vertical tab before chunked"),
    pytest.param(b"Transfer-Encoding: chunked\r\n chunked\r\n", 400, id="TE folded"),
]


@pytest.mark.parametrize(("fields", "status"), SMUGGLING)
def test_ambiguous_framing_is_refused(fields: bytes, status: int) -> None:
    raw = b"POST http://a/ HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n"
    assert status_of(raw) == status


def test_transfer_encoding_in_http10_is_refused() -> None:
    assert status_of(b"POST http://a/ HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n") == 400


def test_incomplete_head_needs_more_data() -> None:
    assert parse_request_head(b"", LIMIT) is None
    assert parse_request_head(b"GET http://a/ HTTP/1.1\r\nHost: a\r\n", LIMIT) is None
    assert parse_request_head(b"\r\n", LIMIT) is None


def test_consumed_stops_at_the_empty_line() -> None:
    first = b"POST http://a/ HTTP/1.1\r\nContent-Length: 3\r\n\r\n"
    parsed = parse_request_head(first + b"abcGET http://b/ HTTP/1.1\r\n\r\n", LIMIT)
    assert parsed is not None
    assert parsed[1] == len(first)


def test_bytearray_and_memoryview_parse_like_bytes() -> None:
    raw = b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\nbody"
    expected = parse_request_head(raw, LIMIT)
    assert parse_request_head(bytearray(raw), LIMIT) == expected
    assert parse_request_head(memoryview(raw), LIMIT) == expected


def test_head_larger_than_the_limit_is_431() -> None:
    raw = b"GET http://a/ HTTP/1.1\r\nX: " + b"a" * 100 + b"\r\n\r\n"
    assert parse_request_head(raw, len(raw)) is not None
    with pytest.raises(HttpError) as caught:
        parse_request_head(raw, len(raw) - 1)
    assert caught.value.status == 431


def test_unterminated_head_reaching_the_limit_is_431() -> None:
    assert parse_request_head(b"GET http://a/ HTTP/1.1\r\nX: aaaa", 100) is None
    with pytest.raises(HttpError) as caught:
        parse_request_head(b"GET http://a/ HTTP/1.1\r\nX: " + b"a" * 100, 100)
    assert caught.value.status == 431


def test_get_is_case_insensitive_and_returns_the_first() -> None:
    head = parse(b"GET http://a/ HTTP/1.1\r\nX-A: 1\r\nx-a: 2\r\nX-B: 3\r\n\r\n")
    assert head.get("X-A") == "1"
    assert head.get("x-b") == "3"
    assert head.get("missing") is None
    assert head.get_all("X-a") == ["1", "2"]
    assert head.get_all("missing") == []


KEEP_ALIVE = [
    pytest.param("HTTP/1.1", [], True, id="HTTP/1.1 persists by default"),
    pytest.param("HTTP/1.1", [("Connection", "close")], False, id="HTTP/1.1 with close"),
    pytest.param("HTTP/1.1", [("connection", "Foo, CLOSE")], False, id="close among options"),
    pytest.param("HTTP/1.0", [], False, id="HTTP/1.0 closes by default"),
    pytest.param("HTTP/1.0", [("Connection", "Keep-Alive")], True, id="HTTP/1.0 with keep-alive"),
    pytest.param(
        "HTTP/1.0", [("Connection", "keep-alive, close")], False, id="close wins over keep-alive"
    ),
]


@pytest.mark.parametrize(("version", "headers", "expected"), KEEP_ALIVE)
def test_keep_alive_follows_version_and_connection(
    version: str, headers: list[tuple[str, str]], expected: bool
) -> None:
    assert RequestHead("GET", "http://a/", version, headers).keep_alive is expected
    assert ResponseHead(version, 200, "OK", headers).keep_alive is expected


# --- destinations ------------------------------------------------------------------


def destination(method: str, target: str, *headers: tuple[str, str]) -> Destination:
    return request_destination(RequestHead(method, target, "HTTP/1.1", list(headers)))


VALID_TARGETS = [
    pytest.param("CONNECT", "example.com:443", ("connect", "example.com", 443, ""),
                 id="CONNECT host:port"),
    pytest.param("CONNECT", "Example.COM.:8443", ("connect", "Example.COM.", 8443, ""),
                 id="CONNECT keeps the host text unnormalised"),
    pytest.param("CONNECT", "[2001:db8::1]:443", ("connect", "2001:db8::1", 443, ""),
                 id="CONNECT to a bracketed IPv6 literal"),
    pytest.param("CONNECT", "192.0.2.7:22", ("connect", "192.0.2.7", 22, ""),
                 id="CONNECT to an IPv4 literal"),
    pytest.param("GET", "http://example.com/a/b?c=d&e", ("http", "example.com", 80, "/a/b?c=d&e"),
                 id="absolute-form defaults to port 80"),
    pytest.param("GET", "http://example.com", ("http", "example.com", 80, "/"),
                 id="an empty path becomes /"),
    pytest.param("GET", "http://example.com?q", ("http", "example.com", 80, "/?q"),
                 id="a query without a path gets /"),
    pytest.param("POST", "HTTP://example.com:8080/x", ("http", "example.com", 8080, "/x"),
                 id="the scheme is case-insensitive and the port is read"),
    pytest.param("GET", "http://[::1]:8080/x", ("http", "::1", 8080, "/x"),
                 id="absolute-form to an IPv6 literal"),
    pytest.param("GET", "http://[::ffff:127.0.0.1]/", ("http", "::ffff:127.0.0.1", 80, "/"),
                 id="IPv4-mapped IPv6 literal without a port"),
    pytest.param("GET", "http://a.example/p@q:r", ("http", "a.example", 80, "/p@q:r"),
                 id="@ and : in the path do not touch the authority"),
    pytest.param("GET", "http://a.example:00080/", ("http", "a.example", 80, "/"),
                 id="leading zeros in a port are digits"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "target", "expected"), VALID_TARGETS)
def test_request_destination_reads_the_target(
    method: str, target: str, expected: tuple[str, str, int, str]
) -> None:
    assert destination(method, target) == Destination(*expected)


INVALID_TARGETS = [
    pytest.param("CONNECT", "example.com", id="CONNECT without a port"),
    pytest.param("CONNECT", "example.com:", id="CONNECT with an empty port"),
    pytest.param("CONNECT", "example.com:443/x", id="CONNECT with a path"),
    pytest.param("CONNECT", "user:pw@example.com:443", id="CONNECT with userinfo"),
    pytest.param("CONNECT", "http://example.com:443", id="CONNECT with absolute-form"),
    pytest.param("CONNECT", "[::1]", id="CONNECT to IPv6 without a port"),
    pytest.param("CONNECT", "::1:443", id="CONNECT to unbracketed IPv6"),
    pytest.param("CONNECT", "[::1:443", id="CONNECT with an unclosed bracket"),
    pytest.param("CONNECT", "[::1]x:443", id="CONNECT with junk after the bracket"),
    pytest.param("CONNECT", "[example.com]:443", id="CONNECT with a bracketed name"),
    pytest.param("CONNECT", "example.com:0", id="port 0"),
    pytest.param("CONNECT", "example.com:65536", id="port 65536"),
    pytest.param("CONNECT", "example.com:+443", id="port with a sign"),
    pytest.param("CONNECT", "example.com:443:1", id="two ports"),
    pytest.param("CONNECT", "example.com:1e3", id="port in exponent form"),
    pytest.param("CONNECT", "example.com:0x1bb", id="port in hex"),
    pytest.param("CONNECT", "example.com:000443", id="port with six digits"),
    pytest.param("CONNECT", ":443", id="CONNECT with an empty host"),
    pytest.param("CONNECT", "ex%61mple.com:443", id="percent-encoded host"),
    pytest.param("GET", "/path", id="origin-form to a proxy"),
    pytest.param("OPTIONS", "*", id="asterisk-form to a proxy"),
    pytest.param("GET", "https://example.com/", id="https absolute-form"),
    pytest.param("GET", "ftp://example.com/", id="an ftp URI"),
    pytest.param("GET", "http:/example.com/", id="a single slash after the scheme"),
    pytest.param("GET", "http://user:pw@example.com/", id="userinfo in absolute-form"),
    pytest.param("GET", "http://allowed.example@evil.example/", id="user@ confusion"),
    pytest.param("GET", "http://evil.example\\@allowed.example/", id="backslash-at confusion"),
    pytest.param("GET", "http://allowed.example#@evil.example/", id="fragment confusion"),
    pytest.param("GET", "http://a.example/x#frag", id="fragment in the path"),
    pytest.param("GET", "http:///x", id="absolute-form with an empty host"),
    pytest.param("GET", "http://a.example:/x", id="absolute-form with an empty port"),
    pytest.param("GET", "http://a.example:99999/", id="absolute-form with a port too large"),
    pytest.param("GET", "http://[zz::1]/", id="invalid IPv6 characters"),
]


@pytest.mark.parametrize(("method", "target"), INVALID_TARGETS)
def test_request_destination_refuses_bad_targets(method: str, target: str) -> None:
    with pytest.raises(HttpError) as caught:
        destination(method, target)
    assert caught.value.status == 400


def test_https_absolute_form_tells_the_client_to_use_connect() -> None:
    with pytest.raises(HttpError, match="CONNECT"):
        destination("GET", "https://example.com/")


@pytest.mark.parametrize(
    ("method", "target"),
    [("GET", "http://allowed.example/"), ("CONNECT", "allowed.example:443")],
)
def test_host_header_never_affects_the_destination(method: str, target: str) -> None:
    plain = destination(method, target)
    for host in ("evil.example", "evil.example:443", "[::1]:22", "allowed.example@evil.example"):
        assert destination(method, target, ("Host", host)) == plain


def test_origin_form_with_host_header_is_still_refused() -> None:
    with pytest.raises(HttpError):
        destination("GET", "/", ("Host", "example.com"))


# --- forwarding --------------------------------------------------------------------


def forwarded(raw: bytes) -> bytes:
    head = parse(raw)
    return forward_request_head(head, request_destination(head))


def test_forwarded_request_uses_origin_form_and_rewrites_host() -> None:
    out = forwarded(
        b"GET http://Example.com:8080/a?b HTTP/1.0\r\nAccept: */*\r\nhost: evil.example\r\n\r\n"
    )
    assert out == (
        b"GET /a?b HTTP/1.1\r\nHost: Example.com:8080\r\nAccept: */*\r\n"
        b"Connection: keep-alive\r\n\r\n"
    )


def test_forwarded_host_omits_port_80_and_brackets_ipv6() -> None:
    assert b"\r\nHost: example.com\r\n" in forwarded(b"GET http://example.com:80/ HTTP/1.1\r\n\r\n")
    assert b"\r\nHost: [::1]:81\r\n" in forwarded(b"GET http://[::1]:81/ HTTP/1.1\r\n\r\n")


def test_forwarding_removes_hop_by_hop_fields() -> None:
    out = forwarded(
        b"GET http://a/ HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, X-Secret, Upgrade\r\n"
        b"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n"
        b"Proxy-Authorization: Basic cjp0\r\nProxy-Authenticate: Basic\r\nTE: trailers\r\n"
        b"Trailer: X-T\r\nUpgrade: websocket\r\nX-Secret: s\r\nx-secret: t\r\n"
        b"X-Egress-Decision: allow\r\nX-Kept: k\r\n\r\n"
    )
    assert field_names(out) == ["host", "x-egress-decision", "x-kept", "connection"]
    assert out.endswith(b"\r\nConnection: keep-alive\r\n\r\n")


def test_framing_fields_named_in_connection_are_kept() -> None:
    out = forwarded(
        b"POST http://a/ HTTP/1.1\r\nConnection: Content-Length, Transfer-Encoding\r\n"
        b"Content-Length: 3\r\n\r\n"
    )
    assert field_names(out) == ["host", "content-length", "connection"]
    out = forwarded(
        b"POST http://a/ HTTP/1.1\r\nConnection: transfer-encoding\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    assert b"\r\nTransfer-Encoding: chunked\r\n" in out


def test_fields_named_in_connection_are_dropped_wherever_they_come() -> None:
    # The names come after, before and on both sides of the Connection fields that name them.
    out = forwarded(
        b"GET http://a/ HTTP/1.1\r\nX-Before: 1\r\nConnection: x-before\r\nX-Kept: k\r\n"
        b"connection: X-After, close\r\nX-After: 2\r\nClose: c\r\n\r\n"
    )
    assert field_names(out) == ["host", "x-kept", "connection"]
    # "close" names no field here: nothing else goes.
    out = forwarded(b"GET http://a/ HTTP/1.1\r\nConnection: close\r\nX-Kept: k\r\n\r\n")
    assert field_names(out) == ["host", "x-kept", "connection"]


def test_duplicate_content_length_is_forwarded_once() -> None:
    out = forwarded(b"POST http://a/ HTTP/1.1\r\nContent-Length: 3, 3\r\nContent-Length: 3\r\n\r\n")
    assert out.count(b"Content-Length") == 1
    assert b"\r\nContent-Length: 3\r\n" in out


def test_forwarded_request_parses_back_with_the_same_fields() -> None:
    raw = (
        b"PUT http://a.example/x HTTP/1.1\r\nHost: a.example\r\nX-A:  1 \r\n"
        b"Transfer-Encoding: gzip, chunked\r\nX-Latin: \xe9\r\n\r\n"
    )
    again = parse(forwarded(raw))
    assert (again.method, again.target, again.version) == ("PUT", "/x", "HTTP/1.1")
    assert again.headers == [
        ("Host", "a.example"),
        ("X-A", "1"),
        ("Transfer-Encoding", "gzip, chunked"),
        ("X-Latin", "\xe9"),
        ("Connection", "keep-alive"),
    ]


def test_forwarding_a_connect_destination_is_a_caller_bug() -> None:
    head = parse(b"CONNECT a:443 HTTP/1.1\r\n\r\n")
    with pytest.raises(ValueError):
        forward_request_head(head, request_destination(head))


# --- responses ---------------------------------------------------------------------

VALID_RESPONSES = [
    pytest.param(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
        ResponseHead("HTTP/1.1", 200, "OK", [("Content-Length", "2")]),
        id="a 200 parses",
    ),
    pytest.param(
        b"HTTP/1.0 404 Not   Found\tHere\r\n\r\n",
        ResponseHead("HTTP/1.0", 404, "Not   Found\tHere", []),
        id="a reason keeps inner whitespace",
    ),
    pytest.param(
        b"HTTP/1.1 204 \r\n\r\n", ResponseHead("HTTP/1.1", 204, "", []), id="an empty reason"
    ),
    pytest.param(
        b"HTTP/1.1 204\r\n\r\n", ResponseHead("HTTP/1.1", 204, "", []), id="no reason at all"
    ),
    pytest.param(
        b"HTTP/1.1 100 Continue\r\n\r\n",
        ResponseHead("HTTP/1.1", 100, "Continue", []),
        id="an interim response parses like any other",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\nServer: x\n\n",
        ResponseHead("HTTP/1.1", 200, "OK", [("Server", "x")]),
        id="bare LF line endings are accepted",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), VALID_RESPONSES)
def test_valid_response_heads_parse(raw: bytes, expected: ResponseHead) -> None:
    assert parse_response(raw) == expected


INVALID_RESPONSES = [
    pytest.param(b"HTTP/1.1 20 OK\r\n\r\n", id="a two-digit status"),
    pytest.param(b"HTTP/1.1 2000 OK\r\n\r\n", id="a four-digit status"),
    pytest.param(b"HTTP/1.1 600 Odd\r\n\r\n", id="a status above 599"),
    pytest.param(b"HTTP/1.1 abc OK\r\n\r\n", id="a non-numeric status"),
    pytest.param(b"HTTP/1.1  200 OK\r\n\r\n", id="two spaces before the status"),
    pytest.param(b"HTTP/2 200 OK\r\n\r\n", id="HTTP/2"),
    pytest.param(b"HTTP/3.0 200 OK\r\n\r\n", id="HTTP/3.0"),
    pytest.param(b"ICY 200 OK\r\n\r\n", id="not HTTP"),
    pytest.param(b"HTTP/1.1 200 OK\r\nServer : x\r\n\r\n", id="space before colon"),
    pytest.param(b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", id="obs-fold"),
    pytest.param(b"HTTP/1.1 200 OK\r\nX: a\rb\r\n\r\n", id="bare CR"),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        id="CL and TE together",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        id="two differing CL",
    ),
    pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", id="TE not ending chunked"),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: br, chunked\r\n\r\n", id="an unknown coding"
    ),
    pytest.param(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", id="TE in HTTP/1.0"),
]


@pytest.mark.parametrize("raw", INVALID_RESPONSES)
def test_malformed_response_heads_are_the_upstreams_fault(raw: bytes) -> None:
    with pytest.raises(HttpError) as caught:
        parse_response_head(raw, LIMIT)
    assert caught.value.status == 502


def test_oversized_response_head_is_the_upstreams_fault() -> None:
    with pytest.raises(HttpError) as caught:
        parse_response_head(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 200, 100)
    assert caught.value.status == 502


def test_forwarded_response_strips_egress_and_hop_by_hop_fields() -> None:
    head = parse_response(
        b"HTTP/1.0 200 Fine\r\nX-Egress-Decision: allow\r\nx-egress-reason: forged\r\n"
        b"X-EGRESS-Request-Id: 1\r\nX-Egressed: kept\r\nConnection: X-Hop\r\nX-Hop: 1\r\n"
        b"Keep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nUpgrade: h2c\r\n"
        b"Content-Length: 4\r\n\r\n"
    )
    out = forward_response_head(head, client_keep_alive=True)
    assert out == (
        b"HTTP/1.1 200 Fine\r\nX-Egressed: kept\r\nContent-Length: 4\r\n"
        b"Connection: keep-alive\r\n\r\n"
    )


def test_forwarded_response_says_close_when_the_client_connection_ends() -> None:
    head = parse_response(b"HTTP/1.1 500 Oops\r\nConnection: keep-alive\r\n\r\n")
    out = forward_response_head(head, client_keep_alive=False)
    assert out == b"HTTP/1.1 500 Oops\r\nConnection: close\r\n\r\n"
    assert parse_response(out).keep_alive is False


def test_forwarded_response_keeps_obs_text_and_the_reason() -> None:
    head = parse_response(b"HTTP/1.1 200 D\xe9j\xe0 vu\r\nX-N: \xff\r\n\r\n")
    out = forward_response_head(head, client_keep_alive=True)
    assert out.startswith(b"HTTP/1.1 200 D\xe9j\xe0 vu\r\nX-N: \xff\r\n")


# --- body framing ------------------------------------------------------------------

REQUEST_BODIES = [
    pytest.param(b"", (BodyKind.NONE, 0), id="no framing fields means no body"),
    pytest.param(b"Content-Length: 0\r\n", (BodyKind.LENGTH, 0), id="CL 0"),
    pytest.param(b"Content-Length: 12\r\n", (BodyKind.LENGTH, 12), id="CL 12"),
    pytest.param(b"Content-Length: 7, 7\r\n", (BodyKind.LENGTH, 7), id="a repeated CL list"),
    pytest.param(b"Transfer-Encoding: chunked\r\n", (BodyKind.CHUNKED, 0), id="chunked"),
    pytest.param(b"Transfer-Encoding: Chunked\r\n", (BodyKind.CHUNKED, 0), id="Chunked"),
    pytest.param(b"Transfer-Encoding: gzip, chunked\r\n", (BodyKind.CHUNKED, 0), id="gzip first"),
    pytest.param(
        b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
        (BodyKind.CHUNKED, 0),
        id="codings across two fields",
    ),
]


@pytest.mark.parametrize(("fields", "expected"), REQUEST_BODIES)
def test_request_body_kind(fields: bytes, expected: tuple[BodyKind, int]) -> None:
    head = parse(b"POST http://a/ HTTP/1.1\r\n" + fields + b"\r\n")
    assert request_body_kind(head) == expected


RESPONSE_BODIES = [
    pytest.param("GET", 200, [("Content-Length", "5")], (BodyKind.LENGTH, 5), id="CL"),
    pytest.param(
        "GET", 200, [("Transfer-Encoding", "chunked")], (BodyKind.CHUNKED, 0), id="chunked"
    ),
    pytest.param("GET", 200, [], (BodyKind.UNTIL_CLOSE, 0), id="no framing reads until close"),
    pytest.param("POST", 404, [], (BodyKind.UNTIL_CLOSE, 0), id="errors read until close too"),
    pytest.param("HEAD", 200, [("Content-Length", "5")], (BodyKind.NONE, 0), id="HEAD"),
    pytest.param(
        "HEAD", 200, [("Transfer-Encoding", "chunked")], (BodyKind.NONE, 0), id="HEAD chunked"
    ),
    pytest.param("GET", 100, [], (BodyKind.NONE, 0), id="100"),
    pytest.param("GET", 103, [("Content-Length", "5")], (BodyKind.NONE, 0), id="103"),
    pytest.param("GET", 204, [("Content-Length", "5")], (BodyKind.NONE, 0), id="204"),
    pytest.param("GET", 304, [("Content-Length", "5")], (BodyKind.NONE, 0), id="304"),
    pytest.param("CONNECT", 200, [], (BodyKind.NONE, 0), id="2xx to CONNECT"),
    pytest.param("CONNECT", 403, [("Content-Length", "3")], (BodyKind.LENGTH, 3),
                 id="403 to CONNECT"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "status", "headers", "expected"), RESPONSE_BODIES)
def test_response_body_kind(
    method: str, status: int, headers: list[tuple[str, str]], expected: tuple[BodyKind, int]
) -> None:
    head = ResponseHead("HTTP/1.1", status, "", headers)
    assert response_body_kind(head, method) == expected


def test_body_kind_of_a_hand_built_ambiguous_head_raises() -> None:
    both = [("Content-Length", "1"), ("Transfer-Encoding", "chunked")]
    with pytest.raises(HttpError):
        request_body_kind(RequestHead("POST", "http://a/", "HTTP/1.1", both))
    with pytest.raises(HttpError) as caught:
        response_body_kind(ResponseHead("HTTP/1.1", 200, "OK", both), "GET")
    assert caught.value.status == 502


PARSED_AS_BUILT = [
    pytest.param(version, fields, id=f"{version} {name}")
    for version in ("HTTP/1.1", "HTTP/1.0")
    for name, fields in [
        ("no fields", []),
        ("a length", [("Content-Length", "5")]),
        ("a repeated length", [("Content-Length", "5, 5"), ("content-length", "5")]),
        ("chunked", [("Transfer-Encoding", "gzip, chunked")]),
        ("Connection: close", [("Connection", "close")]),
        ("Connection: keep-alive", [("connection", "Keep-Alive")]),
        ("a length and close", [("Content-Length", "0"), ("Connection", "keep-alive, close")]),
        ("Proxy-Connection only", [("Proxy-Connection", "close")]),
    ]
    if not (version == "HTTP/1.0" and name == "chunked")
]


@pytest.mark.parametrize(("version", "fields"), PARSED_AS_BUILT)
def test_a_parsed_head_answers_as_the_same_head_built_by_hand(version: str, fields: list[tuple[str, str]]) -> None:
    """The framing and keep-alive a parse keeps on the head are what its fields say, worked out anew."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in fields)
    request = parse(f"POST http://a/ {version}\r\nHost: a\r\n{lines}\r\n".encode())
    assert request.framing is not None  # kept by the parse: the fast path took it
    built = RequestHead("POST", "http://a/", version, [("Host", "a"), *fields])
    assert (request_body_kind(request), request.keep_alive) == (request_body_kind(built), built.keep_alive)
    response = parse_response(f"{version} 200 OK\r\n{lines}\r\n".encode())
    assert response.framing is not None
    built_response = ResponseHead(version, 200, "OK", list(fields))
    for method in ("GET", "HEAD"):
        assert response_body_kind(response, method) == response_body_kind(built_response, method)
    assert response.keep_alive is built_response.keep_alive


def test_keep_alive_is_known_at_parse_only_without_a_connection_field() -> None:
    assert parse(b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n").persists is True
    assert parse(b"GET http://a/ HTTP/1.0\r\nHost: a\r\n\r\n").persists is False
    assert parse(b"GET http://a/ HTTP/1.1\r\nConnection: close\r\n\r\n").persists is None
    assert parse_response(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n").keep_alive is False


# --- chunked bodies ----------------------------------------------------------------


def scan(pieces: list[bytes]) -> tuple[int, bool]:
    """Feed pieces until done; the body length and whether it ended."""
    scanner = ChunkedScanner()
    total = 0
    for piece in pieces:
        used = scanner.feed(piece)
        assert 0 <= used <= len(piece)
        total += used
        if scanner.done:
            break
        assert used == len(piece)
    return total, scanner.done


CHUNKED_BODIES = [
    pytest.param(b"0\r\n\r\n", id="only the last chunk"),
    pytest.param(b"5\r\nhello\r\n0\r\n\r\n", id="one chunk"),
    pytest.param(b"5\r\nhe\r\nl\r\n6\r\n world\r\n0\r\n\r\n", id="CRLF inside chunk data"),
    pytest.param(b"A\r\n0123456789\r\na\r\n0123456789\r\n0\r\n\r\n", id="hex sizes of either case"),
    pytest.param(b"005\r\nhello\r\n000\r\n\r\n", id="leading zeros in sizes"),
    pytest.param(b"5;name=val;flag\r\nhello\r\n0;last\r\n\r\n", id="chunk extensions"),
    pytest.param(b'5 ; q="a b"\r\nhello\r\n0\r\n\r\n', id="BWS and a quoted extension"),
    pytest.param(b"3\r\nabc\r\n0\r\nExpires: never\r\nX-Sum:\t1\r\n\r\n", id="trailer fields"),
    pytest.param(b"1\r\n\x00\r\n0\r\n\r\n", id="chunk data is opaque bytes"),
]


@pytest.mark.parametrize("body", CHUNKED_BODIES)
def test_chunked_scanner_finds_the_end(body: bytes) -> None:
    assert scan([body + b"GET http://next/ HTTP/1.1\r\n\r\n"]) == (len(body), True)


@pytest.mark.parametrize("body", CHUNKED_BODIES)
def test_chunked_scanner_handles_every_byte_boundary(body: bytes) -> None:
    for cut in range(1, len(body)):
        assert scan([body[:cut], body[cut:] + b"tail"]) == (len(body), True)
    assert scan([body[i : i + 1] for i in range(len(body))] + [b"tail"]) == (len(body), True)


MALFORMED_CHUNKED = [
    pytest.param(b"5\nhello\r\n0\r\n\r\n", id="bare LF after the size"),
    pytest.param(b"5\r\nhello\n0\r\n\r\n", id="bare LF after the data"),
    pytest.param(b"5\r\nhelloX\r\n0\r\n\r\n", id="data longer than its size"),
    pytest.param(b"5\r\nhello\rX0\r\n\r\n", id="CR then junk after the data"),
    pytest.param(b"0\r\n\r\r\n", id="bare CR in the final empty line"),
    pytest.param(b"g\r\n", id="a non-hex size"),
    pytest.param(b"0x5\r\nhello\r\n", id="a 0x prefix"),
    pytest.param(b"+5\r\nhello\r\n", id="a signed size"),
    pytest.param(b"-0\r\n\r\n", id="a negative zero"),
    pytest.param(b"5_0\r\n", id="an underscore in the size"),
    pytest.param(b" 5\r\nhello\r\n", id="space before the size"),
    pytest.param(b"5 \r\nhello\r\n", id="space after the size without an extension"),
    pytest.param(b"\r\n", id="an empty size line"),
    pytest.param(b";ext\r\n", id="an extension without a size"),
    pytest.param(b"1" * 17 + b"\r\n", id="seventeen hex digits"),
    pytest.param(b"5;a\x00b\r\nhello\r\n", id="NUL in an extension"),
    pytest.param(b"5;a\rb\r\nhello\r\n", id="bare CR in an extension"),
    pytest.param(b"5;" + b"x" * 5000 + b"\r\n", id="an extension too long"),
    pytest.param(b"0\r\nno colon\r\n\r\n", id="a trailer without a colon"),
    pytest.param(b"0\r\nBad Name: x\r\n\r\n", id="a trailer with a bad name"),
    pytest.param(b"0\r\n folded: x\r\n\r\n", id="a folded trailer"),
    pytest.param(b"0\r\nX: a\x7f\r\n\r\n", id="DEL in a trailer"),
    pytest.param(b"0\r\n" + b"X: y\r\n" * 20000, id="trailers too large"),
]


@pytest.mark.parametrize("body", MALFORMED_CHUNKED)
def test_chunked_scanner_refuses_malformed_framing(body: bytes) -> None:
    with pytest.raises(HttpError) as caught:
        scan([body])
    assert caught.value.status == 400


def test_chunked_scanner_uses_the_status_it_was_given() -> None:
    with pytest.raises(HttpError) as caught:
        ChunkedScanner(error_status=502).feed(b"zz\r\n")
    assert caught.value.status == 502


def test_a_failed_chunked_scanner_stays_failed() -> None:
    scanner = ChunkedScanner()
    with pytest.raises(HttpError):
        scanner.feed(b"x\r\n")
    with pytest.raises(HttpError):
        scanner.feed(b"0\r\n\r\n")
    assert not scanner.done


def test_chunked_scanner_takes_nothing_after_done() -> None:
    scanner = ChunkedScanner()
    assert scanner.feed(b"0\r\n\r\nrest") == 5
    assert scanner.done
    assert scanner.feed(b"more") == 0
    assert scanner.feed(b"") == 0


def test_chunked_scanner_is_not_done_midway() -> None:
    scanner = ChunkedScanner()
    assert scanner.feed(b"5\r\nhel") == 6
    assert not scanner.done
    assert scanner.feed(b"") == 0


def test_chunked_scanner_skips_huge_chunks_a_feed_at_a_time() -> None:
    megabyte = memoryview(bytes(1 << 20))
    scanner = ChunkedScanner()
    assert scanner.feed(b"ffffffffffffffff\r\n") == 18
    for _ in range(1000):  # a gigabyte of chunk data, no line search in it
        assert scanner.feed(megabyte) == len(megabyte)
    assert not scanner.done


def test_chunked_scanner_accepts_memoryview_and_bytearray() -> None:
    body = b"3;x\r\nabc\r\n0\r\nT: 1\r\n\r\n"
    for wrap in (memoryview, bytearray):
        scanner = ChunkedScanner()
        assert scanner.feed(wrap(body + b"next")) == len(body)
        assert scanner.done


# --- properties --------------------------------------------------------------------


@settings(max_examples=500)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=400))
@example(b"GET http://a/ HTTP/1.1\r\n\r\n", 400)
@example(b"\n\n", 10)
def test_random_bytes_yield_a_request_head_none_or_http_error(raw: bytes, limit: int) -> None:
    try:
        result = parse_request_head(raw, limit)
    except HttpError as exc:
        assert exc.status in (400, 431, 501, 505)
        return
    if result is not None:
        head, used = result
        assert 0 < used <= min(len(raw), limit)
        request_body_kind(head)


@settings(max_examples=500)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=400))
@example(b"HTTP/1.1 200 OK\r\n\r\n", 400)
def test_random_bytes_yield_a_response_head_none_or_http_error(raw: bytes, limit: int) -> None:
    try:
        result = parse_response_head(raw, limit)
    except HttpError as exc:
        assert exc.status == 502
        return
    if result is not None:
        head, used = result
        assert 0 < used <= min(len(raw), limit)
        response_body_kind(head, "GET")


_SEED_REQUEST = (
    b"POST http://a.example:8080/p?q HTTP/1.1\r\nHost: a.example\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)


@settings(max_examples=500)
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=len(_SEED_REQUEST)),
            st.integers(min_value=0, max_value=3),
            st.sampled_from([b"", b" ", b"\t", b"\r", b"\n", b":", b"\x00", b",", b"\xff", b"@"]),
        ),
        max_size=4,
    )
)
def test_mutated_requests_parse_or_fail_cleanly(
    edits: list[tuple[int, int, bytes]],
) -> None:
    raw = _SEED_REQUEST
    for at, cut, insert in edits:
        raw = raw[:at] + insert + raw[at + cut :]
    try:
        result = parse_request_head(raw, LIMIT)
        if result is not None:
            head = result[0]
            request_body_kind(head)
            dest = request_destination(head)
            if dest.scheme == "http":
                again = parse_request_head(forward_request_head(head, dest), LIMIT)
                assert again is not None
                assert request_body_kind(again[0]) == request_body_kind(head)
    except HttpError:
        pass


_TCHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-!#$%&'*+.^_`|~"
_TOKEN = st.text(_TCHARS, min_size=1, max_size=12)
# Visible ASCII and obs-text; OWS cannot start or end a value, so none at all.
_VALUE = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=20
)
# Fields forwarding rewrites or drops; the rest must pass through unchanged.
_SPECIAL = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te",
            "trailer", "upgrade", "proxy-connection", "proxy-authorization",
            "proxy-authenticate"}  # fmt: skip
_FIELDS = st.lists(
    st.tuples(_TOKEN, _VALUE).filter(lambda f: f[0].lower() not in _SPECIAL), max_size=6
)


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    method = draw(_TOKEN)
    path = draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789/?=&%.-~", max_size=20))
    fields = draw(_FIELDS)
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    lines = [f"{method} http://host.example/{path} HTTP/1.1".encode()]
    lines += [f"{name}: {value}".encode("latin-1") for name, value in fields]
    return draw(st.sampled_from([b"", b"\r\n", b"\n"])) + eol.join(lines) + eol + eol


@given(request_heads(), st.binary(max_size=10))
def test_growing_prefixes_need_more_data_until_the_head_is_complete(
    raw: bytes, after: bytes
) -> None:
    full = parse_request_head(raw + after, LIMIT)
    assert full is not None
    assert full[1] == len(raw)
    for cut in range(len(raw)):
        assert parse_request_head(raw[:cut], LIMIT) is None
    assert parse_request_head(raw, LIMIT) == full


@given(request_heads())
def test_forwarding_keeps_every_end_to_end_field(raw: bytes) -> None:
    head = parse(raw)
    again = parse(forward_request_head(head, request_destination(head)))
    assert again.headers == [("Host", "host.example"), *head.headers, ("Connection", "keep-alive")]


@st.composite
def chunked_bodies(draw: st.DrawFn) -> bytes:
    parts = []
    for data in draw(st.lists(st.binary(min_size=1, max_size=40), max_size=6)):
        size = draw(st.sampled_from(["{:x}", "{:X}", "{:04x}"])).format(len(data))
        ext = draw(st.sampled_from(["", ";a", ";a=b", ' ;q="x y"', ";a=1;b"]))
        parts.append(f"{size}{ext}\r\n".encode() + data + b"\r\n")
    trailers = draw(st.lists(st.tuples(_TOKEN, _VALUE), max_size=3))
    parts.append(b"0\r\n")
    parts += [f"{n}: {v}\r\n".encode("latin-1") for n, v in trailers]
    parts.append(b"\r\n")
    return b"".join(parts)


@settings(max_examples=300)
@given(
    chunked_bodies(),
    st.binary(max_size=20),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    st.booleans(),
)
def test_chunked_end_does_not_depend_on_how_the_body_is_split(
    body: bytes, after: bytes, cuts: list[int], as_view: bool
) -> None:
    stream = body + after
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    pieces = [stream[a:b] for a, b in zip(points, points[1:], strict=False)]
    scanner = ChunkedScanner()
    total = 0
    for piece in pieces:
        used = scanner.feed(memoryview(piece) if as_view else piece)
        total += used
        if scanner.done:
            break
        assert used == len(piece)
    assert scanner.done
    assert total == len(body)


@settings(max_examples=500)
@given(st.lists(st.binary(max_size=30), max_size=5))
@example([b"1\r\n", b"x\r\n0\r\n\r\n"])
def test_random_bytes_to_the_chunked_scanner_yield_a_count_or_http_error(
    pieces: list[bytes],
) -> None:
    scanner = ChunkedScanner()
    try:
        for piece in pieces:
            used = scanner.feed(piece)
            assert 0 <= used <= len(piece)
            assert used == len(piece) or scanner.done
    except HttpError as exc:
        assert exc.status == 400


@settings(max_examples=500)
@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40))
@example("http://a@b/")
@example("[::1]:1")
def test_random_targets_yield_a_destination_or_400(target: str) -> None:
    for method in ("GET", "CONNECT"):
        try:
            dest = destination(method, target)
        except HttpError as exc:
            assert exc.status == 400
            continue
        assert 1 <= dest.port <= 65535
        assert dest.host and "@" not in dest.host and "/" not in dest.host
        assert dest.scheme == ("connect" if method == "CONNECT" else "http")


# --- the fast path against the general parser ---------------------------------------
# parse_request_head, parse_response_head and request_destination take the common input by a
# fast path and give every other to the general parser; the fast path must give exactly what the
# general parser gives (the same head, or the same refusal) wherever it answers.

_PIECES = [b"GET", b"CONNECT", b" ", b"  ", b"\t", b"\r\n", b"\n", b"\r", b":", b": ", b" :", b"HTTP/1.1", b"HTTP/1.0",
           b"HTTP/2.0", b"http://a.b/x", b"a.b:443", b"Host", b"host", b"Content-Length", b"Transfer-Encoding",
           b"chunked", b"5", b"5, 5", b"x", b"\xe9", b"\x00", b"\x7f", b"200", b"404 Not Found", b"099", b"1000", b",",
           b"\r\n\r\n", b"\n\n", b"Connection", b"@", b"["]  # fmt: skip


@st.composite
def near_heads(draw: st.DrawFn, response: bool) -> bytes:
    """A well-formed head with a few edits: most of them near the fast path's edge."""
    if response:
        starts = [b"HTTP/1.1 200 OK", b"HTTP/1.0 404", b"HTTP/1.1 204 ", b"HTTP/1.1 101 A \t\xe9"]
    else:
        starts = [b"GET http://a.b/x HTTP/1.1", b"CONNECT a.b:443 HTTP/1.1", b"POST http://q/ HTTP/1.0"]
    start = draw(st.sampled_from(starts))
    names = st.sampled_from([b"Host", b"host", b"X-A", b"Content-Length", b"Transfer-Encoding", b"Connection"])
    values = st.sampled_from([b"v", b"5", b"5, 5", b"chunked", b"a b", b"a\tb", b"", b"\xe9x"])
    ows = st.sampled_from([b"", b" ", b"\t", b" \t"])
    fields = draw(st.lists(st.tuples(names, ows, values, ows), max_size=5))
    raw = b"\r\n".join([start, *(n + b":" + a + v + b for n, a, v, b in fields)]) + b"\r\n\r\n"
    for at, cut, insert in draw(
        st.lists(st.tuples(st.integers(0, len(raw)), st.integers(0, 2), st.sampled_from(_PIECES)), max_size=3)
    ):
        raw = raw[:at] + insert + raw[at + cut :]
    return raw + draw(st.sampled_from([b"", b"body", b"GET"]))


def _outcome(parser: Callable[[bytes, int], object], raw: bytes, limit: int) -> object:
    try:
        return parser(raw, limit)
    except HttpError as exc:
        return exc.status, exc.detail


@settings(max_examples=200)
@given(near_heads(response=False), st.sampled_from([LIMIT, 40, 80]))
def test_the_fast_request_parse_agrees_with_the_general_one(raw: bytes, limit: int) -> None:
    assert _outcome(parse_request_head, raw, limit) == _outcome(heads._parse_request_head, raw, limit)


@settings(max_examples=200)
@given(near_heads(response=True), st.sampled_from([LIMIT, 40, 80]))
def test_the_fast_response_parse_agrees_with_the_general_one(raw: bytes, limit: int) -> None:
    assert _outcome(parse_response_head, raw, limit) == _outcome(heads._parse_response_head, raw, limit)


_TARGET_PIECES = ["http://", "HTTP://", "hTtP://", "https://", "a.b", "EXAMPLE.com", "x-y_z.", "1.2.3.4", "[::1]",
                  "-", ":", "::", ":80", ":0", ":00080", ":65535", ":65536", ":99999", ":123456", "/", "?", "#", "@",
                  "[", "]", "%", "/p?q=1", "ftp://"]  # fmt: skip


@settings(max_examples=300)
@given(st.lists(st.sampled_from(_TARGET_PIECES), min_size=1, max_size=5), st.sampled_from(["GET", "CONNECT"]))
@example(["http://", "a.b", ":00080", "?q"], "GET")
@example(["a.b", ":0"], "CONNECT")
def test_the_fast_destination_agrees_with_the_general_one(pieces: list[str], method: str) -> None:
    head = RequestHead(method, "".join(pieces), "HTTP/1.1", [])

    def outcome(find: Callable[[RequestHead], Destination]) -> object:
        try:
            return find(head)
        except HttpError as exc:
            return exc.status, exc.detail

    assert outcome(request_destination) == outcome(destination_module._request_destination)
