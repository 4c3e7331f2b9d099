"""What a spliced tunnel's client sends, checked against the name the policy decided on.

``SniCheck`` is the tunnel's ``ClientCheck`` (``tunnel``) for every mode
that splices: a CONNECT, a SOCKS CONNECT and the transparent SNI listener.
An allowed tunnel cannot be steered to another name on the same address
(domain fronting at the TLS layer), nor carry plain HTTP to another host.
"""

from __future__ import annotations

from egressd.names.hosts import normalised
from egressd.proxy.core.attempt import Attempt
from egressd.proxy.core.clienthello import ClientHello, ClientHelloError, NotTls, ServerWatch, scan_client
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import ECH_DETAIL
from egressd.proxy.core.requestwatch import OtherHost, RequestWatch
from egressd.proxy.core.responses import refusal, tls_refusal
from egressd.proxy.net.recorder import Recorder
from egressd.proxy.net.stream import Peer
from egressd.proxy.net.tunnel import Tunnel
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Alert


class SniCheck:
    """A tunnel's client bytes, checked until the TLS handshake is settled (``tunnel.ClientCheck``).

    ``scan_client`` walks the held bytes; each ClientHello in them is checked
    before any of them is relayed; ``ServerWatch`` follows the upstream's
    bytes and ends the check at its ServerHello (unless a HelloRetryRequest,
    after which the client's second ClientHello is checked the same way).
    For each ClientHello, in order:

    1. it carries encrypted_client_hello (ECH) → ``sni_mismatch``: the name
       it really asks for is hidden, the readable one is a cover;
    2. no SNI → relay (CONNECT: the server answers for the address the
       policy checked), or ``bad_request`` when ``name_required`` (the
       transparent listener, which decided on the first hello's SNI);
    3. the SNI, normalised, differs from the attempt's host → ``sni_mismatch``.

    Refusals get a fatal TLS alert and the close; none of the held bytes is
    relayed. A malformed hello or record → ``bad_request``. Bytes held
    incomplete for the head timeout → ``limit_exceeded``, no alert. The
    upstream speaking first with something that is not TLS (SSH, SMTP, ...)
    or either side half-closing ends the check and relays (``Tunnel``).

    The first bytes not being TLS → ``requestwatch.RequestWatch`` reads them
    for as long as the tunnel lasts: plain HTTP has every request's Host and
    absolute-form target checked against the attempt's host and port (a
    mismatch is ``sni_mismatch``, the record's ``request_host`` saying what
    was named; a head that does not parse, ``bad_request``); another protocol
    is relayed with no more checking. An HTTP refusal is a refusal response
    when nothing has moved yet, else the close alone; a half-close does not
    end this check.
    """

    __slots__ = (
        "recorder", "attempt", "max_head_bytes", "name_required", "wants_upstream", "_server", "_started", "_http"
    )

    def __init__(
        self, recorder: Recorder, attempt: Attempt, max_head_bytes: int, *, name_required: bool = False
    ) -> None:
        self.recorder = recorder
        self.attempt = attempt
        self.max_head_bytes = max_head_bytes
        self.name_required = name_required
        self.wants_upstream = True  # TLS: until the server settles the handshake; HTTP: while an upgrade is answered
        self._server = ServerWatch()
        self._started = False  # a byte has been relayed: the held bytes no longer start the connection
        self._http: RequestWatch | None = None  # the first bytes were not TLS

    def client(self, tunnel: Tunnel) -> int | None:
        http = self._http
        if http is None:
            try:
                scanned = scan_client(tunnel.client.buf, first=not self._started)
            except NotTls:
                if self.name_required:  # the transparent listener read a ClientHello first: cannot be
                    return None
                attempt = self.attempt
                assert attempt.host is not None and attempt.port is not None
                http = self._http = RequestWatch(attempt.host, attempt.port, self.max_head_bytes)
            except ClientHelloError as exc:
                self._cut(tunnel, Reason.BAD_REQUEST, str(exc), alert=Alert.DECODE_ERROR)
                return 0
            else:
                for hello in scanned.hellos:
                    if not self._allowed(tunnel, hello):
                        return 0
                if scanned.ready:
                    self._started = True
                return scanned.ready
        if tunnel.bytes_down:
            http.upstream_spoke = True
        try:
            ready = http.client(tunnel.client.buf)
        except OtherHost as exc:
            if exc.named is not None:
                self.attempt.request_host = exc.named
            self._cut_http(tunnel, Reason.SNI_MISMATCH, exc.detail)
            return 0
        except HttpError as exc:
            self._cut_http(tunnel, Reason.LIMIT_EXCEEDED if exc.status == 431 else Reason.BAD_REQUEST, exc.detail)
            return 0
        self.wants_upstream = http.switching
        return ready

    def upstream(self, tunnel: Tunnel, data: bytes) -> bool:
        http = self._http
        if http is None:
            server = self._server
            if not server.feed(data):
                return False
            if server.tls or not self._started:
                return True  # the handshake is settled, or the server spoke first: another protocol
            # A ClientHello went to a server that answered in something else (plain HTTP's 400, say):
            # what the client sends next is a stream of its own, read as the first bytes are.
            attempt = self.attempt
            assert attempt.host is not None and attempt.port is not None
            self._http = RequestWatch(attempt.host, attempt.port, self.max_head_bytes)
            self.wants_upstream = False
            return False
        try:
            over = http.upstream(data)  # an upgrade's answer: only then does the check see the upstream's bytes
        except HttpError as exc:
            self._cut_http(tunnel, Reason.BAD_REQUEST, f"the answer to a WebSocket upgrade: {exc.detail}")
            return False
        if not over and not http.switching:
            self.wants_upstream = False
            tunnel.look()  # no switch: what the client sent meanwhile is requests, checked now
        return over

    def expired(self, tunnel: Tunnel) -> None:
        what = "ClientHello" if self._http is None else "request head"
        self._cut(tunnel, Reason.LIMIT_EXCEEDED, f"{what} incomplete in time", silent=True)

    def eof(self, tunnel: Tunnel, source: Peer) -> bool:
        if self._http is not None:
            if source is not tunnel.client:
                return False  # the client may still send requests
            tunnel.client.buf.clear()  # an unfinished head (or bytes after an unanswered upgrade) never goes
        return True

    def _allowed(self, tunnel: Tunnel, hello: ClientHello) -> bool:
        if hello.ech:
            self._cut(tunnel, Reason.SNI_MISMATCH, ECH_DETAIL)
            return False
        if hello.server_name is None:
            if not self.name_required:
                return True
            self._cut(tunnel, Reason.BAD_REQUEST, "ClientHello without server_name", alert=Alert.MISSING_EXTENSION)
            return False
        name = normalised(hello.server_name)
        if name == self.attempt.host:
            return True
        self.attempt.sni = name or hello.server_name
        self._cut(tunnel, Reason.SNI_MISMATCH)
        return False

    def _cut_http(self, tunnel: Tunnel, reason: Reason, detail: str) -> None:
        """A plain HTTP refusal: answered (``responses.refusal``) when nothing has moved either way yet,
        else the close alone (an answer then would land inside the origin's)."""
        attempt = self.attempt
        self.recorder.overrule(attempt, reason)
        attempt.detail = detail
        transport = tunnel.client.transport
        if not tunnel.bytes_up and not tunnel.bytes_down and transport is not None and not transport.is_closing():
            run = attempt.run
            transport.write(refusal(reason, attempt.host or "-", attempt.port, run.id if run else None, attempt.id))
        tunnel.close()

    def _cut(
        self,
        tunnel: Tunnel,
        reason: Reason,
        detail: str | None = None,
        *,
        alert: Alert | None = None,
        silent: bool = False,
    ) -> None:
        """An alert (``responses.tls_refusal``; none when ``silent``), the close, and the
        record says deny with ``reason`` (written when the tunnel ends)."""
        self.recorder.overrule(self.attempt, reason)
        if detail:
            self.attempt.detail = detail
        transport = tunnel.client.transport
        if not silent and transport is not None and not transport.is_closing():
            transport.write(tls_refusal(reason, alert))
        tunnel.close()
