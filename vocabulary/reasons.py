"""Why a request was refused, and how an approval ended: the one table of each.

Each ``Reason`` carries everything a refusal needs, side by side, so no other
module keeps a table of its own (after Smokescreen's decision reasons):

- its code (the member's ``value``): the ``reason`` of an audit record and
  the ``X-Egress-Reason`` header (DESIGN.md "What a client sees");
- ``status``: the HTTP status a refused client gets unless the caller knows
  a more precise one (431 for an oversized head, 408 for a slow one);
- ``message``: the phrase in the refusal's one-line body;
- ``alert``: the fatal TLS alert (RFC 8446 §6.2) the transparent TLS
  listener and a CONNECT tunnel's SNI check send instead of an HTTP answer:
  access_denied for a policy refusal (403, 407), internal_error otherwise;
- ``socks``: the REP (RFC 1928 §6) the SOCKS listener answers a request
  refused with this reason: not allowed by ruleset for a policy refusal,
  host unreachable or connection refused for an upstream failure, general
  failure otherwise;
- ``rcode``: the DNS response code (RFC 1035 §4.1.1) of a query refused
  with this reason, None for a reason no DNS answer carries.

``Answer`` is how an approval ended; ``ANSWER_REASONS`` is the reason each
failed answer becomes (the refusal the client sees and the ``reason`` of the
``approval.decided`` record).

``proxy.core.responses`` turns a reason into HTTP bytes or a TLS alert,
``proxy.core.dnsanswer`` into a reply, ``proxy.core.socks5.reply`` into a
SOCKS reply. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

from egressd.vocabulary.wire import Alert, Rcode, SocksReply

__all__ = ["ANSWER_REASONS", "Answer", "Reason", "reason_for", "reason_message"]


class _Row(NamedTuple):
    """A reason's columns after its code (see the module docstring)."""

    status: int
    message: str
    alert: Alert
    socks: SocksReply
    rcode: Rcode | None


_DENIED = Alert.ACCESS_DENIED
_FAILED = Alert.INTERNAL_ERROR
_RULESET = SocksReply.NOT_ALLOWED
_GENERAL = SocksReply.GENERAL_FAILURE


class Reason(enum.StrEnum):
    """Why a request was refused: the codes clients see in ``X-Egress-Reason``.

    A member is (code, status, message, alert, socks, rcode); see the module docstring.
    A ``str`` (its code), so a record, a metric's label or a header takes it as it is.
    """

    _value_: str
    _row: _Row

    def __new__(
        cls, code: str, status: int, message: str, alert: Alert, socks: SocksReply, rcode: Rcode | None = None
    ) -> Reason:
        member = str.__new__(cls, code)
        member._value_ = code
        member._row = _Row(status, message, alert, socks, rcode)
        return member

    # Read-only: a refusal cannot be reworded or re-statused at run time.
    @property
    def status(self) -> int:
        return self._row.status

    @property
    def message(self) -> str:
        return self._row.message

    @property
    def alert(self) -> Alert:
        return self._row.alert

    @property
    def socks(self) -> SocksReply:
        return self._row.socks

    @property
    def rcode(self) -> Rcode | None:
        return self._row.rcode

    # The policy's refusals (DESIGN.md "Decision order"). In strict mode the
    # DNS server answers NXDOMAIN for a name refused for one of the four that
    # hold for every port and the rest of the run.
    DENYLISTED = ("denylisted", 403, "on the denylist", _DENIED, _RULESET, Rcode.NXDOMAIN)
    NOT_ALLOWLISTED = ("not_allowlisted", 403, "not on the allowlist", _DENIED, _RULESET, Rcode.NXDOMAIN)
    DENIED = ("denied", 403, "denied by approver", _DENIED, _RULESET)
    APPROVAL_TIMEOUT = ("approval_timeout", 403, "no answer from an approver in time", _DENIED, _RULESET)
    NO_APPROVER = ("no_approver", 403, "no approver attached", _DENIED, _RULESET)
    DENIED_EARLIER = ("denied_earlier", 403, "denied earlier in this run", _DENIED, _RULESET, Rcode.NXDOMAIN)
    TOO_MANY_PENDING = ("too_many_pending", 403, "too many approvals pending", _DENIED, _RULESET)
    IP_LITERAL = ("ip_literal", 403, "IP address not allowlisted", _DENIED, _RULESET, Rcode.NXDOMAIN)
    PRIVATE_ADDRESS = ("private_address", 403, "resolves only to private or special addresses", _DENIED, _RULESET)
    PORT_NOT_ALLOWED = ("port_not_allowed", 403, "port not allowed for this host", _DENIED, _RULESET)
    SNI_MISMATCH = ("sni_mismatch", 403, "TLS server name differs from the CONNECT host", _DENIED, _RULESET)
    # The request itself: malformed (a DNS query whose name is not a host is
    # FORMERR), or from a client no run claims (REFUSED: nothing to answer for).
    BAD_REQUEST = ("bad_request", 400, "malformed request", _FAILED, _GENERAL, Rcode.FORMERR)
    AUTH_REQUIRED = ("auth_required", 407, "run credentials missing or wrong", _DENIED, _RULESET, Rcode.REFUSED)
    # Upstream failures, after the policy allowed the request.
    RESOLVE_FAILED = ("resolve_failed", 502, "could not resolve", _FAILED, SocksReply.HOST_UNREACHABLE)
    UPSTREAM_UNREACHABLE = (
        "upstream_unreachable",
        502,
        "could not connect upstream",
        _FAILED,
        SocksReply.CONNECTION_REFUSED,
    )
    UPSTREAM_TIMEOUT = ("upstream_timeout", 504, "upstream timed out", _FAILED, SocksReply.HOST_UNREACHABLE)
    # A connection cap (429, with Retry-After) or a head limit (431, 408). A
    # DNS query over its rate is dropped unanswered, so no rcode.
    LIMIT_EXCEEDED = ("limit_exceeded", 429, "a limit was exceeded", _FAILED, _GENERAL)
    # Not in the design's list: the audit log cannot be written, so nothing may
    # go out unrecorded (fail closed).
    AUDIT_UNAVAILABLE = ("audit_unavailable", 503, "the audit log cannot be written", _FAILED, _GENERAL, Rcode.REFUSED)
    # egressd stopped while the request was held or queued.
    SHUTTING_DOWN = ("shutting_down", 503, "egressd stopped while the request was held", _FAILED, _GENERAL)
    # Not in the design's list: a DNS query of a type (or class) egressd does
    # not answer (only A and AAAA in IN); no HTTP or SOCKS request is refused with it.
    UNSUPPORTED_QUERY = ("unsupported_query", 400, "DNS query type not answered", _FAILED, _GENERAL, Rcode.REFUSED)
    # Not in the design's list: an AAAA query answered with no address (NOERROR, no records:
    # no IPv6 answer is configured). DESIGN.md records it ``deny`` (not egressd's address);
    # this says why, and that it explains no failure: the name's A query gets the address.
    EMPTY_ANSWER = (
        "empty_answer",
        400,
        "no IPv6 answer is configured (the name's IPv4 answer stands)",
        _FAILED,
        _GENERAL,
        Rcode.NOERROR,
    )
    # Inspection (DESIGN.md "Request rules"): the client would not take the run's certificate
    # (a pinned client, mutual TLS) or the TLS handshake inside the tunnel failed.
    TLS_INTERCEPT_FAILED = (
        "tls_intercept_failed",
        502,
        "the TLS connection could not be inspected",
        _FAILED,
        _GENERAL,
    )
    # A declared secret's placeholder sent to a name the secret is not declared for.
    SECRET_MISDIRECTED = ("secret_misdirected", 403, "a secret sent to a name it is not for", _DENIED, _RULESET)


# Reasons by code, for codes read back from a record or named by another package.
_BY_CODE: Final[Mapping[str, Reason]] = MappingProxyType({reason.value: reason for reason in Reason})


def reason_for(code: str) -> Reason:
    """The reason whose code is ``code``; ValueError for a code that is none."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise ValueError(f"no reason has the code {code!r}") from None


def reason_message(code: str) -> str:
    """The phrase for a reason code as read back from an audit record; an unknown code is itself."""
    reason = _BY_CODE.get(code)
    return reason.message if reason is not None else code


class Answer(enum.Enum):
    """How an approval ended. Everything but ALLOW fails the request."""

    ALLOW = "allow"
    DENY = "deny"
    TIMEOUT = "timeout"
    NO_APPROVER = "no_approver"
    TOO_MANY_PENDING = "too_many_pending"
    # The run made as many approval requests as it may: nobody is asked (DESIGN.md, "Decision order").
    STOPPED_ASKING = "stopped_asking"
    # egressd stopped while the request was held: nobody can answer any more.
    SHUTTING_DOWN = "shutting_down"


# The refusal (DESIGN.md, "What a client sees") each failed answer becomes;
# the audit log's approval.decided record carries its code as ``reason``.
ANSWER_REASONS: Final[Mapping[Answer, Reason]] = MappingProxyType(
    {
        Answer.DENY: Reason.DENIED,
        Answer.TIMEOUT: Reason.APPROVAL_TIMEOUT,
        Answer.NO_APPROVER: Reason.NO_APPROVER,
        Answer.TOO_MANY_PENDING: Reason.TOO_MANY_PENDING,
        Answer.STOPPED_ASKING: Reason.NOT_ALLOWLISTED,
        Answer.SHUTTING_DOWN: Reason.SHUTTING_DOWN,
    }
)
