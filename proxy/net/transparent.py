"""The transparent listeners: tools that ignore proxy settings meet the same policy.

The sandbox's DNS (``dnsserver``) answers every name with egressd's address,
so a program that connects on its own lands here, on port 443 or 80 of that
address, without having said where it wanted to go. The destination is read
from what the client sends first, and then everything happens as for the
explicit proxy: the run by source address (``runs``), the decision, the
approval wait, resolution and the address check, the dial of exactly the
checked address (``gate``), the audit record.

- ``TransparentTlsServer`` reads the ClientHello (``clienthello``) without
  terminating TLS, decides on its SNI with the listener's destination port
  (443), dials, replays the bytes it read and splices the two sockets
  (``tunnel``): the TLS session is end to end, between the client and the
  origin. It cannot answer in HTTP, so a refusal is a fatal TLS alert and
  the close (the audit record and the run's events say why); a ClientHello
  without SNI, or a malformed one, is refused the same way, and one that
  carries encrypted_client_hello (ECH: the SNI is a cover name) is refused
  as ``sni_mismatch`` before anything is decided. The splice checks the
  client's bytes until the handshake is settled (``server.SniCheck``): a
  second ClientHello, after a HelloRetryRequest, must name the same host.
- ``TransparentHttpServer`` is the proxy's absolute-form forwarding with the
  destination taken from the Host header (``host_destination``) on port 80;
  a Host naming another port is refused. Refusals are HTTP answers, as from
  the proxy.

Both attribute by source address only: with ``--require-auth`` a source
bound to no run is refused (``auth_required``) and recorded.
"""

from __future__ import annotations

import asyncio
import logging

from egressd.audit.records import EgressKind
from egressd.names.addresses import IPAddress
from egressd.names.hosts import normalised
from egressd.proxy.core.clienthello import Alert, ClientHello, ClientHelloError, NotTls, parse_client_hello
from egressd.proxy.core.http1 import Destination, HttpError, RequestHead, request_destination
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.responses import tls_refusal
from egressd.proxy.core.runs import NOT_WAITING, Run, RunRegistry, source_address
from egressd.proxy.net.gate import Attempt, DialError, Gate
from egressd.proxy.net.server import (
    ECH_DETAIL,
    GONE_DETAIL,
    RUN_CAP_DETAIL,
    Listener,
    ListenerLimits,
    ProxyServer,
    SniCheck,
)
from egressd.proxy.net.stream import Peer, PeerClosed

log = logging.getLogger("egressd.transparent")

# DESIGN.md "What a client sees": the SNI listener's destination port is 443
# and the Host listener's is 80. A listener on another port (a test, an
# unusual sandbox) still decides and dials with these unless told otherwise.
TLS_PORT = 443
HTTP_PORT = 80

# Characters that cannot be in a Host header's authority (RFC 9110 §7.2 is
# uri-host [":" port]); any of them would let the header smuggle a path,
# query, userinfo or fragment into the destination.
_NOT_IN_HOST = frozenset("/?#@\\ \t")


def host_destination(head: RequestHead, port: int) -> Destination:
    """The destination of a request that reached the transparent HTTP listener.

    1. CONNECT, asterisk-form and authority-form → HttpError 400: this is an
       origin server's port, not a proxy's;
    2. absolute-form → its URI decides (RFC 9112 §3.2.2: a server ignores
       Host then), exactly as the proxy does;
    3. origin-form → exactly one Host header (RFC 9112 §3.2), a plain
       ``host[:port]`` whose port, if any, is the listener's;
    4. a destination port other than ``port`` → HttpError 400: the client
       connected to ``port``, so a Host naming another one is not where it
       went.

    The host is the header's text; ``policy.decide`` normalises it.
    """
    target = head.target
    if head.method == "CONNECT":
        raise HttpError(400, "CONNECT goes to the proxy port, not here")
    if "://" in target:
        destination = request_destination(head)
    elif target.startswith("/"):
        hosts = head.get_all("Host")
        if len(hosts) != 1:
            raise HttpError(400, "a request needs exactly one Host header")
        host = hosts[0]
        if not host or _NOT_IN_HOST & set(host):
            raise HttpError(400, "invalid Host header")
        absolute = RequestHead(head.method, f"http://{host}{target}", head.version, head.headers)
        destination = request_destination(absolute)
    else:
        raise HttpError(400, "invalid request target")
    if destination.port != port:
        raise HttpError(400, f"the request names port {destination.port}; this listener serves port {port}")
    return destination


class TransparentHttpServer(ProxyServer):
    """The Host-header listener: the proxy's forwarding, the Host header's destination.

    ``dest_port`` is the port every request here is decided and dialled on
    (80: the port the sandbox connected to).
    """

    def __init__(self, *, gate: Gate, runs: RunRegistry, limits: ListenerLimits, dest_port: int = HTTP_PORT) -> None:
        super().__init__(gate=gate, runs=runs, limits=limits)
        self.dest_port = dest_port

    def _destination(self, head: RequestHead) -> Destination:
        return host_destination(head, self.dest_port)

    def _attribute(self, source: IPAddress | None, head: RequestHead) -> Run | None:
        # By source address only: Proxy-Authorization is a proxy's header,
        # and a program that ignores proxy settings sends none.
        return self.runs.attribute(source, None)

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
        if reason is Reason.AUTH_REQUIRED and status is None:
            # 407 asks for proxy credentials, which a client that does not
            # know it talks to a proxy cannot send: refuse plainly.
            status = 403
        await super()._refuse(client, attempt, reason, status=status, detail=detail, retry_after_s=retry_after_s)


class _Refusal(Exception):
    """End this connection: the reason to record, and the alert to send (``responses.tls_refusal``).

    ``alert`` overrides the reason's own; ``silent``: close without an alert
    (the client has not spoken TLS, or is shed before it did).
    """

    def __init__(
        self, reason: Reason, detail: str | None = None, *, alert: Alert | None = None, silent: bool = False
    ) -> None:
        super().__init__(detail or reason.value)
        self.reason = reason
        self.detail = detail
        self.alert = alert
        self.silent = silent


class TransparentTlsServer(Listener):
    """The SNI listener. ``dest_port`` is the port decided on and dialled (443)."""

    def __init__(self, *, gate: Gate, runs: RunRegistry, limits: ListenerLimits, dest_port: int = TLS_PORT) -> None:
        super().__init__(gate=gate, runs=runs, limits=limits)
        self.dest_port = dest_port

    async def _serve_client(self, client: Peer) -> None:
        peer = client.peername or ("", 0)
        metrics = self.gate.metrics
        metrics.connections_open += 1
        metrics.connections_total["tls"] += 1
        attempt = self.gate.begin(EgressKind.TLS, f"{peer[0]}:{peer[1]}")
        attempt.port = self.dest_port
        record = True
        try:
            if metrics.connections_open > self.limits.max_connections:
                raise _Refusal(Reason.LIMIT_EXCEEDED, "too many open connections", silent=True)
            source = source_address(str(peer[0]))
            holder = self.runs.bound(source)  # known before the hello: its slow hellos count against its own cap
            if holder is not None and holder.at_connection_cap(self.limits.max_connections_per_run):
                attempt.run = holder
                raise _Refusal(Reason.LIMIT_EXCEEDED, RUN_CAP_DETAIL)
            with holder.waiting_head() if holder is not None else NOT_WAITING:
                hello = await self._read_hello(client)
            if hello is None:
                record = False  # closed before sending a byte: nothing was attempted
                return
            await self._serve_hello(client, attempt, hello, source)
        except _Refusal as refusal:
            attempt.refuse(refusal.reason, refusal.detail)
            if not refusal.silent:
                try:
                    await client.send(tls_refusal(refusal.reason, refusal.alert))
                except PeerClosed:
                    pass
        except PeerClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("TLS connection %s failed (request %s)", attempt.client, attempt.id)
            if not attempt.decided:
                attempt.refuse(Reason.BAD_REQUEST)
        finally:
            if not attempt.handed_off:
                if record:
                    self._finish(attempt)
                metrics.connections_open -= 1
                client.close()

    async def _read_hello(self, client: Peer) -> ClientHello | None:
        """The ClientHello, within the head timeout; None when the client closed at once."""
        deadline = asyncio.get_running_loop().time() + self.limits.head_timeout_s
        try:
            while True:
                if client.buf:
                    try:
                        hello = parse_client_hello(client.buf)
                    except NotTls:
                        raise _Refusal(Reason.BAD_REQUEST, "not a TLS ClientHello", silent=True) from None
                    except ClientHelloError as exc:
                        raise _Refusal(Reason.BAD_REQUEST, str(exc), alert=Alert.DECODE_ERROR) from None
                    if hello is not None:
                        return hello
                if not await client.fill(deadline):
                    if client.buf:
                        raise _Refusal(Reason.BAD_REQUEST, "closed inside the ClientHello", silent=True)
                    return None
        except TimeoutError:
            raise _Refusal(Reason.LIMIT_EXCEEDED, "no complete ClientHello in time", silent=True) from None

    async def _serve_hello(self, client: Peer, attempt: Attempt, hello: ClientHello, source: IPAddress | None) -> None:
        """Attribute, decide on the SNI, dial, replay and splice; refusals raise _Refusal."""
        if hello.server_name is None:
            raise _Refusal(Reason.BAD_REQUEST, "ClientHello without server_name", alert=Alert.MISSING_EXTENSION)
        # A name that is no host is kept as sent: the gate refuses it as bad_request.
        attempt.host = normalised(hello.server_name) or hello.server_name
        run = self.runs.attribute(source, None)
        if run is None:
            raise _Refusal(Reason.AUTH_REQUIRED)
        attempt.attribute(run)
        if hello.ech:
            # Refused before the policy runs: the SNI is a cover name, so no
            # approver is asked about it and nothing is dialled.
            raise _Refusal(Reason.SNI_MISMATCH, ECH_DETAIL)
        if run.open_connections >= self.limits.max_connections_per_run:
            raise _Refusal(Reason.LIMIT_EXCEEDED, "too many open connections in the run")
        run.open_connections += 1
        try:
            try:
                # A client that hangs up while held for an answer stops the wait (stream.gone_cancels);
                # after its ClientHello a TLS client cannot go on without sending.
                with client.gone_cancels(on_eof=True):
                    admission = await self.gate.admit(attempt, run, hello.server_name, self.dest_port)
            except PeerClosed:
                attempt.extra["detail"] = GONE_DETAIL
                raise
            if not admission.allowed:
                raise _Refusal(admission.reason or Reason.BAD_REQUEST)
            try:
                upstream = await self.gate.dial(attempt, admission, Peer)
            except DialError as exc:
                raise _Refusal(exc.reason, str(exc)) from None
            self._splice(client, upstream, attempt, check=SniCheck(self.gate, attempt, name_required=True))
        finally:
            if not attempt.handed_off:
                run.open_connections -= 1
