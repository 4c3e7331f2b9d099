"""Contract precision (DESIGN.md "The new-domain approval message", "What a client sees").

Every approval has an id (the ``deny`` approver's too); a deadline passing
while a delivery is still in flight is ``approval_timeout``, not
``no_approver``; a request held when egressd stops hears ``shutting_down``
(503), not "no approver attached".
"""

from __future__ import annotations

import asyncio
from typing import Any

from egressd.approvals.deny import DenyApprover
from egressd.approvals.interface import ChannelError
from egressd.approvals.ledger import Ledger
from egressd.audit.log import MemoryAuditSink
from egressd.vocabulary.reasons import Answer, Reason
from tests.conftest import Listener
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import connect_via, egress, free_port, wait_until
from tests.integration.approvals.test_approvals_e2e import egressd  # noqa: F401  (the fixture)
from tests.integration.approvals.test_approvals_e2e import records as e2e_records
from tests.integration.approvals.test_broker import RecordingChannel, events, make_broker, request
from tests.integration.approvals.test_webhook import hook  # noqa: F401, F811  (the fixture)


async def test_the_deny_approver_gives_every_approval_an_id_and_records_it() -> None:
    audit = MemoryAuditSink()
    outcome = await DenyApprover(audit=audit).ask(request())
    assert outcome.answer is Answer.DENY
    assert outcome.approval_id and outcome.approval_id.startswith("a-")
    (asked,) = events(audit, "approval.requested")
    (decided,) = events(audit, "approval.decided")
    assert asked["id"] == decided["id"] == outcome.approval_id
    assert decided["decision"] == "deny" and decided["reason"] == "denied"
    again = await DenyApprover(audit=audit).ask(request())
    assert again.approval_id != outcome.approval_id


def test_ledger_expiry_with_a_delivery_in_flight_is_a_timeout() -> None:
    ledger = Ledger(max_pending_per_run=5)
    ledger.open(request(), approval_id="a-1", channels=["webhook", "slack"], now=0)
    ledger.failed("a-1", "slack", now=1)  # failed for certain; the webhook is still in flight
    assert ledger.expire("a-1", now=600).answer is Answer.TIMEOUT  # type: ignore[union-attr]


async def test_a_deadline_passing_while_a_delivery_hangs_is_approval_timeout() -> None:
    audit = MemoryAuditSink()
    hanging = RecordingChannel("webhook", hang=True)
    broker = await make_broker(hanging, audit=audit, timeout_s=0.2)
    outcome = await broker.ask(request())
    assert outcome.answer is Answer.TIMEOUT
    assert outcome.approval_id is not None
    (decided,) = events(audit, "approval.decided")
    assert decided["reason"] == "approval_timeout"
    await broker.close()


async def test_a_channel_failing_for_certain_is_still_no_approver() -> None:
    broker = await make_broker(RecordingChannel("webhook", fail=ChannelError("connection refused")), timeout_s=5)
    assert (await broker.ask(request())).answer is Answer.NO_APPROVER
    await broker.close()


async def test_a_request_held_when_egressd_stops_hears_shutting_down() -> None:
    audit = MemoryAuditSink()
    channel = RecordingChannel()
    broker = await make_broker(channel, audit=audit)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    await broker.close()
    assert (await held).answer is Answer.SHUTTING_DOWN
    (decided,) = events(audit, "approval.decided")
    assert decided["reason"] == "shutting_down"
    assert channel.settled[0][1].answer is Answer.SHUTTING_DOWN
    assert (await broker.ask(request("later.example"))).answer is Answer.SHUTTING_DOWN


def test_shutting_down_is_a_503_with_a_true_phrase() -> None:
    assert Reason.SHUTTING_DOWN.status == 503
    assert "stop" in Reason.SHUTTING_DOWN.message
    assert Reason.AUDIT_UNAVAILABLE.status == 503


async def test_a_webhook_post_left_unanswered_at_the_deadline_is_approval_timeout(hook: Any) -> None:  # noqa: F811
    broker, receiver, audit = await hook(mode="hang", timeout_s=0.5)
    outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert receiver.requests  # the POST arrived; its answer never came
    assert outcome.answer is Answer.TIMEOUT and outcome.approval_id is not None
    (decided,) = events(audit, "approval.decided")
    assert decided["reason"] == "approval_timeout"


async def test_a_webhook_that_cannot_be_reached_is_still_no_approver(hook: Any) -> None:  # noqa: F811
    broker, _, audit = await hook(url=f"http://127.0.0.1:{free_port()}/hook", timeout_s=0.5)
    outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert outcome.answer is Answer.NO_APPROVER
    (decided,) = events(audit, "approval.decided")
    assert decided["reason"] == "no_approver"


# -- through the real proxy ----------------------------------------------------------------------


async def test_deny_approver_held_request_names_its_approval_in_the_egress_record(
    egressd: Any,  # noqa: F811
) -> None:
    svc = await egressd(approver=["deny"])
    status, headers, _, _, writer = await connect_via(svc, "origin.test:443")
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "denied"
    (record,) = egress(svc)
    approval_id = record["approval"]["id"]
    assert approval_id
    assert [r["id"] for r in e2e_records(svc, "approval.requested")] == [approval_id]
    assert [r["id"] for r in e2e_records(svc, "approval.decided")] == [approval_id]


async def test_a_request_held_when_egressd_stops_gets_503_shutting_down(
    egressd: Any,  # noqa: F811
    echo_origin: Listener,
) -> None:
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="never") as receiver:
        svc = await egressd(approver=["webhook"], webhook_url=receiver.url, webhook_secret=secret)
        held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
        await wait_until(lambda: receiver.requests)
        await svc.close(grace_s=0)
        status, headers, _, _, writer = await asyncio.wait_for(held, 5)
        writer.close()
        assert status == 503 and headers["x-egress-reason"] == "shutting_down"
        (decided,) = e2e_records(svc, "approval.decided")
        assert decided["reason"] == "shutting_down"
        (record,) = egress(svc)
        assert record["reason"] == "shutting_down" and record["approval"]["id"] == decided["id"]
    assert echo_origin.connections == 0
