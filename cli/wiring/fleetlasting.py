"""``serve --state``: the fleet's *always* answers and shared denials, as this instance keeps, lists and applies them.

- ``keep`` (the broker's, at the answer): the rule counts here at once
  (the running policy is applied again) and goes into an outbox that a
  writer task empties into the database in order, retrying until each
  write lands. While the database is known to be unreachable an answer is
  not kept (``LastingError``: the broker allows it for the run only, and
  says why).
- ``revoke``: the same way, taken back here at once; refused, nothing taken
  back, while the database is known to be unreachable.
- What other instances keep and revoke is read at each notification and
  every ``REFRESH_S`` (one missed while the listener reconnected). A change
  applies the running policy again (a ``policy.reloaded`` record on every
  instance), and an entry revoked is taken back from every live run here.

With ``share_denials`` task or group, a person's denial given here is also
written to the database (``share``, as the broker tells its channels), and
every instance denies the host's registered domain, for 24 hours, to its
runs with the same task, or to all its runs when it is of the same group:
the live runs at once, a run that starts later when it starts. A denial
that cannot be written stays the run's own (said).

The outbox lives in this process: an answer kept in the last moments
before a crash, with the database away, is lost with it (the holder's
``approval.decided`` record still says *always*).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence

from egressd.approvals.interface import PendingApproval, Settlement
from egressd.audit.records import rfc3339
from egressd.config.allowfile import Approved, LastingError
from egressd.control.api import Lasting
from egressd.fleet.rules import Denial, FleetRules, Revocation, Rule
from egressd.proxy.core.runs import Run, RunRegistry
from egressd.vocabulary.reasons import Answer

from .errors import StartupError

log = logging.getLogger("egressd.fleet")

# How often the rules are read without a notification; how soon an outbox that failed is tried again.
REFRESH_S = 5.0
RETRY_S = 1.0


class FleetLasting:
    """The fleet's rules as this instance sees them: read, plus what its outbox has not written yet."""

    def __init__(self, dsn: str, instance: str, *, share_denials: str = "run", group: str = "default") -> None:
        self.instance = instance
        self.share_denials = share_denials  # run: denials stay with their run; task or group: shared that far
        self.group = group
        self._rules = FleetRules(dsn, self._wake)
        self._stored: list[Rule] = []  # as last read from the database
        self._outbox: deque[Rule | Revocation] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._applied: frozenset[str] = frozenset()
        self._denials: list[Denial] = []  # the standing shared denials of this instance's reach, as last read
        self._denied: set[str] = set()  # those applied to the live runs (by approval)
        self._runs: RunRegistry | None = None
        # Set by the service once it serves: apply the running policy again; take entries back from the live runs.
        self.apply: Callable[[], object] = lambda: None
        self.take_back: Callable[[Sequence[str]], None] = lambda _entries: None
        # Told when the database is lost (with why) and found again (None): a record in the audit log.
        self.state_changed: Callable[[str | None], None] = lambda _error: None

    async def open(self) -> None:
        """Read the standing rules (before the policy is made) and follow them; StartupError."""
        try:
            await self._rules.open()
            self._stored = await self._rules.standing()
            self._denials = self._mine(await self._rules.denials())
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many; each one means "not usable")
            await self._rules.close()
            raise StartupError(f"bad setting state: the fleet's rules: {exc}") from None
        self._applied = frozenset(self.entries())
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="fleet rules")

    def attach(self, runs: RunRegistry) -> None:
        """Deny what the fleet's shared denials cover to ``runs``' live runs now, and to each run as it starts."""
        self._runs = runs
        runs.joined.append(self._deny_to)
        self._apply_denials()

    def _mine(self, denials: Sequence[Denial]) -> list[Denial]:
        if self.share_denials == "group":
            return [d for d in denials if d.reach == "group" and d.key == self.group]
        return [d for d in denials if d.reach == self.share_denials]

    def _covers(self, denial: Denial, run: Run) -> bool:
        return denial.reach == "group" or run.task == denial.key

    def _deny_to(self, run: Run) -> None:
        for denial in self._denials:
            if self._covers(denial, run):
                run.deny_host(denial.host)

    def _apply_denials(self) -> None:
        fresh = [d for d in self._denials if d.approval not in self._denied]
        if self._runs is None or not fresh:
            return
        for denial in fresh:
            self._denied.add(denial.approval)
            covered = [run.id for run in self._runs if self._covers(denial, run)]
            for run_id in covered:
                run = self._runs.get(run_id)
                if run is not None:
                    run.deny_host(denial.host)
            log.info("fleet: %s denied by %s (%s %s, approval %s) for runs here: %s", denial.host,
                     denial.by or "someone", denial.reach, denial.key, denial.approval,
                     ", ".join(covered) or "none live now")  # fmt: skip

    async def share(self, approval: PendingApproval, settlement: Settlement) -> None:
        """A person's denial of ``approval``, held here, written for the task or group (share_denials)."""
        request = approval.request
        key = self.group if self.share_denials == "group" else request.task
        if settlement.answer is not Answer.DENY or self.share_denials == "run" or not key:
            return
        denial = Denial(approval=approval.id, reach=self.share_denials, key=key, host=request.host,
                        at=rfc3339(settlement.at), instance=self.instance, run=request.run_id, by=settlement.by,
                        channel=settlement.channel)  # fmt: skip
        try:
            await self._rules.deny(denial)
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many; each one means "not shared")
            log.warning("fleet: the denial of %s (approval %s) stays with its run: the fleet's database: %s",
                        request.host, approval.id, exc)  # fmt: skip

    def entries(self) -> tuple[str, ...]:
        """The standing entries, each once, in the order they were kept."""
        return tuple(dict.fromkeys(a.entry for a in self.standing()))

    def standing(self) -> list[Approved]:
        kept = {rule.approval: rule for rule in self._stored}
        for op in self._outbox:
            if isinstance(op, Rule):
                kept[op.approval] = op
            else:
                kept = {key: rule for key, rule in kept.items() if rule.entry not in op.entries}
        return [Approved(entry=r.entry, at=r.at, approval=r.approval, by=r.by, channel=r.channel, run=r.run,
                         auth=r.auth) for r in kept.values()]  # fmt: skip

    def keep(self, approved: Approved) -> None:
        if self._failing:
            raise LastingError("the fleet's database cannot be reached now")
        self._outbox.append(Rule(approval=approved.approval or approved.at, entry=approved.entry, at=approved.at,
                                 instance=self.instance, run=approved.run, by=approved.by,
                                 channel=approved.channel, auth=approved.auth))  # fmt: skip
        self._changed()
        self._wakeup.set()

    def revoke(self, entries: Sequence[str], by: str | None, channel: str | None, auth: str | None) -> None:
        if self._failing:
            raise LastingError("the fleet's database cannot be reached now: nothing was revoked")
        self._outbox.append(Revocation(tuple(entries), on=self.instance, by=by, channel=channel, auth=auth))
        for entry in entries:
            log.info("always entry %s revoked in the fleet's rules%s", entry, f" by {by}" if by else "")
        self._changed()
        self._wakeup.set()

    def _wake(self) -> None:
        self._wakeup.set()

    def _changed(self) -> None:
        """Apply the standing entries here when they changed; take a revoked one back from the live runs."""
        self._apply_denials()
        now = frozenset(self.entries())
        gone = sorted(self._applied - now)
        if now == self._applied:
            return
        self._applied = now
        # Not from inside the broker's answer: the policy is applied again at the loop's next turn.
        asyncio.get_running_loop().call_soon(self._apply, gone)

    def _apply(self, gone: Sequence[str]) -> None:
        try:
            self.apply()
            if gone:
                self.take_back(gone)
        except Exception:  # the policy as it was stays in force; said
            log.exception("fleet: the fleet's rules could not be applied here")

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), RETRY_S if self._failing else REFRESH_S)
            self._wakeup.clear()
            try:
                await self._rules.listen()  # again, if the connection dropped
                await self._flush()
                self._stored = await self._rules.standing()
                self._denials = self._mine(await self._rules.denials())
            except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many; every one means "not now")
                if not self._failing:
                    log.warning("fleet: the state database is unreachable (%s): always answers here are for the "
                                "run only, and revocations are refused, until it is back", exc)  # fmt: skip
                    self._tell((str(exc) or type(exc).__name__)[:300])
                self._failing = True
                continue
            if self._failing:
                log.warning("fleet: the state database is back: the fleet's rules are followed again")
                self._failing = False
                self._tell(None)
            self._changed()

    def _tell(self, error: str | None) -> None:
        try:
            self.state_changed(error)
        except Exception:  # said; the loop goes on
            log.exception("fleet: the database's state could not be recorded")

    async def _flush(self) -> None:
        while self._outbox:
            op = self._outbox[0]
            if isinstance(op, Rule):
                await self._rules.keep(op)
            else:
                await self._rules.revoke(op)
            self._outbox.popleft()

    async def close(self) -> None:
        """Stop following; what the outbox holds is written if the database answers within 5 s, else said."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._flush(), 5.0)
        if self._outbox:
            log.error("fleet: not written to the fleet's rules before stopping: %s",
                      "; ".join(_described(op) for op in self._outbox))  # fmt: skip
        await self._rules.close()

    def lasting(self, allow_file: Lasting) -> Lasting:
        """The control API's ``Lasting``: the fleet's rules and the allow file's own *always* answers together."""

        def standing() -> Sequence[Approved]:
            return [*allow_file.standing(), *self.standing()]

        def revoke(entries: Sequence[str], by: str | None, channel: str | None, auth: str | None) -> None:
            mine = {a.entry for a in self.standing()}
            in_file = {a.entry for a in allow_file.standing()}
            if any(e in mine for e in entries):
                self.revoke([e for e in entries if e in mine], by, channel, auth)
            if any(e in in_file for e in entries):
                allow_file.revoke([e for e in entries if e in in_file], by, channel, auth)

        return Lasting(standing=standing, revoke=revoke)


def _described(op: Rule | Revocation) -> str:
    if isinstance(op, Rule):
        return f"always {op.entry} (approval {op.approval})"
    return f"revoked {', '.join(op.entries)}"

