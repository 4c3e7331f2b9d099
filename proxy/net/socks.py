"""The SOCKS5 mode's conversation: tools that speak only SOCKS meet the same policy.

``serve_socks`` serves one client connection of a ``Listener`` in the SOCKS
mode (``modes.SOCKS``): the handshake as ``socks5`` parses it, then exactly
what a CONNECT through the explicit proxy gets (``gate``: the decision
order, holds and approvals, resolution and the address check, the dial of
the checked address, the write-ahead record of kind ``socks``), then the
splice (``listener.Held.splice``), with the same ClientHello check as a
CONNECT tunnel (``server.SniCheck``).

1. the greeting: username/password (RFC 1929) is chosen when the client
   offers it; no authentication when the client's source address finds a
   run (a bound sandbox, or the default run of ``egressd serve`` without
   ``--require-auth``), as the proxy allows a request without
   ``Proxy-Authorization``; else no method is acceptable (``auth_required``);
2. username and password are a run's id and token, checked as
   ``Proxy-Authorization`` is (``RunRegistry.credentials``); wrong ones get
   status 1 and the close (``auth_required``);
3. the request: CONNECT is decided; BIND and UDP ASSOCIATE get REP 7
   (``bad_request``, recorded). A domain (ATYP 3) is decided as sent and
   resolved only once the policy allowed it; an IPv4 or IPv6 address
   (ATYP 1, 4) is an IP literal under the policy.

The whole handshake has the head timeout (a slow one is shed silently, as a
slow ClientHello); the listener's and the run's connection caps apply as to
the other modes. A refusal after the request is the reply with the reason's
REP (``Reason.socks``), then the close; every attempt is recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from egressd.audit.records import EgressKind
from egressd.names.addresses import IPAddress
from egressd.names.hosts import normalised
from egressd.proxy.core.modes import GONE_DETAIL, Reads, Refusal, head_too_slow, run_at_cap, too_many_connections
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.runs import NOT_WAITING, Run, source_address
from egressd.proxy.core.socks5 import (
    AUTH_FAILED,
    AUTH_OK,
    Command,
    Method,
    SocksError,
    SocksReply,
    SocksRequest,
    choose_method,
    method_reply,
    parse_credentials,
    parse_greeting,
    parse_request,
    reply,
)
from egressd.proxy.net.gate import DialError, Seen
from egressd.proxy.net.server import SniCheck
from egressd.proxy.net.stream import Peer, PeerClosed

if TYPE_CHECKING:
    from egressd.proxy.net.listener import Held, Listener

log = logging.getLogger("egressd.socks")
T = TypeVar("T")  # a handshake message

_SUCCEEDED = reply(SocksReply.SUCCEEDED)

# What a refused BIND or UDP ASSOCIATE is recorded with (the record's detail).
_COMMAND_DETAIL = {
    Command.BIND: "SOCKS BIND is not supported",
    Command.UDP_ASSOCIATE: "SOCKS UDP ASSOCIATE is not supported",
}


class _Refused(Exception):
    """End this connection with ``refusal``, after sending ``answer`` (None: close without one)."""

    def __init__(self, refusal: Refusal, answer: bytes | None = None) -> None:
        super().__init__(refusal.detail or refusal.reason.value)
        self.refusal = refusal
        self.answer = answer


def _refused(reason: Reason, detail: str | None = None, rep: SocksReply | None = None) -> _Refused:
    """A refusal after the request was read: the reply carries ``rep`` or the reason's REP."""
    return _Refused(Refusal(reason, detail), reply(rep if rep is not None else reason.socks))


async def serve_socks(listener: Listener, client: Peer) -> None:
    """Serve one client connection of the SOCKS mode, then release it (unless a tunnel has it).

    Until the gate starts deciding, what is known is a ``Seen`` (``held.attempt``),
    recorded whole once on a refusal (``Gate.refuse``); after, the gate's ``Attempt``.
    """
    held = listener.hold(client)  # counted open when its task runs, not at the accept
    gate = listener.gate
    limits = listener.limits
    peer = client.peername or ("", 0)
    gate.metrics.connections_total["socks"] += 1
    seen = held.attempt = gate.begin(EgressKind.SOCKS, f"{peer[0]}:{peer[1]}")
    try:
        if gate.metrics.connections_open > limits.max_connections:
            raise _Refused(too_many_connections(Reads.SOCKS))
        source = source_address(str(peer[0]))
        holder = listener.runs.bound(source)  # known before the handshake: its slow ones count against its cap
        if holder is not None and holder.at_connection_cap(limits.max_connections_per_run):
            held.attempt = seen._replace(run=holder)
            raise _Refused(run_at_cap(Reads.SOCKS, attributed=False))
        deadline = client.loop.time() + limits.head_timeout_s
        try:
            with holder.waiting_head() if holder is not None else NOT_WAITING:
                handshake = await _handshake(listener, held, seen, source, deadline)
        except TimeoutError:
            raise _Refused(head_too_slow(Reads.SOCKS)) from None
        if handshake is None:
            held.attempt = None  # closed before sending a byte: nothing was attempted
            return
        await _serve_request(listener, held, source, *handshake)
    except _Refused as refused:
        await held.refuse(refused.refusal.reason, refused.refusal.detail, refused.answer)
    except PeerClosed:
        pass
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("SOCKS connection %s failed (request %s)", seen.client, seen.id)
        held.failed()
    finally:
        held.release()


async def _read(
    client: Peer, parse: Callable[[bytearray], tuple[T, int] | None], deadline: float, what: str
) -> T | None:
    """One message at the start of the buffer (taken from it); None when the client closed before a byte.

    TimeoutError past ``deadline``; SocksError from ``parse``; ``_Refused`` if it closed inside one.
    """
    while True:
        if client.buf:
            parsed = parse(client.buf)
            if parsed is not None:
                message, used = parsed
                del client.buf[:used]
                return message
        if not await client.fill(deadline):
            if client.buf:
                raise _Refused(Refusal(Reason.BAD_REQUEST, f"closed inside the {what}"))
            return None


async def _handshake(
    listener: Listener, held: Held, seen: Seen, source: IPAddress | None, deadline: float
) -> tuple[Seen, Run | None, SocksRequest] | None:
    """Greeting, authentication, request; None when the client closed before its first byte.

    The run is the one the credentials name (None: no authentication was chosen).
    """
    client = held.client
    runs = listener.runs
    try:
        offered = await _read(client, parse_greeting, deadline, "greeting")
    except SocksError as exc:
        raise _Refused(Refusal(Reason.BAD_REQUEST, exc.detail)) from None
    if offered is None:
        return None
    anonymous = runs.attribute(source, None) is not None
    method = choose_method(offered, credentials=listener.mode.credentials, anonymous=anonymous)
    if method is Method.NO_ACCEPTABLE:
        detail = "no SOCKS method offered that egressd accepts (username/password: the run's id and token)"
        raise _Refused(Refusal(Reason.AUTH_REQUIRED, detail), method_reply(method))
    await client.send(method_reply(method))
    run: Run | None = None
    if method is Method.USERNAME_PASSWORD:
        try:
            credentials = await _read(client, parse_credentials, deadline, "username and password")
        except SocksError as exc:
            raise _Refused(Refusal(Reason.BAD_REQUEST, exc.detail), AUTH_FAILED) from None
        if credentials is None:
            raise PeerClosed("closed before authenticating")
        run = runs.credentials(credentials.username, credentials.password)
        if run is None:
            raise _Refused(Refusal(Reason.AUTH_REQUIRED, "wrong SOCKS username or password"), AUTH_FAILED)
        seen = held.attempt = seen.attributed(run)
        await client.send(AUTH_OK)
    try:
        request = await _read(client, parse_request, deadline, "request")
    except SocksError as exc:
        raise _Refused(
            Refusal(Reason.BAD_REQUEST, exc.detail), reply(exc.reply or SocksReply.GENERAL_FAILURE)
        ) from None
    if request is None:
        raise PeerClosed("closed before its request")
    return seen, run, request


async def _serve_request(
    listener: Listener, held: Held, source: IPAddress | None, seen: Seen, run: Run | None, request: SocksRequest
) -> None:
    """Attribute, decide, dial, reply and splice (``held.splice``); refusals raise _Refused."""
    # A name that is no host is kept as sent: the gate refuses it as bad_request.
    seen = held.attempt = seen._replace(host=normalised(request.host) or request.host, port=request.port)
    if run is None:
        run = listener.runs.attribute(source, None)
        if run is None:  # the run the greeting found has ended since
            raise _refused(Reason.AUTH_REQUIRED)
        seen = held.attempt = seen.attributed(run)
    if request.command != Command.CONNECT:
        raise _refused(Reason.BAD_REQUEST, _COMMAND_DETAIL[Command(request.command)], SocksReply.COMMAND_NOT_SUPPORTED)
    if run.open_connections >= listener.limits.max_connections_per_run:
        refusal = run_at_cap(Reads.SOCKS, attributed=True)
        raise _Refused(refusal, reply(refusal.reason.socks))
    gate = listener.gate
    attempt = held.attempt = gate.attempt(seen, run, request.host, request.port)
    with held.slot(run):
        try:
            # A client that hangs up while held for an answer stops the wait (stream.gone_cancels).
            with held.client.gone_cancels(on_eof=True):
                admission = await gate.admit(attempt)
        except PeerClosed:
            attempt.extra["detail"] = GONE_DETAIL
            raise
        if not admission.allowed:
            raise _refused(admission.reason or Reason.BAD_REQUEST)
        try:
            upstream = await gate.dial(attempt, admission, held.client.new_peer, held.client.loop)
        except DialError as exc:
            raise _refused(exc.reason, str(exc)) from None
        try:
            # BND.ADDR and BND.PORT (RFC 1928 §6) left 0.0.0.0:0: egressd's upstream address is none of the
            # sandbox's business (no client of a CONNECT uses them).
            await held.client.send(_SUCCEEDED)
        except BaseException:
            upstream.close()
            raise
        held.splice(upstream, attempt, check=SniCheck(gate, attempt, listener.limits.max_head_bytes))

