"""The fleet as an approval channel (``serve --state``): this instance's held requests in the shared database,
and answers given on other instances applied here.

As a ``Channel`` of this instance's broker, it lists each approval the
broker opens (``deliver``) and how it ended (``settle``). As the control
API's ``Elsewhere`` it lists what the other instances hold and passes an
answer to one of those to its holder. The holder decides: a letter that
arrives here is applied through the broker's own ``answer`` (the first
answer wins, from whichever instance), with the channel named
``CHANNEL@INSTANCE`` and the answerer's credential (``auth``) kept, so the
``approval.decided`` record says who answered, on which channel, on which
instance. Its reply says what became of it.

Without the database nothing can be delivered here: a request that only
the fleet could answer is refused ``no_approver``, as with no channel at
all. A channel of this instance still answers its own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from egressd.fleet.inbox import FleetInbox, Listed, NotSent, OutcomeUnknown
from egressd.fleet.store import StateError
from egressd.vocabulary.reasons import Answer

from .control import Scope, describe
from .interface import (
    Answered,
    Answerer,
    AnswerResult,
    ApprovalScope,
    ChannelError,
    Choice,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    SetupError,
    settled_text,
)
from .slackblocks import fallback_text, request_blocks
from .webview import approval_event

log = logging.getLogger("egressd.approvals.fleet")

# How long an answer given here waits for the holder to take it before it is withdrawn (nothing decided).
REPLY_WAIT_S = 5.0
# How often letters are looked for without a notification (one missed while the listener reconnected).
SWEEP_S = 2.0


def settlement_fields(settlement: Settlement) -> dict[str, Any]:
    """A settlement as JSON: what the approval's row and a reply hold (no secret is in it)."""
    return {
        "answer": settlement.answer.value, "channel": settlement.channel, "by": settlement.by,
        "at": settlement.at, "waited_s": settlement.waited_s,
        "scope": settlement.scope.value if settlement.scope is not None else None,
        "entry": settlement.entry, "scope_error": settlement.scope_error, "auth": settlement.auth,
    }  # fmt: skip


def settlement_from(fields: dict[str, Any]) -> Settlement | None:
    """``settlement_fields`` read back; None for what is not one."""
    try:
        return Settlement(
            answer=Answer(fields["answer"]), channel=fields.get("channel"), by=fields.get("by"),
            at=float(fields.get("at") or 0.0), waited_s=float(fields.get("waited_s") or 0.0),
            scope=ApprovalScope(fields["scope"]) if fields.get("scope") else None,
            entry=fields.get("entry"), scope_error=fields.get("scope_error"), auth=fields.get("auth"),
        )  # fmt: skip
    except (KeyError, ValueError, TypeError):
        return None


class FleetChannel:
    """The fleet's approvals, through ``FleetInbox``: a ``Channel`` of the broker and the control API's
    ``Elsewhere``."""

    name = "fleet"

    def __init__(self, dsn: str, instance: str, *, reply_wait_s: float = REPLY_WAIT_S) -> None:
        self.instance = instance
        self._inbox = FleetInbox(dsn, instance, self._letter)
        self._reply_wait_s = reply_wait_s
        self._answerer: Answerer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._failing = False
        self._unlisted = False  # the last look at the others' approvals failed (said once)
        # This instance has no Slack of its own: its rows carry the message its Slack channel would post, for
        # the instance that relays Slack for the fleet (approvals.slackrelay). Set by approvals.assembly.
        self.stores_slack = True
        # Told each settlement listed here (a denial shared with the task or group); set by approvals.assembly.
        self.shared: Callable[[PendingApproval, Settlement], Awaitable[None]] | None = None
        # What a channel of this instance does with what another instance passed on for an approval held
        # here, by kind (``"slack"``: a click Slack handed to the other instance); set by approvals.assembly.
        self.handlers: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {}

    # -- Channel --------------------------------------------------------------------

    async def start(self, answerer: Answerer) -> None:
        self._answerer = answerer
        try:
            await self._inbox.open()
        except StateError as exc:
            raise SetupError(f"bad setting state: {exc}") from None
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="fleet letters")

    async def deliver(self, approval: PendingApproval) -> None:
        # The page's card too, drawn here as the holder's own page draws it (what another instance's page shows).
        listing = describe(approval) | {"instance": self.instance, "page": approval_event(approval, Scope(None))}
        if self.stores_slack:  # for the instance that relays Slack for the fleet (approvals.slackrelay)
            blocks = request_blocks(approval, instance=self.instance)
            listing["slack"] = {"text": fallback_text(approval), "blocks": blocks}
        try:
            await self._inbox.publish(approval.id, approval.request.run_id, listing, approval.expires_at)
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many; each one means "not delivered")
            raise ChannelError(f"the fleet's database: {exc}") from None

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        try:
            await self._inbox.settled(approval.id, settlement_fields(settlement))
        finally:
            if self.shared is not None:
                await self.shared(approval, settlement)

    async def notify(self, notice: Notice) -> None:
        return None  # a run's notice is its own instance's to show

    async def abandoned(self, approval: PendingApproval) -> None:
        return None  # the row stays answerable, as the approval does

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        with contextlib.suppress(Exception):
            await self._inbox.withdraw_mine()
        await self._inbox.close()

    def routes(self) -> Sequence[Route]:
        return ()

    # -- the holder: letters from other instances --------------------------------------

    def _letter(self, seq: int) -> None:
        task = asyncio.get_running_loop().create_task(self._apply(seq), name=f"fleet letter {seq}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _apply(self, seq: int) -> None:
        try:
            letter = await self._inbox.take(seq)
            if letter is None or self._answerer is None:
                return  # taken by a sweep already, withdrawn, or not ours
            given = letter.given
            handler = self.handlers.get(str(given.get("kind"))) if "kind" in given else None
            if "kind" in given:
                if handler is not None and isinstance(given.get("payload"), dict):
                    await handler(given["payload"])
                    await self._inbox.reply(seq, {"result": "handled"})
                else:
                    await self._inbox.reply(seq, {"result": AnswerResult.UNKNOWN.value})
                return
            try:
                decision, scope = Choice(given["choice"]), ApprovalScope(given["scope"])
            except (KeyError, ValueError):
                await self._inbox.reply(seq, {"result": AnswerResult.UNKNOWN.value})
                return
            answered = self._answerer.answer(
                letter.approval, decision, channel=f"{given.get('channel') or 'fleet'}@{letter.from_instance}",
                by=given.get("by"), scope=scope, auth=given.get("auth"),
            )  # fmt: skip
            reply: dict[str, Any] = {"result": answered.result.value}
            if answered.settlement is not None:
                reply["settlement"] = settlement_fields(answered.settlement)
            await self._inbox.reply(seq, reply)
        except Exception as exc:  # noqa: BLE001 (a letter not applied is withdrawn by its sender in time)
            log.warning("fleet: an answer given on another instance could not be applied here: %s", exc)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self._inbox.listen()  # again, if the connection dropped
                for seq in await self._inbox.posted_to_me():
                    self._letter(seq)
            except Exception as exc:  # noqa: BLE001
                if not self._failing:
                    log.warning("fleet: the state database is unreachable (%s); answers from other instances "
                                "wait for it, this instance's own channels answer on", exc)  # fmt: skip
                self._failing = True
                continue
            if self._failing:
                log.warning("fleet: the state database is back")
                self._failing = False

    async def forward(self, kind: str, approval_id: str, payload: dict[str, Any]) -> str | None:
        """Pass ``payload`` (of ``kind``) to the instance that holds ``approval_id``; None once it took it,
        else why it could not (for the person whose action it was)."""
        try:
            found = await self._inbox.find(approval_id)
        except Exception as exc:  # noqa: BLE001
            return f"the fleet's database cannot be reached ({exc}); try again"
        if found is None:
            return "no instance of this egressd fleet holds this approval (it is long gone)"
        approval, settled = found
        if settled is not None:
            how = settlement_from(settled)
            return f"this request was already settled ({settled_text(how) if how else 'settled'})"
        try:
            reply = await self._inbox.post(approval, {"kind": kind, "payload": payload}, self._reply_wait_s)
        except (NotSent, OutcomeUnknown) as exc:
            return f"the fleet's database went away while it was passed on ({exc}); look before trying again"
        if reply is None:
            return f"instance {approval.instance}, which holds it, did not take it in time; try again"
        if reply.get("result") != "handled":
            return f"instance {approval.instance}, which holds it, could not take it"
        return None

    # -- Elsewhere: what the other instances hold ---------------------------------------

    async def listed(self) -> Sequence[tuple[str, dict[str, Any]]]:
        try:
            rows = await self._inbox.open_elsewhere()
        except Exception as exc:  # noqa: BLE001 (listed without them; said once, not at every page's look)
            if not self._unlisted:
                log.warning("fleet: cannot list the other instances' approvals: %s", exc)
            self._unlisted = True
            return []
        if self._unlisted:
            log.warning("fleet: the other instances' approvals are listed again")
            self._unlisted = False
        return [(row.run, row.listing) for row in rows]

    async def runs(self) -> Sequence[tuple[str, dict[str, Any]]]:
        try:
            return await self._inbox.runs_elsewhere()
        except Exception:  # noqa: BLE001 (listed without them: the failed look at the approvals says why, once)
            return []

    async def outcome(self, approval_id: str) -> Settlement | None:
        try:
            found = await self._inbox.find(approval_id)
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many: each one means "cannot say")
            raise ChannelError(f"the fleet's database cannot be reached ({exc})") from None
        return settlement_from(found[1]) if found is not None and found[1] is not None else None

    async def run_of(self, approval_id: str) -> str | None:
        try:
            found = await self._inbox.find(approval_id)
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many: each one means "cannot say")
            raise ChannelError(f"the fleet's database cannot be reached ({exc}): nothing was decided") from None
        return found[0].run if found is not None else None

    async def answer(
        self, approval_id: str, decision: Choice, *, channel: str, by: str | None, scope: ApprovalScope,
        auth: str | None,
    ) -> Answered:
        try:
            found = await self._inbox.find(approval_id)
        except Exception as exc:  # noqa: BLE001
            raise ChannelError(f"the fleet's database cannot be reached ({exc}): nothing was decided") from None
        if found is None:
            return Answered(AnswerResult.UNKNOWN)
        approval, settled = found
        if settled is not None:
            return Answered(AnswerResult.SETTLED, settlement_from(settled))
        given = {"choice": decision.value, "scope": scope.value, "by": by, "channel": channel, "auth": auth,
                 "at": time.time()}  # fmt: skip
        try:
            reply = await self._inbox.post(approval, given, self._reply_wait_s)
        except NotSent as exc:
            raise ChannelError(f"the fleet's database cannot be reached ({exc}): nothing was decided") from None
        except OutcomeUnknown as exc:
            raise ChannelError(
                f"the fleet's database went away after the answer was passed to instance {approval.instance} "
                f"({exc}): whether it was applied is unknown; egressd pending shows whether it is still open"
            ) from None
        return _answered(reply, approval)


def _answered(reply: dict[str, Any] | None, approval: Listed) -> Answered:
    if reply is None:
        log.warning("fleet: instance %s did not take an answer to approval %s in time; withdrawn",
                    approval.instance, approval.id)  # fmt: skip
        return Answered(AnswerResult.NOT_APPLIED)
    try:
        result = AnswerResult(reply.get("result"))
    except ValueError:  # taken, with no reply: applied or not, the holder did not say
        return Answered(AnswerResult.NOT_APPLIED)
    settlement = settlement_from(reply["settlement"]) if isinstance(reply.get("settlement"), dict) else None
    return Answered(result, settlement)


