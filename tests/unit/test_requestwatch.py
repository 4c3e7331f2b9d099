"""The pure watch over a tunnel's plain HTTP: which bytes go on, which host each request names, and when
the stream is another protocol (``requestwatch.RequestWatch``), driven as the tunnel drives it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.requestwatch import OtherHost, RequestWatch

HOST, PORT = "origin.test", 8080


def watch() -> RequestWatch:
    return RequestWatch(HOST, PORT, 64 * 1024)


def run(w: RequestWatch, pieces: list[bytes]) -> tuple[bytes, bytes | None]:
    """Feed ``pieces`` as a tunnel would (held bytes shown, ``ready`` taken); (what went on, None or what
    was left when the watch ended: the rest then goes on unwatched)."""
    held = bytearray()
    out = bytearray()
    for piece in pieces:
        held += piece
        ready = w.client(held)
        if ready is None:
            return bytes(out), bytes(held)
        out += held[:ready]
        del held[:ready]
    return bytes(out), None


def get(host: str, target: str = "/") -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


@pytest.mark.parametrize(
    "host",
    ["origin.test", "ORIGIN.TEST", "origin.test.", f"origin.test:{PORT}", f"Origin.Test.:{PORT}"],
)
def test_the_tunnels_host_in_any_spelling_goes_on(host: str) -> None:
    assert run(watch(), [get(host)]) == (get(host), None)


def test_an_idna_host_is_compared_in_its_ascii_form() -> None:
    w = RequestWatch("xn--bcher-kva.test", 80, 1024)
    head = b"GET / HTTP/1.1\r\nHost: XN--BCHER-KVA.test.\r\n\r\n"
    assert w.client(head) == len(head)
    with pytest.raises(OtherHost):  # raw UTF-8 is no Host a client sends: not guessed at
        w.client("GET / HTTP/1.1\r\nHost: bücher.test\r\n\r\n".encode())


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (get("evil.test"), "evil.test"),
        (get("origin.test:80"), "origin.test:80"),
        (get("origin.test@evil.test"), "origin.test@evil.test"),
        (b"GET http://evil.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n", "evil.test"),
        (b"GET HTTPS://EVIL.TEST:8080/x HTTP/1.1\r\n\r\n", "evil.test"),
        (b"GET / HTTP/1.1\r\n\r\n", None),
    ],
    ids=["Host", "another port", "userinfo", "absolute-form", "absolute-form alone", "no Host"],
)
def test_a_request_naming_another_destination_is_refused(raw: bytes, named: str | None) -> None:
    with pytest.raises(OtherHost) as refused:
        watch().client(raw)
    assert refused.value.named == named


@pytest.mark.parametrize(
    "raw",
    [
        b"CONNECT origin.test:8080 HTTP/1.1\r\nHost: origin.test:8080\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET  / HTTP/1.1\r\nHost: origin.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: origin.test\r\nUpgrade: h2c\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: origin.test\r\nUpgrade: websocket, TLS/1.2\r\n\r\n",
        b"GET ftp://origin.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: origin.test\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"\r\n" * 5 + get("origin.test"),
    ],
    ids=["CONNECT", "h2 preface", "two spaces", "h2c", "TLS upgrade", "ftp", "CL and TE", "many empty lines"],
)
def test_what_cannot_be_checked_is_a_bad_request(raw: bytes) -> None:
    with pytest.raises(HttpError):
        watch().client(raw)


def test_every_request_on_the_connection_is_checked() -> None:
    w = watch()
    assert run(w, [get("origin.test"), get("origin.test", "/two")]) == (
        get("origin.test") + get("origin.test", "/two"),
        None,
    )
    with pytest.raises(OtherHost):
        w.client(get("evil.test"))


def test_a_pipelined_bad_request_stops_the_good_one_before_it() -> None:
    with pytest.raises(OtherHost):
        watch().client(get("origin.test") + get("evil.test"))


def test_a_head_inside_a_body_is_body() -> None:
    inner = get("evil.test")
    length = b"POST / HTTP/1.1\r\nHost: origin.test\r\nContent-Length: %d\r\n\r\n%s" % (len(inner), inner)
    chunked = b"POST / HTTP/1.1\r\nHost: origin.test\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(inner),
        inner,
    )
    stream = length + chunked + get("origin.test")
    assert run(watch(), [stream]) == (stream, None)


def test_an_unfinished_head_is_held() -> None:
    w = watch()
    held = bytearray(b"GET / HTTP/1.1\r\nHost: origin.test\r\n")
    assert w.client(held) == 0
    held += b"\r\n"
    assert w.client(held) == len(held)


@pytest.mark.parametrize(
    "first",
    [
        b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n",
        b"*1\r\n$4\r\nPING\r\n",
        b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
        b"\x17not tls",
        b"GET /\r\n",  # HTTP/0.9: no header fields, so no Host to front with
    ],
    ids=["ssh", "redis", "postgres", "binary", "http/0.9"],
)
def test_another_protocol_is_let_go_at_its_first_line(first: bytes) -> None:
    assert run(watch(), [first, get("evil.test")]) == (b"", first)


def test_a_first_line_without_its_end_goes_on_and_is_still_read() -> None:
    w = watch()
    assert run(w, [b"x" * 64]) == (b"x" * 64, None)  # the bench's echo is not held up
    with pytest.raises(OtherHost):
        w.client(b" / HTTP/1.1\r\nHost: evil.test\r\n\r\n")  # the line was a request line after all


def test_a_first_line_is_held_from_its_first_space() -> None:
    w = watch()
    assert run(w, [b"GET", b" http://evil.test/", b" HTTP/1.1\r"]) == (b"GET", None)  # the target never went
    with pytest.raises(OtherHost):
        w.client(b" http://evil.test/ HTTP/1.1\r\n\r\n")


def test_a_first_line_as_long_as_a_head_may_be_is_refused() -> None:
    w = RequestWatch(HOST, PORT, 100)
    assert w.client(b"G" * 60) == 60
    with pytest.raises(HttpError):
        w.client(b"G" * 60)


WS = b"GET /ws HTTP/1.1\r\nHost: origin.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


def test_a_websocket_upgrade_holds_until_101_then_the_watch_is_over() -> None:
    w = watch()
    held = bytearray(WS + b"\x81\x02hi")
    assert w.client(held) == len(WS)
    del held[: len(WS)]
    assert w.client(held) == 0  # held: WebSocket frames or requests, the upstream's answer says
    assert w.switching
    assert not w.upstream(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 101 Swi")
    assert w.upstream(b"tching Protocols\r\nUpgrade: websocket\r\n\r\n")
    assert w.client(held) is None


def test_an_upgrade_refused_by_the_upstream_means_requests_again() -> None:
    w = watch()
    assert w.client(WS) == len(WS)
    held = bytearray(get("evil.test"))
    assert w.client(held) == 0
    assert not w.upstream(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(OtherHost):
        w.client(held)


def test_an_upgrade_after_another_request_is_refused() -> None:
    w = watch()
    assert w.client(get("origin.test")) is not None
    assert not w.switching
    w.upstream_spoke = True  # as the shell marks it: that answer's body could say anything, "101" too
    with pytest.raises(HttpError):
        w.client(WS)


@given(st.lists(st.integers(1, 40), max_size=30))
def test_any_split_gives_the_same_bytes_and_the_same_refusal(sizes: list[int]) -> None:
    inner = get("evil.test")
    good = b"POST / HTTP/1.1\r\nHost: origin.test\r\nContent-Length: %d\r\n\r\n%s" % (len(inner), inner)
    stream = good + get("origin.test") + get("evil.test")
    pieces, at = [], 0
    for size in sizes:
        pieces.append(stream[at : at + size])
        at += size
    pieces.append(stream[at:])
    w = watch()
    held = bytearray()
    out = bytearray()
    with pytest.raises(OtherHost):
        for piece in pieces:
            held += piece
            ready = w.client(held)
            assert ready is not None
            out += held[:ready]
            del held[:ready]
    # What went on is a prefix of the good requests: never a byte of the bad one.
    assert (good + get("origin.test")).startswith(bytes(out))


@given(st.lists(st.binary(max_size=80), max_size=8), st.binary(max_size=60))
def test_garbage_is_a_count_none_or_our_own_refusal(pieces: list[bytes], answer: bytes) -> None:
    w = RequestWatch(HOST, PORT, 256)
    held = bytearray()
    try:
        for piece in pieces:
            held += piece
            ready = w.client(held)
            if ready is None:
                return
            assert 0 <= ready <= len(held)
            del held[:ready]
            if w.switching:
                w.upstream(answer)
    except (OtherHost, HttpError):
        pass
