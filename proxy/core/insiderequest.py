"""One request on an inspected name, made unambiguous: where it goes, the method and path it is judged on.

Inside an intercepted tunnel (``inside_request``) a request may only go
where the tunnel goes: its Host, or an ``https://`` absolute-form target,
must name the tunnel's host and port (else ``NamedElsewhere``: the way in
refuses it ``sni_mismatch``, as a tunnel's plain HTTP is); a CONNECT inside
is refused. A plain-HTTP request to an inspected name (``plain_request``)
already has its destination. Either way the path is normalised
(``requestrules.normalise_path``: what is decided is what is forwarded),
the method is the one an override header names when one does (``WEBSOCKET``
for a WebSocket upgrade, whatever it says), and the
approver is shown the request (``HeldRequest``: names, never values).
Pure: no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from egressd.approvals.message import HeldRequest
from egressd.names.authority import AuthorityError, Colons, parse_authority
from egressd.names.hosts import normalised
from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.forwarding import asks_websocket
from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.requestrules import (
    WEBSOCKET,
    PathError,
    RequestError,
    approval_prefix,
    normalise_path,
    override_method,
)

# TRACE echoes the request back (a secret put in included); CONNECT opens a tunnel no rule sees.
NEVER_INSPECTED = frozenset({"TRACE", "CONNECT"})


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
    return _judged(head, host, port, target, "https")


def _judged(head: RequestHead, host: str, port: int, target: str, scheme: str) -> Inside:
    if head.method in NEVER_INSPECTED:
        raise HttpError(400, f"{head.method} is never let through an inspected connection")
    try:
        normal = normalise_path(target)
    except PathError as exc:
        raise HttpError(400, f"path not normalisable: {exc}") from None
    try:
        # A WebSocket upgrade carries what it likes once switched: judged as the method WEBSOCKET, which
        # only a rule naming it (or naming no method) allows, never ``read_only``.
        method = WEBSOCKET if asks_websocket(head) else override_method(head.headers) or head.method
    except RequestError as exc:
        raise HttpError(400, str(exc)) from None
    shown = HeldRequest(
        method, normal.path, approval_prefix(normal.path), normal.query_names,
        head.get("Content-Type"), _declared_length(head),
    )
    return Inside(Destination(scheme, host, port, normal.target), method, normal.path, shown)


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


def plain_request(head: RequestHead, destination: Destination) -> Inside:
    """A plain-HTTP request to an inspected name: its path normalised (forwarded so), its method judged."""
    return _judged(head, destination.host, destination.port, destination.path, "http")
