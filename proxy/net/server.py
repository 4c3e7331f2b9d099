"""The explicit HTTP proxy listener: CONNECT tunnels and absolute-form HTTP.

A thin asyncio shell around the pure parts: ``http1`` parses, ``gate``
decides and dials, ``tunnel`` relays, ``responses`` renders refusals. Each
client connection is one task owned by the server; every request on it is
attributed, decided and recorded on its own (RFC 9112 §9.3 keep-alive and
pipelining), and any refusal closes the connection.

``Listener`` is what every TCP listener shares (accepting, shutdown, the
spliced tunnels); ``ProxyServer`` adds HTTP. The transparent listeners
(``transparent``) build on both: the Host-header one is a ``ProxyServer``
whose destination comes from the Host header, the SNI one a ``Listener``.

After a CONNECT is answered, what the client sends is checked until the
TLS handshake is settled: a ClientHello naming another server than the
CONNECT host, or hiding the name it asks for (ECH), is closed as
``sni_mismatch`` (``SniCheck``), and so is a second ClientHello after a
HelloRetryRequest, so an allowed tunnel cannot be steered to another name
on the same address (domain fronting at the TLS layer).

Bodies (and the wait for a response head) are bounded by the idle timeout:
a side that moves no byte for ``idle_timeout_s`` ends the request, both
connections are closed and the record notes ``end: idle_timeout``, as for
an idle tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from egressd.audit.records import EgressKind
from egressd.names.addresses import IPAddress
from egressd.names.hosts import normalised
from egressd.proxy.core.clienthello import Alert, ClientHello, ClientHelloError, NotTls, ServerWatch, scan_client
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1 import Destination, HttpError, RequestHead, ResponseHead, request_destination
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.responses import CONNECT_ESTABLISHED, refusal, tls_refusal
from egressd.proxy.core.runs import NOT_WAITING, Run, RunRegistry, source_address
from egressd.proxy.net.gate import Admission, Attempt, DialError, Gate
from egressd.proxy.net.stream import IdleTimeout, Peer, PeerClosed
from egressd.proxy.net.tunnel import ClientCheck, Tunnel

log = logging.getLogger("egressd.proxy")

# The audit record's ``end`` when a connection ended because nothing moved (DESIGN.md "Audit log").
IDLE_END = "idle_timeout"
# ... and when egressd cut it on stopping, after the grace period.
SHUTDOWN_END = "shutdown"
# A connection cap's 429 says to try again in a second: connections end all the time.
RETRY_AFTER_S = 1
# Why a run's connection is refused at its cap (the record's detail).
RUN_CAP_DETAIL = "too many open connections in the run"
# Why nothing was dialled for a client that hung up while its request was decided (held for an answer).
GONE_DETAIL = "the client went away before its request was decided"
# Why a ClientHello carrying encrypted_client_hello is refused (the record's detail).
ECH_DETAIL = "encrypted_client_hello hides the server name asked for"


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """The listener's limits; see ``egressd.config.settings`` for why each default."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_connections: int = 10000
    max_connections_per_run: int = 1000


class Listener:
    """Accepts clients on one listening socket and serves each in a task until it is spliced or closed.

    Subclasses implement ``_serve_client``; ``_splice`` hands a decided
    connection to a tunnel (no task from then on) and keeps it where
    ``close`` can end it.
    """

    def __init__(self, *, gate: Gate, runs: RunRegistry, limits: ListenerLimits) -> None:
        self.gate = gate
        self.runs = runs
        self.limits = limits
        self._server: asyncio.AbstractServer | None = None
        self._address: tuple[str, int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tunnels: set[Tunnel] = set()
        self._all_ended: asyncio.Event | None = None  # while close() waits for the tunnels
        self._cutting = False  # close() is ending what the grace period left open

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None, "not started"
        return self._address

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Peer(on_connect=self._accepted), host, port, backlog=1024, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        self._address = (bound[0], bound[1])

    def _accepted(self, client: Peer) -> None:
        # No TCP_NODELAY here: asyncio and uvloop set it on every TCP transport.
        task = asyncio.get_running_loop().create_task(self._serve_client(client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting, give open connections ``grace_s`` to finish, then end them."""
        if self._server is not None:
            self._server.close()  # stop accepting; open connections are ours to end
        if grace_s > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=grace_s)
            # Spliced tunnels have no task to wait on: the last to end sets this.
            self._all_ended = asyncio.Event()
            if self._tunnels:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_ended.wait(), max(0.0, deadline - loop.time()))
        self._cutting = True
        for tunnel in list(self._tunnels):
            tunnel.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _serve_client(self, client: Peer) -> None:
        raise NotImplementedError

    def _finish(self, attempt: Attempt) -> None:
        """``gate.finish``, saying ``shutdown`` for a connection cut when the grace period ran out."""
        if self._cutting and attempt.opened:
            attempt.ends(SHUTDOWN_END)
        self.gate.finish(attempt)

    def _splice(self, client: Peer, upstream: Peer, attempt: Attempt, check: ClientCheck | None = None) -> None:
        """Hand a decided connection to a tunnel, which relays both ways from now on.

        Returns at once: the caller's coroutine ends, and the tunnel owns the
        client, the upstream and the attempt (``attempt.handed_off``), which
        ``_tunnel_ended`` records and releases. Bytes already buffered on
        either side go first.
        """
        attempt.handed_off = True
        tunnel = Tunnel(
            client,
            upstream,
            idle_timeout_s=self.limits.idle_timeout_s,
            on_end=self._tunnel_ended,
            owner=attempt,
            check=check,
            check_timeout_s=self.limits.head_timeout_s,
        )
        self._tunnels.add(tunnel)
        tunnel.start()

    def _tunnel_ended(self, tunnel: Tunnel) -> None:
        """Everything the spliced connection's coroutine would have done when it finished."""
        self._tunnels.discard(tunnel)
        if not self._tunnels and self._all_ended is not None:
            self._all_ended.set()
        attempt: Attempt = tunnel.owner  # type: ignore[assignment]
        attempt.bytes_up += tunnel.bytes_up
        attempt.bytes_down += tunnel.bytes_down
        if tunnel.idle_expired:
            attempt.ends(IDLE_END)
        tunnel.upstream.close()
        if attempt.run is not None:
            attempt.run.open_connections -= 1
        self._finish(attempt)
        self.gate.metrics.connections_open -= 1
        self._close_client(tunnel.client)

    @staticmethod
    def _close_client(client: Peer) -> None:
        if client.pooled is not None:
            client.pooled[2].close()
            client.pooled = None
        client.close()


class ProxyServer(Listener):
    """The explicit proxy: CONNECT and absolute-form HTTP, decided request by request.

    ``_destination`` and ``_attribute`` are where a request's destination and
    run come from; the transparent HTTP listener overrides both.
    """

    def _destination(self, head: RequestHead) -> Destination:
        """Where the request goes: its request-target alone (HttpError if none)."""
        return request_destination(head)

    def _attribute(self, source: IPAddress | None, head: RequestHead) -> Run | None:
        """The request's run: by credentials, else by source address (``runs``)."""
        return self.runs.attribute(source, head.get("Proxy-Authorization"))

    # -- one client connection -------------------------------------------------

    async def _serve_client(self, client: Peer) -> None:
        peer = client.peername or ("", 0)
        client_text = f"{peer[0]}:{peer[1]}"
        source = source_address(peer[0])
        metrics = self.gate.metrics
        metrics.connections_open += 1
        attempt: Attempt | None = None
        try:
            if metrics.connections_open > self.limits.max_connections:
                attempt = self.gate.begin(EgressKind.HTTP, client_text)
                await self._refuse(client, attempt, Reason.LIMIT_EXCEEDED, status=429, retry_after_s=RETRY_AFTER_S)
                return
            first = True
            holder = self.runs.bound(source)  # once per connection: its address's run does not change
            exchange = Exchange(self.limits.max_head_bytes)  # the connection's HTTP, request after request
            while True:
                attempt = self.gate.begin(EgressKind.HTTP, client_text)
                keep_going = await self._serve_request(client, attempt, source, holder, first, exchange)
                first = False
                if not keep_going:
                    return
        except PeerClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("connection %s failed (request %s)", client_text, attempt.id if attempt else "-")
        finally:
            if attempt is None or not attempt.handed_off:
                if attempt is not None and attempt.host is not None:
                    self._finish(attempt)
                metrics.connections_open -= 1
                self._close_client(client)

    async def _serve_request(
        self,
        client: Peer,
        attempt: Attempt,
        source: IPAddress | None,
        holder: Run | None,
        first: bool,
        exchange: Exchange,
    ) -> bool:
        """Serve one request; True when the connection may carry another.

        ``holder``: the run the client's address is bound to, known before the head, so its slow
        heads count against its own cap.
        """
        if holder is not None and holder.at_connection_cap(self.limits.max_connections_per_run):
            attempt.run = holder
            await self._refuse(
                client, attempt, Reason.LIMIT_EXCEEDED, status=429, retry_after_s=RETRY_AFTER_S, detail=RUN_CAP_DETAIL
            )
            return False
        try:
            deadline = asyncio.get_running_loop().time() + self.limits.head_timeout_s
            with holder.waiting_head() if holder is not None else NOT_WAITING:
                head = await client.read_head(exchange.read_request, deadline)
        except TimeoutError:
            if not first and not client.buf:
                return False  # an idle keep-alive connection, not an attempt
            await self._refuse(client, attempt, Reason.LIMIT_EXCEEDED, status=408, detail="request head too slow")
            return False
        except HttpError as exc:
            reason = Reason.LIMIT_EXCEEDED if exc.status == 431 else Reason.BAD_REQUEST
            await self._refuse(client, attempt, reason, status=exc.status, detail=exc.detail)
            return False
        if head is None:
            return False
        self.gate.metrics.connections_total[("connect" if head.method == "CONNECT" else "http")] += 1
        attempt.kind = EgressKind.CONNECT if head.method == "CONNECT" else EgressKind.HTTP
        try:
            destination = self._destination(head)
        except HttpError as exc:
            await self._refuse(client, attempt, Reason.BAD_REQUEST, status=exc.status, detail=exc.detail)
            return False
        attempt.host, attempt.port = destination.host, destination.port

        run = self._attribute(source, head)
        if run is None:
            await self._refuse(client, attempt, Reason.AUTH_REQUIRED)
            return False
        attempt.run = run
        if run.open_connections >= self.limits.max_connections_per_run:
            await self._refuse(client, attempt, Reason.LIMIT_EXCEEDED, status=429, retry_after_s=RETRY_AFTER_S)
            return False
        run.open_connections += 1
        try:
            try:
                # A client that gives up while its request is held (asked about) stops the wait (stream.gone_cancels).
                with client.gone_cancels(on_eof=head.method == "CONNECT"):
                    admission = await self.gate.admit(attempt, run, destination.host, destination.port)
            except PeerClosed:
                attempt.extra["detail"] = GONE_DETAIL
                raise
            if not admission.allowed:
                await self._refuse(client, attempt, admission.reason)
                return False
            if head.method == "CONNECT":
                await self._tunnel(client, attempt, admission)
                return False
            return await self._forward(client, attempt, exchange, admission, destination)
        finally:
            if not attempt.handed_off:
                run.open_connections -= 1
                self._finish(attempt)

    async def _dial(self, client: Peer, attempt: Attempt, admission: Admission) -> Peer | None:
        try:
            return await self.gate.dial(attempt, admission, Peer)
        except DialError as exc:
            attempt.extra["detail"] = str(exc)
            await self._refuse(client, attempt, exc.reason)
            return None

    async def _tunnel(self, client: Peer, attempt: Attempt, admission: Admission) -> None:
        upstream = await self._dial(client, attempt, admission)
        if upstream is None:
            return
        try:
            await client.send(CONNECT_ESTABLISHED)
            self._splice(client, upstream, attempt, check=SniCheck(self.gate, attempt))
        finally:
            if not attempt.handed_off:
                upstream.close()

    async def _forward(
        self, client: Peer, attempt: Attempt, exchange: Exchange, admission: Admission, destination: Destination
    ) -> bool:
        """Forward one request and its response; True when the client connection may carry another.

        Read, feed, act: ``exchange`` says what to send and where each body
        ends. The upstream connection is kept for the client's next request
        to the same host and port when the exchange allows (keep-alive on
        both sides, RFC 9112 §9.3). A kept connection the origin has
        meanwhile closed is replaced once, for a request without a body
        (nothing is lost by sending it again).
        """
        out = exchange.forward(destination)
        if exchange.interim:
            await client.send(exchange.interim)
        body = exchange.request_body
        key = (admission.host, admission.port)
        for try_again in (True, False):
            kept = self._kept(client, key, admission)
            reused = kept is not None
            if kept is None:
                upstream = await self._dial(client, attempt, admission)
                if upstream is None:
                    return False
                address = attempt.address
            else:
                address, upstream = kept
                try:
                    self.gate.open(attempt, address)  # the record before the request goes out
                except DialError as exc:
                    upstream.close()
                    await self._refuse(client, attempt, exc.reason)
                    return False
            keep_upstream = False
            try:
                response = None
                try:
                    await upstream.send(out)
                    if body is None:
                        response = await self._response_head(upstream, exchange)
                except PeerClosed:
                    pass
                if response is None and reused and try_again and body is None:
                    continue  # a stale kept connection: dial a fresh one
                attempt.bytes_up += len(out)
                if body is not None:
                    try:
                        attempt.bytes_up += await client.relay_body(body, upstream, idle_s=self.limits.idle_timeout_s)
                    except (IdleTimeout, PeerClosed) as exc:
                        attempt.bytes_up += exc.moved
                        raise
                if response is None:
                    response = await self._response_head(upstream, exchange)
                if response is None:
                    raise HttpError(502, "upstream closed without a response")
                keep_client = await self._relay_response(client, attempt, exchange, upstream, response)
                keep_upstream = exchange.keep_upstream
                return keep_client
            except HttpError as exc:
                # The origin sent something we cannot frame safely; stop here.
                attempt.extra["detail"] = f"bad response from upstream: {exc.detail}"
                if attempt.bytes_down == 0:
                    await self._refuse(client, attempt, Reason.UPSTREAM_UNREACHABLE)
                return False
            except TimeoutError as exc:
                if response is None and not isinstance(exc, IdleTimeout):
                    # The origin took the whole request and began no answer: 504, the client hears why.
                    if body is None:
                        attempt.bytes_up += len(out)  # sent, and not counted yet
                    await self._refuse(client, attempt, Reason.UPSTREAM_TIMEOUT)
                    return False
                # A body moved no byte for the idle timeout: both connections close, as an idle tunnel's do.
                attempt.ends(IDLE_END)
                return False
            finally:
                if keep_upstream:
                    client.pooled = (key, address, upstream)
                else:
                    upstream.close()
        return False

    @staticmethod
    def _kept(client: Peer, key: tuple[str, int], admission: Admission) -> tuple[str | None, Peer] | None:
        """The client's kept upstream connection and its address, if it serves this request; else None (and closed)."""
        pooled = client.pooled
        if pooled is None:
            return None
        client.pooled = None
        pooled_key, address, upstream = pooled
        usable = (
            pooled_key == key
            and not upstream.closed
            and not upstream.eof
            and not upstream.buf  # an unrequested byte means the stream is out of step
            and address in admission.texts
        )
        if usable:
            return address, upstream
        upstream.close()
        return None

    async def _response_head(self, upstream: Peer, exchange: Exchange) -> ResponseHead | None:
        """The final response head (``exchange`` drops interim 1xx); None if the upstream closed first."""
        deadline = asyncio.get_running_loop().time() + self.limits.idle_timeout_s
        return await upstream.read_head(exchange.read_response, deadline)

    async def _relay_response(
        self, client: Peer, attempt: Attempt, exchange: Exchange, upstream: Peer, response: ResponseHead
    ) -> bool:
        """Send the response on, as ``exchange`` framed it; True when the client may send another request."""
        attempt.extra["status"] = response.status
        out = exchange.response_out
        attempt.bytes_down += len(out)
        body = exchange.response_body
        idle_s = self.limits.idle_timeout_s
        try:
            if body is None:
                await client.send(out, asyncio.get_running_loop().time() + idle_s)
            else:
                # The head and the body bytes already here go out in one write.
                attempt.bytes_down += await upstream.relay_body(body, client, head=out, idle_s=idle_s)
        except (IdleTimeout, PeerClosed) as exc:
            attempt.bytes_down += exc.moved  # what reached the client counts, cut short or not
            raise
        return exchange.finish()

    async def _refuse(
        self,
        client: Peer,
        attempt: Attempt,
        reason: Reason | None,
        *,
        status: int | None = None,
        detail: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        """Answer a refusal as the contract says (``responses.refusal``) and record it.

        ``status`` overrides the reason's (431, 408); ``detail`` goes to the
        record only; ``retry_after_s`` goes with a 429 for a connection cap.
        """
        reason = reason or Reason.BAD_REQUEST
        attempt.refuse(reason, detail)
        run = attempt.run
        data = refusal(
            reason,
            attempt.host or "-",
            attempt.port,
            run.id if run else None,
            attempt.id,
            status=status,
            message=attempt.message,
            retry_after_s=retry_after_s,
        )
        self.gate.finish(attempt)
        with contextlib.suppress(PeerClosed):
            await client.send(data)


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
    relayed. The first bytes not being TLS → relay with no more checking:
    another protocol. A malformed hello or record → ``bad_request``. Bytes
    held incomplete for the head timeout → ``limit_exceeded``, no alert. The
    upstream speaking first with something that is not TLS (SSH, SMTP, ...)
    or either side half-closing ends the check and relays (``Tunnel``).
    """

    __slots__ = ("gate", "attempt", "name_required", "_server", "_started")

    def __init__(self, gate: Gate, attempt: Attempt, *, name_required: bool = False) -> None:
        self.gate = gate
        self.attempt = attempt
        self.name_required = name_required
        self._server = ServerWatch()
        self._started = False  # a byte has been relayed: the held bytes no longer start the connection

    def client(self, tunnel: Tunnel) -> int | None:
        try:
            scanned = scan_client(tunnel.client.buf, first=not self._started)
        except NotTls:
            return None
        except ClientHelloError as exc:
            self._refuse(tunnel, Reason.BAD_REQUEST, str(exc), alert=Alert.DECODE_ERROR)
            return 0
        for hello in scanned.hellos:
            if not self._allowed(tunnel, hello):
                return 0
        if scanned.ready:
            self._started = True
        return scanned.ready

    def upstream(self, tunnel: Tunnel, data: bytes) -> bool:
        return self._server.feed(data)

    def expired(self, tunnel: Tunnel) -> None:
        self._refuse(tunnel, Reason.LIMIT_EXCEEDED, "ClientHello incomplete in time", silent=True)

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
