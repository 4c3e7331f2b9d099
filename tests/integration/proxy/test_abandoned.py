"""An approval whose waiting clients all gave up (issue 13): it stays answerable, and the answer applies to the run.

Through a real egressd in process: a client CONNECTs to a domain nobody
allowed (the loopback origin, ``origin.test``), is held, and hangs up. The
approval stays pending; every channel says, once, that the client gave up
(the control API's ``abandoned``, the recording channel, a Slack
``chat.update`` that keeps its buttons, a signed webhook event); an answer
given afterwards applies to the run: the run's next request to the same
destination goes through (allow) or is refused (deny) without asking again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest, Choice
from egressd.approvals.slackblocks import abandoned_blocks, fallback_text
from egressd.audit.log import MemoryAuditSink
from egressd.cli.commands.approvals import _print_pending
from egressd.cli.wiring.service import EgressService
from egressd.proxy.core.commands import PeerClosed
from egressd.proxy.core.policy import Verdict
from egressd.proxy.net.stream import Peer
from egressd.vocabulary.reasons import Answer
from tests.conftest import Listener, MakeEgressd
from tests.fakes import hellos
from tests.fakes.slack import FakeSlack, limit_problems
from tests.fakes.terminal import Pty
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import connect_via, egress, open_proxy, wait_until
from tests.integration.approvals.test_approvals_e2e import (  # noqa: F401 - fixtures
    ALICE,
    control,
    echo_through,
    egressd,
    fake_slack,
    records,
    slack_settings,
)
from tests.integration.approvals.test_broker import RecordingChannel, request
from tests.integration.approvals.test_slack_hardening import mrkdwn_outside_code
from tests.integration.approvals.test_slack_hardening import pending as slack_pending
from tests.integration.approvals.test_terminal import pty, terminal_broker  # noqa: F401 - the pty fixture
from tests.integration.proxy.test_transparent import transparent  # noqa: F401 - the fixture


async def give_up(svc: EgressService, authority: str, until: Callable[[], object]) -> None:
    """CONNECT, wait until the request is held (``until``), then hang up."""
    reader, writer = await open_proxy(svc)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    await wait_until(until)
    writer.close()
    await writer.wait_closed()


async def recording_egressd(
    make_egressd: MakeEgressd, **kwargs: Any
) -> tuple[EgressService, RecordingChannel, ApprovalBroker]:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink, **kwargs)
    await broker.start()
    svc = await make_egressd(approver=broker, audit=sink)
    return svc, channel, broker


async def test_a_client_that_gives_up_leaves_the_approval_answerable_and_an_allow_serves_the_next_request(
    make_egressd: MakeEgressd, echo_origin: Listener, capsys: pytest.CaptureFixture[str]
) -> None:
    svc, channel, broker = await recording_egressd(make_egressd)
    target = f"origin.test:{echo_origin.port}"
    await give_up(svc, target, lambda: channel.delivered)
    # The wait ends with the client: nothing is held, nothing dialled, every channel told once.
    await wait_until(lambda: channel.abandonments)
    await wait_until(lambda: svc.path.recorder.metrics.held_requests == 0)  # type: ignore[union-attr]
    approval_id = channel.delivered[0].id
    assert channel.abandonments == [approval_id] and echo_origin.connections == 0
    [gone] = egress(svc)
    assert gone["decision"] == "deny" and gone["detail"] == "the client went away before its request was decided"
    status, listed = await control(svc, "GET", "/approvals")
    [pending] = listed["approvals"]
    assert status == 200 and pending["id"] == approval_id and pending["abandoned"] is True
    [abandoned] = records(svc, "approval.abandoned")
    assert abandoned["id"] == approval_id and abandoned["run"] == "default"
    assert (abandoned["host"], abandoned["port"]) == ("origin.test", echo_origin.port)
    assert not records(svc, "approval.decided")
    # Answered afterwards: recorded like any answer, and the run now allows the destination.
    status, answer = await control(svc, "POST", f"/approvals/{approval_id}/allow", body={"by": "carol"})
    assert (status, answer["decision"]) == (200, "allow")
    _print_pending(listed["approvals"])  # what `egressd pending` shows
    assert f"origin.test:{echo_origin.port} (unrelated) (client gave up)" in capsys.readouterr().out
    [decided] = records(svc, "approval.decided")
    assert decided["id"] == approval_id and decided["decision"] == "allow" and decided["by"] == "carol"
    await asyncio.sleep(0.2)
    assert echo_origin.connections == 0  # nothing was dialled for the client that hung up
    status, _, _, reader, writer = await connect_via(svc, target)
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    assert len(records(svc, "approval.requested")) == 1 and len(channel.delivered) == 1
    await wait_until(lambda: len(channel.settled) == 1)
    assert channel.abandonments == [approval_id]
    await broker.close()


async def test_a_denial_after_the_client_gave_up_sticks_for_the_run(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    svc, channel, broker = await recording_egressd(make_egressd)
    target = f"origin.test:{echo_origin.port}"
    await give_up(svc, target, lambda: channel.delivered)
    await wait_until(lambda: channel.abandonments)
    assert channel.answer(Choice.DENY).settlement is not None
    status, headers, _, _, writer = await connect_via(svc, target)
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "denied_earlier"
    assert len(records(svc, "approval.requested")) == 1 and echo_origin.connections == 0
    await broker.close()


async def test_a_new_request_joins_the_abandoned_approval_without_a_second_message(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    svc, channel, broker = await recording_egressd(make_egressd)
    target = f"origin.test:{echo_origin.port}"
    await give_up(svc, target, lambda: channel.delivered)
    await wait_until(lambda: channel.abandonments)
    again = asyncio.create_task(connect_via(svc, target))
    await wait_until(lambda: svc.path.recorder.metrics.held_requests == 1)  # type: ignore[union-attr]
    await asyncio.sleep(0.1)
    assert not again.done() and channel.attempts == 1 and len(records(svc, "approval.requested")) == 1
    [pending] = (await control(svc, "GET", "/approvals"))[1]["approvals"]
    assert pending["abandoned"] is False  # somebody waits for it again
    channel.answer(Choice.ALLOW)
    status, _, _, reader, writer = await again
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    await broker.close()


async def test_an_abandoned_approval_that_expires_applies_nothing(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    svc, channel, broker = await recording_egressd(make_egressd, timeout_s=0.5)
    target = f"origin.test:{echo_origin.port}"
    await give_up(svc, target, lambda: channel.delivered)
    await wait_until(lambda: records(svc, "approval.decided"))
    [decided] = records(svc, "approval.decided")
    assert decided["decision"] == "deny" and decided["reason"] == "approval_timeout"
    asked = asyncio.create_task(connect_via(svc, target))
    await wait_until(lambda: len(channel.delivered) == 2)  # asked again: a timeout does not stick
    channel.answer(Choice.DENY)
    status, headers, _, _, writer = await asked
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "denied"
    await broker.close()


async def test_slack_says_the_client_gave_up_and_its_buttons_still_answer(
    egressd: Callable[..., Any],  # noqa: F811 - the fixture
    fake_slack: FakeSlack,  # noqa: F811 - the fixture
    echo_origin: Listener,
) -> None:
    svc = await egressd(**slack_settings(fake_slack))
    target = f"origin.test:{echo_origin.port}"
    await give_up(svc, target, lambda: fake_slack.posted)
    await wait_until(lambda: fake_slack.called("chat.update"))
    [update] = fake_slack.called("chat.update")
    blocks = json.dumps(update["blocks"])
    assert update["ts"] == fake_slack.posted[0]["ts"] and "client gave up" in blocks
    assert "egressd_allow" in blocks and "egressd_deny" in blocks  # the buttons stay
    await fake_slack.click(fake_slack.posted[0], "allow", user=ALICE, username="alice")
    await wait_until(lambda: records(svc, "approval.decided"))
    status, _, _, reader, writer = await connect_via(svc, target)
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    assert len(records(svc, "approval.requested")) == 1 and len(fake_slack.posted) == 1
    await wait_until(lambda: len(fake_slack.called("chat.update")) == 2)
    assert "Allowed* by <@U0ALICE>" in json.dumps(fake_slack.called("chat.update")[1]["blocks"])


async def test_the_webhook_gets_one_signed_abandoned_event(
    egressd: Callable[..., Any],  # noqa: F811 - the fixture
    echo_origin: Listener,
) -> None:
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="later") as receiver:
        svc = await egressd(approver=["webhook"], webhook_url=receiver.url, webhook_secret=secret)
        target = f"origin.test:{echo_origin.port}"
        await give_up(svc, target, lambda: receiver.requests)
        await wait_until(lambda: any(r.payload.get("type") == "approval.abandoned" for r in receiver.received))
        approval_id = receiver.requests[0].payload["id"]
        [event] = [r for r in receiver.received if r.payload.get("type") == "approval.abandoned"]
        assert event.signature_ok and event.payload["id"] == approval_id and event.payload["run"] == "default"
        assert event.payload["host"] == "origin.test" and event.payload["port"] == echo_origin.port
        assert "gave up" in event.payload["message"] and event.payload["expires_at"].endswith("Z")
        assert (await control(svc, "POST", f"/approvals/{approval_id}/allow"))[0] == 200
        status, _, _, reader, writer = await connect_via(svc, target)
        assert status == 200 and await echo_through(reader, writer) == b"ping"
        await wait_until(lambda: receiver.settled)
        abandoned = [r for r in receiver.received if r.payload.get("type") == "approval.abandoned"]
        assert len(abandoned) == 1 and len(receiver.requests) == 1


async def test_the_terminal_prompt_says_the_client_gave_up_and_still_takes_an_answer(pty: Pty) -> None:  # noqa: F811
    broker, _ = await terminal_broker(pty)
    late: list[ApprovalOutcome] = []
    asking = asyncio.create_task(broker.ask(request(late=late.append)))
    await pty.shows("allow or deny evil.example:443?")
    assert "client gave up" not in pty.output
    asking.cancel()
    await asyncio.gather(asking, return_exceptions=True)
    await pty.shows("client gave up")
    pty.type("allow\r")
    await pty.shows("allowed for this run")
    assert [o.answer for o in late] == [Answer.ALLOW] and late[0].by == "alice" and late[0].channel == "terminal"
    await broker.close()


async def test_a_transparent_tls_client_that_hangs_up_abandons_the_approval_and_the_allow_still_applies(
    transparent: Callable[..., Any],  # noqa: F811 - the fixture
    make_egressd: MakeEgressd,
    echo_origin: Listener,
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink)
    await broker.start()
    svc = await transparent(approver=broker, audit=sink)
    reader, writer = await asyncio.open_connection(*svc.transparent_tls.address)  # type: ignore[attr-defined]
    writer.write(hellos.client_hello("origin.test"))
    await writer.drain()
    await wait_until(lambda: channel.delivered)
    writer.close()
    await writer.wait_closed()
    await wait_until(lambda: channel.abandonments)
    await wait_until(lambda: egress(svc))
    [gone] = egress(svc)
    assert gone["kind"] == "tls" and gone["detail"] == "the client went away before its request was decided"
    assert [p.abandoned for p in broker.pending()] == [True]
    channel.answer(Choice.ALLOW)
    assert svc.default_run.decide("origin.test", 443).verdict is Verdict.ALLOW  # type: ignore[union-attr]
    assert len(records(svc, "approval.requested")) == 1
    await broker.close()


# -- the wait that the client's leaving ends (egressd.proxy.net.stream.GoneCancels), socket-free ----------------


async def _held_in(peer: Peer, *, on_eof: bool) -> None:
    with peer.gone_cancels(on_eof=on_eof):
        await asyncio.sleep(10)


async def test_a_client_hanging_up_ends_the_wait_as_peer_closed_and_leaves_no_cancellation_behind() -> None:
    for on_eof, leave in ((True, "eof"), (True, "lost"), (False, "lost")):
        peer = Peer()
        task = asyncio.create_task(_held_in(peer, on_eof=on_eof))
        await asyncio.sleep(0)
        peer.eof_received() if leave == "eof" else peer.connection_lost(None)
        with pytest.raises(PeerClosed):
            await task
        assert task.cancelling() == 0


async def test_a_plain_http_client_half_closing_is_still_waited_for() -> None:
    peer = Peer()
    task = asyncio.create_task(_held_in(peer, on_eof=False))
    await asyncio.sleep(0)
    peer.eof_received()  # may still read the answer
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_from_elsewhere_passes_through_unchanged() -> None:
    peer = Peer()
    task = asyncio.create_task(_held_in(peer, on_eof=True))
    await asyncio.sleep(0)
    task.cancel()  # egressd stopping, say
    peer.eof_received()  # and the client leaving in the same instant
    with pytest.raises(asyncio.CancelledError):
        await task


def test_the_slack_abandoned_update_fits_slacks_limits_and_keeps_agent_text_out_of_mrkdwn() -> None:
    hostile = "<!channel> *bold* `tick` :skull: \u202e" + "x" * 20_000
    req = ApprovalRequest(
        run_id="r-" + "9" * 200, host="evil.example", port=443, command=hostile, task=hostile, allowed=(hostile,) * 40
    )
    approval = slack_pending(req)
    blocks = abandoned_blocks(approval, instance="i-1", at=1_700_000_100)
    assert limit_problems({"blocks": blocks, "text": fallback_text(approval) + ": the client gave up waiting"}) == []
    assert [b["type"] for b in blocks][-1] == "actions"  # the buttons stay
    benign = slack_pending(ApprovalRequest("r-1", "evil.example", 443, "x", "y", ()))
    ours = set(mrkdwn_outside_code(abandoned_blocks(benign, instance="i-1", at=1_700_000_100)))
    assert set(mrkdwn_outside_code(blocks)) <= ours
