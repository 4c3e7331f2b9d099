"""What an audit record says of an egress attempt: its kind, its decision, how it ended.

The members' values are the strings the records hold (DESIGN.md, "Audit log").
"""

from __future__ import annotations

import enum

__all__ = ["Decision", "EgressKind", "End"]


class EgressKind(enum.StrEnum):
    """What an egress attempt was: the ``kind`` of its ``egress`` record."""

    CONNECT = "connect"  # a CONNECT tunnel through the explicit proxy
    HTTP = "http"  # a plain-HTTP request, explicit or transparent
    TLS = "tls"  # a transparent TLS connection, decided on its SNI
    DNS = "dns"  # a query to egressd's DNS server
    SOCKS = "socks"  # a SOCKS5 CONNECT (or a refused BIND / UDP ASSOCIATE) through the SOCKS listener
    HTTPS = "https"  # one request inside an inspected TLS connection, decided on its method and path


class Decision(enum.StrEnum):
    """Allowed or refused: the ``decision`` of an egress or approval record."""

    ALLOW = "allow"
    DENY = "deny"


class End(enum.StrEnum):
    """Why an allowed connection ended when nothing was refused: the ``end`` of its ``egress.end`` record.

    Any other ``end`` is a reason code (``sni_mismatch``, ``upstream_unreachable``,
    ...): the connection was cut, and readers show it as a refusal.
    """

    CLOSED = "closed"  # one side closed
    IDLE_TIMEOUT = "idle_timeout"  # no byte either way for the listener's idle limit
    SHUTDOWN = "shutdown"  # egressd stopped
    # The worker process serving it died (``--workers``); the owner ends its record, bytes not known (null).
    WORKER_LOST = "worker_lost"
