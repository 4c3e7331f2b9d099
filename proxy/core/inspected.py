"""The way in inside an inspected connection: HTTP/1 requests read in clear from the client's TLS.

A CONNECT to a name the run has request rules for (DESIGN.md "Policy",
request rules) is answered and its TLS taken over with the run's own
certificate (the runner's ``Intercept``); from then on this way reads the
requests, one after another, on the same connection, and each is decided
on its own (``decision.decide_request``): its method, and its path
normalised (``requestrules.normalise_path``), the same path forwarded.

Inside the tunnel a request may only go where the tunnel goes: its Host (or
an absolute-form target) must name the tunnel's host and port, else it is
refused ``sni_mismatch`` with the name it asked for (as a tunnel's plain
HTTP is, ``tunnelcheck``); a CONNECT inside it is ``bad_request``. A
refusal is an HTTP answer inside the TLS, as the explicit proxy gives one.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from egressd.approvals.message import HeldRequest
from egressd.names.authority import AuthorityError, Colons, parse_authority
from egressd.names.hosts import normalised
from egressd.proxy.core.attempt import Seen
from egressd.proxy.core.commands import ReadHead, Steps
from egressd.proxy.core.conversation import Conversation, Refused
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import Reads, Refusal, bad_head, head_too_slow
from egressd.proxy.core.requestrules import PathError, RequestError, approval_prefix, normalise_path, override_method
from egressd.proxy.core.runs import Run
from egressd.proxy.core.ways import HttpWay
from egressd.vocabulary.egress import EgressKind
from egressd.vocabulary.reasons import Reason

_HTTPS: Final = EgressKind.HTTPS


class NamedElsewhere(HttpError):
    """A request inside the tunnel names another host or port than the tunnel's (``named``: which)."""

    def __init__(self, named: str) -> None:
        super().__init__(400, f"the request names {named}, not the tunnel's host")
        self.named = named


class Inside(NamedTuple):
    """One request inside the tunnel: where it goes, and what it is decided on."""

    destination: Destination  # the tunnel's host and port, the normalised target to forward
    method: str  # the method it is judged as (a method-override header's, when it names one)
    path: str  # normalised, without the query
    shown: HeldRequest  # what an approver is shown of it


def inside_request(head: RequestHead, host: str, port: int) -> Inside:
    """Where a request read inside the tunnel to ``host``:``port`` goes, or HttpError.

    ``host`` is the tunnel's, as the policy normalised it. The target is
    origin-form with exactly one Host header naming the tunnel (its port
    optional when it is the tunnel's), or absolute-form ``https://`` naming
    it; the path is normalised (``PathError`` → 400, ``bad_request``), and
    the method is the one an override header names, when it names one.
    """
    if head.method == "CONNECT":
        raise HttpError(400, "CONNECT inside an inspected tunnel")
    target = head.target
    if target.startswith("/"):
        hosts = head.get_all("Host")
        if len(hosts) != 1:
            raise HttpError(400, "a request needs exactly one Host header")
        authority = hosts[0]
    elif "://" in target:
        scheme, _, rest = target.partition("://")
        if scheme.lower() != "https":
            raise HttpError(400, "inside an inspected tunnel a target is https or origin-form")
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        authority, target = rest[:cut], rest[cut:] or "/"
        if not target.startswith("/"):
            target = "/" + target
    else:
        raise HttpError(400, "invalid request target")
    _same_place(authority, host, port)
    try:
        normal = normalise_path(target)
    except PathError as exc:
        raise HttpError(400, f"path not normalisable: {exc}") from None
    try:
        method = override_method(head.headers) or head.method
    except RequestError as exc:
        raise HttpError(400, str(exc)) from None
    shown = HeldRequest(
        method, normal.path, approval_prefix(normal.path), normal.query_names,
        head.get("Content-Type"), _declared_length(head),
    )
    return Inside(Destination("https", host, port, normal.target), method, normal.path, shown)


def _declared_length(head: RequestHead) -> int | None:
    """The body size the request declares (Content-Length), for the approver; None when it declares none."""
    value = head.get("Content-Length")
    return int(value) if value is not None and value.isdigit() and len(value) < 19 else None


def _same_place(authority: str, host: str, port: int) -> None:
    """The authority names the tunnel's host and port (its port may be left out), else NamedElsewhere."""
    if "@" in authority:
        raise HttpError(400, "userinfo in request target is not allowed")
    try:
        named_host, named_port = parse_authority(authority, port, colons=Colons.FIRST, host=str, host_first=True)
    except AuthorityError:
        raise HttpError(400, "invalid Host header") from None
    if (normalised(named_host) or named_host) != host or named_port != port:
        raise NamedElsewhere(authority)


class InspectedWay(HttpWay):
    """Requests inside an intercepted TLS connection to one host and port, in one run.

    Made by the conversation once the client's TLS is taken over; the
    tunnel's ``Attempt`` stays open as the connection's record.
    """

    kind: EgressKind = EgressKind.HTTPS
    accepted: bytes | None = None

    def __init__(self, run: Run, host: str, port: int, max_head_bytes: int) -> None:
        self.run = run
        self.host = host
        self.port = port
        self.exchange = Exchange(max_head_bytes)  # the requests in clear: a framing of their own
        self.request: Inside | None = None  # the request being carried

    def arrive(self, talk: Conversation) -> Steps:
        run, host, port = self.run, self.host, self.port
        seen: Seen = talk.at.begin(_HTTPS, talk.client, port)._replace(
            host=host, run=run, command=run.command
        )
        talk.exchange = self.exchange
        try:
            head = yield ReadHead(self.exchange.read_request, talk.now() + talk.at.limits.head_timeout_s)
        except TimeoutError:
            if not talk.buf:
                return None  # an idle keep-alive connection, not an attempt
            raise Refused(seen, head_too_slow(Reads.HTTP)) from None
        except HttpError as exc:
            raise Refused(seen, bad_head(exc)) from None
        if head is None:
            return None
        try:
            inside = self.request = inside_request(head, host, port)
        except NamedElsewhere as exc:
            raise Refused(seen, Refusal(Reason.SNI_MISMATCH, f"the request names {exc.named}")) from None
        except HttpError as exc:
            raise Refused(seen, Refusal(Reason.BAD_REQUEST, exc.detail, status=exc.status)) from None
        talk.at.metrics.connections_total["https"] += 1
        return seen, run, host, port, _HTTPS, inside.destination
