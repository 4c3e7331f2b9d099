"""What a refused client sees, as HTTP/1.1 bytes, without I/O.

``refusal`` is the one place a refusal becomes a response: the status, the
``X-Egress-*`` headers that tell a program why, and a one-line body that
tells a person (DESIGN.md "What a client sees"). ``REASON_MESSAGES`` and
``STATUS_FOR_REASON`` map each reason code to its phrase and default status.

Everything interpolated into a refusal (host, message, run id, request id,
reason code, extra header values) is escaped to printable ASCII first, so a
hostile name can neither split the head nor add a header or a body line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from types import MappingProxyType
from typing import Final

from names.shown import ascii_escaped

# RFC 9110 §9.3.6: any 2xx to CONNECT opens the tunnel; no body, no fields.
CONNECT_ESTABLISHED: Final = b"HTTP/1.1 200 Connection established\r\n\r\n"

REASON_MESSAGES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "denylisted": "on the denylist",
        "not_allowlisted": "not on the allowlist",
        "denied": "denied by approver",
        "approval_timeout": "no answer from an approver in time",
        "no_approver": "no approver attached",
        "denied_earlier": "denied earlier in this run",
        "too_many_pending": "too many approvals pending",
        "ip_literal": "IP address not allowlisted",
        "private_address": "resolves only to private or special addresses",
        "port_not_allowed": "port not allowed for this host",
        "sni_mismatch": "TLS server name differs from the CONNECT host",
        "bad_request": "malformed request",
        "auth_required": "run credentials missing or wrong",
        "resolve_failed": "could not resolve",
        "upstream_unreachable": "could not connect upstream",
        "upstream_timeout": "upstream timed out",
        "limit_exceeded": "a limit was exceeded",
        "audit_unavailable": "the audit log cannot be written",
        "shutting_down": "egressd stopped while the request was held",
    }
)

# Said instead of "private_address"'s usual phrase when the destination is one
# of egressd's own listening addresses and ports: the reason code stays, the
# person learns why (no allow_private exempts it).
OWN_ENDPOINT_MESSAGE: Final = "that address and port is egressd itself, which never connects to its own listeners"

_POLICY_REASONS: Final = (
    "denylisted",
    "not_allowlisted",
    "denied",
    "approval_timeout",
    "no_approver",
    "denied_earlier",
    "too_many_pending",
    "ip_literal",
    "private_address",
    "port_not_allowed",
    "sni_mismatch",
)

# The default status per reason; the caller overrides where the same reason
# has a more precise status (431 for an oversized head, 408 for a slow one).
STATUS_FOR_REASON: Final[Mapping[str, int]] = MappingProxyType(
    {reason: 403 for reason in _POLICY_REASONS}
    | {
        "bad_request": 400,
        "auth_required": 407,
        "resolve_failed": 502,
        "upstream_unreachable": 502,
        "upstream_timeout": 504,
        "limit_exceeded": 429,
        "audit_unavailable": 503,
        "shutting_down": 503,
    }
)

# RFC 9110 §5.6.2 token: the only header names we will emit.
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Fields the refusal sets itself; an extra copy would contradict them.
_OWN_FIELDS: Final = frozenset(
    {
        "x-egress-decision",
        "x-egress-reason",
        "x-egress-request-id",
        "proxy-authenticate",
        "content-type",
        "content-length",
        "connection",
    }
)
def refusal(
    status: int,
    reason_code: str,
    host: str,
    port: int | None,
    run_id: str | None,
    request_id: str,
    message: str,
    extra_headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    """A complete HTTP/1.1 refusal, to send before closing the connection.

    The body is ``egressd: blocked HOST:PORT (MESSAGE) in run RUN`` and a
    newline; ``:PORT`` is left out when ``port`` is None, `` in run RUN``
    when ``run_id`` is None, and an IPv6 host is bracketed before a port. A
    407 carries ``Proxy-Authenticate: Basic realm="egressd"`` (RFC 9110
    §11.7.1). ``extra_headers`` (e.g. Retry-After for 429) go after the
    ``X-Egress-*`` fields; their values are escaped like everything else.
    Raises ValueError for a status that is not a 4xx/5xx known to
    ``http.HTTPStatus``, or an extra header that is not a token or that
    repeats one the refusal sets.
    """
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
        ("X-Egress-Reason", ascii_escaped(reason_code)),
        ("X-Egress-Request-Id", ascii_escaped(request_id)),
    ]
    if status == 407:
        fields.append(("Proxy-Authenticate", 'Basic realm="egressd"'))
    for name, value in extra_headers:
        if not _TOKEN.fullmatch(name) or name.lower() in _OWN_FIELDS:
            raise ValueError(f"cannot add header {name!r} to a refusal")
        fields.append((name, ascii_escaped(value)))
    fields += [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(payload))),
        ("Connection", "close"),
    ]
    head = f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields)
    return (head + "\r\n").encode("ascii") + payload
