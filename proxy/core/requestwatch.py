"""A tunnel's plain HTTP/1 requests, each checked against the tunnel's host, without I/O.

A CONNECT (or SOCKS) tunnel to an allowed ``host:port`` that carries plain
HTTP could name another host in each request (``Host: evil.test``, or an
absolute-form target), and an origin that routes by Host (a CDN) would serve
another of its tenants: domain fronting without TLS. The network shell
(``egressd.proxy.net.tunnelcheck.SniCheck``) shows ``RequestWatch`` the client's held bytes, once
they are known not to be TLS, and relays only what it lets go:

1. the first line (leading empty lines skipped, RFC 9112 §2.2) says whether
   the stream is HTTP: a line that names an HTTP version (``HTTP/``, in any
   case) is; a line without one, or a byte no request line holds (a control
   other than HTAB and CR), is another protocol and is relayed unwatched
   (None). Until its line feed comes, the line is held once it holds a
   space (a method and what follows it); before that its one word goes on
   as it arrives (a word with no line end is no request to any server, and
   a protocol that sends a word and waits, as the bench's echo does, is not
   stalled). A first line longer than the head limit is refused;
2. then every request head, strictly parsed (``http1``: one framing, no
   smuggling), must name the tunnel's host and port: its Host and its
   absolute-form target's authority alike, normalised as the policy does
   (case, one trailing dot, IDNA; no port means the tunnel's). A request
   with neither, CONNECT (a tunnel the policy never saw) or a head that
   does not parse is refused; no byte of it goes on;
3. each body is framed (``LengthBody``, ``ChunkedBody``) and relayed as it
   comes, so a head inside a body is body;
4. an upgrade is followed only to WebSocket and only on the tunnel's first
   request, before the upstream said anything: the client's next bytes are
   held until the upstream's first final response (read from its first
   byte, so no earlier response's body can fake one). 101 ends the watch
   (WebSocket frames follow); any other status: requests again. Any other
   protocol (``h2c``, TLS) would carry names this cannot read, so it is
   refused.

Refusals are exceptions: ``OtherHost`` (``sni_mismatch``) and ``HttpError``
(``bad_request``; 431 ``limit_exceeded``).

Hot in step 1 only: every tunnel that is not TLS runs it (bench/instructions.py's
tunnels, a 64-byte word), so a first chunk of letters and digits is told in C
(``isalnum``) and what only an upgrade or a body needs is set when needed.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import enum
from typing import Final

from egressd.names.authority import Colons, parse_authority
from egressd.names.hosts import HostError, normalise_host, normalised
from egressd.proxy.core.exchange import ChunkedBody, LengthBody
from egressd.proxy.core.http1.framing import BodyKind
from egressd.proxy.core.http1.heads import RequestHead, parse_request_head, parse_response_head, request_body_kind
from egressd.proxy.core.http1.syntax import HttpError

# Every byte a request line may hold to a lenient server: printable ASCII, obs-text, HTAB and the CR
# before its LF. Any other byte in the first line says this is not HTTP.
_LINE_BYTES: Final = bytes(b for b in range(256) if b in (0x09, 0x0D) or 0x20 <= b != 0x7F)
# The schemes an absolute-form target may carry to an origin (RFC 9112 §3.2.2); any other is refused.
_SCHEMES: Final = frozenset({"http", "https"})
_CRLF: Final = b"\r\n"


class OtherHost(Exception):
    """A request names another destination than the tunnel's: ``named`` is what it named (None: nothing)."""

    def __init__(self, named: str | None, detail: str) -> None:
        super().__init__(detail)
        self.named = named
        self.detail = detail


class _State(enum.Enum):
    FIRST_LINE = "first line"  # not yet known to be HTTP
    HEAD = "head"  # a request head starts at the held bytes
    BODY = "body"  # a request body is being relayed
    SWITCHING = "switching"  # after an upgrade request: held until the upstream's answer
    OVER = "over"  # switched to WebSocket: nothing more to watch


_FIRST_LINE: Final = _State.FIRST_LINE
_HEAD: Final = _State.HEAD
_BODY: Final = _State.BODY
_SWITCHING: Final = _State.SWITCHING
_OVER: Final = _State.OVER


class RequestWatch:
    """The requests of one tunnel to ``host`` (normalised) and ``port``; the module docstring's steps."""

    __slots__ = (
        "host",
        "port",
        "max_head_bytes",
        "switching",
        "upstream_spoke",
        "_state",
        "_sent",
        "_body",
        "_upgrade",
        "_requests",
        "_response",
    )

    def __init__(self, host: str, port: int, max_head_bytes: int) -> None:
        self.host = host
        self.port = port
        self.max_head_bytes = max_head_bytes
        # An upgrade waits for the upstream's answer (the client's next bytes held): only then does
        # ``upstream`` need the upstream's bytes; otherwise the caller sets ``upstream_spoke`` itself.
        self.switching = False
        self.upstream_spoke = False
        self._state = _FIRST_LINE
        self._sent = b""  # the current head's bytes already relayed (the first line, before its end)
        self._requests = 0
        # Set when first needed: ``_upgrade`` by each head's check (it asks for WebSocket), ``_body`` with
        # a body to frame, ``_response`` (the upstream's bytes) while an upgrade is answered.
        self._body: LengthBody | ChunkedBody | None
        self._upgrade: bool
        self._response: bytes

    def client(self, held: bytes | bytearray) -> int | None:
        """How many of the held bytes may go on now (the rest stay held); None: not HTTP, or switched.

        Raises ``OtherHost`` or ``HttpError``: the tunnel is to be cut.
        """
        end = len(held)
        if self._state is _FIRST_LINE:
            text = self._sent + held if self._sent else held
            if text.isalnum() and len(text) < self.max_head_bytes:
                # Letters and digits alone, no line end yet: one word (found in C, for every tunnel that
                # is not TLS, bench/instructions.py's too). It goes on, and is kept: a head would start with it.
                self._sent = bytes(text)
                return end
        ready = 0
        while ready < end:
            state = self._state
            rest = held[ready:] if ready else held
            if state is _BODY:
                body = self._body
                assert body is not None
                ready += body.feed(rest)
                if body.done:
                    self._body = None
                    self._state = _SWITCHING if self._upgrade else _HEAD
                    self.switching = self._upgrade
                    self._response = b""
                continue
            if state is _HEAD:
                buf = self._sent + rest if self._sent else rest
                parsed = parse_request_head(buf, self.max_head_bytes)
                if parsed is None:
                    break
                head, used = parsed
                self._requests += 1
                self._check(head)
                ready += used - len(self._sent)
                self._sent = b""
                kind, length = request_body_kind(head)
                if kind is BodyKind.LENGTH and length:
                    self._body = LengthBody(length)
                    self._state = _BODY
                elif kind is BodyKind.CHUNKED:
                    self._body = ChunkedBody(error_status=400)
                    self._state = _BODY
                elif self._upgrade:
                    self._state = _SWITCHING
                    self.switching = True
                    self._response = b""
                continue
            if state is _FIRST_LINE:
                text = self._sent + rest if self._sent else rest
                start = len(text) - len(text.lstrip(b"\r\n")) if text[0] in _CRLF else 0
                newline = text.find(b"\n", start)
                line = text[start:newline] if newline >= 0 else text[start:] if start else text
                if line.translate(None, _LINE_BYTES):
                    return None  # another protocol's bytes
                if newline >= 0:
                    if b"http/" not in line.lower():
                        return None
                    self._state = _HEAD
                    continue
                if len(text) >= self.max_head_bytes:
                    raise HttpError(431, "first line longer than a request head may be")
                if b" " in line or b"\t" in line:
                    return 0  # a word and a space: maybe a method and a target, held until the line ends
                self._sent = bytes(text)  # one word so far goes on, and is kept: a head would start with it
                return end
            if state is _OVER:
                return None
            break  # switching: held until the upstream answers the upgrade
        return ready

    def upstream(self, data: bytes | bytearray) -> bool:
        """The upstream's next bytes while ``switching``: True when they switched the tunnel to WebSocket
        (the watch is over); False: not yet, or no switch (then the held bytes are requests again).

        HttpError (502) for a response that does not parse.
        """
        self._response += data
        while True:
            parsed = parse_response_head(self._response, self.max_head_bytes)
            if parsed is None:
                return False
            response, used = parsed
            self._response = self._response[used:]
            if response.status == 101:
                self._state = _OVER
                self.switching = False
                return True
            if response.status >= 200:  # no switch: the next client bytes are requests again
                self._state = _HEAD
                self.switching = self._upgrade = False
                self._response = b""
                self.upstream_spoke = True
                return False

    def _check(self, head: RequestHead) -> None:
        """The head names the tunnel's host and port, and asks for nothing this cannot follow."""
        self._upgrade = False
        if head.method == "CONNECT":
            raise HttpError(400, "CONNECT inside a tunnel")
        target = head.target
        absolute = not target.startswith("/") and target != "*"
        if absolute:
            scheme, sep, rest = target.partition("://")
            if not sep or scheme.lower() not in _SCHEMES:
                raise HttpError(400, "invalid request target")
            cut = len(rest)
            for delimiter in "/?#":
                found = rest.find(delimiter, 0, cut)
                if found >= 0:
                    cut = found
            self._same(rest[:cut], "the request target")
        hosts = head.get_all("Host")
        if hosts:
            self._same(hosts[0], "Host")  # the parser refuses a second
        elif not absolute:
            raise OtherHost(None, "a request without Host")
        upgrades = head.get_all("Upgrade")
        if upgrades:
            protocols = [p.strip().lower() for value in upgrades for p in value.split(",") if p.strip()]
            if any(p.partition("/")[0] != "websocket" for p in protocols):
                raise HttpError(400, "an upgrade to another protocol than WebSocket inside a tunnel")
            if self._requests != 1 or self.upstream_spoke:
                raise HttpError(400, "a WebSocket upgrade that is not the tunnel's first request")
            self._upgrade = True

    def _same(self, authority: str, where: str) -> None:
        try:
            host, port = parse_authority(authority, self.port, colons=Colons.FIRST, host=normalise_host)
        except HostError:
            raise OtherHost(normalised(authority) or authority, f"{where} names another host") from None
        if host != self.host or port != self.port:
            named = host if port == self.port else f"{host}:{port}"
            raise OtherHost(named, f"{where} names another host than the tunnel's")
