"""The approval broker and its state machine, with a recording fake channel (no sockets).

``RecordingChannel`` is the fake every approval test can use: it records what
it was shown and told, answers on request, and can be made to fail.
"""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import egressd.approvals.broker as broker_module
from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import (
    Answered,
    Answerer,
    AnswerResult,
    ApprovalOutcome,
    ApprovalRequest,
    ChannelError,
    ChannelUnavailable,
    Choice,
    ManagedApprover,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    SetupError,
)
from egressd.approvals.ledger import Ledger, LedgerError
from egressd.audit.log import MemoryAuditSink
from egressd.vocabulary.reasons import Answer
from tests import REPO
from tests.harness import wait_until


class RecordingChannel:
    """A channel that records deliveries, settlements and notices and answers when told to."""

    def __init__(
        self,
        name: str = "fake",
        *,
        attach: bool = True,
        fail: Exception | None = None,
        hang: bool = False,
        settle_error: Exception | None = None,
    ) -> None:
        self.name = name
        self.attach = attach
        self.fail = fail
        self.hang = hang
        self.settle_error = settle_error
        self.answerer: Answerer | None = None
        self.delivered: list[PendingApproval] = []
        self.attempts = 0
        self.settled: list[tuple[str, Settlement]] = []
        self.notices: list[Notice] = []
        self.abandonments: list[str] = []
        self.closed = False

    async def start(self, answerer: Answerer) -> None:
        if not self.attach:
            raise ChannelUnavailable("nothing to attach to")
        self.answerer = answerer

    async def deliver(self, approval: PendingApproval) -> None:
        self.attempts += 1
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await asyncio.Event().wait()
        self.delivered.append(approval)

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        if self.settle_error is not None:
            raise self.settle_error
        self.settled.append((approval.id, settlement))

    async def notify(self, notice: Notice) -> None:
        self.notices.append(notice)

    async def abandoned(self, approval: PendingApproval) -> None:
        self.abandonments.append(approval.id)

    async def close(self) -> None:
        self.closed = True

    def routes(self) -> Sequence[Route]:
        return []

    def answer(self, decision: Choice, *, by: str = "tester", index: int = -1) -> Answered:
        assert self.answerer is not None
        return self.answerer.answer(self.delivered[index].id, decision, channel=self.name, by=by)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def request(
    host: str = "evil.example",
    port: int = 443,
    run: str = "r-1",
    late: Callable[[ApprovalOutcome], None] | None = None,
) -> ApprovalRequest:
    return ApprovalRequest(
        run_id=run,
        host=host,
        port=port,
        command="curl evil",
        task="build",
        allowed=("pypi.org",),
        on_late_answer=late,
    )


async def make_broker(*channels: RecordingChannel, audit: MemoryAuditSink | None = None, **kwargs) -> ApprovalBroker:  # type: ignore[no-untyped-def]
    broker = ApprovalBroker(list(channels), audit=audit if audit is not None else MemoryAuditSink(), **kwargs)
    await broker.start()
    return broker


def events(audit: MemoryAuditSink, name: str) -> list[dict[str, object]]:
    return [r for r in audit.records if r["event"] == name]


# -- the ledger (pure) ------------------------------------------------------------------


def test_ledger_first_answer_decides_and_later_ones_hear_who_did() -> None:
    ledger = Ledger(max_pending_per_run=5)
    approval = ledger.open(request(), approval_id="a-1", channels=["x", "y"], now=100.0)
    assert ledger.find(("r-1", "evil.example", 443)) is approval
    first = ledger.answer("a-1", Choice.DENY, channel="x", by="alice", now=103.5)
    assert first.result is AnswerResult.ACCEPTED
    assert first.settlement == Settlement(Answer.DENY, "x", "alice", 103.5, 3.5)
    again = ledger.answer("a-1", Choice.ALLOW, channel="y", by="bob", now=104.0)
    assert again == Answered(AnswerResult.SETTLED, first.settlement)
    assert ledger.answer("a-nope", Choice.ALLOW, channel="y", by="bob", now=104.0).result is AnswerResult.UNKNOWN
    assert ledger.find(("r-1", "evil.example", 443)) is None  # settled: the key may be asked again


def test_ledger_every_channel_failing_settles_no_approver_but_one_delivery_keeps_it_open() -> None:
    ledger = Ledger(max_pending_per_run=5)
    one = ledger.open(request("a.example"), approval_id="a-1", channels=["x", "y"], now=0)
    assert ledger.failed("a-1", "x", now=1) is None
    settled = ledger.failed("a-1", "y", now=2)
    assert settled is not None and settled.answer is Answer.NO_APPROVER and one.settlement == settled
    two = ledger.open(request("b.example"), approval_id="a-2", channels=["x", "y"], now=0)
    ledger.delivered(two, "x")
    assert ledger.failed("a-2", "y", now=1) is None


def test_ledger_expiry_is_a_timeout_whether_shown_or_still_in_flight() -> None:
    # DESIGN.md: a deadline passing while a delivery is still in flight is approval_timeout.
    ledger = Ledger(max_pending_per_run=5)
    shown = ledger.open(request("a.example"), approval_id="a-1", channels=["x"], now=0)
    ledger.delivered(shown, "x")
    ledger.open(request("b.example"), approval_id="a-2", channels=["x"], now=0)
    assert ledger.expire("a-1", now=600).answer is Answer.TIMEOUT  # type: ignore[union-attr]
    assert ledger.expire("a-2", now=600).answer is Answer.TIMEOUT  # type: ignore[union-attr]
    assert ledger.expire("a-1", now=601) is None


def test_ledger_counts_pending_approvals_per_run() -> None:
    ledger = Ledger(max_pending_per_run=2)
    ledger.open(request("a.example"), approval_id="a-1", channels=["x"], now=0)
    ledger.open(request("b.example"), approval_id="a-2", channels=["x"], now=0)
    assert not ledger.has_room("r-1") and ledger.has_room("r-2")
    with pytest.raises(LedgerError):
        ledger.open(request("c.example"), approval_id="a-3", channels=["x"], now=0)
    with pytest.raises(LedgerError):
        ledger.open(request("a.example", run="r-2"), approval_id="a-1", channels=["x"], now=0)  # id reused
    ledger.withdraw("a-1", now=1)
    assert ledger.has_room("r-1")
    assert [a.id for a in ledger.pending()] == ["a-2"]


def test_ledger_forgets_old_settlements_within_its_bound() -> None:
    ledger = Ledger(max_pending_per_run=5, remembered=2)
    for i in range(3):
        ledger.open(request(f"h{i}.example"), approval_id=f"a-{i}", channels=["x"], now=0)
        ledger.withdraw(f"a-{i}", now=1)
    assert ledger.answer("a-0", Choice.ALLOW, channel="x", by=None, now=2).result is AnswerResult.UNKNOWN
    assert ledger.answer("a-2", Choice.ALLOW, channel="x", by=None, now=2).result is AnswerResult.SETTLED


# -- the broker -----------------------------------------------------------------------------


async def test_no_channel_attached_is_no_approver_at_once() -> None:
    for broker in (await make_broker(), await make_broker(RecordingChannel(attach=False))):
        assert broker.attached == ()
        outcome = await asyncio.wait_for(broker.ask(request()), 1)
        assert outcome.answer is Answer.NO_APPROVER and outcome.approval_id is None
        await broker.close()


async def test_allow_after_a_delay_answers_the_held_request() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    await asyncio.sleep(0.05)
    assert not held.done()  # held until someone answers
    assert channel.answer(Choice.ALLOW, by="alice").result is AnswerResult.ACCEPTED
    outcome = await asyncio.wait_for(held, 1)
    assert outcome.allowed and outcome.channel == "fake" and outcome.by == "alice"
    assert outcome.approval_id == channel.delivered[0].id and outcome.waited_s >= 0.05
    await broker.close()


async def test_the_message_is_rendered_once_and_sent_to_every_channel() -> None:
    a, b, c = RecordingChannel("a"), RecordingChannel("b"), RecordingChannel("c")
    broker = await make_broker(a, b, c)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: a.delivered and b.delivered and c.delivered)
    assert a.delivered[0] is b.delivered[0] is c.delivered[0]  # one PendingApproval, one rendered message
    message = a.delivered[0].message
    assert "Domain: evil.example:443" in message.text and message.unrelated
    b.answer(Choice.DENY)
    assert (await held).answer is Answer.DENY
    await broker.close()


async def test_the_first_answer_decides_and_every_channel_is_told() -> None:
    a, b = RecordingChannel("a"), RecordingChannel("b")
    broker = await make_broker(a, b)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: a.delivered and b.delivered)
    assert a.answer(Choice.ALLOW, by="alice").result is AnswerResult.ACCEPTED
    late = b.answer(Choice.DENY, by="bob")
    assert late.result is AnswerResult.SETTLED and late.settlement is not None
    assert late.settlement.answer is Answer.ALLOW and late.settlement.by == "alice"
    assert (await held).allowed
    await wait_until(lambda: a.settled and b.settled)
    assert a.settled[0][1] == b.settled[0][1] == late.settlement
    await broker.close()


async def test_approval_ids_are_unguessable_and_each_answers_once() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel)
    tasks = [asyncio.create_task(broker.ask(request(f"h{i}.example", run=f"r-{i}"))) for i in range(4)]
    await wait_until(lambda: len(channel.delivered) == 4)
    ids = [a.id for a in channel.delivered]
    assert len(set(ids)) == 4
    assert all(re.fullmatch(r"a-[A-Za-z0-9_-]{16}", i) for i in ids)  # 96 random bits
    assert broker.answer("a-guessed", Choice.ALLOW, channel="x", by="mallory").result is AnswerResult.UNKNOWN
    for index in range(4):
        assert channel.answer(Choice.DENY, index=index).result is AnswerResult.ACCEPTED
        assert channel.answer(Choice.ALLOW, index=index).result is AnswerResult.SETTLED
    assert [o.answer for o in await asyncio.gather(*tasks)] == [Answer.DENY] * 4
    await broker.close()


async def test_a_timeout_denies_and_does_not_stick() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink()
    broker = await make_broker(channel, audit=audit, timeout_s=0.1)
    first = await asyncio.wait_for(broker.ask(request()), 2)
    assert first.answer is Answer.TIMEOUT and first.approval_id == channel.delivered[0].id
    await wait_until(lambda: channel.settled)
    assert channel.settled[0][1].answer is Answer.TIMEOUT
    assert events(audit, "approval.decided")[0]["reason"] == "approval_timeout"
    second = asyncio.create_task(broker.ask(request()))  # asked again: a new approval
    await wait_until(lambda: len(channel.delivered) == 2)
    assert channel.delivered[1].id != first.approval_id
    channel.answer(Choice.ALLOW)
    assert (await second).allowed
    await broker.close()


async def test_every_channel_failing_to_deliver_is_no_approver_at_once() -> None:
    a, b = RecordingChannel("a", fail=ChannelError("down")), RecordingChannel("b", fail=RuntimeError("bug"))
    audit = MemoryAuditSink()
    broker = await make_broker(a, b, audit=audit, timeout_s=60)
    outcome = await asyncio.wait_for(broker.ask(request()), 1)
    assert outcome.answer is Answer.NO_APPROVER and outcome.approval_id is not None
    assert events(audit, "approval.decided")[0]["reason"] == "no_approver"
    assert not a.settled and not b.settled  # nothing was shown, nothing to withdraw
    await broker.close()


async def test_a_channel_that_is_down_does_not_stop_another_from_answering() -> None:
    down, up = RecordingChannel("down", fail=ChannelError("unreachable")), RecordingChannel("up")
    broker = await make_broker(down, up)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: down.attempts and up.delivered)
    up.answer(Choice.ALLOW)
    assert (await held).allowed
    await wait_until(lambda: up.settled)
    assert not down.settled
    await broker.close()


async def test_a_channel_still_delivering_when_another_answers_is_stopped() -> None:
    slow, fast = RecordingChannel("slow", hang=True), RecordingChannel("fast")
    broker = await make_broker(slow, fast)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: slow.attempts and fast.delivered)
    fast.answer(Choice.DENY)
    assert (await asyncio.wait_for(held, 1)).answer is Answer.DENY
    await wait_until(lambda: fast.settled)
    assert not slow.settled and not broker._tasks
    await broker.close()


async def test_twenty_concurrent_requests_for_one_key_share_one_approval() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink()
    broker = await make_broker(channel, audit=audit)
    held = [asyncio.create_task(broker.ask(request())) for _ in range(20)]
    await wait_until(lambda: channel.delivered)
    await asyncio.sleep(0.02)
    assert len(channel.delivered) == 1 and len(broker.pending()) == 1
    channel.answer(Choice.ALLOW)
    outcomes = await asyncio.gather(*held)
    assert all(o.allowed for o in outcomes)
    assert {o.approval_id for o in outcomes} == {channel.delivered[0].id}
    assert len(events(audit, "approval.requested")) == 1 and len(events(audit, "approval.decided")) == 1
    await broker.close()


async def test_another_port_or_run_is_another_approval() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel)
    held = [
        asyncio.create_task(broker.ask(request(port=443))),
        asyncio.create_task(broker.ask(request(port=8443))),
        asyncio.create_task(broker.ask(request(run="r-2"))),
    ]
    await wait_until(lambda: len(channel.delivered) == 3)
    for index in range(3):
        channel.answer(Choice.DENY, index=index)
    await asyncio.gather(*held)
    await broker.close()


async def test_too_many_pending_in_a_run_is_refused_at_once() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink()
    broker = await make_broker(channel, audit=audit, max_pending_per_run=2)
    held = [asyncio.create_task(broker.ask(request(f"h{i}.example"))) for i in range(2)]
    await wait_until(lambda: len(channel.delivered) == 2)
    third = await asyncio.wait_for(broker.ask(request("h2.example")), 1)
    assert third.answer is Answer.TOO_MANY_PENDING
    joined = asyncio.create_task(broker.ask(request("h0.example")))  # joining an open one is no new approval
    other_run = asyncio.create_task(broker.ask(request("h2.example", run="r-2")))
    await wait_until(lambda: len(channel.delivered) == 3)
    channel.answer(Choice.DENY, index=0)
    assert (await joined).answer is Answer.DENY
    room_again = asyncio.create_task(broker.ask(request("h3.example")))
    await wait_until(lambda: len(channel.delivered) == 4)
    for index in (1, 2, 3):
        channel.answer(Choice.DENY, index=index)
    await asyncio.gather(*held, other_run, room_again)
    assert len(events(audit, "approval.requested")) == 4  # the refused one asked nobody
    await broker.close()


async def test_every_step_is_in_the_audit_log() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink()
    clock = Clock()
    broker = await make_broker(channel, audit=audit, clock=clock)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    clock.now += 12.5
    channel.answer(Choice.DENY, by="alice")
    await held
    [requested] = events(audit, "approval.requested")
    [decided] = events(audit, "approval.decided")
    approval_id = channel.delivered[0].id
    assert requested == {
        "event": "approval.requested",
        "id": approval_id,
        "ts": "2023-11-14T22:13:20.000000Z",
        "run": "r-1",
        "host": "evil.example",
        "port": 443,
        "command": "curl evil",
        "channels": ["fake"],
    }
    assert decided == {
        "event": "approval.decided",
        "id": approval_id,
        "ts": "2023-11-14T22:13:32.500000Z",
        "run": "r-1",
        "decision": "deny",
        "reason": "denied",
        "channel": "fake",
        "by": "alice",
        "waited_s": 12.5,
        "scope": None,
        "entry": None,
        "scope_error": None,
    }
    await broker.close()


async def test_an_allow_that_cannot_be_recorded_becomes_a_denial() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink(fail_after=1)  # approval.requested fits, approval.decided does not
    broker = await make_broker(channel, audit=audit)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    answered = channel.answer(Choice.ALLOW)
    assert answered.result is AnswerResult.ACCEPTED and answered.settlement is not None
    assert answered.settlement.answer is Answer.NO_APPROVER
    assert (await held).answer is Answer.NO_APPROVER
    await broker.close()


async def test_nobody_is_asked_when_the_request_cannot_be_recorded() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel, audit=MemoryAuditSink(fail_after=0))
    outcome = await asyncio.wait_for(broker.ask(request()), 1)
    assert outcome.answer is Answer.NO_APPROVER
    await asyncio.sleep(0.01)
    assert channel.attempts == 0 and broker.pending() == []
    await broker.close()


async def test_closing_denies_what_waits_tells_the_channels_and_closes_them() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    await broker.close()
    assert (await held).answer is Answer.SHUTTING_DOWN
    assert channel.settled and channel.settled[0][1].answer is Answer.SHUTTING_DOWN and channel.closed
    assert (await broker.ask(request("later.example"))).answer is Answer.SHUTTING_DOWN
    await broker.close()  # idempotent


async def test_a_failing_broker_or_channel_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = RecordingChannel(settle_error=RuntimeError("settle broke"))
    broker = await make_broker(channel)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    channel.answer(Choice.ALLOW)
    assert (await held).allowed  # a channel failing to update afterwards changes nothing

    def broken_render(**_: object) -> object:
        raise RuntimeError("template bug")

    monkeypatch.setattr(broker_module, "render", broken_render)
    outcome = await asyncio.wait_for(broker.ask(request("other.example")), 1)
    assert outcome.answer is Answer.NO_APPROVER
    await broker.close()


async def test_one_waiter_going_away_does_not_cancel_the_shared_approval() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel)
    leaving = asyncio.create_task(broker.ask(request()))
    staying = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    channel.answer(Choice.ALLOW)
    assert (await staying).allowed
    await broker.close()


async def test_who_answered_is_escaped_and_bounded() -> None:
    channel = RecordingChannel()
    broker = await make_broker(channel)
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    channel.answer(Choice.DENY, by="\x1b[2Jmallory" + "x" * 500)
    outcome = await held
    assert outcome.by is not None and outcome.by.startswith("\\x1b[2Jmallory") and len(outcome.by) < 260
    await broker.close()


async def test_start_leaves_out_channels_with_nothing_to_attach_to_and_stops_on_a_broken_one() -> None:
    here, absent = RecordingChannel("here"), RecordingChannel("absent", attach=False)
    broker = await make_broker(here, absent)
    assert broker.attached == ("here",)
    await broker.close()

    class Broken(RecordingChannel):
        async def start(self, answerer: Answerer) -> None:
            raise SetupError("bad setting slack_bot_token: Slack refused it (invalid_auth)")

    fine = RecordingChannel("fine")
    broker = ApprovalBroker([fine, Broken("broken")], audit=MemoryAuditSink())
    with pytest.raises(SetupError, match="slack_bot_token"):
        await broker.start()
    assert fine.closed

    class Slow(RecordingChannel):
        async def start(self, answerer: Answerer) -> None:
            await asyncio.sleep(10)

    broker = ApprovalBroker([Slow("slow")], audit=MemoryAuditSink(), start_timeout_s=0.05)
    with pytest.raises(SetupError, match="did not start within"):
        await broker.start()


def test_the_broker_is_a_managed_approver_with_control_routes() -> None:
    broker = ApprovalBroker([RecordingChannel()], audit=MemoryAuditSink())
    assert isinstance(broker, ManagedApprover)
    assert {(r.method, r.path, r.public) for r in broker.routes()} == {
        ("GET", "/approvals", False),
        ("POST", "/approvals/{approval_id}/allow", False),
        ("POST", "/approvals/{approval_id}/deny", False),
    }


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_channels_and_the_broker_meet_only_at_the_interface() -> None:
    root = REPO / "approvals"
    channels = ("terminal", "slack", "webhook")
    for channel in channels:
        imported = _imports(root / f"{channel}.py")
        assert not any(re.search(r"(^|\.)(broker|ledger|assembly)\b", name) for name in imported), (channel, imported)
    broker_imports = _imports(root / "broker.py") | _imports(root / "ledger.py") | _imports(root / "control.py")
    assert not any(re.search(rf"(^|\.)({'|'.join(channels)}|assembly)\b", name) for name in broker_imports)
    for path in root.glob("*.py"):
        above = {"proxy", "control", "cli", "sandbox", "agent"}
        assert not any(name.split(".")[0] in above for name in _imports(path)), path


# -- every waiting client gave up (issue 13) -------------------------------------------------


async def test_the_last_waiter_leaving_keeps_the_approval_open_and_tells_every_channel_once() -> None:
    one, two = RecordingChannel("one"), RecordingChannel("two")
    audit = MemoryAuditSink()
    late: list[ApprovalOutcome] = []
    broker = await make_broker(one, two, audit=audit)
    first = asyncio.create_task(broker.ask(request(late=late.append)))
    second = asyncio.create_task(broker.ask(request(late=late.append)))
    await wait_until(lambda: one.delivered and two.delivered)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert not one.abandonments and not events(audit, "approval.abandoned")  # one client still waits
    assert [p.abandoned for p in broker.pending()] == [False]
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    await wait_until(lambda: one.abandonments and two.abandonments)
    approval_id = one.delivered[0].id
    assert one.abandonments == two.abandonments == [approval_id]
    [pending] = broker.pending()
    assert pending.id == approval_id and pending.abandoned  # still answerable
    [record] = events(audit, "approval.abandoned")
    assert record["id"] == approval_id and record["run"] == "r-1"
    assert (record["host"], record["port"]) == ("evil.example", 443) and record["waited_s"] >= 0
    assert not events(audit, "approval.decided")
    # The answer after abandonment is recorded as any answer and handed to the askers that left.
    assert one.answer(Choice.ALLOW, by="alice").result is AnswerResult.ACCEPTED
    [decided] = events(audit, "approval.decided")
    assert decided["decision"] == "allow" and decided["by"] == "alice" and decided["channel"] == "one"
    assert late and {o.answer for o in late} == {Answer.ALLOW} and late[0].approval_id == approval_id
    assert late[0].by == "alice" and late[0].channel == "one"
    await wait_until(lambda: one.settled and two.settled)  # the channels are told it is settled as usual
    assert one.abandonments == [approval_id]  # told once
    await broker.close()


async def test_a_new_waiter_joins_an_abandoned_approval_without_a_second_message() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink()
    broker = await make_broker(channel, audit=audit)
    gone = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    await wait_until(lambda: channel.abandonments)
    back = asyncio.create_task(broker.ask(request()))
    await asyncio.sleep(0.05)
    assert not back.done() and len(channel.delivered) == 1 and channel.attempts == 1
    assert len(events(audit, "approval.requested")) == 1
    assert [p.abandoned for p in broker.pending()] == [False]  # somebody waits again
    channel.answer(Choice.DENY)
    outcome = await asyncio.wait_for(back, 1)
    assert outcome.answer is Answer.DENY and outcome.approval_id == channel.delivered[0].id
    assert channel.abandonments == [channel.delivered[0].id]
    await broker.close()


async def test_an_abandoned_approval_that_expires_is_a_timeout_and_the_askers_hear_it() -> None:
    channel = RecordingChannel()
    audit = MemoryAuditSink()
    late: list[ApprovalOutcome] = []
    broker = await make_broker(channel, audit=audit, timeout_s=0.3)
    gone = asyncio.create_task(broker.ask(request(late=late.append)))
    await wait_until(lambda: channel.delivered)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    await wait_until(lambda: late, timeout_s=3)
    assert [o.answer for o in late] == [Answer.TIMEOUT]
    [decided] = events(audit, "approval.decided")
    assert decided["reason"] == "approval_timeout" and decided["by"] is None
    assert broker.pending() == []
    await broker.close()


async def test_a_late_answer_is_not_handed_on_while_a_client_still_waits() -> None:
    channel = RecordingChannel()
    late: list[ApprovalOutcome] = []
    broker = await make_broker(channel)
    gone = asyncio.create_task(broker.ask(request(late=late.append)))
    staying = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    channel.answer(Choice.ALLOW)
    assert (await asyncio.wait_for(staying, 1)).allowed
    assert late == [] and channel.abandonments == []  # the waiter that stayed carries the answer
    await broker.close()


async def test_a_channel_that_cannot_show_the_abandonment_changes_nothing() -> None:
    class Broken(RecordingChannel):
        async def abandoned(self, approval: PendingApproval) -> None:
            raise ChannelError("down")

    channel = Broken()
    broker = await make_broker(channel)
    gone = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: channel.delivered)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert [p.abandoned for p in broker.pending()] == [True]
    assert channel.answer(Choice.ALLOW).result is AnswerResult.ACCEPTED
    await broker.close()


async def test_a_waiter_leaving_in_the_instant_its_answer_came_still_hands_the_answer_on() -> None:
    channel = RecordingChannel()
    late: list[ApprovalOutcome] = []
    broker = await make_broker(channel)
    waiting = asyncio.create_task(broker.ask(request(late=late.append)))
    await wait_until(lambda: channel.delivered)
    channel.answer(Choice.ALLOW)  # settled; the waiter has not woken yet ...
    waiting.cancel()  # ... when its client goes
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled()
    assert [o.answer for o in late] == [Answer.ALLOW]
    await broker.close()


async def test_settlement_callbacks_run_before_any_waiting_request_wakes() -> None:
    """``serve --workers``' owner applies a new domain's answer to its run here: a question on its way from a
    worker must find it applied, not open a second approval nobody answers (seen once in CI under load)."""
    channel = RecordingChannel()
    broker = await make_broker(channel)
    held = asyncio.create_task(broker.ask(request()))
    told: list[tuple[str, bool]] = []
    broker.settled.append(lambda approval, settlement: told.append((settlement.answer.value, held.done())))
    broker.settled.append(lambda approval, settlement: 1 / 0)  # a broken callback changes nothing for the others
    await wait_until(lambda: channel.delivered)
    assert channel.answer(Choice.ALLOW, by="alice").result is AnswerResult.ACCEPTED
    assert told == [("allow", False)]  # at once, inside the answer, while the request still waits
    assert (await asyncio.wait_for(held, 1)).allowed
    await broker.close()
