"""What the sandbox-facing DNS server answers a decoded query: the plan, and its reply prepared once.

The server (``egressd.proxy.net.dnsserver``) reads a query with the codec
(``egressd.proxy.core.dns``), finds its run, and asks here what to answer.
For a query from a run whose audit log can be written (``plan_answer``), in
order:

1. a name that is not a well-formed host name (``egressd.names.hosts``) → FORMERR;
2. a class other than IN, or a type other than A and AAAA → REFUSED
   (``unsupported_query``);
3. strict mode, and the run could never reach the name → NXDOMAIN (the
   caller asks ``unreachable_reason``);
4. A → the IPv4 answer; AAAA → the IPv6 answer if there is one, else
   NOERROR with no records (RFC 2308 §2.2 "NODATA"), recorded ``deny`` as
   DESIGN.md says (not egressd's address) with the reason
   ``empty_answer``, which explains no failure (the A query answers).

A query from no run is refused ``auth_required`` (``Answers.no_run``), and
one that cannot be recorded ``audit_unavailable`` (``Answers.no_audit_log``).
Every refusal (decision ``deny``) carries a reason, and the reason's table row gives the response
code (``Reason.rcode``, through ``refused``). A ``Plan`` is what to answer; a ``PreparedReply`` is a
plan with the record's fields and the reply's bytes worked out once, and
``Answers`` keeps one per distinct outcome for a server. Pure: no I/O.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv6Address

from egressd.names.addresses import IPAddress
from egressd.proxy.core.dns import CLASS_IN, TYPE_A, TYPE_AAAA, Query, ReplyTemplate
from egressd.proxy.core.memo import remember
from egressd.proxy.core.policy import Verdict, decide
from egressd.proxy.core.runs import Run
from egressd.vocabulary.egress import Decision
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Rcode

__all__ = [
    "UNREACHABLE",
    "Answers",
    "Plan",
    "PreparedReply",
    "pack_reply",
    "plan_answer",
    "refused",
    "unreachable_reason",
]

# Strict mode: the policy reasons that hold for the rest of a run whatever
# the port, so no connection to the name can ever be let out — those the
# reason table answers NXDOMAIN (denylisted, ip_literal, denied_earlier,
# not_allowlisted). ``port_not_allowed`` is not one (the host is allowed on
# another port), nor is ASK (a person may still allow it).
UNREACHABLE: frozenset[Reason] = frozenset(reason for reason in Reason if reason.rcode is Rcode.NXDOMAIN)

# Outcomes kept per server: a handful in use (A, AAAA, REFUSED, FORMERR and
# the strict-mode NXDOMAINs); the bound is for a client cycling through types.
_MAX_OUTCOMES = 1024


@dataclass(frozen=True, slots=True)
class Plan:
    """What to answer: the code, the address (if any), and how to record it.

    A plan without a reason answered the query with egressd's address; one
    with a reason did not (a refusal, or NODATA for an AAAA).
    """

    rcode: Rcode
    address: IPAddress | None = None
    reason: Reason | None = None

    @property
    def decision(self) -> Decision:
        return Decision.ALLOW if self.reason is None else Decision.DENY

    @property
    def answer_text(self) -> str:
        return str(self.address) if self.address is not None else self.rcode.name


def refused(reason: Reason) -> Plan:
    """The answer that refuses a query with ``reason``: the reason's rcode (``Reason.rcode``).

    Raises ValueError for a reason no DNS answer carries.
    """
    if reason.rcode is None:
        raise ValueError(f"no DNS answer says {reason.value}")
    return Plan(reason.rcode, reason=reason)


def plan_answer(
    query: Query,
    *,
    answer4: IPv4Address,
    answer6: IPv6Address | None,
    unreachable: Reason | None,
) -> Plan:
    """Steps 1-4 of the module docstring, for a query from an attributed client.

    ``unreachable`` is the strict-mode verdict for the name (None: reachable,
    or strict mode off).
    """
    if query.name is None:
        return refused(Reason.BAD_REQUEST)
    if query.qclass != CLASS_IN or query.qtype not in (TYPE_A, TYPE_AAAA):
        return refused(Reason.UNSUPPORTED_QUERY)
    if unreachable is not None:
        return refused(unreachable)
    if query.qtype == TYPE_A:
        return Plan(Rcode.NOERROR, answer4)
    if answer6 is not None:
        return Plan(Rcode.NOERROR, answer6)
    return Plan(Rcode.NOERROR, reason=Reason.EMPTY_ANSWER)


def unreachable_reason(run: Run, name: str) -> tuple[Reason | None, str | None, Reason | None]:
    """Strict mode: why no connection to ``name`` can ever leave in this run.

    The policy's verdict for the name on port 443: a DENY whose reason is in
    ``UNREACHABLE`` (on the denylist, an IP literal no entry names, denied
    earlier in the run, or not allowlisted with asking off) holds for every
    port and for the rest of the run. Allowed names, names allowed on other
    ports, and names a person could still be asked about are reachable.
    Returns (reason or None, the rule that matched, learned): in learn mode
    a name the allowlist alone would have made unreachable is answered, and
    ``learned`` is the reason it would have been refused with (else None).
    """
    policy = run.policy()
    decision = decide(policy, name, 443)
    if decision.verdict is Verdict.DENY and decision.reason in UNREACHABLE:
        return decision.reason, decision.rule, None
    if decision.learned is not None:
        # Learn mode: would this name have been refused without it? (Not if a person could have been asked.)
        would = decide(replace(policy, learn=False), name, 443)
        if would.verdict is Verdict.DENY and would.reason in UNREACHABLE:
            return None, None, would.reason
    return None, decision.rule, None


def pack_reply(query: Query, plan: Plan, ttl_s: int) -> bytes:
    """The reply to ``query`` per ``plan`` (RFC 1035 §4.1).

    The header keeps the query's id, opcode and RD, sets QR and RA (we act as
    the sandbox's recursive resolver) and the response code; the question is
    repeated byte for byte (so 0x20 case randomisation survives); the answer,
    if any, is one record whose owner is a pointer to the question's name
    (§4.1.4), class IN, ``ttl_s``, and the address (``dns.ReplyTemplate``).
    """
    return PreparedReply(plan, ttl_s).reply(query)


class PreparedReply:
    """A plan with what the server writes for it worked out once: the
    record's decision, reason and answer text, and the reply's bytes but for
    the query's own (``dns.ReplyTemplate``). Immutable by convention; a
    server keeps one per distinct plan (``Answers``), so a query costs no
    Plan, no ``str(address)``, no packing of the address."""

    __slots__ = ("plan", "decision", "reason", "answer", "reply")

    def __init__(self, plan: Plan, ttl_s: int) -> None:
        self.plan = plan
        self.decision = Decision(plan.decision)
        self.reason = plan.reason.value if plan.reason is not None else None
        self.answer = plan.answer_text
        # The reply to a query (see ``pack_reply``): the template's bound
        # method, so the hot path makes one call.
        self.reply: Callable[[Query], bytes] = ReplyTemplate(plan.rcode, plan.address, ttl_s).pack


class Answers:
    """One server's answers: its IPv6 answer and TTL fixed, each distinct outcome prepared once.

    ``plan_answer`` is a pure function of (the name is None, class, type,
    unreachable, the A answer) and the fixed AAAA answer, so its outcomes
    are kept under that key, bounded (a run's own address adds a handful).
    ``answer4``: the server's A answer, what ``outcome`` answers when given none.
    """

    __slots__ = ("answer4", "answer6", "ttl_s", "no_run", "no_audit_log", "_outcomes")

    def __init__(self, answer6: IPv6Address | None, ttl_s: int, answer4: IPv4Address | None = None) -> None:
        self.answer4 = answer4
        self.answer6 = answer6
        self.ttl_s = ttl_s
        # Before the steps: no run to answer for, or no audit log to record the query in.
        self.no_run = PreparedReply(refused(Reason.AUTH_REQUIRED), ttl_s)
        self.no_audit_log = PreparedReply(refused(Reason.AUDIT_UNAVAILABLE), ttl_s)
        # Keyed by the A answer's integer (an IPv4Address hashes in Python, four times the cost of
        # int()), or None for the server's own: most queries, which then cost no int() either.
        self._outcomes: dict[tuple[bool, int, int, Reason | None, int | None], PreparedReply] = {}

    def outcome(self, query: Query, unreachable: Reason | None, answer4: IPv4Address | None = None) -> PreparedReply:
        """``plan_answer`` for ``query``, as a PreparedReply kept for the next query like it.

        ``answer4`` None: the server's (``Answers.answer4``); ValueError when it has none.
        """
        key = (query.name is None, query.qclass, query.qtype, unreachable, None if answer4 is None else int(answer4))
        try:
            return self._outcomes[key]
        except KeyError:
            pass
        if answer4 is None:
            if self.answer4 is None:
                raise ValueError("no A answer: none given, and this server has none")
            answer4 = self.answer4
        plan = plan_answer(query, answer4=answer4, answer6=self.answer6, unreachable=unreachable)
        return remember(self._outcomes, key, PreparedReply(plan, self.ttl_s), _MAX_OUTCOMES)
