"""Slack for a fleet: one Slack app, several instances, and every click counts, whichever instance Slack hands it to.

Socket Mode gives each click to one of the connected instances. In a fleet
(``serve --state``), an instance that gets a click for another's approval
passes it, through the database, to the instance that holds it, which
checks it as its own (its message, an approver) and counts it; that
instance's message is the one updated, once. Brokers made by the real
assembly (``approver_from_settings``) from settings, against FakeSlack and a
real PostgreSQL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from egressd.approvals.assembly import approver_from_settings
from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import AnswerResult, Choice
from egressd.audit.log import MemoryAuditSink
from egressd.config.settings import load_settings
from egressd.fleet.store import Store
from tests.fakes.slack import FakeSlack
from tests.harness import wait_until
from tests.integration.approvals.test_broker import request
from tests.postgres import Postgres

CHANNEL = "C0APPROVE"
ALICE, MALLORY = "U0ALICE", "U0MALLORY"


@pytest.fixture
async def fake_slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as slack:
        yield slack


@pytest.fixture
async def instances(
    fake_slack: FakeSlack, postgres: Postgres, database: str
) -> AsyncIterator[Callable[[str], Any]]:
    """Make an instance of the fleet: (its broker, its audit sink), its Slack connected."""
    dsn = postgres.dsn(database)
    store = await Store.open(dsn)
    await store.migrate()
    await store.close()
    made: list[ApprovalBroker] = []

    async def make(name: str, *, slack: bool = True, relay: bool = False) -> tuple[ApprovalBroker, MemoryAuditSink]:
        values: dict[str, Any] = {"state": dsn, "approver": []}
        if slack:
            values |= {
                "approver": ["slack"], "slack_bot_token": fake_slack.bot_token, "slack_app_token": fake_slack.app_token,
                "slack_channel": CHANNEL, "slack_approvers": [ALICE], "slack_api_url": fake_slack.api_url,
                "slack_relay": relay,
            }  # fmt: skip
        settings = load_settings(values)
        audit = MemoryAuditSink()
        broker = approver_from_settings(settings, audit=audit, fleet_instance=name)
        assert isinstance(broker, ApprovalBroker)
        made.append(broker)
        await broker.start()
        await fake_slack.wait_sockets(sum(1 for b in made if "slack" in b.attached))
        return broker, audit

    yield make
    for broker in made:
        await broker.close()


def decided(audit: MemoryAuditSink) -> list[dict[str, Any]]:
    return [r for r in audit.records if r["event"] == "approval.decided"]


async def test_a_click_slack_hands_to_another_instance_counts_once_and_the_message_is_updated_once(
    fake_slack: FakeSlack, instances: Callable[[str], Any]
) -> None:
    holder, holder_audit = await instances("holder")
    other, other_audit = await instances("other")
    held = asyncio.create_task(holder.ask(request()))
    await wait_until(lambda: fake_slack.posted, 10)
    [post] = fake_slack.posted
    # Slack hands the click to the instance that does not hold it (socket 1: the newest, "other").
    await fake_slack.click(post, "allow", user=ALICE, socket=1)
    outcome = await asyncio.wait_for(held, 15)
    assert outcome.allowed and outcome.channel == "slack", outcome
    [record] = decided(holder_audit)
    assert record["decision"] == "allow" and ALICE in str(record["by"]), record
    assert decided(other_audit) == [] and not fake_slack.called("chat.postEphemeral")
    await wait_until(lambda: len(fake_slack.called("chat.update")) == 1, 10)
    # A second click, on either instance, changes nothing: too late, said to the person who clicked.
    await fake_slack.click(post, "deny", user=ALICE, socket=1)
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"), 10)
    [told] = fake_slack.called("chat.postEphemeral")
    assert "already settled" in told["text"] and "allowed by" in told["text"], told
    assert len(decided(holder_audit)) == 1 and len(fake_slack.called("chat.update")) == 1


async def test_a_forwarded_click_is_checked_by_the_holder_as_its_own(
    fake_slack: FakeSlack, instances: Callable[[str], Any]
) -> None:
    holder, holder_audit = await instances("holder")
    await instances("other")
    held = asyncio.create_task(holder.ask(request()))
    await wait_until(lambda: fake_slack.posted, 10)
    [post] = fake_slack.posted
    # Someone who is not an approver clicks, and Slack hands it to the other instance: it counts nowhere.
    await fake_slack.click(post, "allow", user=MALLORY, socket=1)
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"), 10)
    [told] = fake_slack.called("chat.postEphemeral")
    assert "not one of egressd's approvers" in told["text"], told
    await asyncio.sleep(0.2)
    assert not held.done() and decided(holder_audit) == []
    await fake_slack.click(post, "deny", user=ALICE, socket=1)
    outcome = await asyncio.wait_for(held, 15)
    assert not outcome.allowed and [r["decision"] for r in decided(holder_audit)] == ["deny"]


async def test_one_instance_relays_slack_for_instances_without_it_and_the_holder_decides(
    fake_slack: FakeSlack, instances: Callable[..., Any]
) -> None:
    holder, holder_audit = await instances("sidecar", slack=False)  # no Slack of its own: the fleet only
    relay, relay_audit = await instances("approvals", relay=True)
    held = asyncio.create_task(holder.ask(request()))
    await wait_until(lambda: fake_slack.posted, 10)
    [post] = fake_slack.posted  # posted once, by the relaying instance, drawn by the holder
    assert "egressd sidecar" in str(post["blocks"]), post
    # Someone who is not an approver: refused here, nothing passed on.
    await fake_slack.click(post, "allow", user=MALLORY)
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"), 10)
    assert "not one of egressd's approvers" in fake_slack.called("chat.postEphemeral")[0]["text"]
    await asyncio.sleep(0.3)
    assert not held.done() and decided(holder_audit) == []
    await fake_slack.click(post, "allow", user=ALICE)
    outcome = await asyncio.wait_for(held, 15)
    assert outcome.allowed and outcome.channel == "slack@approvals", outcome
    [record] = decided(holder_audit)
    assert record["channel"] == "slack@approvals" and ALICE in str(record["by"]), record
    assert decided(relay_audit) == []
    # The message is updated once: how it ended, and no buttons.
    await wait_until(lambda: fake_slack.called("chat.update"), 10)
    await asyncio.sleep(1.5)  # the relay's next looks do not update it again
    [update] = fake_slack.called("chat.update")
    assert "allowed by" in update["text"] and "actions" not in str(update["blocks"]), update
    assert len(fake_slack.posted) == 1


async def test_a_relayed_message_is_closed_when_the_approval_is_settled_elsewhere(
    fake_slack: FakeSlack, instances: Callable[..., Any]
) -> None:
    holder, _ = await instances("sidecar", slack=False)
    await instances("approvals", relay=True)
    held = asyncio.create_task(holder.ask(request()))
    await wait_until(lambda: fake_slack.posted, 10)
    [approval] = holder.pending()
    assert holder.answer(approval.id, Choice.DENY, channel="control", by="ops").result is AnswerResult.ACCEPTED
    assert not (await asyncio.wait_for(held, 15)).allowed
    await wait_until(lambda: fake_slack.called("chat.update"), 10)
    [update] = fake_slack.called("chat.update")
    assert "denied by ops via control" in update["text"] and "actions" not in str(update["blocks"]), update
