"""The HTTP modes' conversation: CONNECT tunnels and absolute-form HTTP, request after request.

A thin asyncio shell around the pure parts: ``exchange`` frames, ``modes``
says where a request goes, how it is attributed and which refusal it
earns, ``gate`` decides and dials, ``tunnel`` relays, ``responses`` renders
refusals. ``serve_http`` serves one client connection of a ``Listener``
(``listener``) in the explicit proxy mode or the transparent Host mode;
every request on it is attributed, decided and recorded on its own
(RFC 9112 §9.3 keep-alive and pipelining), and any refusal closes the
connection.

After a CONNECT is answered, what the client sends is checked until the
TLS handshake is settled: a ClientHello naming another server than the
CONNECT host, or hiding the name it asks for (ECH), is closed as
``sni_mismatch`` (``SniCheck``), and so is a second ClientHello after a
HelloRetryRequest, so an allowed tunnel cannot be steered to another name
on the same address (domain fronting at the TLS layer). A tunnel that
carries plain HTTP instead has every request's Host checked the same way
(``requestwatch``), for as long as it lasts.

Bodies (and the wait for a response head) are bounded by the idle timeout:
a side that moves no byte for ``idle_timeout_s`` ends the request, both
connections are closed and the record notes ``end: idle_timeout``, as for
an idle tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Final

from egressd.audit.records import EgressKind
from egressd.names.addresses import IPAddress
from egressd.names.hosts import normalised
from egressd.proxy.core.clienthello import Alert, ClientHello, ClientHelloError, NotTls, ServerWatch, scan_client
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.heads import ResponseHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import (
    ECH_DETAIL,
    GONE_DETAIL,
    IDLE_END,
    Refusal,
    bad_head,
    head_too_slow,
    no_destination,
    run_at_cap,
    too_many_connections,
)
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.requestwatch import OtherHost, RequestWatch
from egressd.proxy.core.responses import CONNECT_ESTABLISHED, refusal, tls_refusal
from egressd.proxy.core.runs import Run, source_address
from egressd.proxy.net.gate import Admission, Attempt, DialError, Gate, Seen
from egressd.proxy.net.stream import GoneCancels, IdleTimeout, Peer, PeerClosed
from egressd.proxy.net.tunnel import Tunnel

if TYPE_CHECKING:
    from egressd.proxy.net.listener import Held, Listener

log = logging.getLogger("egressd.proxy")

# The record kinds, as module constants: an Enum member's lookup on its class costs ten times a global's.
_HTTP: Final = EgressKind.HTTP
_CONNECT: Final = EgressKind.CONNECT


def serve_http(listener: Listener, client: Peer) -> Coroutine[object, object, None]:
    """Serve one client connection of an HTTP mode, request after request, then release it.

    Returns the connection's coroutine, not a coroutine awaiting it: a layer
    the event loop would resume on every read of every request.
    """
    return _HttpConnection(listener, client).serve()


class _HttpConnection:
    """One client connection of an HTTP mode (``listener.mode``)."""

    __slots__ = ("listener", "gate", "limits", "mode", "held", "client", "gone")

    held: Held
    # Entered around each request's decision (``stream.gone_cancels``): one per connection.
    gone: GoneCancels

    def __init__(self, listener: Listener, client: Peer) -> None:
        self.listener = listener
        self.gate = listener.gate
        self.limits = listener.limits
        self.mode = listener.mode
        self.client = client

    async def serve(self) -> None:
        client = self.client
        self.held = self.listener.hold(client)  # counted open when its task runs, not at the accept
        peer = client.peername or ("", 0)
        client_text = f"{peer[0]}:{peer[1]}"
        source = source_address(peer[0])
        seen: Seen | None = None
        try:
            if self.gate.metrics.connections_open > self.limits.max_connections:
                seen = self.gate.begin(_HTTP, client_text)
                await self._refuse(seen, too_many_connections(self.mode.reads))
                return
            first = True
            holder = self.listener.runs.bound(source)  # once per connection: its address's run does not change
            self.gone = client.gone_cancels(on_eof=False)
            exchange = Exchange(self.limits.max_head_bytes)  # the connection's HTTP, request after request
            while True:
                seen = self.gate.begin(_HTTP, client_text)
                keep_going = await self._serve_request(seen, source, holder, first, exchange)
                first = False
                if not keep_going:
                    return
        except PeerClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("connection %s failed (request %s)", client_text, seen.id if seen else "-")
        finally:
            self.held.release()

    async def _serve_request(
        self,
        seen: Seen,
        source: IPAddress | None,
        holder: Run | None,
        first: bool,
        exchange: Exchange,
    ) -> bool:
        """Serve one request; True when the connection may carry another.

        ``holder``: the run the client's address is bound to, known before the head, so its slow
        heads count against its own cap.
        """
        client = self.client
        reads = self.mode.reads
        if holder is not None and holder.at_connection_cap(self.limits.max_connections_per_run):
            await self._refuse(seen._replace(run=holder), run_at_cap(reads, attributed=False))
            return False
        try:
            deadline = client.loop.time() + self.limits.head_timeout_s
            if holder is None:  # no run to count the wait against (no ``with``: every request comes here)
                head = await client.read_head(exchange.read_request, deadline)
            else:
                with holder.waiting_head():
                    head = await client.read_head(exchange.read_request, deadline)
        except TimeoutError:
            if not first and not client.buf:
                return False  # an idle keep-alive connection, not an attempt
            await self._refuse(seen, head_too_slow(reads))
            return False
        except HttpError as exc:
            await self._refuse(seen, bad_head(exc))
            return False
        if head is None:
            return False
        connect = head.method == "CONNECT"
        self.gate.metrics.connections_total[("connect" if connect else "http")] += 1
        kind = _CONNECT if connect else _HTTP
        # What is learnt from here on is made into a new ``Seen`` only where a refusal needs it:
        # on the way to a decision it goes into the gate's attempt directly.
        try:
            destination = self.mode.destination(head)
        except HttpError as exc:
            await self._refuse(seen._replace(kind=kind), no_destination(exc))
            return False
        host, port = destination.host, destination.port
        try:
            run = self.listener.runs.attribute(source, self.mode.proxy_credentials(head))
        except Exception:
            self.held.attempt = seen._replace(kind=kind, host=host, port=port)  # recorded as the connection ends
            raise
        if run is None:
            await self._refuse(seen._replace(kind=kind, host=host, port=port), Refusal(Reason.AUTH_REQUIRED))
            return False
        if run.open_connections >= self.limits.max_connections_per_run:
            refused = seen._replace(kind=kind, host=host, port=port, run=run)
            await self._refuse(refused, run_at_cap(reads, attributed=True))
            return False
        attempt = self.held.attempt = self.gate.attempt(seen, run, host, port, kind)
        try:
            with self.held.slot(run):
                try:
                    # A client that gives up while its request is held (asked about) stops the wait
                    # (stream.gone_cancels): its FIN too for a CONNECT, which cannot go on without sending.
                    gone = self.gone
                    gone.on_eof = connect
                    with gone:
                        admission = await self.gate.admit(attempt)
                except PeerClosed:
                    attempt.extra["detail"] = GONE_DETAIL
                    raise
                if not admission.allowed:
                    await self._refuse(attempt, Refusal(admission.reason or Reason.BAD_REQUEST))
                    return False
                if connect:
                    await self._tunnel(attempt, admission)
                    return False
                return await self._forward(attempt, exchange, admission, destination)
        finally:
            self.held.done(attempt)

    async def _dial(self, attempt: Attempt, admission: Admission) -> Peer | None:
        try:
            return await self.gate.dial(attempt, admission, self.client.new_peer, self.client.loop)
        except DialError as exc:
            attempt.extra["detail"] = str(exc)
            await self._refuse(attempt, Refusal(exc.reason))
            return None

    async def _tunnel(self, attempt: Attempt, admission: Admission) -> None:
        upstream = await self._dial(attempt, admission)
        if upstream is None:
            return
        try:
            if self.client.write(CONNECT_ESTABLISHED):
                await self.client.drain()
        except BaseException:
            upstream.close()
            raise
        self.held.splice(upstream, attempt, check=SniCheck(self.gate, attempt, self.limits.max_head_bytes))

    async def _forward(
        self, attempt: Attempt, exchange: Exchange, admission: Admission, destination: Destination
    ) -> bool:
        """Forward one request and its response; True when the client connection may carry another.

        Read, feed, act: ``exchange`` says what to send and where each body
        ends. The upstream connection is kept for the client's next request
        to the same host and port when the exchange allows (keep-alive on
        both sides, RFC 9112 §9.3). A kept connection the origin has
        meanwhile closed is replaced once, for a request without a body
        (nothing is lost by sending it again).
        """
        client = self.client
        idle_s = self.limits.idle_timeout_s
        out = exchange.forward(destination)
        if exchange.interim:
            await client.send(exchange.interim)
        body = exchange.request_body
        key = (admission.host, admission.port)
        for try_again in (True, False):
            kept = self._kept(key, admission)
            reused = kept is not None
            if kept is None:
                upstream = await self._dial(attempt, admission)
                if upstream is None:
                    return False
                address = attempt.address
            else:
                address, upstream = kept
                try:
                    self.gate.open(attempt, address)  # the record before the request goes out
                except DialError as exc:
                    upstream.close()
                    await self._refuse(attempt, Refusal(exc.reason))
                    return False
            keep_upstream = False
            try:
                response = None
                try:
                    if upstream.write(out):
                        await upstream.drain()
                    if body is None:
                        # The final response head (``exchange`` drops interim 1xx); None: the upstream closed first.
                        response = await upstream.read_head(exchange.read_response, upstream.loop.time() + idle_s)
                except PeerClosed:
                    pass
                if response is None and reused and try_again and body is None:
                    continue  # a stale kept connection: dial a fresh one
                attempt.bytes_up += len(out)
                if body is not None:
                    try:
                        attempt.bytes_up += await client.relay_body(body, upstream, idle_s=idle_s)
                    except (IdleTimeout, PeerClosed) as exc:
                        attempt.bytes_up += exc.moved
                        raise
                if response is None:
                    response = await upstream.read_head(exchange.read_response, upstream.loop.time() + idle_s)
                if response is None:
                    raise HttpError(502, "upstream closed without a response")
                keep_client = await self._relay_response(attempt, exchange, upstream, response)
                keep_upstream = exchange.keep_upstream
                return keep_client
            except HttpError as exc:
                # The origin sent something we cannot frame safely; stop here.
                attempt.extra["detail"] = f"bad response from upstream: {exc.detail}"
                if attempt.bytes_down == 0:
                    await self._refuse(attempt, Refusal(Reason.UPSTREAM_UNREACHABLE))
                return False
            except TimeoutError as exc:
                if response is None and not isinstance(exc, IdleTimeout):
                    # The origin took the whole request and began no answer: 504, the client hears why.
                    if body is None:
                        attempt.bytes_up += len(out)  # sent, and not counted yet
                    await self._refuse(attempt, Refusal(Reason.UPSTREAM_TIMEOUT))
                    return False
                # A body moved no byte for the idle timeout: both connections close, as an idle tunnel's do.
                attempt.ends(IDLE_END)
                return False
            finally:
                if keep_upstream:
                    self.held.kept = (key, address, upstream)
                else:
                    upstream.close()
        return False

    def _kept(self, key: tuple[str, int], admission: Admission) -> tuple[str | None, Peer] | None:
        """The client's kept upstream connection and its address, if it serves this request; else None (and closed)."""
        kept = self.held.kept
        if kept is None:
            return None
        self.held.kept = None
        kept_key, address, upstream = kept
        usable = (
            kept_key == key
            and not upstream.closed
            and not upstream.eof
            and not upstream.buf  # an unrequested byte means the stream is out of step
            and address in admission.texts
        )
        if usable:
            return address, upstream
        upstream.close()
        return None

    async def _relay_response(
        self, attempt: Attempt, exchange: Exchange, upstream: Peer, response: ResponseHead
    ) -> bool:
        """Send the response on, as ``exchange`` framed it; True when the client may send another request."""
        client = self.client
        attempt.extra["status"] = response.status
        out = exchange.response_out
        attempt.bytes_down += len(out)
        body = exchange.response_body
        idle_s = self.limits.idle_timeout_s
        try:
            if body is None:
                if client.write(out):
                    await client.drain(client.loop.time() + idle_s)
            else:
                # The head and the body bytes already here go out in one write.
                attempt.bytes_down += await upstream.relay_body(body, client, head=out, idle_s=idle_s)
        except (IdleTimeout, PeerClosed) as exc:
            attempt.bytes_down += exc.moved  # what reached the client counts, cut short or not
            raise
        return exchange.finish()

    async def _refuse(self, attempt: Attempt | Seen, refused: Refusal) -> None:
        """Answer a refusal as the contract says (``responses.refusal``, the mode's status) and record it.

        ``Seen``: refused before the policy ran; its record is built here, once.
        """
        reason = refused.reason
        message = None
        if isinstance(attempt, Attempt):
            attempt.refuse(reason, refused.detail)
            message = attempt.message
        run = attempt.run
        data = refusal(
            reason,
            attempt.host or "-",
            attempt.port,
            run.id if run else None,
            attempt.id,
            status=self.mode.status(refused),
            message=message,
            retry_after_s=refused.retry_after_s,
        )
        if isinstance(attempt, Attempt):
            self.gate.finish(attempt)
        else:
            if self.held.attempt is attempt:
                self.held.attempt = None
            self.gate.refuse(attempt, reason, refused.detail)
        with contextlib.suppress(PeerClosed):
            await self.client.send(data)


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

    __slots__ = ("gate", "attempt", "max_head_bytes", "name_required", "wants_upstream", "_server", "_started", "_http")

    def __init__(self, gate: Gate, attempt: Attempt, max_head_bytes: int, *, name_required: bool = False) -> None:
        self.gate = gate
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
                self._refuse(tunnel, Reason.BAD_REQUEST, str(exc), alert=Alert.DECODE_ERROR)
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
                self.attempt.extra["request_host"] = exc.named
            self._refuse_http(tunnel, Reason.SNI_MISMATCH, exc.detail)
            return 0
        except HttpError as exc:
            self._refuse_http(tunnel, Reason.LIMIT_EXCEEDED if exc.status == 431 else Reason.BAD_REQUEST, exc.detail)
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
            self._refuse_http(tunnel, Reason.BAD_REQUEST, f"the answer to a WebSocket upgrade: {exc.detail}")
            return False
        if not over and not http.switching:
            self.wants_upstream = False
            tunnel.look()  # no switch: what the client sent meanwhile is requests, checked now
        return over

    def expired(self, tunnel: Tunnel) -> None:
        what = "ClientHello" if self._http is None else "request head"
        self._refuse(tunnel, Reason.LIMIT_EXCEEDED, f"{what} incomplete in time", silent=True)

    def eof(self, tunnel: Tunnel, source: Peer) -> bool:
        if self._http is not None:
            if source is not tunnel.client:
                return False  # the client may still send requests
            tunnel.client.buf.clear()  # an unfinished head (or bytes after an unanswered upgrade) never goes
        return True

    def _allowed(self, tunnel: Tunnel, hello: ClientHello) -> bool:
        if hello.ech:
            self._refuse(tunnel, Reason.SNI_MISMATCH, ECH_DETAIL)
            return False
        if hello.server_name is None:
            if not self.name_required:
                return True
            self._refuse(tunnel, Reason.BAD_REQUEST, "ClientHello without server_name", alert=Alert.MISSING_EXTENSION)
            return False
        name = normalised(hello.server_name)
        if name == self.attempt.host:
            return True
        self.attempt.extra["sni"] = name or hello.server_name
        self._refuse(tunnel, Reason.SNI_MISMATCH)
        return False

    def _refuse_http(self, tunnel: Tunnel, reason: Reason, detail: str) -> None:
        """A plain HTTP refusal: answered (``responses.refusal``) when nothing has moved either way yet,
        else the close alone (an answer then would land inside the origin's)."""
        attempt = self.attempt
        self.gate.overrule(attempt, reason)
        attempt.extra["detail"] = detail
        transport = tunnel.client.transport
        if not tunnel.bytes_up and not tunnel.bytes_down and transport is not None and not transport.is_closing():
            run = attempt.run
            transport.write(refusal(reason, attempt.host or "-", attempt.port, run.id if run else None, attempt.id))
        tunnel.close()

    def _refuse(
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
        self.gate.overrule(self.attempt, reason)
        if detail:
            self.attempt.extra["detail"] = detail
        transport = tunnel.client.transport
        if not silent and transport is not None and not transport.is_closing():
            transport.write(tls_refusal(reason, alert))
        tunnel.close()
