"""One client connection, every mode: the sequence written once, as a generator of commands.

accept → attribute → cap → decide → (ask) → record → dial → answer →
carry → record. Layers stack on it:

1. the way in (``ways``: an HTTP request head, a TLS ClientHello, a SOCKS5
   handshake) finds the destination and the run's credentials, and says how
   a refusal is heard (an HTTP answer, a TLS alert, a SOCKS reply) and what
   the client is told once the upstream is connected;
2. the decision, the same for all: the run attributed, its cap, the
   decision (``decision``: ``Ask``, ``Resolve``), the ``egress`` record written (``WriteAhead``)
   before the dial (``Dial``) and never after;
3. what the connection carries: opaque bytes or TLS (``Splice``, the
   client's ClientHellos and plain HTTP checked against the decided name),
   or HTTP/1 requests forwarded one by one (``Relay``, framed by
   ``exchange``).

No I/O: each step is a command (``commands``) the runner
(``egressd.proxy.net.runner``) executes, resuming the generator with the
result or throwing the failure into it. A playbook test does the same by
hand. What is left to record when the connection ends early (its client
gone, egressd stopping) is ``pending``; the run's slot it holds is ``slot``.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from egressd.approvals.interface import ApprovalOutcome
from egressd.approvals.message import HeldRequest
from egressd.names.addresses import IPAddress
from egressd.names.suffixes import registrable_domain
from egressd.proxy.core.attempt import Admission, Attempt, DialError, Seen
from egressd.proxy.core.budget import Budget
from egressd.proxy.core.commands import (
    STALE,
    Close,
    Dial,
    Extend,
    Finish,
    Intercept,
    InterceptFailed,
    PeerClosed,
    RecordRefusal,
    Relay,
    Send,
    Splice,
    Steps,
    Upstream,
    WriteAhead,
)
from egressd.proxy.core.decision import Screen, conclude, decide, decide_request
from egressd.proxy.core.exchange import Exchange
from egressd.proxy.core.http1.destination import Destination
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.insiderequest import plain_request
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.modes import GONE_DETAIL, ListenerLimits, Mode, Refusal, run_at_cap, too_many_connections
from egressd.proxy.core.runs import Run, RunRegistry
from egressd.proxy.core.secrets import Secrets
from egressd.vocabulary.egress import EgressKind
from egressd.vocabulary.reasons import ANSWER_REASONS, Reason

# ``Refused.answer``'s default: the way in renders the refusal (``Way.answer``).
THE_WAYS_ANSWER: Final[Any] = object()


class Refused(Exception):
    """End the request with ``refusal`` of ``target``; ``answer``: the bytes the client hears (None: none)."""

    def __init__(self, target: Seen | Attempt, refusal: Refusal, answer: bytes | None = THE_WAYS_ANSWER) -> None:
        super().__init__(refusal.detail or refusal.reason.value)
        self.target = target
        self.refusal = refusal
        self.answer = answer


# What the way in found for one request: the attempt seen so far, the run, HOST:PORT as the client
# named it (the decision normalises), the request's kind when the way learnt it from the request
# (CONNECT or HTTP; None: the first seen's), and an HTTP request to forward (None: a tunnel).
# A tuple: one is made for every request.
Arrival = tuple[Seen, Run, str, int, "EgressKind | None", "Destination | None"]


class AuditHealth(Protocol):
    """The audit log, as far as the decision needs it: nothing goes out that cannot be recorded."""

    @property
    def healthy(self) -> bool: ...


class Way(Protocol):
    """A way in: one per listener mode (``ways``)."""

    kind: EgressKind  # an attempt's kind before its request is read
    counted: str | None  # the connection's metrics name, counted as it starts (None: per request)
    name_required: bool  # a spliced tunnel's ClientHello must name the decided host
    accepted: bytes | None  # what a tunnel's client hears once the upstream is connected (None: nothing)

    def arrive(self, talk: Conversation) -> Steps:
        """The next request, as far as the way in goes → ``Arrival``, or None: the connection is over.

        Refusals raise ``Refused``.
        """
        ...

    def answer(self, talk: Conversation, refusal: Refusal, target: Seen | Attempt) -> bytes | None:
        """What the client hears for ``refusal`` (None: the close alone)."""
        ...




class InsideRequest(Protocol):
    """A request read inside an inspected connection, as the decision judges it."""

    @property
    def method(self) -> str: ...  # the method it is judged as

    @property
    def path(self) -> str: ...  # normalised, without the query

    @property
    def shown(self) -> HeldRequest: ...  # what an approver is shown of it


class InsideWay(Way, Protocol):
    """The way in inside an inspected connection (``inspected.InspectedWay``): one host and port, one run."""

    @property
    def run(self) -> Run: ...

    @property
    def request(self) -> InsideRequest | None: ...  # the request ``arrive`` read last


@dataclass(frozen=True, slots=True)
class Listening:
    """What a listener gives each of its conversations: the same for all of them, made once."""

    way: Way
    mode: Mode
    limits: ListenerLimits
    runs: RunRegistry
    metrics: Metrics
    screen: Screen  # which resolved addresses may be dialled
    audit: AuditHealth  # whether the audit log can be written
    begin: Callable[[EgressKind, str | None, int | None], Seen]  # a new attempt's identity (id, start)
    # The way in inside an inspected connection, for (run, host, port, max head bytes); None: none is.
    inspecting: Callable[[Run, str, int, int], InsideWay] | None = None
    secrets: Secrets | None = None  # declared secrets: their placeholders checked and replaced (None: none)


class Conversation:
    """One client connection's state, and its steps (``steps``)."""

    __slots__ = ("at", "now", "client", "source", "buf", "pending", "slot", "spliced", "first", "holder", "exchange",
                 "kept", "inside", "outer")

    def __init__(
        self, at: Listening, now: Callable[[], float], client: str, source: IPAddress | None, buf: bytearray
    ) -> None:
        self.at = at
        self.now = now  # the connection's clock: every deadline is an instant on it
        self.client = client  # "address:port"
        self.source = source  # the client's address, for attributing runs
        self.buf = buf  # the client's unread bytes (the runner fills it)
        # What to record if the connection ends with it unrecorded: an attempt decided or being
        # decided (``Finish`` is idempotent), or one seen and not yet refused (recorded with no reason).
        self.pending: Seen | Attempt | None = None
        self.slot: Run | None = None  # the run whose connection cap this request counts against
        self.spliced = False  # a tunnel has the connection (and ``pending``, ``slot``) now
        self.first = True  # the connection's first request
        # The run the client's address is bound to, known before any request is read: its slow
        # heads count against its own cap. Found by the way in.
        self.holder: Run | None = None
        self.exchange: Exchange | None = None  # the HTTP modes' framing, request after request
        # The upstream connection kept for the client's next request: (host and port, address, upstream).
        self.kept: tuple[tuple[str, int], str | None, Upstream] | None = None
        # An inspected connection: the way its requests are read in clear (``inspected``), and the
        # tunnel's attempt (its Admission: the addresses every request dials), recorded at the end.
        self.inside: InsideWay | None = None
        self.outer: tuple[Attempt, Admission] | None = None

    def steps(self) -> Steps:
        """The whole connection: request after request until one ends it."""
        at = self.at
        way = at.way
        if way.counted is not None:
            at.metrics.connections_total[way.counted] += 1
        if at.metrics.connections_open > at.limits.max_connections:
            seen = at.begin(way.kind, self.client, at.mode.dest_port if way.kind is not EgressKind.HTTP else None)
            yield from self._refuse(seen, too_many_connections(at.mode.reads))
            return
        while True:
            try:
                inside = self.inside
                if inside is None:
                    arrival = yield from way.arrive(self)
                    if arrival is None:
                        return
                    go_on = yield from self._decide_and_carry(arrival)
                else:
                    arrival = yield from inside.arrive(self)
                    if arrival is None:
                        return
                    go_on = yield from self._carry_inside(inside, arrival)
            except Refused as refused:
                yield from self._refuse(refused.target, refused.refusal, refused.answer)
                return
            self.first = False
            if not go_on:
                return

    def failed(self) -> Seen | None:
        """The steps raised (a bug, logged by the runner): what was pending is a ``bad_request``.

        Returns a ``Seen`` still to record (``RecordRefusal``); an attempt is
        refused in place and recorded with the connection's end.
        """
        current = self.pending
        if isinstance(current, Seen):
            self.pending = None
            return current
        if isinstance(current, Attempt) and not current.decided:
            current.deny(Reason.BAD_REQUEST)
        return None

    # -- the decision layer ---------------------------------------------------------------------

    def _decide_and_carry(self, arrival: Arrival) -> Steps:
        """Cap, decide, record, dial and carry one request; True when the connection may carry another."""
        seen, run, host, port, kind, destination = arrival
        at = self.at
        if run.open_connections >= at.limits.max_connections_per_run:
            refused = seen._replace(host=seen.host or host, port=port, run=run)
            if kind is not None:
                refused = refused._replace(kind=kind)
            raise Refused(refused, run_at_cap(at.mode.reads, attributed=True))
        attempt = Attempt(seen, host, port, run, kind)
        self.pending = attempt
        if destination is not None and at.secrets is not None:
            self._no_misdirected_secret(attempt, host, port, inspected=False)
        run.open_connections += 1
        self.slot = run
        try:
            connect = destination is None
            try:
                # A client that gives up while its request is held (asked about) stops the wait; its
                # FIN too for a tunnel, which cannot go on without sending.
                admission: Admission = yield from decide(
                    host, port, run, at.screen, at.metrics, at.audit.healthy, connect
                )
            except PeerClosed:
                attempt.detail = GONE_DETAIL
                raise
            if admission.inspect:
                if destination is not None:
                    admission = yield from self._plain_request(attempt, run, admission, destination)
                elif at.inspecting is None:
                    # Its requests must each be decided, and nothing here can read them: fail closed.
                    admission = admission._replace(reason=Reason.TLS_INTERCEPT_FAILED, inspect=False,
                                                   detail="this listener cannot inspect a name with request rules")
            conclude(attempt, admission)
            if not admission.allowed:
                raise Refused(attempt, Refusal(admission.reason or Reason.BAD_REQUEST))
            if connect and admission.inspect:
                yield from self._intercept(attempt, admission)
                return True
            if connect:
                # The record, then the dial (inline: the path of every tunnel).
                try:
                    yield WriteAhead(attempt, admission.texts[0])
                    upstream = yield Dial(attempt, admission, self.now() + at.limits.connect_timeout_s)
                except DialError as exc:
                    raise _dial_refused(attempt, exc) from None
                way = at.way
                self.spliced = True  # the tunnel releases the slot and records the attempt
                yield Splice(upstream, attempt, way.accepted, way.name_required)
                return False
            assert destination is not None
            go_on = yield from self._forward(attempt, admission, destination)
            yield Finish(attempt)
            self.pending = None
            return go_on
        finally:
            if not self.spliced and self.outer is None:
                self.slot = None
                run.open_connections -= 1

    # -- an inspected connection: HTTP/1 requests inside the client's TLS -------------------------

    def _intercept(self, attempt: Attempt, admission: Admission) -> Steps:
        """Record the tunnel, answer it, take over its TLS: its requests are read in clear from here.

        The tunnel's record is written ahead with no address (nothing is
        dialled for it: each request dials for itself); it keeps the run's
        slot and is recorded when the connection ends (``outer``).
        """
        try:
            yield WriteAhead(attempt, None)
        except DialError as exc:
            raise _dial_refused(attempt, exc) from None
        run = attempt.run
        assert run is not None and attempt.port is not None
        limits = self.at.limits
        try:
            yield Intercept(attempt, admission.host, self.at.way.accepted, self.now() + limits.head_timeout_s)
        except InterceptFailed as exc:
            attempt.deny(Reason.TLS_INTERCEPT_FAILED, str(exc))
            # The client is inside a TLS handshake: it cannot read an HTTP answer.
            raise Refused(attempt, Refusal(Reason.TLS_INTERCEPT_FAILED), answer=None) from None
        self.outer = (attempt, admission)
        self.pending = None
        inspecting = self.at.inspecting
        assert inspecting is not None  # the decision admits nothing for inspection without it
        self.inside = inspecting(run, admission.host, attempt.port, limits.max_head_bytes)

    def _plain_request(self, attempt: Attempt, run: Run, admission: Admission, destination: Destination) -> Steps:
        """A plain-HTTP request to an inspected name: decided on its method and path as inside a tunnel."""
        exchange = self.exchange
        assert exchange is not None and exchange.request is not None
        try:
            request = plain_request(exchange.request, destination)
        except HttpError as exc:
            return Admission(Reason.BAD_REQUEST, admission.host, admission.port, detail=exc.detail)
        attempt.method, attempt.path, attempt.shown = request.method, request.path, request.shown
        destination.path = request.destination.path  # the normalised target is what goes upstream
        decided: Admission = yield from decide_request(
            run, admission, request.method, request.path, request.shown, self.at.audit.healthy
        )
        return decided

    def _no_misdirected_secret(self, attempt: Attempt, host: str, port: int, *, inspected: bool) -> None:
        """Refuse (``secret_misdirected``) a request carrying a secret's placeholder where it may not go."""
        secrets, exchange = self.at.secrets, self.exchange
        assert secrets is not None and exchange is not None and exchange.request is not None
        found = secrets.misdirected(exchange.request, host.lower().rstrip("."), port, inspected=inspected)
        if found is not None:
            secret, where = found
            attempt.deny(Reason.SECRET_MISDIRECTED, f"the placeholder of the secret {secret.name} {where}")
            raise Refused(attempt, Refusal(Reason.SECRET_MISDIRECTED))

    def _carry_inside(self, inside: InsideWay, arrival: Arrival) -> Steps:
        """Decide one request inside the inspected tunnel on its method and path, then forward it."""
        seen = arrival[0]
        outer = self.outer
        request = inside.request
        assert outer is not None and request is not None
        tunnel, tunnel_admission = outer
        attempt = self.pending = Attempt(seen)
        attempt.method, attempt.path, attempt.shown = request.method, request.path, request.shown
        secrets = self.at.secrets
        if secrets is not None:
            self._no_misdirected_secret(attempt, tunnel_admission.host, tunnel_admission.port, inspected=True)
        admission: Admission = yield from decide_request(
            inside.run, tunnel_admission, request.method, request.path, request.shown, self.at.audit.healthy
        )
        conclude(attempt, admission)
        if not admission.allowed:
            raise Refused(attempt, Refusal(admission.reason or Reason.BAD_REQUEST))
        destination = arrival[5]
        assert destination is not None
        if secrets is not None:
            assert self.exchange is not None and self.exchange.request is not None
            secrets.substitute(self.exchange.request, admission.host, admission.port)
        try:
            go_on = yield from self._forward(attempt, admission, destination, tls_name=admission.host)
        finally:
            tunnel.bytes_up += attempt.bytes_up
            tunnel.bytes_down += attempt.bytes_down
        yield Finish(attempt)
        self.pending = None
        return go_on

    # -- HTTP/1 carried: one request forwarded ----------------------------------------------------

    def _forward(
        self, attempt: Attempt, admission: Admission, destination: Destination, tls_name: str | None = None
    ) -> Steps:
        """Forward one request and its response; True when the client connection may carry another.

        The upstream connection is kept for the client's next request to the
        same host and port when the exchange allows (RFC 9112 §9.3). A kept
        connection the origin has meanwhile closed is replaced once, for a
        request without a body (nothing is lost by sending it again).
        """
        limits = self.at.limits
        budget: Budget | None = None
        if limits.upload_budget_bytes:
            budget = yield from self._within_budget(attempt, admission, limits.upload_budget_bytes)
        # The per-request cap is for requests decided on their method and path (an inspected name's).
        cap = limits.request_body_cap_bytes if attempt.method is not None else 0
        return (yield from self._send_on(attempt, admission, destination, tls_name, budget, cap))

    def _send_on(
        self, attempt: Attempt, admission: Admission, destination: Destination, tls_name: str | None,
        budget: Budget | None, cap: int,
    ) -> Steps:
        """``_forward``'s work: the request out, the response back, the upstream kept or closed."""
        exchange = self.exchange
        assert exchange is not None
        out = exchange.forward(destination)
        if exchange.interim:
            yield Send(exchange.interim)
        key = (admission.host, admission.port)
        for last_try in (False, True):
            kept = self.kept
            if kept is not None and not _may_carry(kept, key, admission):
                self.kept = None
                yield Close(kept[2])
                kept = None
            upstream: Upstream
            if kept is None:
                try:
                    yield WriteAhead(attempt, admission.texts[0])  # the record before the dial
                    upstream = yield Dial(attempt, admission, self.now() + self.at.limits.connect_timeout_s, tls_name)
                except DialError as exc:
                    raise _dial_refused(attempt, exc) from None
                address, reused = attempt.address, False
            else:
                _, address, upstream = kept
                reused = True
                try:
                    yield WriteAhead(attempt, address)  # the record before the request goes out
                except DialError as exc:  # the runner closes the kept connection with the client
                    raise Refused(attempt, Refusal(exc.reason)) from None
            self.kept = None  # the relay closes it, or it is kept again below
            outcome = yield Relay(attempt, exchange, upstream, out, reused, last_try, budget, cap)
            if outcome is STALE:
                continue
            if outcome is True and exchange.keep_upstream:
                self.kept = (key, address, upstream)  # for the client's next request to the same host
            if isinstance(outcome, Reason):
                raise Refused(attempt, Refusal(outcome))
            return bool(outcome)
        return False

    def _within_budget(self, attempt: Attempt, admission: Admission, grant: int) -> Steps:
        """An HTTP request's upload budget (``budget``): one that would go past it (its declared length
        counted) is asked about before anything of it is sent. The runner counts what it sends as it
        goes, and pauses a body that passes the budget all the same (a chunked one declares no length).
        Returns the budget, for the runner.
        """
        run, exchange = attempt.run, self.exchange
        assert run is not None and exchange is not None and exchange.request is not None
        budget = run.budget(registrable_domain(admission.host) or admission.host, grant)
        declared = exchange.request.get("Content-Length")
        length = int(declared) if declared is not None and declared.isdigit() else 0
        if budget.short(length):
            outcome: ApprovalOutcome = yield Extend(attempt, budget, length)
            if not outcome.allowed:
                attempt.deny(ANSWER_REASONS[outcome.answer], f"past the run's upload budget ({budget.sent} bytes sent "
                             f"to {budget.site})")
                raise Refused(attempt, Refusal(ANSWER_REASONS[outcome.answer]))
        return budget

    # -- refusals -----------------------------------------------------------------------------

    def _refuse(self, target: Seen | Attempt, refused: Refusal, answer: bytes | None = THE_WAYS_ANSWER) -> Steps:
        """Record the refusal, then answer it as the way in does (the client may be gone already)."""
        reason = refused.reason
        if isinstance(target, Attempt):
            target.deny(reason, refused.detail)
        way = self.inside or self.at.way
        data = way.answer(self, refused, target) if answer is THE_WAYS_ANSWER else answer
        if isinstance(target, Attempt):
            yield Finish(target)
            if self.pending is target:
                self.pending = None
        else:
            if self.pending is target:
                self.pending = None
            yield RecordRefusal(target, reason, refused.detail)
        if data:
            try:
                yield Send(data)
            except PeerClosed:
                pass


def _dial_refused(attempt: Attempt, error: DialError) -> Refused:
    """The record could not be written, or no admitted address answered: refused, with why."""
    if attempt.detail is None:
        attempt.detail = str(error)
    return Refused(attempt, Refusal(error.reason))


def _may_carry(kept: tuple[tuple[str, int], str | None, Upstream], key: tuple[str, int], admission: Admission) -> bool:
    """Whether the kept upstream connection may carry a request to ``key`` as admitted now."""
    kept_key, address, upstream = kept
    return (
        kept_key == key
        and not upstream.closed
        and not upstream.eof
        and not upstream.buf  # an unrequested byte means the stream is out of step
        and address in admission.texts
    )
