"""What a listener is, as values: its mode, its limits and the refusals it sends, without I/O.

egressd has one listener (``egressd.proxy.net.listener.Listener``) in four
modes (the explicit proxy, the transparent Host and SNI listeners, SOCKS5).
A ``Mode`` says, for each, what the network shell must not decide on its
own:

1. what the client sends first (``Reads``): an HTTP request head (the
   explicit proxy, the transparent Host listener), a TLS ClientHello
   (the transparent SNI listener) or a SOCKS5 greeting (``socks5``);
2. how the destination is found: the request-target alone
   (``http1.request_destination``), the Host header on the listener's
   destination port (``host_destination``), or the ClientHello's SNI on it;
3. how a run is attributed: by ``Proxy-Authorization`` (SOCKS: RFC 1929's
   username and password, the same run id and token) and then the source
   address (the explicit proxy, SOCKS), or by the source address only (a program
   that ignores proxy settings sends no proxy credentials);
4. how a refusal is sent: an HTTP answer (``responses.refusal``, with the
   status ``Mode.status`` gives), a TLS alert (``responses.tls_refusal``)
   or a SOCKS reply (``socks5.reply`` with the reason's REP).

Which refusal each limit or bad input earns is a ``Refusal`` value, from the
functions at the end, for the mode that met it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from egressd.proxy.core.http1.destination import Destination, request_destination
from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Alert

# DESIGN.md "What a client sees": the SNI listener's destination port is 443
# and the Host listener's is 80. A listener on another port (a test, an
# unusual sandbox) still decides and dials with these unless told otherwise.
TLS_PORT = 443
HTTP_PORT = 80

# A connection cap's 429 says to try again in a second: connections end all the time.
RETRY_AFTER_S = 1
# Why a run's connection is refused at its cap (the record's detail).
RUN_CAP_DETAIL = "too many open connections in the run"
# Why nothing was dialled for a client that hung up while its request was decided (held for an answer).
GONE_DETAIL = "the client went away before its request was decided"
# Why a ClientHello carrying encrypted_client_hello is refused (the record's detail).
ECH_DETAIL = "encrypted_client_hello hides the server name asked for"

# Characters that cannot be in a Host header's authority (RFC 9110 §7.2 is
# uri-host [":" port]); any of them would let the header smuggle a path,
# query, userinfo or fragment into the destination.
_NOT_IN_HOST = frozenset("/?#@\\ \t")


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """The listener's limits; see ``egressd.config.settings`` for why each default."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    upload_budget_bytes: int = 0  # per run and registered domain before a person is asked again (0: none)
    request_body_cap_bytes: int = 0  # one inspected request's body before a person is asked (0: none)
    max_connections: int = 10000
    max_connections_per_run: int = 1000
    splice: bool = True  # a tunnel's bytes move in the kernel once nothing is left to look at (where Linux has it)


class Reads(enum.Enum):
    """What a listener reads first from a client, to learn where it goes."""

    HTTP = "http"  # request heads, one after another (RFC 9112 §9.3)
    TLS = "tls"  # one ClientHello (RFC 8446 §4.1.2), then the bytes are spliced
    SOCKS = "socks"  # a SOCKS5 handshake (RFC 1928, RFC 1929), then the bytes are spliced


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal before or instead of a decision: the reason recorded, and how the client hears it.

    ``detail`` goes to the record only. HTTP: ``status`` overrides the
    reason's, ``retry_after_s`` goes with a 429. TLS: ``alert`` overrides the
    reason's; ``silent`` closes without one (the client has not spoken TLS,
    or is shed before it did).
    """

    reason: Reason
    detail: str | None = None
    status: int | None = None
    retry_after_s: int | None = None
    alert: Alert | None = None
    silent: bool = False


@dataclass(frozen=True, slots=True)
class Mode:
    """One listener mode (the module docstring's steps 1-4).

    ``dest_port``: the port every request is decided and dialled on (the
    transparent listeners: the port the sandbox connected to); None for the
    explicit proxy, whose requests name their own.
    """

    name: str
    reads: Reads
    dest_port: int | None = None
    credentials: bool = False  # Proxy-Authorization attributes a request (the explicit proxy)

    def destination(self, head: RequestHead) -> Destination:
        """Where an HTTP request goes (HttpError if it names none this listener serves)."""
        if self.dest_port is None:
            return request_destination(head)
        return host_destination(head, self.dest_port)

    def proxy_credentials(self, head: RequestHead | None) -> str | None:
        """The credentials a run is attributed by (``runs.RunRegistry.attribute``); None: source address only."""
        if not self.credentials or head is None:
            return None
        lowered = head.lowered
        if lowered is not None and "\nproxy-authorization:" not in lowered:
            return None  # the parse saw no such field: no scan of the fields
        return head.get("Proxy-Authorization")

    def status(self, refusal: Refusal) -> int | None:
        """The HTTP status a refusal is answered with (None: the reason's own)."""
        if refusal.reason is Reason.AUTH_REQUIRED and refusal.status is None and not self.credentials:
            # 407 asks for proxy credentials, which a client that does not
            # know it talks to a proxy cannot send: refuse plainly.
            return 403
        return refusal.status


EXPLICIT = Mode("proxy", Reads.HTTP, credentials=True)
SOCKS = Mode("socks", Reads.SOCKS, credentials=True)


def transparent_http(dest_port: int = HTTP_PORT) -> Mode:
    """The Host-header listener: the proxy's forwarding, the Host header's destination."""
    return Mode("transparent_http", Reads.HTTP, dest_port)


def transparent_tls(dest_port: int = TLS_PORT) -> Mode:
    """The SNI listener: decides on the ClientHello's server name."""
    return Mode("transparent_tls", Reads.TLS, dest_port)


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


# -- which refusal ---------------------------------------------------------------------------


def too_many_connections(reads: Reads) -> Refusal:
    """The listener is at ``max_connections``: shed at once (TLS, SOCKS: before the client spoke, so no answer)."""
    if reads is not Reads.HTTP:
        return Refusal(Reason.LIMIT_EXCEEDED, "too many open connections", silent=True)
    return Refusal(Reason.LIMIT_EXCEEDED, status=429, retry_after_s=RETRY_AFTER_S)


def run_at_cap(reads: Reads, *, attributed: bool) -> Refusal:
    """The run is at ``max_connections_per_run``.

    ``attributed``: found when the request was attributed, not by its source
    address's run before the head (the HTTP record then has no detail).
    """
    if reads is Reads.TLS:
        return Refusal(Reason.LIMIT_EXCEEDED, RUN_CAP_DETAIL)
    if reads is Reads.SOCKS:
        return Refusal(Reason.LIMIT_EXCEEDED, RUN_CAP_DETAIL, silent=not attributed)
    detail = None if attributed else RUN_CAP_DETAIL
    return Refusal(Reason.LIMIT_EXCEEDED, detail, status=429, retry_after_s=RETRY_AFTER_S)


def head_too_slow(reads: Reads) -> Refusal:
    """No complete request head (ClientHello, SOCKS handshake) within ``head_timeout_s``."""
    if reads is Reads.TLS:
        return Refusal(Reason.LIMIT_EXCEEDED, "no complete ClientHello in time", silent=True)
    if reads is Reads.SOCKS:
        return Refusal(Reason.LIMIT_EXCEEDED, "SOCKS handshake too slow", silent=True)
    return Refusal(Reason.LIMIT_EXCEEDED, "request head too slow", status=408)


def bad_head(error: HttpError) -> Refusal:
    """A request head that did not parse: 431 is a limit, the rest bad requests (status as the parser says)."""
    reason = Reason.LIMIT_EXCEEDED if error.status == 431 else Reason.BAD_REQUEST
    return Refusal(reason, error.detail, status=error.status)


def no_destination(error: HttpError) -> Refusal:
    """A parsed head that names no destination this listener serves."""
    return Refusal(Reason.BAD_REQUEST, error.detail, status=error.status)
