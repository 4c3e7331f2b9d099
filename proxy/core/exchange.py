"""One client connection of the plain-HTTP forward proxy, as a state machine without I/O.

The conversation (``conversation``, in the HTTP modes) reads, feeds and acts; everything HTTP
about a connection is decided here: where a message head ends, how its body
is framed and where it ends, which interim responses are answered or dropped,
and whether the connection may carry another request (RFC 9112 §9.3).

Theory of operation. A connection goes round one cycle per request::

    IDLE ──read_request──▶ DECIDING ──forward──▶ SENDING ─(body done)─▶ WAITING
     ▲                        │                     (no body: straight to WAITING)
     │                        └── refused, or CONNECT: the listener closes or splices
     │
     └─ finish() keeps it ── RELAYING ◀──read_response── WAITING
                  (else CLOSED)

1. ``read_request(buf, closed)``: the next request head at the start of the
   client's bytes, and how many of them it spans (``None`` and 0: read more;
   ``None`` at a clean close: the connection ended). Bytes after the head are
   its body or the next, pipelined request: they stay with the caller until
   this request is done, so requests are served strictly one after another;
2. the caller decides (policy, the approval wait) and, to forward, calls
   ``forward(destination)``: the head to send upstream. ``interim`` is what
   the client hears first (``100 Continue`` when it asked for one: we answer
   the expectation ourselves, RFC 9110 §10.1.1, so a client never stalls
   waiting behind our relay), ``request_body`` the body's framer (None: no body);
3. ``read_response(buf, closed)``: the final response head at the start of
   the upstream's bytes; interim 1xx responses before it are consumed and
   dropped (we already answered any 100-continue), except 101, which is final.
   ``response_out`` is the head to send the client, ``response_body`` the
   body's framer (None: no body);
4. ``finish()`` once the response body is through: True when the client
   connection may carry another request. ``keep_upstream`` says whether the
   upstream connection may serve the client's next request.

A framer's ``feed(data)`` says how many leading bytes of ``data`` belong to
the body; the caller passes exactly those on and stops when ``done``
(``LengthBody``, ``ChunkedBody``, ``UntilClose``). Bodies are never
decoded or re-framed: what goes out is what came in.

Every ambiguity a peer could read differently from us (Content-Length with
Transfer-Encoding, differing Content-Lengths, bad chunk sizes, obs-fold, bare
CR) is refused by ``http1`` as ``HttpError``, raised from here: the status
says whose fault it is (4xx the client's, 502 the upstream's), the detail is
safe to show. No request smuggling, no response splitting.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import enum
from typing import Final

from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.forwarding import (
    asks_websocket,
    forward_request_head,
    forward_response_head,
    names_websocket,
)
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

CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
# The detail of the HttpError for a peer that closed half-way through a head.
CLOSED_IN_HEAD: Final = "connection closed inside a message head"


class LengthBody:
    """A body of exactly ``left`` more bytes (Content-Length)."""

    __slots__ = ("left", "done")
    # Feeding never fails: bytes may be passed on as they arrive, from the transport's callbacks.
    passes_on = True
    ends_at_close = False

    def __init__(self, length: int) -> None:
        self.left = length
        self.done = not length  # kept up to date by feed: read once per chunk relayed

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """How many leading bytes of ``data`` belong to the body."""
        n = min(self.left, len(data))
        self.left -= n
        self.done = not self.left
        return n


class UntilClose:
    """A response body that runs until the upstream closes (RFC 9112 §6.3 item 8)."""

    __slots__ = ()
    passes_on = False
    ends_at_close = True
    done = False

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        return len(data)


class ChunkedBody(ChunkedScanner):
    """A chunked body (``http1.ChunkedScanner``), as a framer: it ends with its last chunk."""

    __slots__ = ()
    # A feed can fail, so bytes are fed from a buffer, never from the transport's callbacks;
    # and the body ends with its last chunk, never at a close.
    passes_on = False
    ends_at_close = False


# What ``request_body`` and ``response_body`` hold: the three framings of RFC 9112 §6.3.
Framer = LengthBody | ChunkedBody | UntilClose


def _framer(kind: BodyKind, length: int, error_status: int) -> Framer | None:
    # Callers test for the two common kinds (no body, a length) inline: one call less per message.
    if kind is _LENGTH:
        return LengthBody(length)
    if kind is _CHUNKED:
        return ChunkedBody(error_status=error_status)
    if kind is _UNTIL_CLOSE:
        return UntilClose()
    return None


# The kinds, as module constants: an Enum member's lookup on its class costs ten times a global's.
_NO_BODY: Final = BodyKind.NONE
_LENGTH: Final = BodyKind.LENGTH
_CHUNKED: Final = BodyKind.CHUNKED
_UNTIL_CLOSE: Final = BodyKind.UNTIL_CLOSE


class State(enum.Enum):
    """Where a connection is in its request cycle (see the module's docstring)."""

    IDLE = "idle"  # waiting for a request head
    DECIDING = "deciding"  # a head is in; the listener decides and dials
    SENDING = "sending"  # the request body goes upstream
    WAITING = "waiting"  # for the response head
    RELAYING = "relaying"  # the response body goes to the client
    CLOSED = "closed"  # the connection carries no more requests


class ExchangeError(RuntimeError):
    """A call out of turn: the caller's bug, never a peer's."""


# The states the methods check on every request, as module constants (each check is inline: no call).
_IDLE: Final = State.IDLE
_DECIDING: Final = State.DECIDING
_SENDING: Final = State.SENDING
_WAITING: Final = State.WAITING
_RELAYING: Final = State.RELAYING
_CLOSED: Final = State.CLOSED


class Exchange:
    """One client connection, request after request; the module's docstring says how to drive it."""

    __slots__ = (
        "max_head_bytes",
        "state",
        "request",
        "interim",
        "request_body",
        "response",
        "response_out",
        "response_body",
        "keep_client",
        "keep_upstream",
        "upgrade",
        "upgraded",
    )

    def __init__(self, max_head_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self.state = _IDLE
        self.request: RequestHead | None = None
        self.interim = b""
        self.request_body: Framer | None = None
        self.response: ResponseHead | None = None
        self.response_out = b""
        self.response_body: Framer | None = None
        self.keep_client = False
        self.keep_upstream = False
        self.upgrade = False  # the request asks for a WebSocket upgrade, and is forwarded asking for it
        self.upgraded = False  # the origin switched (101): the connection carries WebSocket both ways now

    def _out_of_turn(self, state: State) -> ExchangeError:
        return ExchangeError(f"{self.state.value}, not {state.value}")

    # -- the client's side -------------------------------------------------------

    def read_request(self, buf: bytes | bytearray, closed: bool) -> tuple[RequestHead | None, int]:
        """The request head at the start of ``buf`` and the bytes it spans; (None, 0) to read more.

        ``closed``: nothing more will come; then (None, 0) is the clean end of
        the connection, and a head cut short is HttpError(400). Malformed or
        ambiguous heads are HttpError (400, 431, 501, 505).
        """
        if self.state is not _IDLE:
            raise self._out_of_turn(_IDLE)
        parsed = parse_request_head(buf, self.max_head_bytes) if buf else None
        if parsed is None:
            if closed:
                if buf:
                    raise HttpError(400, CLOSED_IN_HEAD)
                self.state = _CLOSED
            return None, 0
        self.request = parsed[0]
        self.state = _DECIDING
        return parsed

    def forward(self, destination: Destination) -> bytes:
        """The request is to go to ``destination``: the head to send upstream.

        Sets ``interim`` (bytes for the client before anything else) and
        ``request_body`` (None: the request has no body). An ``Expect:
        100-continue`` is answered here and not forwarded.
        """
        if self.state is not _DECIDING:
            raise self._out_of_turn(_DECIDING)
        head = self.request
        assert head is not None
        self.interim = b""
        lowered = head.lowered
        if lowered is None or "\nexpect:" in lowered:  # no scan of the fields when the parse saw none
            expects = head.get_all("Expect")
            if expects and any(value.lower() == "100-continue" for value in expects):
                head.headers = [(k, v) for k, v in head.headers if k.lower() != "expect"]
                head.lowered = None
                self.interim = CONTINUE
        kind, length = request_body_kind(head)
        body = self.request_body = None if kind is _NO_BODY else _framer(kind, length, 400)
        self.state = _SENDING if body is not None else _WAITING
        # A WebSocket upgrade (RFC 6455 §4.1: a GET with no body) goes on as one; any other Upgrade is dropped.
        upgrade = self.upgrade = (
            (lowered is None or "\nupgrade:" in lowered) and body is None and asks_websocket(head)
        )
        return forward_request_head(head, destination, upgrade)

    # -- the upstream's side ---------------------------------------------------

    def read_response(self, buf: bytes | bytearray, closed: bool) -> tuple[ResponseHead | None, int]:
        """The final response head at the start of ``buf`` and the bytes used; (None, n) to read more.

        Interim (1xx but 101) responses are consumed and dropped: ``n`` counts
        them. ``closed``: nothing more will come; then (None, n) means the
        upstream closed without a response, and a head cut short is
        HttpError(400). Malformed heads and bodies are HttpError(502).
        Sets ``response_out`` (the head for the client), ``response_body``,
        ``keep_client`` and ``keep_upstream``.
        """
        if self.state is not _WAITING:
            body = self.request_body
            if self.state is not _SENDING or body is None or not body.done:
                raise self._out_of_turn(_WAITING)
            self.state = _WAITING  # the request body is through
        used = 0
        while True:
            rest = buf[used:] if used else buf
            parsed = parse_response_head(rest, self.max_head_bytes) if rest else None
            if parsed is None:
                if closed and rest:
                    raise HttpError(400, CLOSED_IN_HEAD)
                return None, used
            response, n = parsed
            used += n
            if not 100 <= response.status < 200 or response.status == 101:
                break
        request = self.request
        assert request is not None
        if response.status == 101:
            return self._switched(response), used
        kind, length = response_body_kind(response, request.method)
        # ``keep_alive`` as the parse knew it (``persists``), else asked: a property's call less per message.
        persists = request.persists
        keep_client = (request.keep_alive if persists is None else persists) and kind is not _UNTIL_CLOSE
        self.response = response
        self.response_out = forward_response_head(response, keep_client)
        self.response_body = LengthBody(length) if kind is _LENGTH else _framer(kind, length, 502)
        self.keep_client = keep_client
        persists = response.persists
        self.keep_upstream = (
            keep_client and (response.keep_alive if persists is None else persists) and response.status != 101
        )
        self.state = _RELAYING
        return response, used

    def _switched(self, response: ResponseHead) -> ResponseHead:
        """A 101: the WebSocket upgrade the request asked for, and nothing else (HttpError 502)."""
        if not self.upgrade or not names_websocket(response.get_all("Upgrade")):
            raise HttpError(502, "a 101 Switching Protocols to what the request did not ask for")
        self.response = response
        self.response_out = forward_response_head(response, False, upgrade=True)
        self.response_body = None
        self.keep_client = self.keep_upstream = False
        self.upgraded = True
        self.state = _RELAYING
        return response

    def finish(self) -> bool:
        """The response is through: True when the client connection may carry another request."""
        if self.state is not _RELAYING:
            raise self._out_of_turn(_RELAYING)
        keep = self.keep_client
        self.state = _IDLE if keep else _CLOSED
        self.request = self.response = None
        self.request_body = self.response_body = None
        self.upgrade = self.upgraded = False
        return keep

