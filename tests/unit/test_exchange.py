"""The connection state machine of the plain-HTTP proxy, without sockets.

Playbooks: a ``Wire`` feeds the exchange the bytes a client and an upstream
send, does what it says as the listener does (pass on exactly the bytes it
points at), and the tests assert what went where and what it decided.
"""

from __future__ import annotations

import ast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.proxy.core.exchange import (
    CLOSED_IN_HEAD,
    CONTINUE,
    ChunkedBody,
    Exchange,
    ExchangeError,
    LengthBody,
    State,
    UntilClose,
)
from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.heads import RequestHead, ResponseHead
from egressd.proxy.core.http1.syntax import HttpError
from tests import REPO

LIMIT = 64 * 1024
ORIGIN = Destination("http", "example.com", 80, "/")


class Wire:
    """One client connection and its upstream, as byte strings: the listener without I/O."""

    def __init__(self, max_head_bytes: int = LIMIT) -> None:
        self.exchange = Exchange(max_head_bytes)
        self.from_client = bytearray()  # received, not yet consumed
        self.from_upstream = bytearray()
        self.to_upstream = bytearray()  # what we sent on
        self.to_client = bytearray()

    def client_sends(self, data: bytes, *, closed: bool = False) -> RequestHead | None:
        self.from_client += data
        head, used = self.exchange.read_request(self.from_client, closed)
        del self.from_client[:used]
        return head

    def forward(self, destination: Destination = ORIGIN) -> bytes:
        out = self.exchange.forward(destination)
        self.to_client += self.exchange.interim
        self.to_upstream += out
        return out

    def request_body(self, data: bytes = b"") -> bool:
        """Pass on what of ``data`` (after anything held) is the request body; True once it is through."""
        body = self.exchange.request_body
        assert body is not None
        self.from_client += data
        n = body.feed(self.from_client)
        self.to_upstream += self.from_client[:n]
        del self.from_client[:n]
        return body.done

    def upstream_sends(self, data: bytes, *, closed: bool = False) -> ResponseHead | None:
        self.from_upstream += data
        response, used = self.exchange.read_response(self.from_upstream, closed)
        del self.from_upstream[:used]
        if response is not None:
            self.to_client += self.exchange.response_out
        return response

    def response_body(self, data: bytes = b"") -> bool:
        body = self.exchange.response_body
        assert body is not None
        self.from_upstream += data
        n = body.feed(self.from_upstream)
        self.to_client += self.from_upstream[:n]
        del self.from_upstream[:n]
        return body.done


def get(target: str = "http://example.com/", extra: str = "", version: str = "HTTP/1.1") -> bytes:
    return f"GET {target} {version}\r\nHost: example.com\r\n{extra}\r\n".encode()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


# --- one request, start to end ---------------------------------------------------


def test_a_get_goes_round_the_cycle_and_the_connection_stays_open() -> None:
    wire = Wire()
    assert wire.exchange.state is State.IDLE
    assert wire.client_sends(b"GET http://exam") is None  # read more
    head = wire.client_sends(b"ple.com/a?b HTTP/1.1\r\nHost: example.com\r\n\r\n")
    assert head is not None and head.target == "http://example.com/a?b"
    assert wire.exchange.state is State.DECIDING
    out = wire.forward(Destination("http", "example.com", 80, "/a?b"))
    assert out == b"GET /a?b HTTP/1.1\r\nHost: example.com\r\nConnection: keep-alive\r\n\r\n"
    assert wire.exchange.request_body is None and wire.exchange.interim == b""
    assert wire.exchange.state is State.WAITING
    response = wire.upstream_sends(OK)
    assert response is not None and response.status == 200
    assert isinstance(wire.exchange.response_body, LengthBody)
    assert wire.response_body()
    assert wire.to_client == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
    assert wire.exchange.keep_upstream
    assert wire.exchange.finish() is True
    assert wire.exchange.state is State.IDLE


def test_a_clean_close_between_requests_ends_the_connection() -> None:
    wire = Wire()
    assert wire.client_sends(b"", closed=True) is None
    assert wire.exchange.state is State.CLOSED


def test_a_close_inside_a_request_head_is_the_clients_fault() -> None:
    wire = Wire()
    assert wire.client_sends(b"GET http://example.com/ HTTP/1.1\r\n") is None
    with pytest.raises(HttpError) as caught:
        wire.client_sends(b"Host: x", closed=True)
    assert (caught.value.status, caught.value.detail) == (400, CLOSED_IN_HEAD)


def test_a_request_and_its_close_in_one_read_is_still_served() -> None:
    wire = Wire()
    assert wire.client_sends(get(), closed=True) is not None


def test_an_upstream_that_closes_without_answering_gives_no_response() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    assert wire.upstream_sends(b"", closed=True) is None


def test_an_upstream_that_closes_inside_a_response_head_is_an_error() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    with pytest.raises(HttpError, match=CLOSED_IN_HEAD):
        wire.upstream_sends(b"HTTP/1.1 200 OK\r\n", closed=True)


def test_calls_out_of_turn_are_the_callers_bug() -> None:
    wire = Wire()
    with pytest.raises(ExchangeError):
        wire.exchange.forward(ORIGIN)
    with pytest.raises(ExchangeError):
        wire.exchange.read_response(OK, False)
    with pytest.raises(ExchangeError):
        wire.exchange.finish()
    wire.client_sends(get())
    with pytest.raises(ExchangeError):
        wire.exchange.read_request(get(), False)


# --- bodies --------------------------------------------------------------------


def test_a_request_body_is_passed_on_to_its_last_byte_and_no_further() -> None:
    wire = Wire()
    post = b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nContent-Length: 5\r\n\r\n"
    wire.client_sends(post + b"hel")
    wire.forward()
    assert wire.exchange.state is State.SENDING
    assert not wire.request_body()
    assert wire.request_body(b"lo" + get())  # the next request arrived with the body's end
    assert wire.to_upstream.endswith(b"\r\n\r\nhello")
    assert bytes(wire.from_client) == get()  # untouched: the next request's
    assert wire.upstream_sends(OK) is not None
    assert wire.exchange.state is State.RELAYING


def test_a_response_before_the_request_body_is_through_is_out_of_turn() -> None:
    wire = Wire()
    wire.client_sends(b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nContent-Length: 5\r\n\r\n")
    wire.forward()
    with pytest.raises(ExchangeError):
        wire.exchange.read_response(OK, False)


CHUNKED_BODY = b"5;ext=1\r\nhello\r\n0\r\nTrailer: x\r\n\r\n"


@given(cuts=st.lists(st.integers(min_value=0, max_value=len(CHUNKED_BODY)), max_size=6))
def test_a_chunked_body_goes_on_unchanged_however_it_is_cut(cuts: list[int]) -> None:
    wire = Wire()
    wire.client_sends(b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nTransfer-Encoding: chunked\r\n\r\n")
    wire.forward()
    assert isinstance(wire.exchange.request_body, ChunkedBody)
    data = CHUNKED_BODY + get()
    start = 0
    for cut in sorted(cuts):
        assert wire.request_body(data[start:cut]) is (cut == len(CHUNKED_BODY))
        start = cut
    assert wire.request_body(data[start:])
    assert wire.to_upstream.endswith(CHUNKED_BODY)
    assert bytes(wire.from_client) == get()


def test_a_response_without_framing_runs_until_close_and_closes_the_client() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    wire.upstream_sends(b"HTTP/1.1 200 OK\r\n\r\npartial")
    assert isinstance(wire.exchange.response_body, UntilClose)
    assert b"Connection: close\r\n" in wire.to_client
    assert not wire.response_body()
    assert wire.to_client.endswith(b"partial")
    assert not wire.exchange.keep_client and not wire.exchange.keep_upstream
    assert wire.exchange.finish() is False
    assert wire.exchange.state is State.CLOSED


@pytest.mark.parametrize(
    ("framer", "passes_on", "ends_at_close"),
    [
        pytest.param(LengthBody(3), True, False, id="Content-Length: a close cuts it short"),
        pytest.param(ChunkedBody(), False, False, id="chunked: a close cuts it short, a feed may fail"),
        pytest.param(UntilClose(), False, True, id="until close: the close is its end"),
    ],
)
def test_what_a_close_means_to_each_framing(
    framer: LengthBody | ChunkedBody | UntilClose, passes_on: bool, ends_at_close: bool
) -> None:
    # The relay (stream.relay_body) acts on these: what it may pass on from the
    # transport's callbacks, and whether the peer's FIN ends the body or cuts it short.
    assert (framer.passes_on, framer.ends_at_close) == (passes_on, ends_at_close)
    assert not framer.done


@pytest.mark.parametrize(
    ("method", "status_line"),
    [
        pytest.param("HEAD", b"HTTP/1.1 200 OK", id="a response to HEAD"),
        pytest.param("GET", b"HTTP/1.1 204 No Content", id="204"),
        pytest.param("GET", b"HTTP/1.1 304 Not Modified", id="304"),
    ],
)
def test_responses_without_a_body_have_no_body_whatever_they_say(method: str, status_line: bytes) -> None:
    wire = Wire()
    wire.client_sends(f"{method} http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n".encode())
    wire.forward()
    wire.upstream_sends(status_line + b"\r\nContent-Length: 10\r\n\r\n")
    assert wire.exchange.response_body is None
    assert wire.exchange.finish() is True


# --- pipelining -------------------------------------------------------------------


def test_pipelined_requests_are_served_one_after_another() -> None:
    wire = Wire()
    first = wire.client_sends(get("http://example.com/1") + get("http://example.com/2"))
    assert first is not None and first.target == "http://example.com/1"
    assert bytes(wire.from_client) == get("http://example.com/2")  # waits its turn
    wire.forward()
    wire.upstream_sends(OK)
    wire.response_body()
    assert wire.exchange.finish()
    second = wire.client_sends(b"")
    assert second is not None and second.target == "http://example.com/2"
    assert not wire.from_client


def test_a_pipelined_request_after_a_body_waits_for_the_response() -> None:
    wire = Wire()
    post = b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nContent-Length: 2\r\n\r\nhi"
    assert wire.client_sends(post + get("http://example.com/next")) is not None
    wire.forward()
    assert wire.request_body()
    with pytest.raises(ExchangeError):
        wire.exchange.read_request(wire.from_client, False)  # not before this request's response is through
    wire.upstream_sends(OK)
    assert wire.response_body() and wire.exchange.finish()
    second = wire.client_sends(b"")
    assert second is not None and second.target == "http://example.com/next"


def test_a_response_head_and_the_next_ones_bytes_are_told_apart() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    wire.upstream_sends(OK + b"HTTP/1.1 200 OK")
    assert wire.response_body()
    assert bytes(wire.from_upstream) == b"HTTP/1.1 200 OK"  # unrequested: the listener will not reuse this upstream


# --- 100-continue and interim responses -------------------------------------------


def test_expect_100_continue_is_answered_here_and_not_forwarded() -> None:
    wire = Wire()
    wire.client_sends(
        b"PUT http://example.com/ HTTP/1.1\r\nHost: example.com\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n"
    )
    out = wire.forward()
    assert wire.exchange.interim == CONTINUE
    assert bytes(wire.to_client) == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert b"expect" not in out.lower()
    assert wire.request_body(b"hi")


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"PUT http://example.com/ HTTP/1.1\r\nEXPECT: 100-continue\r\nContent-Length: 2\r\n\r\n",
                     id="the name in capitals"),
        pytest.param(b"PUT http://example.com/ HTTP/1.1\nExpect: 100-continue\nContent-Length: 2\n\n",
                     id="bare LF line ends (the general parser's head)"),
    ],
)  # fmt: skip
def test_expect_100_continue_is_found_however_the_head_was_parsed(raw: bytes) -> None:
    wire = Wire()
    wire.client_sends(raw)
    out = wire.forward()
    assert wire.exchange.interim == CONTINUE
    assert b"expect" not in out.lower()
    assert wire.request_body(b"hi")


def test_the_client_hears_one_100_continue_even_when_the_origin_sends_its_own() -> None:
    wire = Wire()
    wire.client_sends(
        b"PUT http://example.com/ HTTP/1.1\r\nHost: example.com\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    wire.forward()
    assert wire.request_body(b"hi")
    assert wire.upstream_sends(b"HTTP/1.1 100 Continue\r\n\r\n" + OK) is not None
    assert wire.response_body()
    assert bytes(wire.to_client).count(b"100 Continue") == 1
    assert wire.to_client.startswith(CONTINUE + b"HTTP/1.1 200 OK\r\n")


def test_another_expectation_is_forwarded_and_not_answered() -> None:
    wire = Wire()
    wire.client_sends(get(extra="Expect: something-else\r\n"))
    out = wire.forward()
    assert wire.exchange.interim == b""
    assert b"Expect: something-else\r\n" in out


def test_interim_responses_are_dropped_and_the_final_one_relayed() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    assert wire.upstream_sends(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n") is None
    assert not wire.from_upstream  # consumed, and nothing for the client
    assert not wire.to_client
    response = wire.upstream_sends(OK)
    assert response is not None and response.status == 200
    assert wire.to_client.startswith(b"HTTP/1.1 200 OK\r\n")


def test_interim_and_final_responses_in_one_read() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    response = wire.upstream_sends(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    assert response is not None and response.status == 200
    assert bytes(wire.from_upstream) == b"ok"


def test_101_is_final_and_the_upstream_is_not_kept() -> None:
    wire = Wire()
    wire.client_sends(get(extra="Connection: upgrade\r\nUpgrade: websocket\r\n"))
    wire.forward()
    response = wire.upstream_sends(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n")
    assert response is not None and response.status == 101
    assert wire.exchange.response_body is None
    assert not wire.exchange.keep_upstream


def test_a_websocket_upgrade_goes_on_asking_for_it_and_its_101_switches() -> None:
    wire = Wire()
    wire.client_sends(get(extra="Connection: keep-alive, Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: k\r\n"))
    out = wire.forward()
    assert out.endswith(b"Sec-WebSocket-Key: k\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"), out
    response = wire.upstream_sends(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: a\r\n\r\n"
    )
    assert response is not None and response.status == 101 and wire.exchange.upgraded
    switched = b"Sec-WebSocket-Accept: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    assert wire.exchange.response_out.endswith(switched)
    assert not wire.exchange.keep_upstream and not wire.exchange.finish()


@pytest.mark.parametrize(
    "extra",
    [
        "Connection: Upgrade\r\nUpgrade: h2c\r\n",  # another protocol: the field is dropped
        "Upgrade: websocket\r\n",  # Connection does not name it: not an upgrade
    ],
)
def test_other_upgrades_are_not_forwarded_and_a_101_nobody_asked_for_is_refused(extra: str) -> None:
    wire = Wire()
    wire.client_sends(get(extra=extra))
    out = wire.forward()
    assert b"upgrade:" not in out.lower() and out.endswith(b"Connection: keep-alive\r\n\r\n"), out
    with pytest.raises(HttpError) as refused:
        wire.upstream_sends(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n")
    assert refused.value.status == 502


def test_a_post_asking_for_a_websocket_is_not_upgraded() -> None:
    wire = Wire()
    wire.client_sends(
        b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nContent-Length: 0\r\n\r\n"
    )
    assert b"upgrade" not in wire.forward().lower()


# --- keep-alive ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "request_fields", "response", "keep_client", "keep_upstream"),
    [
        pytest.param("HTTP/1.1", "", OK, True, True, id="1.1 persists"),
        pytest.param("HTTP/1.1", "Connection: close\r\n", OK, False, False, id="the client says close"),
        pytest.param("HTTP/1.0", "", OK, False, False, id="1.0 does not persist"),
        pytest.param("HTTP/1.0", "Connection: keep-alive\r\n", OK, True, True, id="1.0 asking for keep-alive"),
        pytest.param(
            "HTTP/1.1",
            "",
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
            True,
            False,
            id="the upstream says close: the client stays",
        ),
        pytest.param(
            "HTTP/1.1", "", b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", True, False, id="a 1.0 upstream"
        ),
        pytest.param("HTTP/1.1", "", b"HTTP/1.1 200 OK\r\n\r\nok", False, False, id="read until close"),
    ],
)
def test_who_stays_open(
    version: str, request_fields: str, response: bytes, keep_client: bool, keep_upstream: bool
) -> None:
    wire = Wire()
    wire.client_sends(get(extra=request_fields, version=version))
    wire.forward()
    wire.upstream_sends(response)
    assert (wire.exchange.keep_client, wire.exchange.keep_upstream) == (keep_client, keep_upstream)
    connection = b"Connection: keep-alive\r\n" if keep_client else b"Connection: close\r\n"
    assert connection in wire.to_client
    assert wire.exchange.finish() is keep_client


# --- smuggling and splitting ----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        pytest.param("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, id="CL and TE"),
        pytest.param("Content-Length: 5\r\nContent-Length: 6\r\n", 400, id="differing Content-Lengths"),
        pytest.param("Content-Length: 5, 6\r\n", 400, id="differing Content-Lengths in one field"),
        pytest.param("Content-Length: +5\r\n", 400, id="a signed Content-Length"),
        pytest.param("Transfer-Encoding: chunked, identity\r\n", 400, id="chunked not last"),
        pytest.param("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 400, id="chunked twice"),
        pytest.param("Transfer-Encoding: xchunked\r\n", 400, id="an unknown final coding"),
        pytest.param("X-A: 1\r\n folded\r\n", 400, id="obs-fold"),
        pytest.param("Content-Length : 5\r\n", 400, id="space before the colon"),
        pytest.param("X-A: 1\rContent-Length: 5\r\n", 400, id="bare CR"),
    ],
)
def test_ambiguous_request_framing_is_refused_before_anything_is_decided(fields: str, status: int) -> None:
    wire = Wire()
    with pytest.raises(HttpError) as caught:
        wire.client_sends(f"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\n{fields}\r\n".encode())
    assert caught.value.status == status
    assert wire.exchange.state is State.IDLE and not wire.to_upstream


def test_identical_content_lengths_go_on_as_one() -> None:
    wire = Wire()
    wire.client_sends(
        b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n"
    )
    out = wire.forward()
    assert out.count(b"Content-Length") == 1
    assert wire.request_body(b"hi")


def test_a_head_with_bare_lf_line_ends_is_read_as_one_head() -> None:
    # RFC 9112 §2.2 lets a recipient take a bare LF as a line end in a head; the head we send on uses CRLF.
    wire = Wire()
    head = wire.client_sends(b"GET http://example.com/ HTTP/1.1\nHost: example.com\nX-A: 1\n\n")
    assert head is not None and head.get("X-A") == "1"
    assert b"\n" not in wire.forward().replace(b"\r\n", b"")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"-1\r\n", id="a negative size"),
        pytest.param(b"0x5\r\nhello\r\n0\r\n\r\n", id="a 0x prefix"),
        pytest.param(b"5 5\r\n", id="two sizes"),
        pytest.param(b" 5\r\n", id="space before the size"),
        pytest.param(b"1" * 17 + b"\r\n", id="a size past 64 bits"),
        pytest.param(b"\r\n", id="no size"),
        pytest.param(b"5\nhello\r\n0\r\n\r\n", id="a bare LF after the size"),
        pytest.param(b"5\r\nhelloX\r\n", id="data longer than its size"),
        pytest.param(b"0\r\nBad Trailer\r\n\r\n", id="a malformed trailer"),
    ],
)
def test_bad_chunked_framing_is_the_clients_fault_and_stops_the_body(body: bytes) -> None:
    wire = Wire()
    wire.client_sends(b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nTransfer-Encoding: chunked\r\n\r\n")
    wire.forward()
    sent = bytes(wire.to_upstream)
    with pytest.raises(HttpError) as caught:
        wire.request_body(body)
    assert caught.value.status == 400
    assert bytes(wire.to_upstream) == sent  # nothing of the fed bytes went on


def test_a_smuggled_request_after_a_chunked_body_stays_a_request_of_its_own() -> None:
    wire = Wire()
    wire.client_sends(b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nTransfer-Encoding: chunked\r\n\r\n")
    wire.forward()
    smuggled = b"GET http://evil.example/ HTTP/1.1\r\nHost: evil.example\r\n\r\n"
    assert wire.request_body(b"0\r\n\r\n" + smuggled)
    assert not wire.to_upstream.endswith(smuggled)
    assert bytes(wire.from_client) == smuggled  # read next, as a request of its own, and decided on its own


@pytest.mark.parametrize(
    "response",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", id="CL and TE"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n", id="differing CLs"),
        pytest.param(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\n\r\n", id="obs-fold"),
        pytest.param(b"HTTP/1.1 2000 OK\r\n\r\n", id="a bad status"),
        pytest.param(b"HTTP/2 200 OK\r\n\r\n", id="another version"),
    ],
)
def test_ambiguous_responses_are_the_upstreams_fault(response: bytes) -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    with pytest.raises(HttpError) as caught:
        wire.upstream_sends(response)
    assert caught.value.status == 502
    assert not wire.to_client


def test_a_bad_chunk_from_upstream_is_the_upstreams_fault() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    wire.upstream_sends(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(HttpError) as caught:
        wire.response_body(b"zz\r\n")
    assert caught.value.status == 502


def test_an_origins_x_egress_fields_never_reach_the_client() -> None:
    wire = Wire()
    wire.client_sends(get())
    wire.forward()
    wire.upstream_sends(b"HTTP/1.1 200 OK\r\nX-Egress-Decision: allow\r\nContent-Length: 0\r\n\r\n")
    assert b"x-egress" not in wire.to_client.lower()


# --- the room it lives in -------------------------------------------------------------


def test_the_exchange_is_pure() -> None:
    """No asyncio, socket, clock or environment: only the HTTP/1 parser, names and the standard library's types."""
    core = REPO / "proxy" / "core"
    for path in (core / "exchange.py", *sorted((core / "http1").glob("*.py"))):
        name = str(path.relative_to(core))
        tree = ast.parse(path.read_text())
        imported = {
            alias.name if isinstance(node, ast.Import) else (node.module or "")
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        ours = {module for module in imported if module.startswith("egressd.")}
        assert {module.split(".")[0] for module in imported - ours} <= {
            "__future__", "enum", "re", "dataclasses", "operator", "typing"}, name
        # names: the pure bottom layer (http1 parses its authorities with egressd.names.authority).
        assert all(module.startswith(("egressd.proxy.core.http1.", "egressd.names.")) for module in ours), name
