"""The owner process as a worker sees it (``--workers``): the approver behind its questions, the recorder it tells.

A worker has no channel of its own: every question goes to the owner, whose
approver (the terminal, Slack, the webhook, the page) asks a person, and the
answer comes back over the channel (``channel.Channel``). A question the
client gave up on is withdrawn; an answer that comes after that still
reaches the run through the request's ``on_late_answer``, called here when
the owner says so. If the owner goes away, every question still open is
answered ``no_approver``: nobody can answer any more.

The worker's recorder (``ReportingRecorder``) tells the owner of every
connection whose ``egress`` record it wrote ahead, before the dial, and of
its end: if the worker dies, the owner ends each one still open with an
``egress.end`` record (``worker_lost``), so no record of what went out is
left without its end.

The owner also keeps the runs' upload budgets: a worker's budget is lent
to it by the owner (``lend``), so the processes together send no more than
the run's budget before a person is asked (``lend_budget`` is the owner's
side).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest
from egressd.proxy.core.attempt import Attempt
from egressd.proxy.core.budget import Budget, lend
from egressd.proxy.core.decision import budget_approval
from egressd.proxy.core.runs import Run
from egressd.proxy.net.recorder import Recorder
from egressd.vocabulary.reasons import Answer

# Late answers still expected (their clients gave up); past this many the oldest are forgotten.
MAX_LATE = 4096


class OwnerApprover:
    """An ``Approver`` whose questions the owner process asks (``send``), answered by ``answered``."""

    def __init__(self, send: Callable[[Any], None]) -> None:
        self._send = send
        self._ids = itertools.count(1)
        self._open: dict[int, asyncio.Future[ApprovalOutcome]] = {}
        self._late: OrderedDict[int, Callable[[ApprovalOutcome], None]] = OrderedDict()
        self._loans: dict[int, asyncio.Future[tuple[ApprovalOutcome, int]]] = {}
        self._gone = False

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        if self._gone:
            return ApprovalOutcome(Answer.NO_APPROVER)
        ask_id = next(self._ids)
        answer = self._open[ask_id] = asyncio.get_running_loop().create_future()
        if request.on_late_answer is not None:
            self._late[ask_id] = request.on_late_answer
            while len(self._late) > MAX_LATE:
                self._late.popitem(last=False)
        self._send(("ask", ask_id, replace(request, on_late_answer=None)))
        try:
            outcome = await answer
        except asyncio.CancelledError:
            self._send(("withdraw", ask_id))  # the late answer, if any, still comes
            raise
        finally:
            del self._open[ask_id]
        self._late.pop(ask_id, None)
        return outcome

    async def lend(self, run_id: str, site: str, port: int, need: int) -> tuple[ApprovalOutcome, int]:
        """``need`` bytes or more of the run's upload budget to ``site``, from the owner (``runner.Lender``)."""
        if self._gone:
            return ApprovalOutcome(Answer.NO_APPROVER), 0
        ask_id = next(self._ids)
        loan = self._loans[ask_id] = asyncio.get_running_loop().create_future()
        self._send(("lend", ask_id, run_id, site, port, need))
        try:
            return await loan
        except asyncio.CancelledError:
            self._send(("withdraw", ask_id))
            raise
        finally:
            del self._loans[ask_id]

    def lent(self, ask_id: int, outcome: ApprovalOutcome, amount: int) -> None:
        """The owner's answer to loan ``ask_id``."""
        waiting = self._loans.get(ask_id)
        if waiting is not None and not waiting.done():
            waiting.set_result((outcome, amount))

    def answered(self, ask_id: int, outcome: ApprovalOutcome) -> None:
        """The owner's answer to question ``ask_id``."""
        waiting = self._open.get(ask_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(outcome)

    def late(self, ask_id: int, outcome: ApprovalOutcome) -> None:
        """An answer that came after the client gave up: it still applies to the run."""
        apply = self._late.pop(ask_id, None)
        if apply is not None:
            apply(outcome)

    def owner_gone(self) -> None:
        """The owner died: every open question is answered ``no_approver``, and so is every new one."""
        self._gone = True
        for waiting in self._open.values():
            if not waiting.done():
                waiting.set_result(ApprovalOutcome(Answer.NO_APPROVER))
        for loan in self._loans.values():
            if not loan.done():
                loan.set_result((ApprovalOutcome(Answer.NO_APPROVER), 0))
        self._late.clear()


class ReportingRecorder(Recorder):
    """A worker's recorder: tells the owner which connections are open (``tell_now``: sent before the dial), and
    when each ends (``tell``: with the loop turn's other messages)."""

    tell_now: Callable[[Any], None]
    tell: Callable[[Any], None]

    def open(self, attempt: Attempt, address: str | None) -> None:
        opening = attempt.ahead is None
        super().open(attempt, address)
        if opening:  # written ahead now (else DialError was raised): said before the dial
            run = attempt.run
            self.tell_now(("opened", attempt.id, run.id if run is not None else None, self.clock()))

    def finish(self, attempt: Attempt) -> None:
        ending = attempt.ahead is not None and not attempt.finished
        super().finish(attempt)
        if ending:
            self.tell(("ended", attempt.id))


async def lend_budget(
    run: Run,
    site: str,
    port: int,
    need: int,
    *,
    grant: int,
    share: int,
    ask: Callable[[ApprovalRequest], Awaitable[ApprovalOutcome]],
) -> tuple[ApprovalOutcome, int]:
    """The owner's side of a worker's loan: ``need`` bytes or more (at least one) of ``run``'s upload budget
    to ``site`` (``share`` when it has them) → (the outcome, the bytes lent).

    When the budget has not ``need`` left, a person is asked first, through
    the question every connection waiting on the budget shares (``asking``:
    the owner's own connections' too); an allow grants another budget's
    worth, as it does without workers.
    """
    budget = run.budget(site, grant)
    outcome = ApprovalOutcome(Answer.ALLOW)
    # At least a byte: a connection asks when it cannot send its next one. An allow grants room for ``need``
    # only (a body declared past the loan) and a budget, as without workers: not for that one byte too.
    while (lent := lend(budget, max(1, need), share)) is None:
        # Asked again when others spent what an allow granted before this loan's turn came.
        if budget.asking is None:
            budget.asking = asyncio.ensure_future(_ask_budget(run, budget, port, need, ask))
        outcome = await asyncio.shield(budget.asking)
        if not outcome.allowed:
            return outcome, 0
    return outcome, lent


async def _ask_budget(
    run: Run, budget: Budget, port: int, need: int, ask: Callable[[ApprovalRequest], Awaitable[ApprovalOutcome]]
) -> ApprovalOutcome:
    try:
        outcome = await ask(budget_approval(run, budget.site, port, budget.sent))
    except Exception:  # fail closed: a question that broke allowed nothing
        outcome = ApprovalOutcome(Answer.NO_APPROVER)
    finally:
        budget.asking = None
    if outcome.allowed:
        budget.granted(need)  # room for what the asker needs (a body declared larger than a budget) and a budget
    return outcome
