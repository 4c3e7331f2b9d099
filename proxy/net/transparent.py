"""The transparent SNI mode's conversation: tools that ignore proxy settings meet the same policy.

The sandbox's DNS (``dnsserver``) answers every name with egressd's address,
so a program that connects on its own lands on a transparent listener, on
port 443 or 80 of that address, without having said where it wanted to go.
The destination is read from what the client sends first, and then
everything happens as for the explicit proxy: the run by source address
(``runs``), the decision, the approval wait, resolution and the address
check, the dial of exactly the checked address (``gate``), the audit record.

- The SNI mode (``modes.transparent_tls``, served by ``serve_tls`` here)
  reads the ClientHello (``clienthello``) without terminating TLS, decides
  on its SNI with the mode's destination port (443), dials, replays the
  bytes it read and splices the two sockets (``tunnel``): the TLS session
  is end to end, between the client and the origin. It cannot answer in
  HTTP, so a refusal is a fatal TLS alert and the close (the audit record
  and the run's events say why); a ClientHello without SNI, or a malformed
  one, is refused the same way, and one that carries encrypted_client_hello
  (ECH: the SNI is a cover name) is refused as ``sni_mismatch`` before
  anything is decided. The splice checks the client's bytes until the
  handshake is settled (``server.SniCheck``): a second ClientHello, after a
  HelloRetryRequest, must name the same host.
- The Host mode (``modes.transparent_http``) is the proxy's absolute-form
  forwarding (``server.serve_http``) with the destination taken from the
  Host header (``modes.host_destination``) on port 80; a Host naming
  another port is refused. Refusals are HTTP answers, as from the proxy.

Both attribute by source address only: with ``--require-auth`` a source
bound to no run is refused (``auth_required``) and recorded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from egressd.audit.records import EgressKind
from egressd.names.addresses import IPAddress
from egressd.names.hosts import normalised
from egressd.proxy.core.clienthello import Alert, ClientHello, ClientHelloError, NotTls, parse_client_hello
from egressd.proxy.core.modes import (
    ECH_DETAIL,
    GONE_DETAIL,
    Reads,
    Refusal,
    head_too_slow,
    run_at_cap,
    too_many_connections,
)
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.responses import tls_refusal
from egressd.proxy.core.runs import NOT_WAITING, source_address
from egressd.proxy.net.gate import DialError, Seen
from egressd.proxy.net.server import SniCheck
from egressd.proxy.net.stream import Peer, PeerClosed

if TYPE_CHECKING:
    from egressd.proxy.net.listener import Held, Listener

log = logging.getLogger("egressd.transparent")


class _Refused(Exception):
    """End this connection with ``refusal`` (its alert: ``responses.tls_refusal``)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail or refusal.reason.value)
        self.refusal = refusal


async def serve_tls(listener: Listener, client: Peer) -> None:
    """Serve one client connection of the SNI mode, then release it (unless a tunnel has it).

    Until the gate starts deciding, what is known is a ``Seen`` (``held.attempt``): a
    refusal then is recorded whole, once (``Gate.refuse``); after, the gate's ``Attempt``.
    """
    held = listener.hold(client)  # counted open when its task runs, not at the accept
    gate = listener.gate
    limits = listener.limits
    reads = listener.mode.reads
    peer = client.peername or ("", 0)
    gate.metrics.connections_total["tls"] += 1
    seen = held.attempt = gate.begin(EgressKind.TLS, f"{peer[0]}:{peer[1]}", listener.mode.dest_port)
    try:
        if gate.metrics.connections_open > limits.max_connections:
            raise _Refused(too_many_connections(reads))
        source = source_address(str(peer[0]))
        holder = listener.runs.bound(source)  # known before the hello: its slow hellos count against its own cap
        if holder is not None and holder.at_connection_cap(limits.max_connections_per_run):
            held.attempt = seen._replace(run=holder)
            raise _Refused(run_at_cap(reads, attributed=False))
        with holder.waiting_head() if holder is not None else NOT_WAITING:
            hello = await _read_hello(client, limits.head_timeout_s)
        if hello is None:
            held.attempt = None  # closed before sending a byte: nothing was attempted
            return
        await _serve_hello(listener, held, seen, hello, source)
    except _Refused as refused:
        refusal = refused.refusal
        answer = None if refusal.silent else tls_refusal(refusal.reason, refusal.alert)
        await held.refuse(refusal.reason, refusal.detail, answer)
    except PeerClosed:
        pass
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("TLS connection %s failed (request %s)", seen.client, seen.id)
        held.failed()
    finally:
        held.release()


async def _read_hello(client: Peer, head_timeout_s: float) -> ClientHello | None:
    """The ClientHello, within the head timeout; None when the client closed at once."""
    deadline = client.loop.time() + head_timeout_s
    try:
        while True:
            if client.buf:
                try:
                    hello = parse_client_hello(client.buf)
                except NotTls:
                    raise _Refused(Refusal(Reason.BAD_REQUEST, "not a TLS ClientHello", silent=True)) from None
                except ClientHelloError as exc:
                    raise _Refused(Refusal(Reason.BAD_REQUEST, str(exc), alert=Alert.DECODE_ERROR)) from None
                if hello is not None:
                    return hello
            if not await client.fill(deadline):
                if client.buf:
                    raise _Refused(Refusal(Reason.BAD_REQUEST, "closed inside the ClientHello", silent=True))
                return None
    except TimeoutError:
        raise _Refused(head_too_slow(Reads.TLS)) from None


async def _serve_hello(
    listener: Listener, held: Held, seen: Seen, hello: ClientHello, source: IPAddress | None
) -> None:
    """Attribute, decide on the SNI, dial, replay and splice; refusals raise _Refused."""
    mode = listener.mode
    if hello.server_name is None:
        raise _Refused(Refusal(Reason.BAD_REQUEST, "ClientHello without server_name", alert=Alert.MISSING_EXTENSION))
    # A name that is no host is kept as sent: the gate refuses it as bad_request.
    seen = held.attempt = seen._replace(host=normalised(hello.server_name) or hello.server_name)
    run = listener.runs.attribute(source, mode.proxy_credentials(None))
    if run is None:
        raise _Refused(Refusal(Reason.AUTH_REQUIRED))
    seen = held.attempt = seen.attributed(run)
    if hello.ech:
        # Refused before the policy runs: the SNI is a cover name, so no
        # approver is asked about it and nothing is dialled.
        raise _Refused(Refusal(Reason.SNI_MISMATCH, ECH_DETAIL))
    if run.open_connections >= listener.limits.max_connections_per_run:
        raise _Refused(run_at_cap(mode.reads, attributed=True))
    assert mode.dest_port is not None
    attempt = held.attempt = listener.gate.attempt(seen, run, hello.server_name, mode.dest_port)
    with held.slot(run):
        try:
            # A client that hangs up while held for an answer stops the wait (stream.gone_cancels);
            # after its ClientHello a TLS client cannot go on without sending.
            with held.client.gone_cancels(on_eof=True):
                admission = await listener.gate.admit(attempt)
        except PeerClosed:
            attempt.extra["detail"] = GONE_DETAIL
            raise
        if not admission.allowed:
            raise _Refused(Refusal(admission.reason or Reason.BAD_REQUEST))
        try:
            upstream = await listener.gate.dial(attempt, admission, held.client.new_peer, held.client.loop)
        except DialError as exc:
            raise _Refused(Refusal(exc.reason, str(exc))) from None
        check = SniCheck(listener.gate, attempt, listener.limits.max_head_bytes, name_required=True)
        held.splice(upstream, attempt, check=check)
