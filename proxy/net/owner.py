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
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest
from egressd.proxy.core.attempt import Attempt
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
