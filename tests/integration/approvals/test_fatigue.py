"""Approval fatigue: an agent must not be able to wear the approver down.

Two walls (DESIGN.md, "Decision order"):

- a denial covers the denied host's registered domain for the rest of the
  run: after denying ``a1.evil.test`` nobody is asked about ``a2.evil.test``
  (``denied_earlier``), and the message said so;
- a run makes at most ``max_approvals_per_run`` approval requests (timeouts
  count); past it the run stops asking (``not_allowlisted``) and every
  channel says so once.

The attacks go through the real proxy (CONNECTs on loopback) with a recording
fake channel; each channel's "stopped asking" notice is checked on the real
channel (Slack against the fake Slack, the webhook against a receiver, the
terminal in a pseudo-terminal).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from egressd.approvals.assembly import approver_from_settings
from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import Choice, Notice
from egressd.approvals.ledger import Ledger
from egressd.approvals.message import render
from egressd.approvals.slack import SlackChannel
from egressd.approvals.terminal import TerminalChannel
from egressd.approvals.webhook import WebhookChannel
from egressd.audit.log import MemoryAuditSink
from egressd.cli.wiring.service import EgressService
from egressd.config.settings import SettingsError, load_settings
from egressd.proxy.core.runs import Run
from egressd.vocabulary.reasons import Answer
from tests.conftest import Listener, MakeEgressd
from tests.fakes.slack import FakeSlack
from tests.fakes.terminal import Pty
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import connect_via, egress, wait_until
from tests.integration.approvals.test_broker import RecordingChannel, request

# -- helpers ---------------------------------------------------------------------------------


def credentials(run: Run) -> str:
    token = base64.b64encode(f"{run.id}:{run.token}".encode()).decode()
    return f"Proxy-Authorization: Basic {token}\r\n"


async def attempt(svc: EgressService, authority: str, extra: str = "") -> tuple[int, dict[str, str]]:
    status, headers, _, _, writer = await connect_via(svc, authority, extra)
    writer.close()
    return status, headers


async def refused_or_asked(
    svc: EgressService, channel: RecordingChannel, authority: str, extra: str = ""
) -> tuple[int, dict[str, str]] | None:
    """The answer to a CONNECT, or None when the channel was asked instead (the request is held)."""
    before = len(channel.delivered)
    task = asyncio.create_task(attempt(svc, authority, extra))
    await wait_until(lambda: task.done() or len(channel.delivered) > before)
    if task.done():
        return task.result()
    channel.answer(Choice.DENY, by="tester")  # let the held request go
    await task
    return None


@pytest.fixture
async def broker_over() -> AsyncIterator[Any]:
    brokers: list[ApprovalBroker] = []

    async def make(*channels: Any, **kwargs: Any) -> ApprovalBroker:
        kwargs.setdefault("audit", MemoryAuditSink())
        broker = ApprovalBroker(list(channels), **kwargs)
        brokers.append(broker)
        await broker.start()
        return broker

    yield make
    for broker in brokers:
        await broker.close()


# -- a denial covers the registered domain ---------------------------------------------------------


async def test_after_denying_a1_evil_test_every_name_under_evil_test_is_denied_earlier_without_asking(
    make_egressd: MakeEgressd, broker_over: Any, echo_origin: Listener
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel("terminal")
    broker = await broker_over(channel, audit=sink)
    svc = await make_egressd(approver=broker, audit=sink)
    first = asyncio.create_task(attempt(svc, "a1.evil.test:443"))
    await wait_until(lambda: channel.delivered)
    channel.answer(Choice.DENY, by="alice")
    status, headers = await first
    assert status == 403 and headers["x-egress-reason"] == "denied"
    for name in ("a2.evil.test", "evil.test", "deep.a3.evil.test", "A4.Evil.Test."):
        answer = await refused_or_asked(svc, channel, f"{name}:443")
        assert answer is not None, f"{name} was asked about again"
        status, headers = answer
        assert status == 403 and headers["x-egress-reason"] == "denied_earlier", name
    assert len(channel.delivered) == 1 and channel.attempts == 1
    assert echo_origin.connections == 0
    await wait_until(lambda: len(egress(svc)) == 5)
    later = egress(svc)[1:]
    assert [r["reason"] for r in later] == ["denied_earlier"] * 4
    assert all(r["approval"] is None and r["run"] == "default" and r["decision"] == "deny" for r in later)
    assert [r["host"] for r in later] == ["a2.evil.test", "evil.test", "deep.a3.evil.test", "a4.evil.test"]
    assert len([r for r in sink.records if r["event"] == "approval.requested"]) == 1


async def test_a_denial_in_one_run_does_not_touch_another_run(make_egressd: MakeEgressd, broker_over: Any) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = await broker_over(channel, audit=sink)
    svc = await make_egressd(approver=broker, audit=sink)
    assert await refused_or_asked(svc, channel, "a1.evil.test:443") is None  # asked, and denied
    other = svc.runs.create(task="another task", allow=[])  # type: ignore[union-attr]
    assert await refused_or_asked(svc, channel, "a2.evil.test:443", credentials(other)) is None  # asked
    assert [d.request.run_id for d in channel.delivered] == ["default", other.id]
    answer = await refused_or_asked(svc, channel, "a2.evil.test:443")
    assert answer is not None and answer[1]["x-egress-reason"] == "denied_earlier"


async def test_an_allowlisted_name_under_a_denied_domain_stays_allowed(
    make_egressd: MakeEgressd, broker_over: Any, echo_origin: Listener
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = await broker_over(channel, audit=sink)
    svc = await make_egressd(approver=broker, audit=sink, allow=[f"sub.example.test:{echo_origin.port}"])
    assert await refused_or_asked(svc, channel, "x.example.test:443") is None  # asked, and denied
    status, _ = await attempt(svc, f"sub.example.test:{echo_origin.port}")
    assert status == 200 and echo_origin.connections == 1
    status, headers = await attempt(svc, "example.test:443")
    assert status == 403 and headers["x-egress-reason"] == "denied_earlier"


async def test_a_timeout_is_not_a_denial_of_the_domain(make_egressd: MakeEgressd, broker_over: Any) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = await broker_over(channel, audit=sink, timeout_s=0.2)
    svc = await make_egressd(approver=broker, audit=sink)
    status, headers = await attempt(svc, "a1.evil.test:443")
    assert status == 403 and headers["x-egress-reason"] == "approval_timeout"
    assert await refused_or_asked(svc, channel, "a2.evil.test:443") is None  # asked again


def test_the_message_says_the_deny_covers_the_registered_domain() -> None:
    message = render(host="a1.evil.com", port=443, command="curl a1.evil.com", task="t", allowed=())
    assert "deny covers *.evil.com for this run" in message.text
    scope = "A deny covers *.evil.com for this run (evil.com included): no name under it is asked about again."
    assert ("scope", scope) in message.lines
    # A host that is its own registered domain: the same rule, said the same way.
    assert (
        "deny covers *.evil.com for this run"
        in render(host="evil.com", port=443, command=None, task=None, allowed=()).text
    )
    # No registered domain (a public suffix as a host): only that host is covered; nothing to say.
    assert "deny covers" not in render(host="github.io", port=443, command=None, task=None, allowed=()).text


def test_a_run_remembers_denied_registered_domains_purely() -> None:
    run = Run(id="r-1", token="t", task=None, allow=(), deny=())
    run.deny_host("a1.evil.com")
    assert run.decide("a2.evil.com", 443).reason is not None
    assert run.decide("a2.evil.com", 443).reason.value == "denied_earlier"  # type: ignore[union-attr]
    assert run.decide("evil.com", 8443).reason.value == "denied_earlier"  # type: ignore[union-attr]
    assert run.decide("notevil.com", 443).verdict.value == "ask"
    assert run.decide("evil.com.example", 443).verdict.value == "ask"
    # A public-suffix host covers only itself, never every name under the suffix.
    run.deny_host("github.io")
    assert run.decide("alice.github.io", 443).verdict.value == "ask"


# -- at most N approval requests per run ---------------------------------------------------------------


def test_the_ledger_counts_approval_requests_per_run_and_stops_once() -> None:
    ledger = Ledger(max_pending_per_run=5, max_requests_per_run=2)
    for i in range(2):
        assert ledger.may_ask("r-1")
        approval = ledger.open(request(f"h{i}.test"), approval_id=f"a-{i}", channels=["x"], now=0)
        ledger.expire(approval.id, now=1)  # a timeout still counts
    assert not ledger.may_ask("r-1") and ledger.may_ask("r-2")
    assert ledger.stop("r-1") is True
    assert ledger.stop("r-1") is False  # said once


async def test_past_the_cap_the_run_stops_asking_and_every_channel_says_so_once(
    make_egressd: MakeEgressd, broker_over: Any
) -> None:
    sink = MemoryAuditSink()
    terminal, webhook = RecordingChannel("terminal"), RecordingChannel("webhook")
    broker = await broker_over(terminal, webhook, audit=sink, timeout_s=0.2, max_requests_per_run=3)
    svc = await make_egressd(approver=broker, audit=sink)
    for name in ("one.test", "two.test", "three.test"):
        status, headers = await attempt(svc, f"{name}:443")  # each times out; each counts
        assert headers["x-egress-reason"] == "approval_timeout"
    assert len(terminal.delivered) == len(webhook.delivered) == 3
    for name in ("four.test", "five.test", "one.test"):
        answer = await refused_or_asked(svc, terminal, f"{name}:443")
        assert answer is not None, f"{name} was asked about past the cap"
        status, headers = answer
        assert status == 403 and headers["x-egress-reason"] == "not_allowlisted", name
    await wait_until(lambda: terminal.notices and webhook.notices)
    await asyncio.sleep(0.05)
    assert len(terminal.notices) == len(webhook.notices) == 1
    [notice] = terminal.notices
    assert notice.run_id == "default" and "stopped asking" in notice.text and "3 approval requests" in notice.text
    assert len(terminal.delivered) == 3
    await wait_until(lambda: len(egress(svc)) == 6)
    assert [r["reason"] for r in egress(svc)] == ["approval_timeout"] * 3 + ["not_allowlisted"] * 3
    assert len([r for r in sink.records if r["event"] == "approval.requested"]) == 3
    assert svc.default_run.ask is False  # type: ignore[union-attr]
    # Another run has its own count.
    other = svc.runs.create(task="t", allow=[])  # type: ignore[union-attr]
    assert await refused_or_asked(svc, terminal, "four.test:443", credentials(other)) is None


async def test_concurrent_requests_cannot_overshoot_the_cap(broker_over: Any) -> None:
    channel = RecordingChannel()
    broker = await broker_over(channel, max_requests_per_run=2, max_pending_per_run=5)
    held = [asyncio.create_task(broker.ask(request(f"h{i}.test"))) for i in range(5)]
    await wait_until(lambda: sum(t.done() for t in held) == 3)
    assert len(channel.delivered) == 2
    assert sorted(t.result().answer.value for t in held if t.done()) == ["stopped_asking"] * 3
    await wait_until(lambda: channel.notices)
    for index in range(2):
        channel.answer(Choice.ALLOW, index=index)
    await asyncio.gather(*held)
    assert len(channel.notices) == 1


async def test_joining_an_open_approval_is_not_another_request(broker_over: Any) -> None:
    channel = RecordingChannel()
    broker = await broker_over(channel, max_requests_per_run=1)
    held = [asyncio.create_task(broker.ask(request())) for _ in range(10)]
    await wait_until(lambda: channel.delivered)
    channel.answer(Choice.ALLOW)
    assert all(o.answer is Answer.ALLOW for o in await asyncio.gather(*held))
    assert (await broker.ask(request("other.test"))).answer is Answer.STOPPED_ASKING


def test_max_approvals_per_run_defaults_to_20_and_a_bad_value_stops_start_up(tmp_path: Path) -> None:
    base = {"audit_log": str(tmp_path / "a.jsonl")}
    assert load_settings(base).max_approvals_per_run == 20
    for bad in (0, -1, "many"):
        with pytest.raises(SettingsError, match="max_approvals_per_run"):
            load_settings({**base, "max_approvals_per_run": bad})
    settings = load_settings({**base, "max_approvals_per_run": 7, "approver": ["terminal"]})
    broker = approver_from_settings(settings, audit=MemoryAuditSink(), tty_path=str(tmp_path / "no-tty"))
    assert isinstance(broker, ApprovalBroker) and broker.max_requests_per_run == 7


# -- each real channel says so once ---------------------------------------------------------------


async def _spend_and_pass_the_cap(broker: ApprovalBroker, answer: Any) -> None:
    """One approval (answered by ``answer``), then two requests past the cap of 1."""
    held = asyncio.create_task(broker.ask(request("first.test")))
    await answer()
    await held
    for host in ("second.test", "third.test"):
        assert (await broker.ask(request(host))).answer is Answer.STOPPED_ASKING


async def test_slack_posts_the_stopped_asking_notice_once_neutralised(broker_over: Any) -> None:
    async with FakeSlack() as slack:
        channel = SlackChannel(
            bot_token=slack.bot_token,
            app_token=slack.app_token,
            api_url=slack.api_url,
            channel="C0APPROVE",
            approvers=["U0ALICE"],
            retry_backoff_s=0.01,
        )
        broker = await broker_over(channel, max_requests_per_run=1)

        async def click() -> None:
            await wait_until(lambda: slack.posted)
            await slack.click(slack.posted[0], "deny", user="U0ALICE")

        await _spend_and_pass_the_cap(broker, click)
        await wait_until(lambda: len(slack.posted) == 2)
        await asyncio.sleep(0.05)
        assert len(slack.posted) == 2 and not slack.rejected
        notice = slack.posted[1]
        shown = json.dumps(notice["blocks"])
        assert "stopped asking" in shown and "r-1" in shown and "not_allowlisted" in shown
        assert not any(b["type"] == "actions" for b in notice["blocks"])
        await broker.close()


async def test_the_webhook_posts_one_signed_stopped_asking_event(broker_over: Any) -> None:
    _, key = make_secret()
    async with WebhookReceiver(key, mode="now", decision="deny") as receiver:
        channel = WebhookChannel(url=receiver.url, secret=key)
        broker = await broker_over(channel, max_requests_per_run=1)

        async def answered_at_once() -> None:
            pass

        await _spend_and_pass_the_cap(broker, answered_at_once)
        await wait_until(lambda: any(r.payload["type"] == "run.stopped_asking" for r in receiver.received))
        await asyncio.sleep(0.05)
        [event] = [r for r in receiver.received if r.payload["type"] == "run.stopped_asking"]
        assert event.signature_ok and event.payload["run"] == "r-1" and "stopped asking" in event.payload["message"]
        await broker.close()


async def test_the_terminal_says_it_stopped_asking_once(broker_over: Any) -> None:
    pty = Pty()
    try:
        channel = TerminalChannel(tty_path=pty.path, who="alice")
        broker = await broker_over(channel, max_requests_per_run=1)

        async def type_deny() -> None:
            await pty.shows("allow or deny first.test:443?")
            pty.type("deny\r")

        await _spend_and_pass_the_cap(broker, type_deny)
        await pty.shows("stopped asking")
        await asyncio.sleep(0.05)
        assert pty.output.count("stopped asking") == 1
        await broker.close()
    finally:
        pty.close()


def test_a_notice_is_a_plain_value() -> None:
    notice = Notice(run_id="r-1", text="egressd stopped asking", at=0.0)
    assert notice.kind.value == "run.stopped_asking"
