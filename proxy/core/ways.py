"""The ways in: what each listener mode reads first, and how its client hears a refusal.

One ``Way`` per mode (``modes.Reads``), each a layer under the conversation
(``conversation``), which does the rest the same way for all:

- ``HTTP`` (the explicit proxy, the transparent Host listener): request
  heads one after another (RFC 9112 §9.3), framed by ``exchange``; the
  destination from the request-target or the Host header (``Mode.destination``),
  the run by ``Proxy-Authorization`` and the source address; a refusal is an
  HTTP answer (``responses.refusal``); a CONNECT is answered ``200`` once the
  upstream is connected, an absolute-form request is forwarded.
- ``TLS`` (the transparent SNI listener): one ClientHello (``clienthello``),
  read without terminating TLS; the destination is its SNI on the
  listener's port, the run is the source address's; a refusal is a fatal
  TLS alert (``responses.tls_refusal``) or, before the client spoke TLS, the
  close alone. A hello carrying encrypted_client_hello is refused
  (``sni_mismatch``) before anything is decided: its SNI is a cover name.
- ``SOCKS`` (RFC 1928, RFC 1929): greeting, username and password (a run's
  id and token) or none when the source address finds a run, then the
  request: CONNECT is decided, BIND and UDP ASSOCIATE refused; a refusal
  after the request is the reply with the reason's REP (``Reason.socks``).

The whole head (hello, handshake) has the head timeout; a slow one is
shed (HTTP: 408). Pure: no I/O.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

from egressd.names.hosts import normalised
from egressd.proxy.core.attempt import Attempt, Seen
from egressd.proxy.core.clienthello import ClientHello, ClientHelloError, NotTls, parse_client_hello
from egressd.proxy.core.commands import Fill, PeerClosed, ReadHead, Send, Steps
from egressd.proxy.core.conversation import Conversation, Refused, Way
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import (
    ECH_DETAIL,
    Reads,
    Refusal,
    bad_head,
    head_too_slow,
    no_destination,
    run_at_cap,
)
from egressd.proxy.core.responses import CONNECT_ESTABLISHED, refusal, tls_refusal
from egressd.proxy.core.socks5 import (
    AUTH_FAILED,
    AUTH_OK,
    Command,
    Method,
    SocksError,
    choose_method,
    method_reply,
    parse_credentials,
    parse_greeting,
    parse_request,
    reply,
)
from egressd.vocabulary.egress import EgressKind
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Alert, SocksReply

T = TypeVar("T")  # a SOCKS handshake message

# Module constants: an Enum member's lookup on its class costs ten times a global's (every request).
_HTTP: Final = EgressKind.HTTP
_CONNECT: Final = EgressKind.CONNECT


class HttpWay:
    """Request heads, one after another: the explicit proxy and the transparent Host listener."""

    kind: EgressKind = EgressKind.HTTP
    counted: str | None = None  # counted per request, as CONNECT or HTTP
    name_required: bool = False
    accepted: bytes | None = CONNECT_ESTABLISHED

    def arrive(self, talk: Conversation) -> Steps:
        seen = talk.at.begin(_HTTP, talk.client, None)
        limits = talk.at.limits
        reads = talk.at.mode.reads
        exchange = talk.exchange
        if exchange is None:
            talk.holder = talk.at.runs.bound(talk.source)  # once per connection: its address's run does not change
            exchange = talk.exchange = Exchange(limits.max_head_bytes)
        holder = talk.holder
        if holder is not None and holder.at_connection_cap(limits.max_connections_per_run):
            raise Refused(seen._replace(run=holder), run_at_cap(reads, attributed=False))
        try:
            deadline = talk.now() + limits.head_timeout_s
            if holder is None:  # no run to count the wait against (no ``with``: every request comes here)
                head = yield ReadHead(exchange.read_request, deadline)
            else:
                with holder.waiting_head():
                    head = yield ReadHead(exchange.read_request, deadline)
        except TimeoutError:
            if not talk.first and not talk.buf:
                return None  # an idle keep-alive connection, not an attempt
            raise Refused(seen, head_too_slow(reads)) from None
        except HttpError as exc:
            raise Refused(seen, bad_head(exc)) from None
        if head is None:
            return None
        connect = head.method == "CONNECT"
        talk.at.metrics.connections_total["connect" if connect else "http"] += 1
        kind = _CONNECT if connect else _HTTP
        try:
            destination = talk.at.mode.destination(head)
        except HttpError as exc:
            raise Refused(seen._replace(kind=kind), no_destination(exc)) from None
        host, port = destination.host, destination.port
        try:
            run = talk.at.runs.attribute(talk.source, talk.at.mode.proxy_credentials(head))
        except Exception:
            talk.pending = seen._replace(kind=kind, host=host, port=port)  # recorded as the connection ends
            raise
        if run is None:
            raise Refused(seen._replace(kind=kind, host=host, port=port), Refusal(Reason.AUTH_REQUIRED))
        return seen, run, host, port, kind, None if connect else destination

    def answer(self, talk: Conversation, refused: Refusal, target: Seen | Attempt) -> bytes | None:
        run = target.run
        return refusal(
            refused.reason,
            target.host or "-",
            target.port,
            run.id if run else None,
            target.id,
            status=talk.at.mode.status(refused),
            message=target.message if isinstance(target, Attempt) else None,
            retry_after_s=refused.retry_after_s,
        )



class TlsWay:
    """One ClientHello: the transparent SNI listener."""

    kind: EgressKind = EgressKind.TLS
    counted: str | None = "tls"
    name_required: bool = True
    accepted: bytes | None = None  # the ClientHello read goes upstream first, then the splice

    def arrive(self, talk: Conversation) -> Steps:
        if not talk.first:
            return None
        seen = talk.pending = talk.at.begin(EgressKind.TLS, talk.client, talk.at.mode.dest_port)
        limits = talk.at.limits
        holder = talk.at.runs.bound(talk.source)  # known before the hello: its slow hellos count against its own cap
        if holder is not None and holder.at_connection_cap(limits.max_connections_per_run):
            raise Refused(seen._replace(run=holder), run_at_cap(Reads.TLS, attributed=False))
        if holder is None:
            hello = yield from self._hello(talk, seen)
        else:
            with holder.waiting_head():
                hello = yield from self._hello(talk, seen)
        if hello is None:
            talk.pending = None  # closed before sending a byte: nothing was attempted
            return None
        if hello.server_name is None:
            raise Refused(
                seen, Refusal(Reason.BAD_REQUEST, "ClientHello without server_name", alert=Alert.MISSING_EXTENSION)
            )
        # A name that is no host is kept as sent: the decision refuses it as bad_request.
        seen = talk.pending = seen._replace(host=normalised(hello.server_name) or hello.server_name)
        run = talk.at.runs.attribute(talk.source, talk.at.mode.proxy_credentials(None))
        if run is None:
            raise Refused(seen, Refusal(Reason.AUTH_REQUIRED))
        seen = talk.pending = seen.attributed(run)
        if hello.ech:
            # Refused before the policy runs: the SNI is a cover name, so no
            # approver is asked about it and nothing is dialled.
            raise Refused(seen, Refusal(Reason.SNI_MISMATCH, ECH_DETAIL))
        port = talk.at.mode.dest_port
        assert port is not None
        return seen, run, hello.server_name, port, None, None

    @staticmethod
    def _hello(talk: Conversation, seen: Seen) -> Steps:
        """The ClientHello, within the head timeout → None when the client closed at once."""
        buf = talk.buf
        deadline = talk.now() + talk.at.limits.head_timeout_s
        try:
            while True:
                if buf:
                    try:
                        hello: ClientHello | None = parse_client_hello(buf)
                    except NotTls:
                        raise Refused(seen, Refusal(Reason.BAD_REQUEST, "not a TLS ClientHello", silent=True)) from None
                    except ClientHelloError as exc:
                        raise Refused(seen, Refusal(Reason.BAD_REQUEST, str(exc), alert=Alert.DECODE_ERROR)) from None
                    if hello is not None:
                        return hello
                if not (yield Fill(deadline)):
                    if buf:
                        raise Refused(seen, Refusal(Reason.BAD_REQUEST, "closed inside the ClientHello", silent=True))
                    return None
        except TimeoutError:
            raise Refused(seen, head_too_slow(Reads.TLS)) from None

    def answer(self, talk: Conversation, refused: Refusal, target: Seen | Attempt) -> bytes | None:
        return None if refused.silent else tls_refusal(refused.reason, refused.alert)



# What a refused BIND or UDP ASSOCIATE is recorded with (the record's detail).
_COMMAND_DETAIL = {
    Command.BIND: "SOCKS BIND is not supported",
    Command.UDP_ASSOCIATE: "SOCKS UDP ASSOCIATE is not supported",
}


class SocksWay:
    """A SOCKS5 handshake: the SOCKS listener."""

    kind: EgressKind = EgressKind.SOCKS
    counted: str | None = "socks"
    name_required: bool = False
    # BND.ADDR and BND.PORT (RFC 1928 §6) left 0.0.0.0:0: egressd's upstream address is none of the
    # sandbox's business (no client of a CONNECT uses them).
    accepted: bytes | None = reply(SocksReply.SUCCEEDED)

    def arrive(self, talk: Conversation) -> Steps:
        if not talk.first:
            return None
        seen = talk.pending = talk.at.begin(EgressKind.SOCKS, talk.client, None)
        limits = talk.at.limits
        holder = talk.at.runs.bound(talk.source)  # known before the handshake: its slow ones count against its cap
        if holder is not None and holder.at_connection_cap(limits.max_connections_per_run):
            raise Refused(seen._replace(run=holder), run_at_cap(Reads.SOCKS, attributed=False))
        deadline = talk.now() + limits.head_timeout_s
        try:
            if holder is None:
                arrival = yield from self._handshake(talk, seen, deadline)
            else:
                with holder.waiting_head():
                    arrival = yield from self._handshake(talk, seen, deadline)
        except TimeoutError:
            raise Refused(talk.pending or seen, head_too_slow(Reads.SOCKS)) from None
        return arrival

    def _handshake(self, talk: Conversation, seen: Seen, deadline: float) -> Steps:
        """Greeting, authentication, request → the ``Arrival``; None when the client closed before its first byte."""
        runs = talk.at.runs
        try:
            offered = yield from _read(talk, seen, parse_greeting, deadline, "greeting")
        except SocksError as exc:
            raise Refused(seen, Refusal(Reason.BAD_REQUEST, exc.detail), None) from None
        if offered is None:
            talk.pending = None  # closed before sending a byte: nothing was attempted
            return None
        anonymous = runs.attribute(talk.source, None) is not None
        method = choose_method(offered, credentials=talk.at.mode.credentials, anonymous=anonymous)
        if method is Method.NO_ACCEPTABLE:
            detail = "no SOCKS method offered that egressd accepts (username/password: the run's id and token)"
            raise Refused(seen, Refusal(Reason.AUTH_REQUIRED, detail), method_reply(method))
        yield Send(method_reply(method))
        run = None
        if method is Method.USERNAME_PASSWORD:
            try:
                credentials = yield from _read(talk, seen, parse_credentials, deadline, "username and password")
            except SocksError as exc:
                raise Refused(seen, Refusal(Reason.BAD_REQUEST, exc.detail), AUTH_FAILED) from None
            if credentials is None:
                raise PeerClosed("closed before authenticating")
            run = runs.credentials(credentials.username, credentials.password)
            if run is None:
                raise Refused(seen, Refusal(Reason.AUTH_REQUIRED, "wrong SOCKS username or password"), AUTH_FAILED)
            seen = talk.pending = seen.attributed(run)
            yield Send(AUTH_OK)
        try:
            request = yield from _read(talk, seen, parse_request, deadline, "request")
        except SocksError as exc:
            answer = reply(exc.reply or SocksReply.GENERAL_FAILURE)
            raise Refused(seen, Refusal(Reason.BAD_REQUEST, exc.detail), answer) from None
        if request is None:
            raise PeerClosed("closed before its request")
        # A name that is no host is kept as sent: the decision refuses it as bad_request.
        seen = talk.pending = seen._replace(host=normalised(request.host) or request.host, port=request.port)
        if run is None:
            run = runs.attribute(talk.source, None)
            if run is None:  # the run the greeting found has ended since
                raise Refused(seen, Refusal(Reason.AUTH_REQUIRED))
            seen = talk.pending = seen.attributed(run)
        if request.command != Command.CONNECT:
            detail = _COMMAND_DETAIL[Command(request.command)]
            answer = reply(SocksReply.COMMAND_NOT_SUPPORTED)
            raise Refused(seen, Refusal(Reason.BAD_REQUEST, detail), answer)
        return seen, run, request.host, request.port, None, None

    def answer(self, talk: Conversation, refused: Refusal, target: Seen | Attempt) -> bytes | None:
        return None if refused.silent else reply(refused.reason.socks)



def _read(
    talk: Conversation, seen: Seen, parse: Callable[[bytearray], tuple[T, int] | None], deadline: float, what: str
) -> Steps:
    """One message at the start of the buffer (taken from it) → None when the client closed before a byte.

    TimeoutError past ``deadline``; SocksError from ``parse``; ``Refused`` if it closed inside one.
    """
    buf = talk.buf
    while True:
        if buf:
            parsed = parse(buf)
            if parsed is not None:
                message, used = parsed
                del buf[:used]
                return message
        if not (yield Fill(deadline)):
            if buf:
                raise Refused(talk.pending or seen, Refusal(Reason.BAD_REQUEST, f"closed inside the {what}"), None)
            return None


WAYS: Final[dict[Reads, Way]] = {Reads.HTTP: HttpWay(), Reads.TLS: TlsWay(), Reads.SOCKS: SocksWay()}
