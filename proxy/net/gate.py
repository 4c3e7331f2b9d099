"""The gate: from a request for HOST:PORT in a run to a dialled socket or a refusal.

Every listener (the explicit proxy, the transparent SNI and Host listeners)
goes through ``Gate.admit`` and, when admitted, ``Gate.dial``, so they all
decide the same way:

1. the audit log must be writable (else refuse: nothing happens unrecorded);
2. ``policy.decide`` — the design's decision order, pure (learn mode
   included: what the allowlist alone would refuse or hold comes back
   ALLOW with ``learned``, which every record of the attempt carries);
3. ASK → the ``Approver``; an exception there is a denial (fail closed);
   an allow joins the run's allowlist unless its scope is ``once`` (then
   only the requests that waited on that approval go through, and the
   run's next connection to the host asks again), a denial sticks for the
   run (its registered domain too), a run past its approval requests stops asking;
   the request carries the entry an ``always`` answer would keep
   (``policy.lasting_entry``: exact ``host:port``), which the broker appends;
   an answer that comes after the client gave up applies to the run alike
   (the approver calls ``_late_answer``);
4. allowed → resolve (an IP literal is its own address); every address is
   classified and only those that pass are kept (``private_address`` if none);
   an address and port where egressd itself listens never passes, and when
   that is why nothing passed the client is told so;
5. ``dial`` writes the attempt's ``egress`` record ahead (``open``: if it
   cannot be written, ``audit_unavailable``), then connects to exactly
   those addresses — never a second lookup.

Each attempt is an ``Attempt`` that ``finish`` turns into its final audit
record (the ``egress`` record of a refusal, the ``egress.end`` record of an
opened connection), one run event and the metrics; a refusal past its run's
budget for the interval is counted into one ``egress.suppressed`` record
instead (``floods.RefusalBudget``). The DNS server never admits (a query
is answered without asking anyone or resolving anything): it builds each
query's ``EgressDecided`` fact itself and records it through ``settle``,
which does for it what ``finish`` does for a refused attempt.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from egressd.approvals.interface import (
    ANSWER_REASONS,
    Answer,
    ApprovalOutcome,
    ApprovalRequest,
    ApprovalScope,
    Approver,
)
from egressd.audit.log import AuditError, AuditSink
from egressd.audit.records import (
    ApprovalSummary,
    Decision,
    EgressDecided,
    EgressEnded,
    EgressKind,
    new_request_id,
    suppressed_record,
)
from egressd.names.addresses import IPAddress
from egressd.names.shown import logged
from egressd.proxy.core.addresses import OwnEndpoints, forbidden_reason, is_own
from egressd.proxy.core.attempt import Admission, Attempt, DialError, Seen
from egressd.proxy.core.dns import ResolveError
from egressd.proxy.core.floods import RefusalBudget, Suppressed
from egressd.proxy.core.memo import remembered
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.policy import EntryError, Verdict, lasting_entry
from egressd.proxy.core.reasons import Reason, reason_for
from egressd.proxy.core.responses import OWN_ENDPOINT_MESSAGE
from egressd.proxy.core.runs import Run
from egressd.proxy.net.resolver import Resolver

log = logging.getLogger("egressd.decisions")
P = TypeVar("P", bound=asyncio.Protocol)

# The refusal each failed answer becomes: the approvals package names its code.
# A record's plain decision text (``.value`` is a descriptor: a Python call per connection).
_DECISION_TEXT: dict[Decision, str] = {decision: decision.value for decision in Decision}
_ANSWER_REASONS: dict[Answer, Reason] = {answer: reason_for(code) for answer, code in ANSWER_REASONS.items()}


def bound_locally(address: IPAddress) -> bool:
    """Whether an address is one of this host's own: the kernel lets a socket bind to it.

    Asked only for a port where egressd has a listener on 0.0.0.0 or ::
    (``addresses.is_own``), and never remembered: interfaces come and go.
    bind() sends nothing. When in doubt (an error other than "not here"),
    the answer is True: refusing a dial is the safe side.
    """
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


class _Expiry:
    """``Gate.dial``'s connect timeout: cancels the task when due, and takes that cancellation back once."""

    __slots__ = ("task", "cancelling", "fired")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.cancelling = task.cancelling()  # cancellations requested before ours are not ours
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        self.task.cancel()

    def taken_back(self, *, cancelled: bool) -> bool:
        """Take our cancellation back (once); True when the CancelledError under way was ours alone."""
        if not self.fired:
            return False
        self.fired = False
        return self.task.uncancel() <= self.cancelling and cancelled


class Gate:
    """Decides, asks, resolves, dials and records, for every listener."""

    def __init__(
        self,
        *,
        resolver: Resolver,
        approver: Approver,
        audit: AuditSink,
        metrics: Metrics,
        allow_private: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
        own: OwnEndpoints | None = None,
        connect_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        refusals: RefusalBudget | None = None,
    ) -> None:
        self.resolver = resolver
        self.approver = approver
        self.audit = audit
        self.metrics = metrics
        self.allow_private = tuple(allow_private)
        # egressd's listening endpoints; the service updates it as each listener binds.
        self.own = own if own is not None else OwnEndpoints()
        self.connect_timeout_s = connect_timeout_s
        self.clock = clock
        self.monotonic = monotonic
        self._address_ok: dict[IPAddress, bool] = {}
        self._texts: dict[IPAddress, str] = {}
        # Called with every finished egress record (e.g. `egressd run` prints refusals). They read it and
        # never edit it: the same dict is the run's event (``Run.keep_event``).
        self.observers: list[Callable[[dict[str, object]], None]] = []
        # Floods: past a run's budget, refusals are counted into egress.suppressed records (None: all written).
        self.refusals = refusals
        self._refusals_timer: asyncio.TimerHandle | None = None

    def set_allow_private(self, allow_private: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> None:
        """New ``allow_private`` ranges (a reload): addresses are checked against them from the next dial on."""
        self.allow_private = tuple(allow_private)
        self._address_ok.clear()  # remembered under the old ranges

    def begin(self, kind: EgressKind, client: str | None, port: int | None = None) -> Seen:
        """A new attempt's identity: what the listener learns next goes into new ``Seen`` values."""
        return Seen(id=new_request_id(), kind=kind, client=client, ts=self.clock(), started=self.monotonic(), port=port)

    def refuse(self, seen: Seen, reason: Reason | None, detail: str | None = None) -> None:
        """Record an attempt refused before the policy ran (bad request, auth, limits, ECH), at once.

        Its one ``egress`` fact is built whole from what the listener saw;
        ``reason`` None: the connection ended (or broke) before anything was
        decided or refused.
        """
        run = seen.run
        fact = EgressDecided(
            id=seen.id,
            ts=seen.ts,
            run=run.id if run else None,
            kind=seen.kind,
            client=seen.client,
            host=seen.host,
            port=seen.port,
            address=None,
            decision=Decision.DENY,
            reason=reason.value if reason is not None else None,
            rule=None,
            approval=None,
            command=seen.command,
            bytes_up=0,
            bytes_down=0,
            duration_s=self.monotonic() - seen.started,
            extra={"detail": detail} if detail else None,
        )
        self.settle(fact, run, counted=False)

    def attempt(self, seen: Seen, run: Run, host: str, port: int, kind: EgressKind | None = None) -> Attempt:
        """The attempt the gate decides from here on: ``seen``'s (of ``kind`` if given), to ``host``:``port`` in a run.

        The listener's last facts come as arguments, not as one more ``Seen``: this is every request's path.
        """
        return Attempt(
            id=seen.id,
            kind=seen.kind if kind is None else kind,
            client=seen.client,
            ts=seen.ts,
            started=seen.started,
            run=run,
            host=host,
            port=port,
            command=run.command,
        )

    async def admit(self, attempt: Attempt) -> Admission:
        """Steps 1-4 of the module docstring, for the attempt ``attempt`` started; fills it as it goes."""
        run, host, port = attempt.run, attempt.host, attempt.port
        assert run is not None and host is not None and port is not None
        admission = await self._admit(attempt, run, host, port)
        attempt.host = admission.host
        if admission.allowed:
            attempt.decision, attempt.reason = Decision.ALLOW, None
        else:
            attempt.refuse(admission.reason or Reason.BAD_REQUEST)
        attempt.decided = True
        self.metrics.decided(attempt.decision, attempt.reason, self.monotonic() - attempt.started)
        self._log_decision(attempt, admission)
        return admission

    async def _admit(self, attempt: Attempt, run: Run, host: str, port: int) -> Admission:
        if not self.audit.healthy:
            return Admission(Reason.AUDIT_UNAVAILABLE, host, port)
        decision = run.decide(host, port)
        host = decision.host
        attempt.rule = decision.rule
        if decision.learned is not None:
            attempt.learned = decision.learned.value
            self.metrics.learned += 1
        if decision.verdict is Verdict.DENY:
            return Admission(decision.reason, host, port)
        if decision.verdict is Verdict.ASK:
            outcome = await self._ask(run, host, port)
            attempt.approval = ApprovalSummary(
                outcome.approval_id, outcome.channel, outcome.by, round(outcome.waited_s, 3)
            )
            if not outcome.allowed:
                if outcome.answer is Answer.DENY:
                    run.deny_host(host)
                elif outcome.answer is Answer.STOPPED_ASKING:
                    run.stop_asking()
                return Admission(_ANSWER_REASONS[outcome.answer], host, port)
            if run.ended:
                # Allowed after its run ended (the sandbox is gone): its credentials are void.
                return Admission(Reason.AUTH_REQUIRED, host, port)
            if outcome.scope is not ApprovalScope.ONCE:
                run.approve(host, port)
            attempt.rule = "approved"
        return await self._resolve(attempt, host, port, decision.address)

    async def _ask(self, run: Run, host: str, port: int) -> ApprovalOutcome:
        lasting: str | None = None
        lasting_error: str | None = None
        try:
            lasting = lasting_entry(host, port)
        except EntryError as exc:
            lasting_error = str(exc)
        request = ApprovalRequest(
            run_id=run.id,
            host=host,
            port=port,
            command=run.command,
            task=run.task,
            allowed=run.allowed_texts(),
            lasting=lasting,
            lasting_error=lasting_error,
            on_late_answer=lambda outcome: self._late_answer(run, host, port, outcome),
        )
        self.metrics.held_requests += 1
        try:
            return await self.approver.ask(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Fail closed: an approver that broke has not allowed anything.
            log.exception("approver failed for %s:%d in run %s; denying", host, port, run.id)
            return ApprovalOutcome(Answer.NO_APPROVER)
        finally:
            self.metrics.held_requests -= 1

    @staticmethod
    def _late_answer(run: Run, host: str, port: int, outcome: ApprovalOutcome) -> None:
        """An answer that came after every client waiting for it gave up still applies to the run.

        Allow → the host joins the run's allowlist (not for an ended run, and
        not for scope ``once``: it covered only the requests that waited);
        deny → the denial sticks; a timeout or shutdown applies nothing.
        """
        if outcome.answer is Answer.ALLOW and outcome.scope is not ApprovalScope.ONCE and not run.ended:
            run.approve(host, port)
        elif outcome.answer is Answer.DENY:
            run.deny_host(host)

    async def _resolve(self, attempt: Attempt, host: str, port: int, literal: IPAddress | None) -> Admission:
        """Step 4 for a host the policy let through; ``literal`` is its address when it is an IP literal."""
        if literal is not None:
            candidates: Sequence[IPAddress] = [literal]
        else:
            try:
                candidates = await self.resolver.resolve(host)
            except ResolveError as exc:
                attempt.extra["detail"] = str(exc)
                return Admission(Reason.RESOLVE_FAILED, host, port)
        # Most ports are none of egressd's: then one set lookup, not one call per address.
        own_port = port in self.own.ports
        passed = tuple(a for a in candidates if self._dialable(a) and not (own_port and self._own(a, port)))
        if not passed:
            attempt.address = str(candidates[0]) if candidates else None
            itself = next((a for a in candidates if own_port and self._own(a, port)), None)
            if itself is not None:
                attempt.address = str(itself)
                attempt.message = OWN_ENDPOINT_MESSAGE
                attempt.extra["detail"] = f"{self._text(itself)} port {port} is egressd itself (one of its listeners)"
            return Admission(Reason.PRIVATE_ADDRESS, host, port)
        return Admission(None, host, port, passed, tuple(map(self._text, passed)))

    # The two below are pure functions of their argument (and of this gate's
    # fixed settings), so their answers are remembered (``memo``).
    def _text(self, address: IPAddress) -> str:
        return remembered(self._texts, address, str)

    def _dialable(self, address: IPAddress) -> bool:
        return remembered(self._address_ok, address, self._check_address)

    def _check_address(self, address: IPAddress) -> bool:
        return forbidden_reason(address, self.allow_private) is None

    def _own(self, address: IPAddress, port: int) -> bool:
        # Not remembered: a wildcard listener's answer depends on the interfaces of the moment.
        return is_own(address, port, self.own, bound_locally)

    def open(self, attempt: Attempt, address: str | None) -> None:
        """Write an allowed attempt's ``egress`` record before any of its bytes go out (write-ahead).

        Bytes and duration are null in it; ``finish`` then writes the
        ``egress.end`` record. Raises DialError(``audit_unavailable``) when
        the record could not be written: the attempt must not go out.
        Idempotent (a request on a kept upstream connection opens once).
        """
        if attempt.ahead is not None:
            return
        attempt.address = address
        ahead = self._decided(attempt)
        record = ahead.record()
        try:
            self.audit.write_ahead(record)
        except AuditError as exc:
            raise DialError(Reason.AUDIT_UNAVAILABLE, str(exc)) from None
        attempt.ahead, attempt.ahead_record = ahead, record

    async def dial(
        self,
        attempt: Attempt,
        admission: Admission,
        protocol: Callable[[], P],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> P:
        """Connect to the first admitted address that answers (after ``open`` wrote the record ahead).

        Returns the connection's ``protocol()`` instance (the event loop
        connects in its own code: on uvloop no Python socket is involved).
        The address is passed as a literal, so nothing is looked up again.
        Raises DialError (``upstream_unreachable`` or ``upstream_timeout``).
        ``loop``: the running loop, when the caller has it at hand.
        """
        assert attempt.opened, "the egress record is written before the dial"
        if loop is None:
            loop = asyncio.get_running_loop()
        # The connect timeout as ``asyncio.timeout`` would do it (the task cancelled, the
        # cancellation taken back as TimeoutError), with one timer and no context object.
        task = asyncio.current_task(loop)
        assert task is not None
        expiry = _Expiry(task)
        timer = loop.call_later(self.connect_timeout_s, expiry.fire)
        last: OSError | None = None
        try:
            for text in admission.texts:
                try:
                    # Both asyncio and uvloop set TCP_NODELAY on every TCP transport.
                    _transport, peer = await loop.create_connection(protocol, text, admission.port)
                except OSError as exc:
                    last = exc
                    continue
                attempt.address = text
                return peer
        except asyncio.CancelledError:
            if expiry.taken_back(cancelled=True):
                attempt.address = admission.texts[0]
                raise DialError(Reason.UPSTREAM_TIMEOUT, "connect timed out") from None
            raise
        finally:
            timer.cancel()
            expiry.taken_back(cancelled=False)
        attempt.address = admission.texts[-1]
        raise DialError(Reason.UPSTREAM_UNREACHABLE, str(last) if last else "no address")

    def overrule(self, attempt: Attempt, reason: Reason) -> None:
        """Refuse an attempt after it was admitted, for what its connection did next.

        The CONNECT tunnel whose ClientHello names another server
        (``sni_mismatch``) is the case: the policy allowed the host, the
        bytes then asked for a different one. The metrics move the attempt
        from allow to deny; the record says deny with ``reason``.
        """
        if attempt.decided and attempt.decision is Decision.ALLOW:
            self.metrics.decisions[("allow", "")] -= 1
            self.metrics.decisions[("deny", reason.value)] += 1
        attempt.refuse(reason)
        if log.isEnabledFor(logging.INFO):
            run_id = attempt.run.id if attempt.run else "-"
            target = ascii(f"{attempt.host}:{attempt.port}")[1:-1]
            log.info("DENY  %s %s run=%s reason=%s", attempt.kind, target, run_id, attempt.reason)

    def finish(self, attempt: Attempt) -> None:
        """Write the attempt's final audit record (idempotent), its run event and metrics.

        Not opened: the one ``egress`` record. Opened: the ``egress.end``
        record; the run and the observers still see the whole attempt as
        one record (bytes, duration and ``end`` filled in).
        """
        if attempt.finished:
            return
        attempt.finished = True
        run = attempt.run
        duration_s = self.monotonic() - attempt.started
        ahead = attempt.ahead
        if ahead is None:
            fact = self._decided(attempt, duration_s)
            self.settle(fact, run, counted=attempt.decided)
            return
        end = attempt.end or (attempt.reason if attempt.decision is Decision.DENY else None) or "closed"
        extra = attempt.extra
        written = EgressEnded(
            id=attempt.id,
            ts=self.clock(),
            run=run.id if run else None,
            address=attempt.address,
            bytes_up=attempt.bytes_up,
            bytes_down=attempt.bytes_down,
            duration_s=duration_s,
            end=end,
            extra=dict(extra) if extra else None,
        ).record()
        # The whole attempt, for the run's events and the observers: what was written ahead,
        # with what the end says folded in (as ``egressd audit`` joins them).
        record = dict(attempt.ahead_record or ahead.record())
        event, ts = record["event"], record["ts"]
        record.update(written)
        record["event"], record["ts"] = event, ts
        record["decision"], record["reason"] = _DECISION_TEXT[attempt.decision], attempt.reason
        if not attempt.decided:
            self.metrics.decided(attempt.decision, attempt.reason, duration_s)
        self.metrics.bytes_up += attempt.bytes_up
        self.metrics.bytes_down += attempt.bytes_down
        if run is not None:
            run.keep_event(record)  # built here for the run and the observers: not copied
        try:
            # An opened attempt's egress.end follows its written-ahead record whatever the decision became.
            self._write(written, run, attempt.kind, attempt.decision, attempt.reason, attempt.host, always=True)
        except AuditError:
            pass  # the sink has said why once and is now unhealthy: new egress is refused
        for observer in self.observers:
            observer(record)

    def settle(self, fact: EgressDecided, run: Run | None, *, counted: bool = False, summary: bool = False) -> None:
        """Record a decided attempt that opened no connection, its ``egress`` fact built whole by the caller.

        What ``finish`` does for such an attempt: the metrics (unless
        ``counted``: they already have it), the run's event, the record
        (counted instead past the run's refusal budget, unless ``summary``:
        a count of others is always written) and the observers. The DNS
        server records its queries this way; ``finish`` an attempt refused before it opened.
        """
        record = fact.record()
        metrics = self.metrics
        if not counted:  # refused before the policy ran (bad request, auth, limits), or a DNS query
            metrics.decided(fact.decision, fact.reason, fact.duration_s or 0.0)
        if fact.bytes_up:  # none for a DNS query or a refusal
            metrics.bytes_up += fact.bytes_up
        if fact.bytes_down:
            metrics.bytes_down += fact.bytes_down
        if run is not None:
            # A fresh dict, which the sink and the observers only read: the run keeps it, not a copy.
            run.keep_event(record)
        try:
            self._write(record, run, fact.kind, fact.decision, fact.reason, fact.host, always=summary, extra=fact.extra)
        except AuditError:
            pass  # the sink has said why once and is now unhealthy: new egress is refused
        for observer in self.observers:
            observer(record)

    @staticmethod
    def _decided(attempt: Attempt, duration_s: float | None = None) -> EgressDecided:
        """The attempt's ``egress`` fact: final (``duration_s`` given: bytes, duration, extras) or written ahead."""
        run = attempt.run
        final = duration_s is not None
        extra: Mapping[str, object] | None = attempt.extra if final else None
        if attempt.learned is not None:
            # Written ahead too: an allowed connection's one egress record must say it was let through by learn mode.
            extra = {"learned": attempt.learned, **(extra or {})}
        return EgressDecided(
            id=attempt.id,
            ts=attempt.ts,
            run=run.id if run else None,
            kind=attempt.kind,
            client=attempt.client,
            host=attempt.host,
            port=attempt.port,
            address=attempt.address,
            decision=attempt.decision,
            reason=attempt.reason,
            rule=attempt.rule,
            approval=attempt.approval,
            command=attempt.command,
            bytes_up=attempt.bytes_up if final else None,
            bytes_down=attempt.bytes_down if final else None,
            duration_s=duration_s,
            extra=dict(extra) if extra else None,
        )

    def _write(
        self,
        record: dict[str, object],
        run: Run | None,
        kind: EgressKind,
        decision: Decision,
        reason: str | None,
        host: str | None,
        *,
        always: bool,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """Write a finished attempt's record, unless it is a refusal past its run's budget (``floods``).

        ``always``: written whatever the budget (an ``egress.end``, a summary).
        """
        budget = self.refusals
        if budget is None:
            self.audit.write(record)
            return
        now = self.monotonic()
        if budget.next_due is not None and now >= budget.next_due:
            self._write_suppressed(budget.due(now))
        if decision is not Decision.DENY or always:
            self.audit.write(record)
            return
        run_id = run.id if run is not None else None
        # A DNS query refused for its type has no reason code; its response code says why.
        reason = reason or str((extra or {}).get("answer") or "-")
        if budget.admit(run_id, now, kind, reason, host):
            self.audit.write(record)
        elif self._refusals_timer is None and budget.next_due is not None:
            self._arm_refusals_timer(budget.next_due - now)

    def flush_suppressed(self, run_id: str | None = None, *, every: bool = False) -> None:
        """Write the ``egress.suppressed`` summaries of ``run_id`` (or of every run) now.

        Before a run's ``run.end`` record, and when egressd stops (``every``,
        which also stops the timer): no refusal is left uncounted.
        """
        if self.refusals is None:
            return
        if every and self._refusals_timer is not None:
            self._refusals_timer.cancel()
            self._refusals_timer = None
        self._write_suppressed(self.refusals.drain(run_id, every=every))

    def _arm_refusals_timer(self, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a unit test finishing by hand): summaries go out with the next record
        self._refusals_timer = loop.call_later(max(0.0, delay_s), self._refusals_tick)

    def _refusals_tick(self) -> None:
        """An interval ended: write its summaries, and wait for the next one that counts."""
        self._refusals_timer = None
        budget = self.refusals
        if budget is None:
            return
        now = self.monotonic()
        self._write_suppressed(budget.due(now))
        if budget.next_due is not None:
            self._arm_refusals_timer(budget.next_due - now)

    def _write_suppressed(self, summaries: list[Suppressed]) -> None:
        if not summaries:
            return
        # The budget counts in monotonic time; the records say when in wall-clock time.
        offset = self.clock() - self.monotonic()
        for summary in summaries:
            record = suppressed_record(
                ts=self.clock(),
                run=summary.run,
                start=summary.start + offset,
                end=summary.end + offset,
                counts=summary.counts,
                samples=summary.samples,
            )
            try:
                self.audit.write(record)
            except AuditError:
                return  # the sink is unhealthy now: nothing more can be written

    def _log_decision(self, attempt: Attempt, admission: Admission) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        run_id = attempt.run.id if attempt.run else "-"
        target = f"{admission.host}:{admission.port}"
        if not target.isprintable():
            target = logged(target)  # a hostile host must not repaint the operator's terminal
        if admission.allowed and attempt.learned is not None:
            log.info("ALLOW %s %s run=%s learned=%s", attempt.kind, target, run_id, attempt.learned)
        elif admission.allowed:
            log.info("ALLOW %s %s run=%s rule=%s", attempt.kind, target, run_id, attempt.rule)
        else:
            log.info("DENY  %s %s run=%s reason=%s", attempt.kind, target, run_id, attempt.reason)
