"""Approval scopes end to end: once, run, always, through the real proxy and every way to answer.

An in-process egressd whose approver comes from its settings (the webhook
channel against a ``WebhookReceiver`` on loopback, ``--allow-file`` in a
temporary directory); clients send real CONNECTs to the echo origin; the
answers come through the control API, ``egressd allow --scope`` (a real
subprocess) and the webhook's own answers. Then the broker's fallbacks (an
entry it cannot keep, a file it cannot append to) and hostile answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import ApprovalRequest, ApprovalScope, Choice
from egressd.approvals.webhook import WebhookChannel, parse_answer
from egressd.audit.log import MemoryAuditSink
from egressd.cli.wiring.service import EgressService
from egressd.config.allowfile import read_allow_file
from egressd.config.settings import load_settings
from egressd.vocabulary.reasons import Answer
from tests.conftest import Listener, MakeEgressd
from tests.fakes.control import control_server
from tests.fakes.dns import FakeDns
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import ORIGIN_RANGE, connect_via, egress, listening_socket, open_proxy, read_response, wait_until
from tests.integration.approvals.test_approvals_e2e import control, echo_through, records
from tests.integration.approvals.test_broker import RecordingChannel
from tests.integration.proxy.test_abandoned import give_up, recording_egressd

EGRESSD = str(Path(sys.executable).with_name("egressd"))
TOKEN = "test-token"


@pytest.fixture
async def egressd(tmp_path: Path, dns: FakeDns) -> AsyncIterator[Callable[..., Any]]:
    """``await egressd(**settings)``: an egressd answered through a webhook receiver that answers later."""
    started: list[EgressService] = []

    async def make(**values: Any) -> EgressService:
        values.setdefault("listen", "127.0.0.1:0")
        values.setdefault("control", "127.0.0.1:0")
        values.setdefault("control_token", TOKEN)
        values.setdefault("upstream_dns", f"{dns.address[0]}:{dns.address[1]}")
        values.setdefault("allow_private", [ORIGIN_RANGE])
        values.setdefault("audit_log", str(tmp_path / "audit.jsonl"))
        values.setdefault("log_level", "warning")
        sink = MemoryAuditSink()
        service = EgressService(load_settings(values), audit=sink)
        await service.start()
        service.audit_records = sink.records  # type: ignore[attr-defined]
        started.append(service)
        return service

    yield make
    for service in started:
        await service.close(grace_s=0)


@pytest.fixture
async def later() -> AsyncIterator[tuple[WebhookReceiver, str]]:
    """A webhook receiver that takes each approval and answers nothing itself; and its secret."""
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="later") as receiver:
        yield receiver, secret


def webhook(receiver: WebhookReceiver, secret: str, **more: Any) -> dict[str, Any]:
    return {"approver": ["webhook"], "webhook_url": receiver.url, "webhook_secret": secret, **more}


async def asked(receiver: WebhookReceiver, count: int) -> str:
    """The id of the ``count``-th approval the receiver was asked (retries not counted twice)."""
    await wait_until(lambda: len({r.payload["id"] for r in receiver.requests}) >= count)
    ids = list(dict.fromkeys(r.payload["id"] for r in receiver.requests))
    return ids[count - 1]


# -- through the proxy --------------------------------------------------------------------------


async def test_once_lets_the_held_connection_through_and_the_next_connection_asks_again(
    egressd: Callable[..., Any], later: tuple[WebhookReceiver, str], echo_origin: Listener, tmp_path: Path
) -> None:
    receiver, secret = later
    svc = await egressd(**webhook(receiver, secret, allow_file=str(tmp_path / "allow.toml")))
    target = f"origin.test:{echo_origin.port}"
    first = asyncio.create_task(connect_via(svc, target))
    approval_id = await asked(receiver, 1)
    assert receiver.requests[0].payload["scopes"] == ["once", "run", "always"]
    status, answer = await control(svc, "POST", f"/approvals/{approval_id}/allow", body={"scope": "once"})
    assert (status, answer["scope"], answer["entry"]) == (200, "once", None)
    status, _, _, reader, writer = await first
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    # The run did not keep the host: the next connection is held and asked about again.
    second = asyncio.create_task(connect_via(svc, target))
    again = await asked(receiver, 2)
    assert again != approval_id and not second.done()
    assert (await control(svc, "POST", f"/approvals/{again}/deny"))[0] == 200
    status, headers, _, _, writer = await second
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "denied"
    once, denied = records(svc, "approval.decided")
    assert (once["id"], once["decision"], once["scope"], once["entry"]) == (approval_id, "allow", "once", None)
    assert (denied["decision"], denied["scope"]) == ("deny", None)
    assert len(records(svc, "approval.requested")) == 2
    assert [r["decision"] for r in egress(svc)] == ["allow", "deny"]
    assert not (tmp_path / "allow.toml").exists()


async def test_always_appends_the_exact_host_and_port_to_the_allow_file_and_the_run_keeps_it(
    egressd: Callable[..., Any], later: tuple[WebhookReceiver, str], echo_origin: Listener, tmp_path: Path
) -> None:
    receiver, secret = later
    path = tmp_path / "allow.toml"
    path.write_text('# the operator\'s own file\nallow = ["pypi.org"]\n')
    svc = await egressd(**webhook(receiver, secret, allow_file=str(path)))
    target = f"Origin.TEST:{echo_origin.port}"
    held = asyncio.create_task(connect_via(svc, target))
    approval_id = await asked(receiver, 1)
    status, answer = await control(
        svc, "POST", f"/approvals/{approval_id}/allow", body={"by": "carol", "scope": "always"}
    )
    entry = f"origin.test:{echo_origin.port}"
    assert (status, answer["scope"], answer["entry"], answer["scope_error"]) == (200, "always", entry, None)
    status, _, _, reader, writer = await held
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    # On disk: the operator's lines as they were, then one [[approved]] table naming exactly that host and port.
    text = path.read_text()
    assert text.startswith('# the operator\'s own file\nallow = ["pypi.org"]\n')
    data = tomllib.loads(text)
    assert data["allow"] == ["pypi.org"]
    [table] = data["approved"]
    assert table["entry"] == entry and "*" not in table["entry"]
    assert (table["approval"], table["by"], table["channel"], table["run"]) == (
        approval_id,
        "carol",
        "control",
        "default",
    )
    assert table["at"].endswith("Z")
    [decided] = records(svc, "approval.decided")
    assert list(decided)[:10] == [
        "event",
        "id",
        "ts",
        "run",
        "decision",
        "reason",
        "channel",
        "by",
        "waited_s",
        "scope",
    ]
    assert (decided["scope"], decided["entry"], decided["scope_error"]) == ("always", entry, None)
    # The run keeps the host: the next connection is not asked about.
    status, _, _, reader, writer = await connect_via(svc, target)
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    assert len(records(svc, "approval.requested")) == 1
    # A new egressd reading the file allows it from the start.
    assert entry in read_allow_file(path).allowed


async def test_always_through_the_webhook_answer_needs_an_allow_file(
    egressd: Callable[..., Any], echo_origin: Listener, tmp_path: Path
) -> None:
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="now", decision="allow") as receiver:
        receiver.scope = "always"
        # Without --allow-file the answer asks for what is not offered: it decides nothing (then expires).
        svc = await egressd(**webhook(receiver, secret), approval_timeout=1)
        status, headers, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 403 and headers["x-egress-reason"] == "approval_timeout"
        assert receiver.requests[0].payload["scopes"] == ["once", "run"]
        [decided] = records(svc, "approval.decided")
        assert (decided["decision"], decided["reason"], decided["scope"]) == ("deny", "approval_timeout", None)
        assert [r["decision"] for r in egress(svc)] == ["deny"]
        # With one, the same answer keeps the host.
        path = tmp_path / "allow.toml"
        svc = await egressd(**webhook(receiver, secret), allow_file=str(path))
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        assert status == 200 and await echo_through(reader, writer) == b"ping"
        assert [t.entry for t in read_allow_file(path).approved] == [f"origin.test:{echo_origin.port}"]


async def test_egressd_allow_scope_answers_from_another_terminal(
    egressd: Callable[..., Any], later: tuple[WebhookReceiver, str], echo_origin: Listener, tmp_path: Path
) -> None:
    receiver, secret = later
    svc = await egressd(**webhook(receiver, secret))
    env = {**os.environ, "HOME": str(tmp_path), "NO_PROXY": "*"}
    args = ["--control", svc.control_address.removeprefix("http://"), "--control-token", TOKEN]
    # The CONNECT is sent now and its answer read once the CLI has answered: three CLI start-ups
    # can take longer than connect_via's 5 s bound on a busy machine.
    reader, writer = await open_proxy(svc)
    authority = f"origin.test:{echo_origin.port}"
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    await writer.drain()
    approval_id = await asked(receiver, 1)

    def cli(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([EGRESSD, *more], env=env, capture_output=True, text=True, timeout=30)

    refused = await asyncio.to_thread(cli, "allow", approval_id, "--scope", "always", *args)
    assert refused.returncode == 1 and "no allow file" in refused.stderr, refused
    garbage = await asyncio.to_thread(cli, "allow", approval_id, "--scope", "forever", *args)
    assert garbage.returncode == 2 and "invalid choice" in garbage.stderr
    assert not reader.at_eof() and records(svc, "approval.decided") == []  # still held
    done = await asyncio.to_thread(cli, "allow", approval_id, "--scope", "once", "--by", "dave", *args)
    assert done.returncode == 0 and "allowed (this connection only) by dave" in done.stdout, done
    status, _, _ = await read_response(reader)
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    [decided] = records(svc, "approval.decided")
    assert (decided["by"], decided["channel"], decided["scope"]) == ("dave", "control", "once")


# -- the broker's fallbacks -------------------------------------------------------------------


def request(**more: Any) -> ApprovalRequest:
    values: dict[str, Any] = {
        "run_id": "r-1",
        "host": "evil.example",
        "port": 443,
        "command": "curl evil",
        "task": "build",
        "allowed": ("pypi.org",),
        "lasting": "evil.example:443",
    }
    return ApprovalRequest(**(values | more))


async def answered_always(broker: ApprovalBroker, channel: RecordingChannel, req: ApprovalRequest) -> Any:
    waiting = asyncio.create_task(broker.ask(req))
    await wait_until(lambda: channel.delivered)
    result = broker.answer(
        channel.delivered[-1].id, Choice.ALLOW, channel="fake", by="alice", scope=ApprovalScope.ALWAYS
    )
    return result, await asyncio.wait_for(waiting, 5)


async def test_an_entry_the_policy_refuses_is_allowed_for_the_run_only_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    path = tmp_path / "allow.toml"
    broker = ApprovalBroker([channel], audit=sink, allow_file=path)
    await broker.start()
    with caplog.at_level(logging.ERROR, logger="egressd.approvals"):
        _, outcome = await answered_always(broker, channel, request(lasting=None, lasting_error="refused: too broad"))
    assert (outcome.answer, outcome.scope) == (Answer.ALLOW, ApprovalScope.RUN)
    [decided] = [r for r in sink.records if r["event"] == "approval.decided"]
    assert (decided["decision"], decided["scope"], decided["entry"]) == ("allow", "run", None)
    assert "refused: too broad" in decided["scope_error"]
    assert not path.exists()
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "allowed for this run only, not always" in line and "\n" not in line
    await broker.close()


@pytest.mark.parametrize("damage", ["directory", "not toml", "unwritable"])
async def test_an_allow_file_that_cannot_be_appended_to_still_allows_for_the_run(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "allow.toml"
    if damage == "directory":
        path.mkdir()
    elif damage == "not toml":
        path.write_text("allow = [unterminated\n")
    else:
        if os.geteuid() == 0:
            path = tmp_path / "no-such-dir" / "allow.toml"  # root writes anything: a missing directory instead
        else:
            path.write_text("")
            path.chmod(0o400)
    before = path.read_bytes() if path.is_file() else None
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink, allow_file=path)
    await broker.start()
    with caplog.at_level(logging.ERROR, logger="egressd.approvals"):
        _, outcome = await answered_always(broker, channel, request())
    assert (outcome.answer, outcome.scope) == (Answer.ALLOW, ApprovalScope.RUN)
    [decided] = [r for r in sink.records if r["event"] == "approval.decided"]
    assert (decided["decision"], decided["scope"], decided["entry"]) == ("allow", "run", None)
    assert "could not append to the allow file" in decided["scope_error"] and str(path) in decided["scope_error"]
    assert (path.read_bytes() if path.is_file() else None) == before  # nothing half-written
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "not always" in line and "\n" not in line
    await broker.close()


async def test_concurrent_requests_on_one_always_answer_append_one_table(tmp_path: Path) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    path = tmp_path / "allow.toml"
    broker = ApprovalBroker([channel], audit=sink, allow_file=path)
    await broker.start()
    waiting = [asyncio.create_task(broker.ask(request())) for _ in range(5)]
    await wait_until(lambda: channel.delivered)
    broker.answer(channel.delivered[0].id, Choice.ALLOW, channel="fake", by="alice", scope=ApprovalScope.ALWAYS)
    outcomes = await asyncio.gather(*waiting)
    assert {(o.answer, o.scope) for o in outcomes} == {(Answer.ALLOW, ApprovalScope.ALWAYS)}
    assert [t.entry for t in read_allow_file(path).approved] == ["evil.example:443"]
    await broker.close()


# -- hostile answers ----------------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["forever", "ALWAYS", "", 1, ["always"], {"scope": "always"}, True])
def test_a_scope_that_is_not_one_of_the_three_is_no_answer(scope: object) -> None:
    assert parse_answer(json.dumps({"decision": "allow", "scope": scope}).encode()) is None
    # A denial's scope is not looked at: garbage there cannot turn it into anything else.
    assert parse_answer(json.dumps({"decision": "deny", "scope": scope}).encode()) == (
        Choice.DENY, None, ApprovalScope.RUN
    )  # fmt: skip


async def test_hostile_callbacks_asking_for_scopes_decide_nothing(tmp_path: Path) -> None:
    """Signed callbacks: always with no allow file (422), garbage scopes (400); the approval stays open."""
    secret, key = make_secret()
    _, callback_key = make_secret()
    sink = MemoryAuditSink()
    async with WebhookReceiver(key, callback_key=callback_key, mode="later") as receiver:
        sock = listening_socket()
        channel = WebhookChannel(
            url=receiver.url,
            secret=key,
            callback_secret=callback_key,
            public_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
        )
        broker = ApprovalBroker([channel], audit=sink, timeout_s=30)
        await broker.start()
        async with control_server(broker.routes, sock):
            waiting = asyncio.create_task(broker.ask(request()))
            approval_id = await asked(receiver, 1)
            status, body, _ = await receiver.callback(approval_id, "allow", scope="always")
            assert status == 422 and "not offered" in body["error"]
            for garbage in ("forever", "ALWAYS", 7, ["run"]):
                status, _, _ = await receiver.callback(approval_id, "allow", scope=garbage)
                assert status == 400
            await asyncio.sleep(0.05)
            assert not waiting.done() and [a.id for a in broker.pending()] == [approval_id]
            assert [r for r in sink.records if r["event"] == "approval.decided"] == []
            status, body, _ = await receiver.callback(approval_id, "allow", scope="once")
            assert (status, body["scope"]) == (200, "once")
            outcome = await asyncio.wait_for(waiting, 5)
            assert (outcome.answer, outcome.scope) == (Answer.ALLOW, ApprovalScope.ONCE)
            await wait_until(lambda: receiver.settled)
            assert receiver.settled[0].payload["scope"] == "once"
        await broker.close()


# -- an answer after the client gave up ---------------------------------------------------------


async def test_once_given_after_the_client_gave_up_applies_nothing_to_the_run(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    svc, channel, broker = await recording_egressd(make_egressd)
    target = f"origin.test:{echo_origin.port}"
    await give_up(svc, target, lambda: channel.delivered)
    await wait_until(lambda: channel.abandonments)
    first = channel.delivered[0].id
    broker.answer(first, Choice.ALLOW, channel="fake", by="alice", scope=ApprovalScope.ONCE)
    # The connection it covered is gone; the run's next one is asked about again.
    again = asyncio.create_task(connect_via(svc, target))
    await wait_until(lambda: len(channel.delivered) == 2)
    assert channel.delivered[1].id != first
    broker.answer(channel.delivered[1].id, Choice.ALLOW, channel="fake", by="alice", scope=ApprovalScope.RUN)
    status, _, _, reader, writer = await again
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    # That one was for the run: the next is not asked about.
    status, _, _, reader, writer = await connect_via(svc, target)
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    assert len(channel.delivered) == 2
    assert [r["scope"] for r in records(svc, "approval.decided")] == ["once", "run"]
    await broker.close()
