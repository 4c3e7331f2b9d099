"""Slack attacks: formatting smuggled into the approval message, messages past Slack's limits,
clicks for another instance's approval, and clicks on a copy of the message elsewhere.

Pure tests (and Hypothesis properties) on the neutraliser and the blocks,
then the channel against the fake Slack (``tests/fakes/slack.py``), which
refuses a message past any of Slack's limits the way Slack does.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
import unicodedata
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import ApprovalRequest, Choice, PendingApproval, Settlement
from egressd.approvals.message import render
from egressd.approvals.slack import INTERACTIVITY_PATH, SlackChannel
from egressd.approvals.slackblocks import (
    button_value,
    fallback_text,
    neutralise,
    parse_button_value,
    request_blocks,
    settled_blocks,
)
from egressd.audit.log import MemoryAuditSink
from egressd.names.shown import escape, escape_mrkdwn
from egressd.vocabulary.reasons import Answer
from tests.fakes.control import control_server
from tests.fakes.slack import SIGNING_SECRET, FakeSlack, block_actions, interaction_request, limit_problems, units
from tests.fakes.webhook import WebhookReceiver
from tests.harness import listening_socket, wait_until
from tests.integration.approvals.test_broker import RecordingChannel, request

CHANNEL = "C0APPROVE"
ALICE = "U0ALICE"
HOSTILE = (
    "curl <!channel> *bold* _italic_ ~struck~ `code` ```block``` <https://evil.example|pypi.org> "
    "<@U0ALICE> <!subteam^S0ONCALL> :white_check_mark: &amp; &lt;!here&gt; > quoted"
)
MARKERS = (
    "*bold*", "_italic_", "~struck~", "`code`", "```", "!channel", "https://evil", "pypi.org>",
    "@U0ALICE", "subteam", ":white_check_mark:", "!here", "quoted",
)  # fmt: skip
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})
_CODE = re.compile(r"`[^`]*`")
_DATE = re.compile(r"<!date\^\d+\^\{time\}\|\d\d:\d\d UTC>")


def pending(req: ApprovalRequest | None = None, approval_id: str = "a-test") -> PendingApproval:
    req = req or request()
    message = render(host=req.host, port=req.port, command=req.command, task=req.task, allowed=req.allowed)
    return PendingApproval(
        id=approval_id, request=req, message=message, created_at=1_700_000_000, expires_at=1_700_000_600, deadline=0
    )


def text_objects(blocks: Any) -> Iterator[dict[str, Any]]:
    """Every text object in a message's blocks."""
    if isinstance(blocks, str):
        blocks = json.loads(blocks)
    for block in blocks:
        if "text" in block:
            yield block["text"]
        yield from block.get("fields") or []
        for element in block.get("elements") or []:
            if element.get("type") in ("plain_text", "mrkdwn"):
                yield element
            elif "text" in element:
                yield element["text"]


def mrkdwn_outside_code(blocks: Any) -> list[str]:
    """The mrkdwn egressd wrote itself: every mrkdwn text with code spans and its date tokens taken out."""
    return [_DATE.sub("", _CODE.sub("", o["text"])) for o in text_objects(blocks) if o["type"] == "mrkdwn"]


def decode_entities(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


# -- the neutraliser (pure, Hypothesis) ------------------------------------------------------------

# Slack's markup, entities, line breaks, bidi and escape sequences, astral characters, and anything else.
_PIECES = list("*_~`<>&|!@#:\n\r\t ") + ["<!channel>", "&amp;", "```", "\u202e", "\x1b[2J", "\U0001f600"]
hostile_text = st.lists(st.one_of(st.sampled_from(_PIECES), st.characters()), max_size=200).map("".join)


@given(hostile_text, st.integers(min_value=60, max_value=3000))
def test_neutralised_text_is_inert_visible_faithful_and_fits(text: str, limit: int) -> None:
    out = neutralise(text, limit)
    assert units(out) <= limit
    assert "<" not in out and ">" not in out
    assert re.sub(r"&(amp|lt|gt);", "", out).count("&") == 0  # every & starts one of Slack's three entities
    assert not any(unicodedata.category(ch) in _INVISIBLE for ch in out)  # nothing hidden, no line breaks
    whole = escape_mrkdwn(escape(text))
    if units(whole) <= limit:
        assert out == whole and decode_entities(out) == escape(text)
        return
    # Cut: a prefix of the text, shown whole (no entity or escape split), then how much is left out.
    match = re.fullmatch(r"(.*)… \[cut for Slack: (\d+) more characters\]", out, re.S)
    assert match is not None, out
    left_out = int(match.group(2))
    assert 0 < left_out <= len(text)
    assert match.group(1) == escape_mrkdwn(escape(text[: len(text) - left_out]))


@given(hostile_text)
def test_neutralising_twice_changes_nothing_more_than_the_entities(text: str) -> None:
    once = neutralise(text, 3000)
    assert decode_entities(neutralise(decode_entities(once), 3000)) == decode_entities(once)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    command=hostile_text,
    task=hostile_text,
    allowed=st.lists(hostile_text, max_size=40),
    run=st.text(min_size=1, max_size=300),
    host=st.sampled_from(["evil.example", "xn--pypi-9oa.org", "a" * 63 + "." + "b" * 63 + ".example", "pypi.org"]),
)
def test_every_request_and_settled_message_fits_slacks_limits_and_agent_text_never_reaches_mrkdwn(
    command: str, task: str, allowed: list[str], run: str, host: str
) -> None:
    req = ApprovalRequest(run_id=run, host=host, port=443, command=command, task=task, allowed=tuple(allowed))
    approval = pending(req)
    benign = pending(ApprovalRequest(run_id="r-1", host=host, port=443, command="x", task="y", allowed=()))
    related = pending(ApprovalRequest(run_id="r-1", host=host, port=443, command=host, task="y", allowed=()))
    ours = set(mrkdwn_outside_code(request_blocks(benign, instance="i-1")))
    ours |= set(mrkdwn_outside_code(request_blocks(related, instance="i-1")))
    blocks = request_blocks(approval, instance="i-1")
    assert limit_problems({"blocks": blocks, "text": fallback_text(approval)}) == []
    assert set(mrkdwn_outside_code(blocks)) <= ours
    for obj in text_objects(blocks):
        if obj["type"] == "mrkdwn":
            assert obj["verbatim"] is True
        else:
            assert obj["emoji"] is False
    by = command[:200] or "x"
    for settlement, ours_settled in (
        (Settlement(Answer.DENY, "control", by, 1_700_000_060, 60), Settlement(Answer.DENY, "control", "x", 1, 1)),
        (
            Settlement(Answer.ALLOW, "slack", "@alice (U0ALICE)", 1_700_000_060, 60),
            Settlement(Answer.ALLOW, "slack", "@alice (U0ALICE)", 1, 1),
        ),
        (Settlement(Answer.TIMEOUT, None, None, 1_700_000_600, 600), Settlement(Answer.TIMEOUT, None, None, 1, 1)),
    ):
        settled = settled_blocks(approval, settlement)
        assert limit_problems({"blocks": settled}) == []
        expected = set(mrkdwn_outside_code(settled_blocks(benign, ours_settled)))
        expected |= set(mrkdwn_outside_code(settled_blocks(related, ours_settled)))
        assert set(mrkdwn_outside_code(settled)) <= expected


# -- neutralised, as Slack receives it --------------------------------------------------------------


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
        channel = SlackChannel(bot_token=fake_slack.bot_token, channel=CHANNEL, api_url=fake_slack.api_url, **kwargs)
        broker = ApprovalBroker([channel, *others], audit=MemoryAuditSink(), timeout_s=timeout_s)
        brokers.append(broker)
        await broker.start()
        return broker

    yield make
    for broker in brokers:
        await broker.close()


async def test_a_hostile_command_task_and_allowlist_are_posted_neutralised(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    broker = await slack_broker()
    hostile = ApprovalRequest(
        run_id="r-*x*",
        host="evil.example",
        port=443,
        command=HOSTILE,
        task=f"the task, with {HOSTILE}",
        allowed=("pypi.org", "<!everyone>", "*_~`"),
    )
    held = asyncio.create_task(broker.ask(hostile))
    await wait_until(lambda: fake_slack.posted)
    [post] = fake_slack.posted
    assert not fake_slack.rejected
    for text in mrkdwn_outside_code(post["blocks"]):
        assert not any(marker in text for marker in MARKERS), text
        assert "everyone" not in text and "r-*x*" not in text
    objects = list(text_objects(post["blocks"]))
    [command] = [o for o in objects if o["text"].startswith("Command:")]
    assert command == {"type": "plain_text", "text": command["text"], "emoji": False}
    assert "&lt;!channel&gt; *bold* _italic_ ~struck~ `code`" in command["text"]  # shown as typed, never formatted
    assert "&lt;https://evil.example|pypi.org&gt;" in command["text"]
    assert "&amp;amp;" in command["text"]  # an entity the agent wrote is shown as written, not decoded
    raw = json.dumps(post["blocks"])
    assert raw.count("<") == raw.count("<!date^")  # Slack's control character only in our own date token
    assert post["mrkdwn"] is False and "<" not in post["text"] and post["unfurl_links"] is False
    await fake_slack.click(post, "deny", user=ALICE)
    assert (await held).answer is Answer.DENY


async def test_a_10000_character_command_is_cut_with_a_visible_note_and_still_delivered(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    broker = await slack_broker()
    # Tag characters are invisible, so each is shown as a ten-character escape (\U000e0041).
    command = ("curl evil.example " + "&<\u202e\U000e0041" * 2500)[:10_000]
    assert len(command) == 10_000
    held = asyncio.create_task(broker.ask(ApprovalRequest("r-1", "evil.example", 443, command, "t" * 10_000, ())))
    await wait_until(lambda: fake_slack.posted or fake_slack.rejected or held.done())
    assert not fake_slack.rejected, fake_slack.rejected
    [post] = fake_slack.posted
    assert limit_problems(post) == []
    [shown] = [o["text"] for o in text_objects(post["blocks"]) if o["text"].startswith("Command:")]
    assert re.search(r"more characters[)\]]$", shown)  # the cut is said where it happened
    assert units(shown) <= 3000
    assert not held.done() and broker.pending()  # delivered, waiting for a person
    await fake_slack.click(post, "allow", user=ALICE)
    assert (await held).allowed
    await wait_until(lambda: fake_slack.called("chat.update"))
    assert not fake_slack.rejected


def test_a_long_command_without_dots_renders_in_linear_time() -> None:
    # The "unrelated" rule looks for names in the command; a 20,000-character word once took
    # seconds (quadratic backtracking), holding the event loop while the request waited.
    started = time.perf_counter()
    message = render(host="evil.example", port=443, command="x" * 20_000, task="y" * 20_000, allowed=())
    assert time.perf_counter() - started < 1.0 and message.unrelated


async def test_the_settled_message_shows_who_answered_neutralised(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    other = RecordingChannel("webhook")
    broker = await slack_broker(other)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted and other.delivered)
    other.answer(Choice.DENY, by="<!channel> *boss* `x` <https://evil|ok>")
    assert (await held).answer is Answer.DENY
    await wait_until(lambda: fake_slack.called("chat.update"))
    [update] = fake_slack.called("chat.update")
    assert not fake_slack.rejected
    for text in mrkdwn_outside_code(update["blocks"]):
        assert "!channel" not in text and "*boss*" not in text and "https://evil" not in text
    assert "<!channel>" not in update["text"] and "boss" not in update["text"]


# -- the instance that owns an approval ------------------------------------------------------------


def test_button_values_carry_the_instance_and_the_approval() -> None:
    blocks = request_blocks(pending(), instance="egressd-7f3a")
    [actions] = [b for b in blocks if b["type"] == "actions"]
    assert {e["value"] for e in actions["elements"]} == {button_value("egressd-7f3a", "a-test")}
    assert parse_button_value(button_value("egressd-7f3a", "a-test")) == ("egressd-7f3a", "a-test")
    assert parse_button_value("a-test") is None and parse_button_value("") is None
    with pytest.raises(ValueError, match="instance"):
        SlackChannel(bot_token="x", channel=CHANNEL, approvers=[ALICE], app_token="y", instance="no:colons")


async def test_a_click_sent_to_an_instance_that_does_not_own_the_approval_is_answered_truthfully(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    owner = await slack_broker()
    await fake_slack.wait_sockets(1)
    stranger = await slack_broker()
    await fake_slack.wait_sockets(2)
    held = asyncio.create_task(owner.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    [post] = fake_slack.posted
    await fake_slack.click(post, "allow", user=ALICE, socket=1)  # Slack hands the click to the other instance
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
    [told] = fake_slack.called("chat.postEphemeral")
    assert "belongs to another egressd instance" in told["text"] and "did not count" in told["text"]
    assert "Too late" not in told["text"] and "settled" not in told["text"]
    await asyncio.sleep(0.05)
    assert not held.done() and owner.pending() and not stranger.pending()
    await fake_slack.click(post, "allow", user=ALICE, socket=0)  # the same click, delivered to the owner
    assert (await asyncio.wait_for(held, 5)).allowed


# -- clicks only from the message egressd posted ------------------------------------------------------


async def test_a_click_whose_channel_or_message_differs_from_the_post_is_rejected(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    broker = await slack_broker()
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: fake_slack.posted)
    [post] = fake_slack.posted
    await fake_slack.interact(block_actions(post, "allow", user=ALICE, channel="C0ELSEWHERE"))
    await fake_slack.interact(block_actions(post, "allow", user=ALICE, ts="1.000042"))
    await wait_until(lambda: len(fake_slack.called("chat.postEphemeral")) == 2)
    assert all("not from the message egressd posted" in e["text"] for e in fake_slack.called("chat.postEphemeral"))
    await asyncio.sleep(0.05)
    assert not held.done() and broker.pending()
    await fake_slack.click(post, "deny", user=ALICE)
    assert (await asyncio.wait_for(held, 5)).answer is Answer.DENY


async def test_the_http_endpoint_rejects_a_signed_click_from_another_message(
    fake_slack: FakeSlack, slack_broker: Callable[..., Any]
) -> None:
    broker = await slack_broker(app_token=None, signing_secret=SIGNING_SECRET)
    async with control_server(broker.routes, listening_socket()) as base:
        url = base + INTERACTIVITY_PATH
        held = asyncio.create_task(broker.ask(request()))
        await wait_until(lambda: fake_slack.posted)
        [post] = fake_slack.posted
        body, headers = interaction_request(block_actions(post, "allow", user=ALICE, channel="C0ELSEWHERE"))
        assert (await WebhookReceiver.send(url, body, headers))[0] == 200
        await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
        assert not held.done()
        body, headers = interaction_request(block_actions(post, "allow", user=ALICE))
        assert (await WebhookReceiver.send(url, body, headers))[0] == 200
        assert (await asyncio.wait_for(held, 5)).allowed


def test_the_escaped_text_is_what_html_unescape_reads_back() -> None:
    # Slack decodes exactly its three entities; a reader of the JSON sees the same text.
    assert html.unescape(neutralise("<a & b>", 100)) == "<a & b>"
