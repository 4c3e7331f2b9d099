"""Slack for instances that have none: the approvals other instances of a fleet hold, posted and answered here.

In a fleet (``serve --state``) an instance with Slack posts what it holds.
An instance without Slack (a sidecar of ``deploy/kubernetes/fleet/``)
stores in its approval's row the message its Slack channel would post
(``listing["slack"]``: the text and the blocks, drawn by the holder, the
buttons naming the holder). The instance given ``slack_relay`` relays those:

- every ``POLL_S`` it looks at what the others hold (``Elsewhere.listed``)
  and posts each stored message once, remembering where;
- a click on a message posted here is checked by the Slack channel as it
  checks its own (from that message, by an approver) and passed to the
  holder (``Elsewhere.answer``), which decides, once; the person is told
  when it did not count;
- when the approval is settled (answered here or anywhere else, expired,
  its holder stopped), the message is updated once: how it ended, and no
  buttons. An approval that leaves the list while the database cannot say
  how it ended keeps its message until it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .interface import AnswerResult, ApprovalScope, ChannelError, Choice, Elsewhere, Settlement, settled_text

log = logging.getLogger("egressd.approvals.slack")

POLL_S = 1.0

Post = Callable[[str, list[dict[str, Any]]], Awaitable[tuple[str, str]]]  # text, blocks → (channel, ts)
Update = Callable[[str, str, str, list[dict[str, Any]]], Awaitable[None]]  # channel, ts, text, blocks


@dataclass(frozen=True, slots=True)
class _Relayed:
    channel: str
    ts: str
    text: str
    blocks: list[dict[str, Any]]


def stored_message(listing: dict[str, Any]) -> tuple[str, list[dict[str, Any]]] | None:
    """The message a holder stored for Slack in its listing; None when there is none (or it is malformed)."""
    slack = listing.get("slack")
    if not isinstance(slack, dict):
        return None
    text, blocks = slack.get("text"), slack.get("blocks")
    if not isinstance(text, str) or not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        return None
    return text, blocks


def closed_blocks(blocks: list[dict[str, Any]], outcome: str) -> list[dict[str, Any]]:
    """A relayed message once settled: its lines without the buttons, then how it ended."""
    kept = [b for b in blocks if b.get("type") != "actions"]
    return [*kept, {"type": "section", "text": {"type": "plain_text", "text": outcome[:2900], "emoji": False}}]


class SlackRelay:
    """The module docstring; started by the Slack channel that relays (``SlackChannel.relay``)."""

    def __init__(self, elsewhere: Elsewhere, *, poll_s: float = POLL_S) -> None:
        self._elsewhere = elsewhere
        self._poll_s = poll_s
        self._posted: dict[str, _Relayed] = {}
        self._task: asyncio.Task[None] | None = None
        self._update: Update | None = None

    def start(self, post: Post, update: Update) -> None:
        self._update = update
        self._task = asyncio.get_running_loop().create_task(self._follow(post), name="slack relay")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def holds(self, approval_id: str, channels: set[object], stamps: set[object]) -> bool:
        """Whether a click on ``approval_id`` comes from the message posted here for it."""
        relayed = self._posted.get(approval_id)
        return relayed is not None and channels == {relayed.channel} and stamps == {relayed.ts}

    async def answer(self, approval_id: str, decision: Choice, scope: ApprovalScope, by: str) -> str | None:
        """An approver's click, passed to the holder; None when it decided, else the line for the person."""
        try:
            answered = await self._elsewhere.answer(approval_id, decision, channel="slack", by=by, scope=scope,
                                                    auth=None)  # fmt: skip
        except ChannelError as exc:
            return f"Your click did not count: {exc}"
        if answered.result is AnswerResult.ACCEPTED and answered.settlement is not None:
            await self._closed(approval_id, answered.settlement)
            return None
        if answered.result is AnswerResult.NOT_OFFERED:
            return f"Your click did not count: allowing {scope.value} is not offered for this approval."
        if answered.result is AnswerResult.SETTLED:
            how = settled_text(answered.settlement) if answered.settlement else "settled"
            return f"Too late: this request was already settled ({how})."
        if answered.result is AnswerResult.NOT_APPLIED:
            return ("Your click did not count: the egressd that holds this request did not take it in time. "
                    "Nothing was decided: click again.")  # fmt: skip
        return "Your click did not count: no egressd of the fleet holds this request any more."

    async def _follow(self, post: Post) -> None:
        while True:
            try:
                await self._once(post)
            except Exception:  # the relay goes on at the next look; said
                log.exception("Slack relay: the fleet's approvals could not be relayed")
            await asyncio.sleep(self._poll_s)

    async def _once(self, post: Post) -> None:
        listed = set()
        for _run, listing in await self._elsewhere.listed():
            approval_id = listing.get("id")
            message = stored_message(listing)
            if not isinstance(approval_id, str) or message is None:
                continue
            listed.add(approval_id)
            if approval_id not in self._posted:
                channel, ts = await post(*message)
                self._posted[approval_id] = _Relayed(channel, ts, *message)
        for approval_id in [a for a in self._posted if a not in listed]:
            try:
                settlement = await self._elsewhere.outcome(approval_id)
            except ChannelError:
                continue  # the database cannot say now: asked again at the next look
            if settlement is not None:
                await self._closed(approval_id, settlement)

    async def _closed(self, approval_id: str, settlement: Settlement) -> None:
        relayed = self._posted.pop(approval_id, None)
        if relayed is None or self._update is None:
            return  # already updated (answered here, then seen gone)
        outcome = settled_text(settlement)
        try:
            await self._update(relayed.channel, relayed.ts, f"{relayed.text}: {outcome}",
                               closed_blocks(relayed.blocks, outcome))  # fmt: skip
        except ChannelError as exc:
            log.warning("Slack relay: the message of %s could not be updated: %s", approval_id, exc)
