"""The Slack channel: Block Kit builders (pure), then against a fake Slack Web API and Socket Mode on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from egressd.approvals.assembly import approver_from_settings
from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import ApprovalRequest, ApprovalScope, PendingApproval, Settlement, SetupError
from egressd.approvals.message import render
from egressd.approvals.slack import INTERACTIVITY_PATH, SlackChannel
from egressd.approvals.slackblocks import (
    ALLOW_ACTION,
    ALLOW_ALWAYS_ACTION,
    ALLOW_ONCE_ACTION,
    DENY_ACTION,
    outcome_text,
    request_blocks,
    settled_blocks,
)
from egressd.audit.log import MemoryAuditSink
from egressd.config.allowfile import read_allow_file
from egressd.config.settings import load_settings
from egressd.names.shown import escape_mrkdwn
from egressd.vocabulary.reasons import Answer
from tests.conftest import Listener
from tests.fakes.control import control_server
from tests.fakes.slack import SIGNING_SECRET, FakeSlack, block_actions, interaction_request
from tests.fakes.webhook import WebhookReceiver
from tests.harness import listening_socket, refused_port, wait_until
from tests.integration.approvals.test_broker import RecordingChannel, request

CHANNEL = "C0APPROVE"
ALICE = "U0ALICE"


def pending(req: ApprovalRequest | None = None) -> PendingApproval:
    req = req or request()
    message = render(host=req.host, port=req.port, command=req.command, task=req.task, allowed=req.allowed)
    return PendingApproval(
        id="a-test", request=req, message=message, created_at=1_700_000_000, expires_at=1_700_000_600, deadline=0
    )


# -- pure ---------------------------------------------------------------------------------


def test_agent_text_is_escaped_so_it_cannot_link_mention_or_ping() -> None:
    assert (
        escape_mrkdwn("<!channel> <http://x|click> & <@U1>")
        == "&lt;!channel&gt; &lt;http://x|click&gt; &amp; &lt;@U1&gt;"
    )
    hostile = ApprovalRequest(
        run_id="r-1",
        host="evil.example",
        port=443,
        command="curl <https://evil.example|pypi.org> <!channel>",
        task="<@U0ALICE> & co\x1b[2J",
        allowed=("<!here>",),
    )
    blocks = request_blocks(pending(hostile), instance="egressd-test")
    text = json.dumps(blocks)
    assert (
        "<!channel>" not in text and "<https://evil" not in text and "<@U0ALICE>" not in text and "<!here>" not in text
    )
    assert "&lt;!channel&gt;" in text and "&amp; co\\\\x1b[2J" in text
    assert text.count("<") == text.count("<!date^")  # our own date formatting is the only markup


def test_the_request_message_has_the_content_and_allow_and_deny_buttons() -> None:
    blocks = request_blocks(pending(), instance="egressd-test")
    sections = [b["text"] for b in blocks if b["type"] == "section"]
    shown = [t["text"] for t in sections]
    assert {"type": "plain_text", "text": "Domain: evil.example:443", "emoji": False} in sections
    assert {"type": "plain_text", "text": "Command: curl evil", "emoji": False} in sections
    assert "Allowed domains: pypi.org" in shown and any(t.startswith(":warning: *Unrelated:") for t in shown)
    [actions] = [b for b in blocks if b["type"] == "actions"]
    assert [(e["action_id"], e["value"], e.get("style")) for e in actions["elements"]] == [
        (ALLOW_ONCE_ACTION, "egressd-test:a-test", None),
        (ALLOW_ACTION, "egressd-test:a-test", "primary"),
        (DENY_ACTION, "egressd-test:a-test", "danger"),
    ]


@pytest.mark.parametrize(
    ("settlement", "expected"),
    [
        (
            Settlement(Answer.ALLOW, "slack", "@alice (U0ALICE)", 1_700_000_060, 60),
            "*Allowed* by <@U0ALICE> at <!date^1700000060^{time}|22:14 UTC> for run `r-1`",
        ),
        (
            Settlement(Answer.DENY, "control", "cli<x>", 1_700_000_060, 60),
            "*Denied* by `cli&lt;x&gt;` (via control) at",
        ),
        (Settlement(Answer.TIMEOUT, None, None, 1_700_000_600, 600), "*Expired — denied* at"),
        (Settlement(Answer.NO_APPROVER, None, None, 1_700_000_600, 600), "nobody could answer"),
    ],
)
def test_the_outcome_line_says_who_when_and_for_which_run(settlement: Settlement, expected: str) -> None:
    assert expected in outcome_text(pending(), settlement)
    blocks = settled_blocks(pending(), settlement)
    assert not any(b["type"] == "actions" for b in blocks)


# -- against the fake -------------------------------------------------------------------------


@pytest.fixture
async def fake_slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as slack:
        yield slack


@pytest.fixture
async def slack_broker(fake_slack: FakeSlack) -> AsyncIterator[Callable[..., Any]]:
    brokers: list[ApprovalBroker] = []

    async def make(*others: RecordingChannel, timeout_s: float = 30.0, **kwargs: Any) -> ApprovalBroker:
        kwargs.setdefault("app_token", fake_slack.app_token)
        kwargs.setdefault("approvers", [ALICE])
        kwargs.setdefault("retry_backoff_s", 0.01)
        allow_file = kwargs.pop("allow_file", None)
        channel = SlackChannel(
            bot_token=kwargs.pop("bot_token", fake_slack.bot_token),
            channel=CHANNEL,
            api_url=fake_slack.api_url,
            **kwargs,
        )
        broker = ApprovalBroker([channel, *others], audit=MemoryAuditSink(), timeout_s=timeout_s, allow_file=allow_file)
        brokers.append(broker)
        await broker.start()
        return broker

    yield make
    for broker in brokers:
        await broker.close()


async def test_the_approval_is_posted_with_unfurling_off(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    broker = await slack_broker()
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    [post] = fake_slack.posted
    assert post["channel"] == CHANNEL and post["unfurl_links"] is False and post["unfurl_media"] is False
    assert "evil.example:443" in post["text"] and any(b["type"] == "actions" for b in post["blocks"])
    await fake_slack.click(post, "deny", user=ALICE)
    assert (await held).answer is Answer.DENY


async def test_a_click_over_socket_mode_decides_and_the_message_is_updated(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    broker = await slack_broker()
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    await asyncio.sleep(0.05)
    assert not held.done()
    envelope = await fake_slack.click(fake_slack.posted[0], "allow", user=ALICE, username="alice")
    assert envelope in fake_slack.acks  # acknowledged, so Slack does not retry it
    outcome = await asyncio.wait_for(held, 5)
    assert outcome.allowed and outcome.channel == "slack" and outcome.by == "@alice (U0ALICE)"
    await wait_until(lambda: fake_slack.called("chat.update"))
    [update] = fake_slack.called("chat.update")
    assert update["ts"] == fake_slack.posted[0]["ts"] and update["channel"] == CHANNEL
    text = json.dumps(update["blocks"])
    assert "*Allowed* by <@U0ALICE> at <!date^" in text and "for run `r-1`" in text
    assert '"actions"' not in text


async def test_an_unauthorised_user_is_refused_privately_and_the_approval_stays_open(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="egressd.approvals.slack")
    broker = await slack_broker()
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    await fake_slack.click(fake_slack.posted[0], "allow", user="U0MALLORY")
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
    [ephemeral] = fake_slack.called("chat.postEphemeral")
    assert (
        ephemeral["user"] == "U0MALLORY"
        and ephemeral["channel"] == CHANNEL
        and "not one of egressd's approvers" in ephemeral["text"]
    )
    assert not held.done() and broker.pending() and not fake_slack.called("chat.update")
    assert "may not answer" in caplog.text
    await fake_slack.click(fake_slack.posted[0], "deny", user=ALICE)
    assert (await held).answer is Answer.DENY


async def test_members_of_an_approver_user_group_may_answer(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    fake_slack.groups["S0ONCALL"] = ["U0BOB"]
    broker = await slack_broker(approvers=["S0ONCALL"])
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    await fake_slack.click(fake_slack.posted[0], "allow", user=ALICE)  # not in the group
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
    assert not held.done()
    await fake_slack.click(fake_slack.posted[0], "allow", user="U0BOB")
    assert (await held).allowed
    assert [c["usergroup"] for c in fake_slack.called("usergroups.users.list")] == [
        "S0ONCALL"
    ]  # looked up once, cached


async def test_a_click_after_the_decision_is_told_it_is_too_late(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    other = RecordingChannel("webhook")
    broker = await slack_broker(other)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted and other.delivered)
    other.answer(Decision_allow(), by="hook-bot")
    assert (await held).allowed
    await fake_slack.click(fake_slack.posted[0], "deny", user=ALICE)
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
    assert "Too late" in fake_slack.called("chat.postEphemeral")[0]["text"]
    await wait_until(lambda: fake_slack.called("chat.update"))
    assert "`hook-bot` (via webhook)" in json.dumps(fake_slack.called("chat.update")[0]["blocks"])


def Decision_allow() -> Any:  # noqa: N802 - reads like the enum member it returns
    from egressd.approvals.interface import Choice

    return Choice.ALLOW


async def test_rate_limits_are_retried_by_slack_sdk(fake_slack: FakeSlack, slack_broker: Callable[..., Any]) -> None:
    broker = await slack_broker()
    fake_slack.rate_limit = 1
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: len(fake_slack.posted) == 2, timeout_s=10)  # the 429, then the retry
    assert fake_slack.rate_limited == 1
    await fake_slack.click(fake_slack.posted[-1], "allow", user=ALICE)
    assert (await held).allowed


async def test_a_slack_outage_never_allows_and_another_channel_can_still_answer(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    fake_slack.down = True
    broker = await slack_broker()
    assert (await asyncio.wait_for(broker.ask(request()), 10)).answer is Answer.NO_APPROVER
    await broker.close()
    other = RecordingChannel("terminal")
    broker = await slack_broker(other)
    held = asyncio.create_task(broker.ask(request("other.example")))
    await wait_until(lambda: other.delivered)
    other.answer(Decision_allow())
    assert (await held).allowed


async def test_the_http_interactivity_endpoint_checks_slacks_signature(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="egressd.approvals.slack")
    broker = await slack_broker(app_token=None, signing_secret=SIGNING_SECRET)
    async with control_server(broker.routes, listening_socket()) as base:
        url = base + INTERACTIVITY_PATH
        held = asyncio.create_task(broker.ask(request()))
        await wait_until(lambda: fake_slack.posted)
        payload = block_actions(fake_slack.posted[0], "allow", user=ALICE)
        forged_body, forged_headers = interaction_request(payload, secret="not-the-signing-secret")
        assert (await WebhookReceiver.send(url, forged_body, forged_headers))[0] == 401
        stale_body, stale_headers = interaction_request(payload, timestamp=int(time.time()) - 600)
        assert (await WebhookReceiver.send(url, stale_body, stale_headers))[0] == 401
        body, headers = interaction_request(payload)
        tampered = body.replace(b"allow", b"deny_")
        assert (await WebhookReceiver.send(url, tampered, headers))[0] == 401
        assert (await WebhookReceiver.send(url, body, {"Content-Type": headers["Content-Type"]}))[0] == 401
        assert not held.done() and "bad or stale signature" in caplog.text
        assert (await WebhookReceiver.send(url, body, headers))[0] == 200
        assert (await asyncio.wait_for(held, 5)).allowed
        assert (await WebhookReceiver.send(url, body, headers))[0] == 200  # replayed: heard once, answered "too late"
        await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
        assert (await WebhookReceiver.send(url, b"", {}, method="GET"))[0] == 405


async def test_egressd_does_not_reach_slack_through_the_environments_proxy(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any], leak: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://{leak.host}:{leak.port}")
    broker = await slack_broker()
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    await fake_slack.click(fake_slack.posted[0], "allow", user=ALICE)
    assert (await held).allowed
    assert leak.connections == 0


async def test_tokens_slack_rejects_stop_start_up(fake_slack: FakeSlack, slack_broker: Callable[..., Any]) -> None:
    with pytest.raises(SetupError, match=r"bad setting slack_bot_token: Slack refused it \(invalid_auth\)"):
        await slack_broker(bot_token="xoxb-wrong")
    with pytest.raises(SetupError, match=r"bad setting slack_app_token: Slack refused it \(invalid_auth\)"):
        await slack_broker(app_token="xapp-wrong")
    with refused_port() as port, pytest.raises(SetupError, match="bad setting slack_api_url: cannot reach Slack"):
        channel = SlackChannel(
            bot_token="xoxb-1",
            channel=CHANNEL,
            approvers=[ALICE],
            app_token="xapp-1",
            api_url=f"http://127.0.0.1:{port}/api/",
            retry_backoff_s=0.01,
        )
        broker = ApprovalBroker([channel], audit=MemoryAuditSink())
        await broker.start()


def _settings(tmp_path: Path, **values: Any) -> Any:
    return load_settings({"audit_log": str(tmp_path / "a.jsonl"), "approver": ["slack"], **values})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "bad setting slack_bot_token"),
        ({"slack_bot_token": "xoxb-1"}, "bad setting slack_channel"),
        (
            {"slack_bot_token": "xoxb-1", "slack_channel": CHANNEL, "slack_app_token": "xapp-1"},
            "bad setting slack_approvers",
        ),
        (
            {
                "slack_bot_token": "xoxb-1",
                "slack_channel": CHANNEL,
                "slack_app_token": "xapp-1",
                "slack_approvers": ["alice"],
            },
            "is not a user",
        ),
        (
            {"slack_bot_token": "xoxb-1", "slack_channel": CHANNEL, "slack_approvers": [ALICE]},
            "slack_app_token \\(Socket Mode\\)",
        ),
    ],
)
def test_a_slack_channel_missing_what_it_needs_stops_start_up(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(SetupError, match=message):
        approver_from_settings(_settings(tmp_path, **values), audit=MemoryAuditSink())


def test_deny_cannot_be_combined_with_channels(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="deny answers every request at once, so terminal could never answer"):
        approver_from_settings(_settings(tmp_path, approver=["deny", "terminal"]), audit=MemoryAuditSink())


# -- scopes ------------------------------------------------------------------------------------


def test_with_an_allow_file_the_message_offers_once_run_always_and_deny() -> None:
    approval = replace(pending(), scopes=(ApprovalScope.ONCE, ApprovalScope.RUN, ApprovalScope.ALWAYS))
    [actions] = [b for b in request_blocks(approval, instance="egressd-test") if b["type"] == "actions"]
    assert [(e["action_id"], e["text"]["text"]) for e in actions["elements"]] == [
        (ALLOW_ONCE_ACTION, "Allow once"),
        (ALLOW_ACTION, "Allow for this run"),
        (ALLOW_ALWAYS_ACTION, "Allow always"),
        (DENY_ACTION, "Deny"),
    ]


@pytest.mark.parametrize(
    ("scope", "entry", "error", "expected"),
    [
        (ApprovalScope.ONCE, None, None, "*Allowed once* by <@U0ALICE>"),
        (ApprovalScope.RUN, None, None, "*Allowed* by <@U0ALICE>"),
        (ApprovalScope.ALWAYS, "evil.example:443", None, "`evil.example:443` added to the allow file"),
        (ApprovalScope.RUN, None, "could not append", "this run only, not always: `could not append`"),
    ],
)
def test_the_outcome_line_says_the_scope_chosen(
    scope: ApprovalScope, entry: str | None, error: str | None, expected: str
) -> None:
    settlement = Settlement(
        Answer.ALLOW, "slack", "@Alice (U0ALICE)", 1_700_000_060, 60, scope=scope, entry=entry, scope_error=error
    )
    assert expected in outcome_text(pending(), settlement)


async def test_allow_always_records_the_approvers_slack_id_and_display_name_and_updates_the_message(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any], tmp_path: Path
) -> None:
    fake_slack.names[ALICE] = "Alice Liddell"
    path = tmp_path / "allow.toml"
    broker = await slack_broker(allow_file=path)
    held = asyncio.create_task(broker.ask(replace(request(), lasting="evil.example:443")))
    await wait_until(lambda: fake_slack.posted)
    await fake_slack.click(fake_slack.posted[0], "always", user=ALICE, username="alice")
    outcome = await asyncio.wait_for(held, 5)
    assert (outcome.scope, outcome.by) == (ApprovalScope.ALWAYS, "@Alice Liddell (U0ALICE)")
    assert fake_slack.called("users.info")[0]["user"] == ALICE
    [kept] = read_allow_file(path).approved
    assert (kept.entry, kept.by, kept.channel) == ("evil.example:443", "@Alice Liddell (U0ALICE)", "slack")
    await wait_until(lambda: fake_slack.called("chat.update"))
    [update] = fake_slack.called("chat.update")
    text = json.dumps(update["blocks"])
    assert "*Allowed always* by <@U0ALICE>" in text and "`evil.example:443` added to the allow file" in text
    assert update["text"].endswith(": allowed always")
