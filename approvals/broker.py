"""The approval broker: holds a request, asks every channel at once, returns the first valid answer.

``ApprovalBroker.ask`` (the ``Approver`` the proxy calls):

1. an approval for the same (run, host, port) is open → wait for that one
   (concurrent requests share one approval, one message);
2. the broker is closed → SHUTTING_DOWN at once; no channel attached →
   NO_APPROVER at once;
3. the run already opened ``max_requests_per_run`` approvals in its life
   (however they ended) → STOPPED_ASKING at once (``not_allowlisted``), and
   the first time, every channel is told the run stopped asking
   (``Channel.notify``);
4. the run already has ``max_pending_per_run`` approvals open →
   TOO_MANY_PENDING at once;
5. otherwise open one: an unguessable id, the message rendered once, an
   ``approval.requested`` audit record, then one driver task that delivers
   to every channel concurrently and waits, bounded by the deadline, for the
   first answer (``answer``, from any channel or the control API). Every
   channel failing to deliver for certain settles NO_APPROVER at once; the
   deadline settles TIMEOUT (also while a delivery is still in flight: a
   delivery cut off by the deadline is not a failure).
6. The settlement is recorded (``approval.decided``), wakes every waiting
   request, and every channel that showed the approval is told (the Slack
   message updated, the terminal prompt withdrawn).

The broker counts the requests waiting for each approval. When the last one
goes away (its client gave up: the gate's wait is cancelled) the approval is
not withdrawn: it stays open until answered or expired, an
``approval.abandoned`` record is written, and every channel that shows it is
told once (``Channel.abandoned``). A new request for the same key joins it
(no second message). Its settlement is then handed to the requests that left
(``ApprovalRequest.on_late_answer``): the gate applies an allow or a denial
to the run, so the run's next request is not asked again.

Allow and deny mean what the gate makes of them (a denial sticks for the
run). An allow carries its scope (``ApprovalScope``): ``once`` and ``run``
are the gate's to apply; for ``always`` the broker appends the request's
lasting entry (``ApprovalRequest.lasting``, exact ``host:port``) to the
allowlist file as one ``[[approved]]`` table before the decision is
recorded, once per approval however many requests wait on it; in a fleet
(``keep``) it is handed to the fleet's rules instead. *always* is
offered only with an allowlist file (``allow_file``) or ``keep``; asked
for without one it is ``NOT_OFFERED`` and decides nothing. When the request has no
lasting entry, or the file cannot be appended to, the answer still allows,
for the run only: one log line and the record's ``scope_error`` say why.
The append is one small write and fsync under the file's lock, done in the
event loop: it happens once per person's *always* answer, and doing it
before the waiters wake means no request for the same host slips in
between the settlement and the run's allowlist. Fail closed: an exception anywhere here ends in a denial, and an
allow that cannot be recorded in the audit log becomes one.

The state machine is ``ledger.Ledger`` (pure); this module is its asyncio
shell. It knows channels only through ``interface.Channel``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from egressd.audit.approvalrecords import approval_abandoned_record, approval_decided_record, approval_requested_record
from egressd.audit.log import AuditError, AuditSink
from egressd.audit.records import rfc3339
from egressd.config.allowfile import Approved, LastingError, append_approved
from egressd.vocabulary.egress import Decision
from egressd.vocabulary.reasons import Answer

from .control import control_routes
from .interface import (
    Answered,
    AnswerResult,
    ApprovalOutcome,
    ApprovalRequest,
    ApprovalScope,
    Channel,
    ChannelUnavailable,
    Choice,
    Elsewhere,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    SetupError,
)
from .ledger import Approval, Ledger, key_of
from .message import bounded, render, stopped_asking_text

log = logging.getLogger("egressd.approvals")

# Channels get this long to start (Slack's auth.test and Socket Mode
# handshake) before start-up gives up on them with a clear message.
START_TIMEOUT_S = 20.0
# Telling a channel an approval is settled (a Slack update) is best effort,
# but bounded so shutdown and the next approval never wait on it.
SETTLE_TIMEOUT_S = 10.0
# Who answered, as shown to other people: long enough for a name and an id.
MAX_BY_CHARS = 200


def new_approval_id() -> str:
    """An unguessable id (96 random bits), short enough to type: ``a-Xb3kP0…``."""
    return "a-" + secrets.token_urlsafe(12)


@dataclass(slots=True)
class _Held:
    """An approval between opening and the end of its driver task.

    ``waiters``: requests waiting for it now; ``abandoned``: all of them
    left once (the channels were told); ``late``: what the requests that
    left want done with the answer (``ApprovalRequest.on_late_answer``).
    """

    approval: Approval
    view: PendingApproval
    future: asyncio.Future[Settlement]
    waiters: int = 0
    abandoned: bool = False
    late: list[Callable[[ApprovalOutcome], None]] = field(default_factory=list)


class ApprovalBroker:
    """Steps 1-6 of the module docstring; also the ``Answerer`` its channels call."""

    def __init__(
        self,
        channels: Sequence[Channel],
        *,
        audit: AuditSink,
        timeout_s: float = 600.0,
        max_pending_per_run: int = 5,
        max_requests_per_run: int = 20,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_approval_id,
        start_timeout_s: float = START_TIMEOUT_S,
        settle_timeout_s: float = SETTLE_TIMEOUT_S,
        allow_file: Path | None = None,
        keep: Callable[[Approved], None] | None = None,
        elsewhere: Elsewhere | None = None,
    ) -> None:
        names = [c.name for c in channels]
        if len(set(names)) != len(names):
            raise ValueError(f"channel names must be unique: {names}")
        self._configured = tuple(channels)
        self._channels: tuple[Channel, ...] = ()
        self._audit = audit
        self.timeout_s = timeout_s
        self._clock = clock
        self._new_id = new_id
        self._start_timeout_s = start_timeout_s
        self._settle_timeout_s = settle_timeout_s
        # Where *always* answers are appended (--allow-file); None: *always* is not offered.
        self.allow_file = allow_file
        # Where *always* answers are kept instead (a fleet's rules, ``serve --state``); LastingError: not kept.
        self._keep_to = keep
        # A fleet's other instances (--state): their approvals listed and answered through the control API.
        self._elsewhere = elsewhere
        self._ledger = Ledger(max_pending_per_run=max_pending_per_run, max_requests_per_run=max_requests_per_run)
        self._held: dict[str, _Held] = {}
        # Called with each approval as it opens, before any channel shows it (``egressd run``'s
        # "answer from another terminal" line); a callback that raises is logged, never the ask's failure.
        self.opened: list[Callable[[PendingApproval], None]] = []
        # Called with each settlement as it is recorded, before any waiting request wakes (``serve --workers``'
        # owner applies it to its run at once: a worker's question already on its way finds it applied).
        self.settled: list[Callable[[PendingApproval, Settlement], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False

    # -- lifetime -----------------------------------------------------------------

    @property
    def max_requests_per_run(self) -> int:
        return self._ledger.max_requests_per_run

    @property
    def scopes(self) -> tuple[ApprovalScope, ...]:
        """The scopes every approval offers: *always* only with an allowlist file."""
        if self.allow_file is None and self._keep_to is None:
            return (ApprovalScope.ONCE, ApprovalScope.RUN)
        return (ApprovalScope.ONCE, ApprovalScope.RUN, ApprovalScope.ALWAYS)

    @property
    def attached(self) -> tuple[str, ...]:
        """Names of the channels that started and can be asked."""
        return tuple(c.name for c in self._channels)

    async def start(self) -> None:
        """Start every channel concurrently; leave out those with nothing to attach to.

        Raises SetupError (after closing what started) when a channel is
        configured but cannot work.
        """
        if self._started:
            return
        self._started = True
        results = await asyncio.gather(*(self._start_one(c) for c in self._configured), return_exceptions=True)
        problem: BaseException | None = None
        attached: list[Channel] = []
        for channel, result in zip(self._configured, results, strict=True):
            if result is True:
                attached.append(channel)
            elif isinstance(result, BaseException) and problem is None:
                problem = result
        self._channels = tuple(attached)
        if problem is not None:
            self._channels = self._configured  # close every one, started or not
            await self.close()
            if isinstance(problem, SetupError):
                raise problem
            raise SetupError(f"bad setting approver: a channel could not start: {problem}") from problem
        if self._configured and not attached:
            log.warning("no approval channel attached: requests for new domains are refused (no_approver)")

    async def _start_one(self, channel: Channel) -> bool:
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await channel.start(self)
        except ChannelUnavailable as exc:
            log.warning("approval channel %s not attached: %s", channel.name, exc)
            return False
        except TimeoutError:
            raise SetupError(
                f"bad setting approver: the {channel.name} channel did not start within {self._start_timeout_s:.0f}s"
            ) from None
        return True

    async def close(self) -> None:
        """Deny what is still open (nobody can answer any more), tell the channels, close them.

        Idempotent. Waiting requests get SHUTTING_DOWN at once; channels get
        ``settle_timeout_s`` to update what they showed.
        """
        if self._closed:
            return
        self._closed = True
        for approval in self._ledger.pending():
            self._settled(approval.id, self._ledger.withdraw(approval.id, now=self._clock()))
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=self._settle_timeout_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        for channel in self._channels:
            try:
                async with asyncio.timeout(self._settle_timeout_s):
                    await channel.close()
            except Exception:
                log.exception("approval channel %s did not close cleanly", channel.name)
        self._channels = ()

    def routes(self) -> list[Route]:
        """The control API's approval routes and every configured channel's own."""
        own = [route for channel in self._configured for route in channel.routes()]
        return control_routes(self, self._elsewhere) + own

    # -- the Approver -------------------------------------------------------------

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        """Hold until the approval for this request's key is settled (module docstring)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            joined = self._join_or_open(request)
            if isinstance(joined, Answer):
                return ApprovalOutcome(joined)
        except Exception:
            log.exception("approval for %s:%d in run %s failed; denying", request.host, request.port, request.run_id)
            return ApprovalOutcome(Answer.NO_APPROVER)
        joined.waiters += 1
        try:
            # shield: a waiter going away must not cancel the approval (others share it; it stays answerable).
            settlement = await asyncio.shield(joined.future)
        except asyncio.CancelledError:
            joined.waiters -= 1
            self._left(joined, request)
            raise
        joined.waiters -= 1
        return ApprovalOutcome(
            settlement.answer,
            approval_id=joined.approval.id,
            channel=settlement.channel,
            by=settlement.by,
            waited_s=loop.time() - started,
            scope=settlement.scope,
        )

    def _join_or_open(self, request: ApprovalRequest) -> _Held | Answer:
        """Steps 1-5 of the module docstring, without waiting."""
        existing = self._ledger.find(key_of(request))
        if existing is not None:
            return self._held[existing.id]
        if self._closed:
            return Answer.SHUTTING_DOWN
        if not self._channels:
            return Answer.NO_APPROVER
        if not self._ledger.may_ask(request.run_id):
            if self._ledger.stop(request.run_id):
                self._stopped_asking(request.run_id)
            return Answer.STOPPED_ASKING
        if not self._ledger.has_room(request.run_id):
            return Answer.TOO_MANY_PENDING
        loop = asyncio.get_running_loop()
        now = self._clock()
        message = render(
            host=request.host,
            port=request.port,
            command=request.command,
            task=request.task,
            allowed=request.allowed,
            request=request.request,
            uploaded=request.uploaded,
        )
        approval = self._ledger.open(request, approval_id=self._new_id(), channels=self.attached, now=now)
        view = PendingApproval(
            id=approval.id,
            request=request,
            message=message,
            created_at=now,
            expires_at=now + self.timeout_s,
            deadline=loop.time() + self.timeout_s,
            scopes=self.scopes,
        )
        held = _Held(approval, view, loop.create_future())
        self._held[approval.id] = held
        for callback in self.opened:
            try:
                callback(view)
            except Exception:
                log.exception("approval %s: an opened callback failed", approval.id)
        try:
            self._audit.write(
                approval_requested_record(
                    id=approval.id,
                    ts=now,
                    run=request.run_id,
                    host=request.host,
                    port=request.port,
                    command=request.command,
                    channels=self.attached,
                )
            )
        except AuditError:
            # Nothing may happen unrecorded: nobody is asked.
            self._settled(approval.id, self._ledger.withdraw(approval.id, now=now, answer=Answer.NO_APPROVER))
            del self._held[approval.id]
            return held
        log.info(
            "HOLD  %s:%d run=%s approval=%s channels=%s",
            message.host,
            request.port,
            request.run_id,
            approval.id,
            ",".join(self.attached),
        )
        task = loop.create_task(self._drive(held), name=f"approval {approval.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return held

    # -- the Answerer -------------------------------------------------------------

    def answer(
        self,
        approval_id: str,
        decision: Choice,
        *,
        channel: str,
        by: str | None,
        scope: ApprovalScope = ApprovalScope.RUN,
        auth: str | None = None,
    ) -> Answered:
        """A person's answer from a channel or the control API; the first one decides.

        ``by`` is the answerer's own words (shown, escaped and bounded);
        ``auth`` the credential the channel checked (recorded apart, as
        ``approval.decided``'s ``auth``).

        An allow whose ``scope`` the approval does not offer (*always* with
        no allowlist file) is ``NOT_OFFERED``: nothing is decided, the
        approval stays open.
        """
        if not isinstance(approval_id, str) or not isinstance(decision, Choice) or not isinstance(scope, ApprovalScope):
            return Answered(AnswerResult.UNKNOWN)
        if decision is Choice.ALLOW and self._ledger.get(approval_id) is not None:
            held = self._held.get(approval_id)
            if held is None or not held.view.offers(scope):
                log.warning(
                    "approval %s: an allow with scope %s from %s refused: not offered%s",
                    approval_id,
                    scope.value,
                    channel,
                    " (no --allow-file)" if self.allow_file is None and self._keep_to is None else "",
                )
                return Answered(AnswerResult.NOT_OFFERED)
        shown_by = bounded(by, MAX_BY_CHARS) if by else None
        answered = self._ledger.answer(
            approval_id,
            decision,
            channel=channel,
            by=shown_by,
            now=self._clock(),
            scope=scope,
            auth=bounded(auth, MAX_BY_CHARS) if auth else None,
        )
        if answered.result is AnswerResult.ACCEPTED:
            return Answered(AnswerResult.ACCEPTED, self._settled(approval_id, answered.settlement))
        return answered

    def pending(self) -> list[PendingApproval]:
        return [self._view(self._held[a.id]) for a in self._ledger.pending() if a.id in self._held]

    @staticmethod
    def _view(held: _Held) -> PendingApproval:
        """The approval as channels and the control API see it now: abandoned while nobody waits."""
        abandoned = held.abandoned and held.waiters == 0
        return replace(held.view, abandoned=True) if abandoned else held.view

    # -- inside -------------------------------------------------------------------

    def _settled(self, approval_id: str, settlement: Settlement | None) -> Settlement | None:
        """Record a settlement and wake the waiters; returns what they get.

        An allow that cannot be written to the audit log becomes a denial.
        """
        held = self._held.get(approval_id)
        if settlement is None or held is None:
            return settlement
        request = held.view.request
        if settlement.answer is Answer.ALLOW and settlement.scope is ApprovalScope.ALWAYS:
            settlement = self._keep(approval_id, request, settlement)
            self._ledger.amend(approval_id, settlement)
        try:
            self._audit.write(
                approval_decided_record(
                    id=approval_id,
                    ts=settlement.at,
                    decision=Decision.ALLOW if settlement.answer is Answer.ALLOW else Decision.DENY,
                    reason=settlement.reason,
                    channel=settlement.channel,
                    by=settlement.by,
                    waited_s=settlement.waited_s,
                    run=request.run_id,
                    scope=settlement.scope.value if settlement.scope is not None else None,
                    entry=settlement.entry,
                    scope_error=settlement.scope_error,
                    auth=settlement.auth,
                )
            )
        except AuditError:
            if settlement.answer is Answer.ALLOW:
                log.error("approval %s: the allow could not be recorded; denying", approval_id)
                settlement = replace(settlement, answer=Answer.NO_APPROVER, scope=None)
                self._ledger.amend(approval_id, settlement)
        held.approval.settlement = settlement
        log.info(
            "%s %s:%d run=%s approval=%s channel=%s by=%s waited=%.1fs",
            f"ALLOWED ({settlement.scope.value if settlement.scope else 'run'})"
            if settlement.answer is Answer.ALLOW
            else "DENIED ",
            held.view.message.host,
            request.port,
            request.run_id,
            approval_id,
            settlement.channel or "-",
            settlement.by or "-",
            settlement.waited_s,
        )
        for told in self.settled:  # before any waiter wakes: see ``settled``
            try:
                told(held.view, settlement)
            except Exception:
                log.exception("approval %s: a settlement callback failed", approval_id)
        if not held.future.done():
            held.future.set_result(settlement)
        if held.waiters == 0 and held.late:
            self._hand_on(held, settlement)
        return settlement

    def _keep(self, approval_id: str, request: ApprovalRequest, settlement: Settlement) -> Settlement:
        """An *always* allow: append the request's lasting entry to the allowlist file (or hand it to ``keep``).

        Returns the settlement as applied: with ``entry`` when it was
        appended; else scope RUN and ``scope_error`` (the answer is never
        lost: the request is allowed for the run all the same).
        """
        path, entry = self.allow_file, request.lasting
        if not self._audit.healthy:
            return settlement  # the allow cannot be recorded and becomes a denial: nothing lasting is written
        if path is None and self._keep_to is None:
            error = "no allow file (--allow-file) to append to"
        elif entry is None:
            error = f"no lasting entry for this host ({request.lasting_error or 'none'})"
        else:
            approved = Approved(
                entry=entry,
                at=rfc3339(settlement.at),
                approval=approval_id,
                by=settlement.by,
                channel=settlement.channel,
                run=request.run_id,
                auth=settlement.auth,
            )
            try:
                if self._keep_to is not None:
                    self._keep_to(approved)
                else:
                    assert path is not None
                    append_approved(path, approved)
            except LastingError as exc:
                error = f"could not keep it: {exc}" if self._keep_to is not None else \
                    f"could not append to the allow file: {exc}"
            else:
                log.info("approval %s: %s kept in %s (always)", approval_id, entry,
                         "the fleet's rules" if self._keep_to is not None else path)
                return replace(settlement, entry=entry)
        log.error("approval %s: allowed for this run only, not always: %s", approval_id, bounded(error, 300))
        return replace(settlement, scope=ApprovalScope.RUN, scope_error=error)

    def _hand_on(self, held: _Held, settlement: Settlement) -> None:
        """The settlement of an approval nobody waits for any more, to the requests that left."""
        late, held.late = held.late, []
        outcome = ApprovalOutcome(
            settlement.answer,
            approval_id=held.view.id,
            channel=settlement.channel,
            by=settlement.by,
            waited_s=settlement.waited_s,
            scope=settlement.scope,
        )
        for callback in late:
            try:
                callback(outcome)
            except Exception:
                log.exception("approval %s: applying the late answer failed", held.view.id)

    def _left(self, held: _Held, request: ApprovalRequest) -> None:
        """A waiting request went away (its client gave up); the last one abandons the approval."""
        if request.on_late_answer is not None:
            held.late.append(request.on_late_answer)
        if held.waiters:
            return
        if held.future.done():
            # Settled in the same instant, before this waiter woke: the answer is handed on all the same.
            if held.late:
                self._hand_on(held, held.future.result())
            return
        if held.abandoned or held.view.id not in self._held:
            return
        held.abandoned = True
        view = held.view
        now = self._clock()
        try:
            self._audit.write(
                approval_abandoned_record(
                    id=view.id,
                    ts=now,
                    run=view.request.run_id,
                    host=view.request.host,
                    port=view.request.port,
                    waited_s=max(0.0, now - view.created_at),
                )
            )
        except AuditError:
            pass  # the sink has said why once and is now unhealthy; the approval itself goes on
        log.info(
            "ABANDONED %s:%d run=%s approval=%s: every waiting client gave up; it stays answerable",
            view.message.host,
            view.request.port,
            view.request.run_id,
            view.id,
        )
        shown_on = [c for c in self._channels if c.name in held.approval.delivered]
        if shown_on:
            # Channels still delivering say so when their delivery returns (``_deliver``).
            self._track(self._tell_abandoned(shown_on, self._view(held)), f"abandoned {view.id}")

    def _track(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell_abandoned(self, channels: Sequence[Channel], view: PendingApproval) -> None:
        await asyncio.gather(*(self._abandoned_one(c, view) for c in channels))

    async def _abandoned_one(self, channel: Channel, view: PendingApproval) -> None:
        try:
            async with asyncio.timeout(self._settle_timeout_s):
                await channel.abandoned(view)
        except Exception as exc:
            log.warning(
                "approval %s: could not tell %s that every client gave up: %s",
                view.id,
                channel.name,
                str(exc) or type(exc).__name__,
            )

    async def _drive(self, held: _Held) -> None:
        """Deliver to every channel, wait for the settlement or the deadline, tell the channels."""
        view = held.view
        loop = asyncio.get_running_loop()
        try:
            deliveries = [
                loop.create_task(self._deliver(channel, held), name=f"deliver {view.id} to {channel.name}")
                for channel in self._channels
            ]
            try:
                async with asyncio.timeout_at(view.deadline):
                    await asyncio.shield(held.future)
            except TimeoutError:
                self._settled(view.id, self._ledger.expire(view.id, now=self._clock()))
            finally:
                for task in deliveries:
                    task.cancel()
                await asyncio.gather(*deliveries, return_exceptions=True)
            settlement = held.approval.settlement
            shown_on = [c for c in self._channels if c.name in held.approval.delivered]
            if settlement is not None and shown_on:
                await asyncio.gather(*(self._settle_one(c, view, settlement) for c in shown_on))
        except asyncio.CancelledError:
            # Only close() cancels a driver, after withdrawing it; make sure anyway.
            self._settled(view.id, self._ledger.withdraw(view.id, now=self._clock()))
            raise
        except Exception:
            log.exception("approval %s failed; denying", view.id)
            self._settled(view.id, self._ledger.withdraw(view.id, now=self._clock(), answer=Answer.NO_APPROVER))
        finally:
            self._held.pop(view.id, None)

    async def _deliver(self, channel: Channel, held: _Held) -> None:
        view = held.view
        try:
            async with asyncio.timeout_at(view.deadline):
                await channel.deliver(view)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            # Cut off by the deadline, not failed for certain: the driver
            # settles TIMEOUT (DESIGN.md: a delivery in flight is a timeout).
            log.warning("approval %s: %s was still delivering it at the deadline", view.id, channel.name)
        except ChannelUnavailable as exc:
            # Nobody there now (the approvals page closed): expected, not a fault worth a warning.
            log.debug("approval %s: %s is not attached: %s", view.id, channel.name, exc)
            self._settled(view.id, self._ledger.failed(view.id, channel.name, now=self._clock()))
        except Exception as exc:
            log.warning(
                "approval %s: %s could not deliver it: %s", view.id, channel.name, str(exc) or type(exc).__name__
            )
            self._settled(view.id, self._ledger.failed(view.id, channel.name, now=self._clock()))
        else:
            self._ledger.delivered(held.approval, channel.name)
            if held.abandoned and held.approval.settlement is None:
                # Every client gave up while this delivery was under way: the channel is told now.
                await self._abandoned_one(channel, self._view(held))

    def _stopped_asking(self, run_id: str) -> None:
        """Step 3's notice: every attached channel says once that the run stopped asking."""
        limit = self._ledger.max_requests_per_run
        log.warning(
            "run %s made %d approval requests, the most one run may make: it stops asking (not_allowlisted)",
            bounded(run_id, 64),
            limit,
        )
        notice = Notice(run_id=run_id, text=stopped_asking_text(run_id, limit), at=self._clock())
        self._track(self._notify(notice), f"notice for run {run_id}")

    async def _notify(self, notice: Notice) -> None:
        await asyncio.gather(*(self._notify_one(c, notice) for c in self._channels))

    async def _notify_one(self, channel: Channel, notice: Notice) -> None:
        try:
            async with asyncio.timeout(self._settle_timeout_s):
                await channel.notify(notice)
        except Exception as exc:
            log.warning(
                "could not tell %s that run %s stopped asking: %s",
                channel.name,
                bounded(notice.run_id, 64),
                str(exc) or type(exc).__name__,
            )

    async def _settle_one(self, channel: Channel, view: PendingApproval, settlement: Settlement) -> None:
        try:
            async with asyncio.timeout(self._settle_timeout_s):
                await channel.settle(view, settlement)
        except Exception as exc:
            log.warning(
                "approval %s: could not tell %s it is settled: %s",
                view.id,
                channel.name,
                str(exc) or type(exc).__name__,
            )
