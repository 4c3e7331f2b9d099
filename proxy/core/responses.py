"""What a refused client sees, as HTTP/1.1 bytes or a TLS alert, without I/O.

``refusal`` is the one place a refusal becomes an HTTP response: the status,
the ``X-Egress-*`` headers that tell a program why, and a one-line body that
tells a person (DESIGN.md "What a client sees"). ``tls_refusal`` is the one
place it becomes the fatal alert of a listener that cannot answer in HTTP.
Both take a ``Reason``, whose table (``reasons``) gives the default status,
phrase and alert; a caller overrides only what it knows better.

Everything interpolated into a refusal (host, message, run id, request id)
is escaped to printable ASCII first, so a hostile name can neither split
the head nor add a header or a body line.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Final

from egressd.names.shown import ascii_escaped
from egressd.proxy.core.clienthello import tls_alert
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Alert

# RFC 9110 §9.3.6: any 2xx to CONNECT opens the tunnel; no body, no fields.
CONNECT_ESTABLISHED: Final = b"HTTP/1.1 200 Connection established\r\n\r\n"

# Said instead of "private_address"'s usual phrase when the destination is one
# of egressd's own listening addresses and ports: the reason code stays, the
# person learns why (no allow_private exempts it).
OWN_ENDPOINT_MESSAGE: Final = "that address and port is egressd itself, which never connects to its own listeners"


def refusal(
    reason: Reason,
    host: str,
    port: int | None,
    run_id: str | None,
    request_id: str,
    *,
    status: int | None = None,
    message: str | None = None,
    retry_after_s: int | None = None,
) -> bytes:
    """A complete HTTP/1.1 refusal for ``reason``, to send before closing the connection.

    ``status`` and ``message`` default to the reason's (``Reason.status``,
    ``Reason.message``; an empty message too); a caller passes its own only where it knows better
    (431 for an oversized head, 408 for a slow one). The body is
    ``egressd: blocked HOST:PORT (MESSAGE) in run RUN`` and a newline;
    ``:PORT`` is left out when ``port`` is None, `` in run RUN`` when
    ``run_id`` is None, and an IPv6 host is bracketed before a port. A 407
    carries ``Proxy-Authenticate: Basic realm="egressd"`` (RFC 9110 §11.7.1).
    ``retry_after_s`` adds ``Retry-After`` after the ``X-Egress-*`` fields
    (RFC 9110 §10.2.3: a 429 for a connection cap says when to try again,
    RFC 6585 §4). Raises ValueError for a status that is not a 4xx/5xx known
    to ``http.HTTPStatus``.
    """
    if status is None:
        status = reason.status
    if not message:
        message = reason.message
    if not 400 <= status <= 599:
        raise ValueError(f"a refusal needs a 4xx or 5xx status, not {status}")
    phrase = HTTPStatus(status).phrase
    where = ascii_escaped(host)
    if port is not None:
        where = f"[{where}]:{port:d}" if ":" in where else f"{where}:{port:d}"
    body = f"egressd: blocked {where} ({ascii_escaped(message)})"
    if run_id is not None:
        body += f" in run {ascii_escaped(run_id)}"
    payload = (body + "\n").encode("ascii")

    fields = [
        ("X-Egress-Decision", "deny"),
        ("X-Egress-Reason", reason.value),
        ("X-Egress-Request-Id", ascii_escaped(request_id)),
    ]
    if status == 407:
        fields.append(("Proxy-Authenticate", 'Basic realm="egressd"'))
    if retry_after_s is not None:
        fields.append(("Retry-After", f"{retry_after_s:d}"))
    fields += [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(payload))),
        ("Connection", "close"),
    ]
    head = f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields)
    return (head + "\r\n").encode("ascii") + payload


def tls_refusal(reason: Reason, alert: Alert | None = None) -> bytes:
    """The fatal TLS alert record that refuses a client with ``reason``, to send before closing.

    The reason's alert (``Reason.alert``), or ``alert`` where the caller
    knows better (decode_error for a malformed ClientHello, missing_extension
    for one without server_name). A client that has not spoken TLS gets no
    alert at all: the caller sends nothing.
    """
    return tls_alert(alert if alert is not None else reason.alert)
