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

    async def make(name: str) -> tuple[ApprovalBroker, MemoryAuditSink]:
        settings = load_settings({
            "approver": ["slack"], "slack_bot_token": fake_slack.bot_token, "slack_app_token": fake_slack.app_token,
            "slack_channel": CHANNEL, "slack_approvers": [ALICE], "slack_api_url": fake_slack.api_url, "state": dsn,
        })  # fmt: skip
        audit = MemoryAuditSink()
        broker = approver_from_settings(settings, audit=audit, fleet_instance=name)
        assert isinstance(broker, ApprovalBroker)
        made.append(broker)
        await broker.start()
        await fake_slack.wait_sockets(len(made))
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
