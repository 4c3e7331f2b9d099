"""The recorder: every attempt's audit records, metrics, run events and decision log lines.

An allowed attempt's ``egress`` record is written ahead of its dial
(``open``: if it cannot be written, ``audit_unavailable`` and nothing goes
out); ``finish`` then writes its ``egress.end`` record, or the one
``egress`` record of a refusal; ``record_refusal`` an attempt refused
before the policy ran; ``settle`` a decided attempt that opened nothing (the
DNS server's queries). A refusal past its run's budget for the interval is
counted into one ``egress.suppressed`` record instead (``floods.RefusalBudget``).

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from egressd.audit.log import AuditError, AuditSink
from egressd.audit.records import EgressDecided, EgressEnded, new_request_id, suppressed_record
from egressd.names.shown import logged
from egressd.proxy.core.attempt import Attempt, DialError, Seen
from egressd.proxy.core.floods import RefusalBudget, Suppressed
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.runs import Run
from egressd.vocabulary.egress import Decision, EgressKind, End
from egressd.vocabulary.reasons import Reason

log = logging.getLogger("egressd.decisions")

# A record's plain decision text (``.value`` is a descriptor: a Python call per connection).
_DECISION_TEXT: dict[Decision, str] = {decision: decision.value for decision in Decision}


# How an allowed connection ends without anything to tell the operator: the rest get an END line.
_QUIET_ENDS = frozenset({End.CLOSED, End.SHUTDOWN})


def _logged_line(line: str) -> None:
    log.info("%s", line)


class Recorder:
    """Writes every attempt's records, counts it in the metrics, tells the run and the observers."""

    def __init__(
        self,
        *,
        audit: AuditSink,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        refusals: RefusalBudget | None = None,
    ) -> None:
        self.audit = audit
        self.metrics = metrics
        self.clock = clock
        self.monotonic = monotonic
        # Called with every finished egress record (e.g. `egressd run` prints refusals). They read it and
        # never edit it: the same dict is the run's event (``Run.keep_event``).
        self.observers: list[Callable[[dict[str, object]], None]] = []
        # Floods: past a run's budget, refusals are counted into egress.suppressed records (None: all written).
        self.refusals = refusals
        self._refusals_timer: asyncio.TimerHandle | None = None
        # Where each decision's line goes, when ``log`` is on at INFO: through logging by default; egressd's
        # own stderr handler gives a writer that skips the LogRecord (``egressd.cli.logformat.direct_writer``:
        # about a tenth of a tunnel's instructions, bench/RESULTS.md).
        self.say: Callable[[str], None] = _logged_line

    def begin(self, kind: EgressKind, client: str | None, port: int | None = None) -> Seen:
        """A new attempt's identity: what the listener learns next goes into new ``Seen`` values."""
        return Seen(id=new_request_id(), kind=kind, client=client, ts=self.clock(), started=self.monotonic(), port=port)

    def record_refusal(self, seen: Seen, reason: Reason | None, detail: str | None = None) -> None:
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
        written = self.settle(fact, run, counted=False)
        # Every decision one line, as the policy's are; a flood's, past its run's budget, are counted, not said.
        if written and reason is not None and log.isEnabledFor(logging.INFO):
            target = seen.host if seen.port is None else f"{seen.host}:{seen.port}"
            self.say(f"DENY  {seen.kind!s} {logged(str(target or '-'))} run={run.id if run else '-'} "
                     f"reason={reason.value}")  # fmt: skip

    def open(self, attempt: Attempt, address: str | None) -> None:
        """Write an allowed attempt's ``egress`` record before any of its bytes go out (write-ahead).

        Bytes and duration are null in it; ``finish`` then writes the
        ``egress.end`` record. Raises DialError(``audit_unavailable``) when
        the record could not be written: the attempt must not go out.
        Idempotent (a request on a kept upstream connection opens once).
        The decision is counted and logged here, once.
        """
        if not attempt.counted:
            self._count(attempt)
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

    def overrule(self, attempt: Attempt, reason: Reason) -> None:
        """Refuse an attempt after it was admitted, for what its connection did next.

        The CONNECT tunnel whose ClientHello names another server
        (``sni_mismatch``) is the case: the policy allowed the host, the
        bytes then asked for a different one. The metrics move the attempt
        from allow to deny; the record says deny with ``reason``.
        """
        if attempt.counted and attempt.decision is Decision.ALLOW:
            self.metrics.decisions[("allow", "")] -= 1
            self.metrics.decisions[("deny", reason.value)] += 1
        attempt.deny(reason)
        if log.isEnabledFor(logging.INFO):
            run_id = attempt.run.id if attempt.run else "-"
            target = ascii(f"{attempt.host}:{attempt.port}")[1:-1]
            self.say(f"DENY  {attempt.kind!s} {target} run={run_id} reason={attempt.reason!s}")

    def finish(self, attempt: Attempt) -> None:
        """Write the attempt's final audit record (idempotent), its run event and metrics.

        Not opened: the one ``egress`` record. Opened: the ``egress.end``
        record; the run and the observers still see the whole attempt as
        one record (bytes, duration and ``end`` filled in).
        """
        if attempt.finished:
            return
        attempt.finished = True
        if attempt.decided and not attempt.counted:
            self._count(attempt)
        run = attempt.run
        duration_s = self.monotonic() - attempt.started
        ahead = attempt.ahead
        if ahead is None:
            fact = self._decided(attempt, duration_s)
            self.settle(fact, run, counted=attempt.decided)
            return
        end = attempt.end or (attempt.reason if attempt.decision is Decision.DENY else None) or End.CLOSED
        if end not in _QUIET_ENDS and log.isEnabledFor(logging.INFO):  # cut, not closed: the line says why
            self.say(f"END   {attempt.kind!s} {logged(f'{attempt.host}:{attempt.port}')} "
                     f"run={run.id if run else '-'} end={end!s}")  # fmt: skip
        written = EgressEnded(
            id=attempt.id,
            ts=self.clock(),
            run=run.id if run else None,
            address=attempt.address,
            bytes_up=attempt.bytes_up,
            bytes_down=attempt.bytes_down,
            duration_s=duration_s,
            end=end,
            extra=attempt.notes(learned=False, request=False),
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

    def settle(self, fact: EgressDecided, run: Run | None, *, counted: bool = False, summary: bool = False) -> bool:
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
        written = False
        try:
            written = self._write(record, run, fact.kind, fact.decision, fact.reason, fact.host, always=summary,
                                  extra=fact.extra)  # fmt: skip
        except AuditError:
            pass  # the sink has said why once and is now unhealthy: new egress is refused
        for observer in self.observers:
            observer(record)
        return written

    @staticmethod
    def _decided(attempt: Attempt, duration_s: float | None = None) -> EgressDecided:
        """The attempt's ``egress`` fact: final (``duration_s`` given: bytes, duration, extras) or written ahead."""
        run = attempt.run
        final = duration_s is not None
        if final:
            extra = attempt.notes()
        elif attempt.learned is not None or attempt.method is not None:
            # Written ahead too: an allowed connection's one egress record must say it was let through by
            # learn mode, and an inspected request what it was (method, path).
            extra = {}
            if attempt.learned is not None:
                extra["learned"] = attempt.learned.value
            if attempt.method is not None:
                extra["method"], extra["path"] = attempt.method, attempt.path
        else:
            extra = None
        return EgressDecided(
            id=attempt.id,
            ts=attempt.ts,
            run=run.id if run else None,
            kind=attempt.kind,
            client=attempt.client,
            host=attempt.host,
            port=attempt.port,
            address=attempt.recorded_address,
            decision=attempt.decision,
            reason=attempt.reason,
            rule=attempt.rule,
            approval=attempt.approval,
            command=attempt.command,
            bytes_up=attempt.bytes_up if final else None,
            bytes_down=attempt.bytes_down if final else None,
            duration_s=duration_s,
            extra=extra,
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
    ) -> bool:
        """Write a finished attempt's record, unless it is a refusal past its run's budget (``floods``);
        whether it was written.

        ``always``: written whatever the budget (an ``egress.end``, a summary).
        """
        budget = self.refusals
        if budget is None:
            self.audit.write(record)
            return True
        now = self.monotonic()
        if budget.next_due is not None and now >= budget.next_due:
            self._write_suppressed(budget.due(now))
        if decision is not Decision.DENY or always:
            self.audit.write(record)
            return True
        run_id = run.id if run is not None else None
        # A DNS query refused for its type has no reason code; its response code says why.
        reason = reason or str((extra or {}).get("answer") or "-")
        if budget.admit(run_id, now, kind, reason, host):
            self.audit.write(record)
            return True
        if self._refusals_timer is None and budget.next_due is not None:
            self._arm_refusals_timer(budget.next_due - now)
        return False

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

    def _count(self, attempt: Attempt) -> None:
        """A decided attempt: counted in the metrics and logged, once (at its record ahead or its end)."""
        attempt.counted = True
        self.metrics.decided(attempt.decision, attempt.reason, self.monotonic() - attempt.started)
        if not log.isEnabledFor(logging.INFO):
            return
        run_id = attempt.run.id if attempt.run else "-"
        target = f"{attempt.host}:{attempt.port}"
        if not target.isprintable():
            target = logged(target)  # a hostile host must not repaint the operator's terminal
        allowed = attempt.decision is Decision.ALLOW
        if allowed and attempt.learned is not None:
            self.say(f"ALLOW {attempt.kind!s} {target} run={run_id} learned={attempt.learned!s}")
        elif allowed:
            self.say(f"ALLOW {attempt.kind!s} {target} run={run_id} rule={attempt.rule!s}")
        else:
            self.say(f"DENY  {attempt.kind!s} {target} run={run_id} reason={attempt.reason!s}")
