"""The approval state machine: open approvals by id and by (run, host, port), and what settles them.

Pure: no asyncio, no clock (every transition takes ``now``, epoch seconds),
no I/O. The broker is the thin asyncio shell around it.

One approval::

    OPEN ── answer(allow+scope | deny) ───▶ SETTLED  ALLOW (once|run|always) | DENY
      ├──── every channel failed to deliver ▶ SETTLED  NO_APPROVER
      ├──── expire ─────────────────────────▶ SETTLED  TIMEOUT
      └──── withdraw (shutdown) ────────────▶ SETTLED  SHUTTING_DOWN

An approval still open at its deadline was delivered somewhere or has a
delivery still in flight (every channel failing for certain settles it at
once), so the deadline is always a timeout, never ``no_approver``.

Only OPEN has transitions: the first one wins and every later answer hears
``SETTLED``. A settled approval leaves the open maps at once (so the same key
may be asked again: a timeout does not stick), and its settlement is
remembered for a while so a late answer can be told who decided.

Each run may open at most ``max_requests_per_run`` approvals in its life,
however they end (a timeout counts): past that ``may_ask`` is False and the
run stops asking; ``stop`` says True once per run, for the one notice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from egressd.vocabulary.reasons import Answer

from .interface import Answered, AnswerResult, ApprovalRequest, ApprovalScope, Choice, Settlement

Key = tuple[str, str, int]

# Settled approvals remembered for "already settled by X" answers; older ones
# answer UNKNOWN. A person answers within minutes; a thousand covers that.
REMEMBERED_SETTLEMENTS = 1000
# Runs whose request count is remembered, the least recently asking forgotten
# first. A run past its limit is also switched to not asking by the gate, so
# forgetting a count only restarts a run that stayed quiet while this many
# others asked.
REMEMBERED_RUNS = 10_000


class LedgerError(Exception):
    """A caller's bug: opening a key that is open, or past a per-run limit."""


def key_of(request: ApprovalRequest) -> Key:
    """Approvals are keyed by (run, host, port): DESIGN.md, "Decision order"."""
    return (request.run_id, request.host, request.port)


@dataclass(slots=True)
class Approval:
    """One open approval's bookkeeping."""

    id: str
    request: ApprovalRequest
    channels: tuple[str, ...]
    opened_at: float
    delivered: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    settlement: Settlement | None = None

    @property
    def key(self) -> Key:
        return key_of(self.request)


@dataclass(slots=True)
class _RunRequests:
    """How many approvals a run opened, and whether it was told it stopped asking."""

    opened: int = 0
    stopped: bool = False


class Ledger:
    """Every open approval, the recently settled ones, and each run's request count."""

    def __init__(
        self,
        *,
        max_pending_per_run: int,
        max_requests_per_run: int = 20,
        remembered: int = REMEMBERED_SETTLEMENTS,
        remembered_runs: int = REMEMBERED_RUNS,
    ) -> None:
        if max_pending_per_run < 1:
            raise ValueError("max_pending_per_run must be at least 1")
        if max_requests_per_run < 1:
            raise ValueError("max_requests_per_run must be at least 1")
        self.max_pending_per_run = max_pending_per_run
        self.max_requests_per_run = max_requests_per_run
        self._requests: OrderedDict[str, _RunRequests] = OrderedDict()
        self._remembered_runs = remembered_runs
        self._open: dict[str, Approval] = {}
        self._by_key: dict[Key, Approval] = {}
        self._per_run: dict[str, int] = {}
        self._settled: OrderedDict[str, Settlement] = OrderedDict()
        self._remembered = remembered

    def find(self, key: Key) -> Approval | None:
        """The open approval for a key, if any (concurrent requests share it)."""
        return self._by_key.get(key)

    def get(self, approval_id: str) -> Approval | None:
        return self._open.get(approval_id)

    def has_room(self, run_id: str) -> bool:
        """Whether the run may open another approval (``too_many_pending`` otherwise)."""
        return self._per_run.get(run_id, 0) < self.max_pending_per_run

    def may_ask(self, run_id: str) -> bool:
        """Whether the run may open another approval in its life (it stops asking otherwise)."""
        counted = self._requests.get(run_id)
        return counted is None or counted.opened < self.max_requests_per_run

    def stop(self, run_id: str) -> bool:
        """The run is past its limit: True the first time (say so once), False after."""
        counted = self._counted(run_id)
        first, counted.stopped = not counted.stopped, True
        return first

    def _counted(self, run_id: str) -> _RunRequests:
        counted = self._requests.get(run_id)
        if counted is None:
            counted = self._requests[run_id] = _RunRequests()
            while len(self._requests) > self._remembered_runs:
                self._requests.popitem(last=False)
        else:
            self._requests.move_to_end(run_id)
        return counted

    def pending(self) -> list[Approval]:
        """Open approvals, oldest first."""
        return sorted(self._open.values(), key=lambda a: a.opened_at)

    def open(self, request: ApprovalRequest, *, approval_id: str, channels: Sequence[str], now: float) -> Approval:
        """Open an approval; the caller checked ``find``, ``may_ask`` and ``has_room`` first."""
        key = key_of(request)
        if key in self._by_key:
            raise LedgerError(f"an approval for {key} is already open")
        if not self.may_ask(request.run_id):
            raise LedgerError(f"run {request.run_id} made {self.max_requests_per_run} approval requests")
        if not self.has_room(request.run_id):
            raise LedgerError(f"run {request.run_id} has {self.max_pending_per_run} approvals pending")
        if approval_id in self._open or approval_id in self._settled:
            raise LedgerError("approval id reused")
        approval = Approval(id=approval_id, request=request, channels=tuple(channels), opened_at=now)
        self._open[approval_id] = approval
        self._by_key[key] = approval
        self._per_run[request.run_id] = self._per_run.get(request.run_id, 0) + 1
        self._counted(request.run_id).opened += 1
        return approval

    def delivered(self, approval: Approval, channel: str) -> None:
        """A channel showed the approval to a person (also after it settled: it must then be told)."""
        approval.delivered.add(channel)

    def failed(self, approval_id: str, channel: str, *, now: float) -> Settlement | None:
        """A channel could not deliver; settles NO_APPROVER once every channel has failed."""
        approval = self._open.get(approval_id)
        if approval is None:
            return None
        approval.failed.add(channel)
        if approval.delivered or not approval.failed.issuperset(approval.channels):
            return None
        return self._settle(approval, Answer.NO_APPROVER, None, None, now)

    def answer(
        self,
        approval_id: str,
        decision: Choice,
        *,
        channel: str,
        by: str | None,
        now: float,
        scope: ApprovalScope = ApprovalScope.RUN,
        auth: str | None = None,
    ) -> Answered:
        """A person's answer: the first one decides. An allow carries its ``scope``; a denial none.

        ``auth``: the credential that answered (``Settlement.auth``).
        """
        approval = self._open.get(approval_id)
        if approval is None:
            settled = self._settled.get(approval_id)
            if settled is not None:
                return Answered(AnswerResult.SETTLED, settled)
            return Answered(AnswerResult.UNKNOWN)
        if decision is Choice.ALLOW:
            settled = self._settle(approval, Answer.ALLOW, channel, by, now, scope, auth)
        else:
            settled = self._settle(approval, Answer.DENY, channel, by, now, auth=auth)
        return Answered(AnswerResult.ACCEPTED, settled)

    def expire(self, approval_id: str, *, now: float) -> Settlement | None:
        """The deadline passed: TIMEOUT (a delivery reached a person or was still in flight)."""
        approval = self._open.get(approval_id)
        if approval is None:
            return None
        return self._settle(approval, Answer.TIMEOUT, None, None, now)

    def withdraw(self, approval_id: str, *, now: float, answer: Answer = Answer.SHUTTING_DOWN) -> Settlement | None:
        """Nobody will answer: egressd is stopping (SHUTTING_DOWN), or ``answer`` (a failure's denial)."""
        approval = self._open.get(approval_id)
        if approval is None:
            return None
        return self._settle(approval, answer, None, None, now)

    def amend(self, approval_id: str, settlement: Settlement) -> None:
        """Replace a remembered settlement (the broker turned an unrecordable allow into a denial)."""
        if approval_id in self._settled:
            self._settled[approval_id] = settlement

    def settlement(self, approval_id: str) -> Settlement | None:
        return self._settled.get(approval_id)

    def _settle(
        self,
        approval: Approval,
        answer: Answer,
        channel: str | None,
        by: str | None,
        now: float,
        scope: ApprovalScope | None = None,
        auth: str | None = None,
    ) -> Settlement:
        waited_s = max(0.0, now - approval.opened_at)
        settlement = Settlement(
            answer=answer, channel=channel, by=by, at=now, waited_s=waited_s, scope=scope, auth=auth
        )
        approval.settlement = settlement
        del self._open[approval.id]
        del self._by_key[approval.key]
        left = self._per_run[approval.request.run_id] - 1
        if left:
            self._per_run[approval.request.run_id] = left
        else:
            del self._per_run[approval.request.run_id]
        self._settled[approval.id] = settlement
        while len(self._settled) > self._remembered:
            self._settled.popitem(last=False)
        return settlement
