"""Approvals end to end: held requests through the real proxy, answered from every channel.

In-process: an egressd (``EgressService``) whose approver is built from
settings (Slack against ``FakeSlack``, the webhook against
``WebhookReceiver``) or is a broker over a recording channel; clients send
real CONNECTs to the echo origin. Out of process: ``egressd serve
--approver terminal`` with a pseudo-terminal as its controlling terminal,
curl through it, answered by typing and by ``egressd allow|deny ID``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import Choice
from egressd.approvals.slack import INTERACTIVITY_PATH
from egressd.approvals.webhook import CALLBACK_PATH
from egressd.audit.log import MemoryAuditSink
from egressd.cli.wiring.service import EgressService, StartupError
from egressd.config.settings import load_settings
from tests.conftest import HttpOrigin, Listener, MakeEgressd
from tests.fakes.dns import FakeDns
from tests.fakes.slack import SIGNING_SECRET, FakeSlack, block_actions, interaction_request
from tests.fakes.terminal import Pty
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import (
    ORIGIN_RANGE,
    aserve_ports,
    connect_via,
    egress,
    have,
    listening_socket,
    refused_port,
    require,
    serve_ports,
    wait_until,
)
from tests.integration.approvals.test_broker import RecordingChannel

EGRESSD = str(Path(sys.executable).with_name("egressd"))
TOKEN = "test-token"
ALICE = "U0ALICE"


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
async def egressd(tmp_path: Path, dns: FakeDns) -> AsyncIterator[Callable[..., Any]]:
    """``await egressd(approver=["slack"], ...)``: an egressd whose approver comes from the settings."""
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
async def fake_slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as slack:
        yield slack


def slack_settings(slack: FakeSlack, **more: Any) -> dict[str, Any]:
    return {
        "approver": ["slack"],
        "slack_bot_token": slack.bot_token,
        "slack_app_token": slack.app_token,
        "slack_api_url": slack.api_url,
        "slack_channel": "C0APPROVE",
        "slack_approvers": [ALICE],
        **more,
    }


def records(service: EgressService, event: str) -> list[dict[str, Any]]:
    return [r for r in service.audit_records if r["event"] == event]  # type: ignore[attr-defined]


async def echo_through(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes = b"ping") -> bytes:
    writer.write(data)
    await writer.drain()
    echoed = await asyncio.wait_for(reader.readexactly(len(data)), 5)
    writer.close()
    return echoed


async def control(
    service: EgressService,
    method: str,
    path: str,
    *,
    token: str | None = TOKEN,
    body: Any = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.request(method, service.control_address + path, json=body, data=data, headers=sent) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except json.JSONDecodeError:
                return resp.status, None


@contextlib.asynccontextmanager
async def relay(sock: socket.socket) -> AsyncIterator[list[str]]:
    """Relay every connection to ``sock`` (listening already) to the ``http://host:port`` appended to the list."""
    target: list[str] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = target[0].removeprefix("http://").rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(forward, sock=sock)
    try:
        yield target
    finally:
        server.close()
        await server.wait_closed()


# -- through the real proxy, in process ----------------------------------------------------------


async def test_allow_after_a_delay_lets_the_held_tunnel_through(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel("terminal")
    broker = ApprovalBroker([channel], audit=sink)
    await broker.start()
    svc = await make_egressd(approver=broker, audit=sink)
    svc.default_run.command = "curl origin.test"  # type: ignore[union-attr]
    held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
    await wait_until(lambda: channel.delivered)
    await asyncio.sleep(0.3)
    assert not held.done() and echo_origin.connections == 0  # held, and nothing dialled yet
    message = channel.delivered[0].message.text
    assert f"Domain: origin.test:{echo_origin.port}" in message and "Command: curl origin.test" in message
    channel.answer(Choice.ALLOW, by="alice")
    status, headers, _, reader, writer = await held
    assert status == 200
    assert await echo_through(reader, writer) == b"ping"
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    approval_id = channel.delivered[0].id
    assert record["decision"] == "allow" and record["rule"] == "approved"
    assert record["approval"]["id"] == approval_id and record["approval"]["channel"] == "terminal"
    assert record["approval"]["by"] == "alice" and record["approval"]["waited_s"] >= 0.3
    [requested] = records(svc, "approval.requested")
    [decided] = records(svc, "approval.decided")
    assert requested["id"] == decided["id"] == approval_id and requested["command"] == "curl origin.test"
    assert decided["decision"] == "allow" and decided["by"] == "alice"
    # Allowed for the rest of the run: the next request is not asked again.
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200 and len(channel.delivered) == 1
    writer.close()
    await broker.close()


async def test_twenty_concurrent_requests_for_a_new_domain_get_one_slack_message_and_all_proceed(
    egressd: Callable[..., Any], fake_slack: FakeSlack, echo_origin: Listener
) -> None:
    svc = await egressd(**slack_settings(fake_slack))
    held = [asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}")) for _ in range(20)]
    await wait_until(lambda: fake_slack.posted)
    await wait_until(lambda: svc.path.recorder.metrics.held_requests == 20)  # type: ignore[union-attr]
    assert len(fake_slack.posted) == 1
    await fake_slack.click(fake_slack.posted[0], "allow", user=ALICE, username="alice")
    results = await asyncio.gather(*held)
    assert [r[0] for r in results] == [200] * 20
    echoed = await asyncio.gather(*(echo_through(r[3], r[4], f"n{i}".encode()) for i, r in enumerate(results)))
    assert echoed == [f"n{i}".encode() for i in range(20)]
    await wait_until(lambda: len(egress(svc)) == 20)
    assert {r["approval"]["id"] for r in egress(svc)} == {records(svc, "approval.decided")[0]["id"]}
    assert len(records(svc, "approval.requested")) == 1 and len(fake_slack.posted) == 1
    await wait_until(lambda: fake_slack.called("chat.update"))
    assert "Allowed* by <@U0ALICE>" in json.dumps(fake_slack.called("chat.update")[0]["blocks"])


async def test_a_denial_sticks_as_denied_earlier_without_a_second_message(
    egressd: Callable[..., Any], echo_origin: Listener
) -> None:
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="now", decision="deny") as receiver:
        svc = await egressd(approver=["webhook"], webhook_url=receiver.url, webhook_secret=secret)
        status, headers, body, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 403 and headers["x-egress-reason"] == "denied"
        assert b"denied by approver" in body or b"denied" in body
        status, headers, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 403 and headers["x-egress-reason"] == "denied_earlier"
        assert len(receiver.requests) == 1 and echo_origin.connections == 0
        await wait_until(lambda: len(egress(svc)) == 2)
        first, second = egress(svc)
        assert first["approval"]["channel"] == "webhook" and first["approval"]["by"] == "hook-bot"
        assert second["reason"] == "denied_earlier" and second["approval"] is None
        [decided] = records(svc, "approval.decided")
        assert decided["decision"] == "deny" and decided["reason"] == "denied" and decided["channel"] == "webhook"


async def test_a_timeout_refuses_the_request_and_does_not_stick(
    make_egressd: MakeEgressd, echo_origin: Listener
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink, timeout_s=0.3)
    await broker.start()
    svc = await make_egressd(approver=broker, audit=sink)
    status, headers, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "approval_timeout"
    held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
    await wait_until(lambda: len(channel.delivered) == 2)  # asked again
    channel.answer(Choice.ALLOW)
    status, _, _, _, writer = await held
    writer.close()
    assert status == 200
    decided = records(svc, "approval.decided")
    assert [d["reason"] for d in decided] == ["approval_timeout", None]
    assert egress(svc)[0]["approval"]["channel"] is None
    await broker.close()


async def test_no_approver_attached_refuses_at_once(egressd: Callable[..., Any], tmp_path: Path) -> None:
    svc = await egressd()
    status, headers, _, _, writer = await connect_via(svc, "origin.test:443")
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "no_approver"
    # A terminal channel with no terminal is simply not attached: the same.
    svc = await egressd(approver=["terminal"], listen="127.0.0.1:0")
    if svc.path.approver.attached:  # type: ignore[union-attr]
        pytest.skip("this test process has a controlling terminal")
    status, headers, _, _, writer = await connect_via(svc, "origin.test:443")
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "no_approver"
    assert not records(svc, "approval.requested")


async def test_an_unauthorised_slack_user_is_refused_and_the_request_stays_held(
    egressd: Callable[..., Any], fake_slack: FakeSlack, echo_origin: Listener
) -> None:
    svc = await egressd(**slack_settings(fake_slack))
    held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
    await wait_until(lambda: fake_slack.posted)
    await fake_slack.click(fake_slack.posted[0], "allow", user="U0MALLORY")
    await wait_until(lambda: fake_slack.called("chat.postEphemeral"))
    assert fake_slack.called("chat.postEphemeral")[0]["user"] == "U0MALLORY"
    await asyncio.sleep(0.1)
    assert not held.done()
    await fake_slack.click(fake_slack.posted[0], "allow", user=ALICE, username="alice")
    status, _, _, reader, writer = await held
    assert status == 200 and await echo_through(reader, writer) == b"ping"
    [decided] = records(svc, "approval.decided")
    assert decided["by"] == "@alice (U0ALICE)" and decided["channel"] == "slack"


async def test_forged_and_replayed_answers_are_refused_by_the_control_server(
    egressd: Callable[..., Any], fake_slack: FakeSlack, echo_origin: Listener
) -> None:
    secret, key = make_secret()
    callback_secret, callback_key = make_secret()
    # --public-url names a front door held from the start (a reverse proxy's, as in a real deployment),
    # relayed to the control server once that has bound the port the kernel gave it.
    front = listening_socket()
    control_port = front.getsockname()[1]
    async with WebhookReceiver(key, callback_key=callback_key, mode="later") as receiver, relay(front) as to:
        svc = await egressd(
            **slack_settings(
                fake_slack, slack_app_token=None, slack_signing_secret=SIGNING_SECRET, approver=["slack", "webhook"]
            ),
            webhook_url=receiver.url,
            webhook_secret=secret,
            webhook_callback_secret=callback_secret,
            public_url=f"http://127.0.0.1:{control_port}",
        )
        to.append(svc.control_address)
        held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
        await wait_until(lambda: receiver.requests and fake_slack.posted)
        approval_id = receiver.requests[0].payload["id"]
        assert receiver.requests[0].payload["callback_url"] == f"http://127.0.0.1:{control_port}{CALLBACK_PATH}"
        # Slack: a forged click on the public interactivity endpoint (no bearer token needed, none used).
        forged, forged_headers = interaction_request(
            block_actions(fake_slack.posted[0], "allow", user=ALICE), secret="forged"
        )
        assert (await control(svc, "POST", INTERACTIVITY_PATH, token=None, data=forged, headers=forged_headers))[
            0
        ] == 401
        # Webhook: forged, then a good answer, then its replay.
        assert (await receiver.callback(approval_id, "allow", key=key))[0] == 401
        status, _, sent = await receiver.callback(approval_id, "deny", by="bob")
        assert status == 200
        replayed = json.dumps({"id": approval_id, "decision": "deny", "by": "bob"}).encode()
        assert (await receiver.send(receiver.requests[0].payload["callback_url"], replayed, sent))[0] == 409
        status, headers, _, _, writer = await held
        writer.close()
        assert status == 403 and headers["x-egress-reason"] == "denied"
        [decided] = records(svc, "approval.decided")
        assert decided["channel"] == "webhook" and decided["by"] == "bob"
        await wait_until(lambda: fake_slack.called("chat.update"))  # the Slack message says who decided
        assert "`bob` (via webhook)" in json.dumps(fake_slack.called("chat.update")[0]["blocks"])
        # The bearer-token routes stay closed to anyone without the token.
        assert (await control(svc, "GET", "/approvals", token=None))[0] == 401
        assert (await control(svc, "POST", f"/approvals/{approval_id}/allow", token="wrong"))[0] == 401


async def test_a_channel_that_is_down_while_another_answers(
    egressd: Callable[..., Any], fake_slack: FakeSlack, echo_origin: Listener
) -> None:
    secret, key = make_secret()
    async with WebhookReceiver(key, mode="now", decision="allow") as receiver:
        svc = await egressd(
            **slack_settings(fake_slack, approver=["slack", "webhook"]), webhook_url=receiver.url, webhook_secret=secret
        )
        fake_slack.down = True
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        assert status == 200 and await echo_through(reader, writer) == b"ping"
        [decided] = records(svc, "approval.decided")
        assert decided["channel"] == "webhook"


async def test_too_many_pending_in_a_run(make_egressd: MakeEgressd, echo_origin: Listener) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink, max_pending_per_run=2)
    await broker.start()
    svc = await make_egressd(approver=broker, audit=sink, allow=["127.0.0.9"])
    held = [asyncio.create_task(connect_via(svc, f"{host}:443")) for host in ("one.test", "two.test")]
    await wait_until(lambda: len(channel.delivered) == 2)
    status, headers, _, _, writer = await connect_via(svc, "three.test:443")
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "too_many_pending"
    for index in range(2):
        channel.answer(Choice.DENY, index=index)
    for task in held:
        writer = (await task)[4]
        writer.close()
    refused = [r for r in egress(svc) if r["reason"] == "too_many_pending"]
    assert len(refused) == 1 and refused[0]["host"] == "three.test"
    assert len(records(svc, "approval.requested")) == 2
    await broker.close()


async def test_pending_allow_and_deny_through_the_control_api(make_egressd: MakeEgressd, echo_origin: Listener) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink)
    await broker.start()
    svc = await make_egressd(approver=broker, audit=sink)
    held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
    await wait_until(lambda: channel.delivered)
    status, listed = await control(svc, "GET", "/approvals")
    assert status == 200
    [pending] = listed["approvals"]
    assert pending["host"] == "origin.test" and pending["run"] == "default" and pending["id"] == channel.delivered[0].id
    assert pending["message"].startswith("A command in the sandbox") and pending["expires_at"].endswith("Z")
    assert (await control(svc, "POST", "/approvals/a-nope/allow"))[0] == 404
    assert (await control(svc, "POST", f"/approvals/{pending['id']}/allow", body=["x"]))[0] == 400
    status, answer = await control(svc, "POST", f"/approvals/{pending['id']}/allow", body={"by": "carol"})
    assert (status, answer) == (
        200,
        {"id": pending["id"], "decision": "allow", "by": "carol", "scope": "run", "entry": None, "scope_error": None},
    )
    status, answer = await control(svc, "POST", f"/approvals/{pending['id']}/deny")
    assert status == 409 and "already settled: allowed by carol via control" in answer["error"]
    status, _, _, _, writer = await held
    writer.close()
    assert status == 200
    assert (await control(svc, "GET", "/approvals"))[1] == {"approvals": []}
    await broker.close()


# -- out of process: the console script -------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_") and "proxy" not in k.lower()}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["TERM"] = "xterm"
    return env


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EGRESSD, *args], env=env, capture_output=True, text=True, timeout=30)


def _curl(port: int, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "30", "-x", f"http://127.0.0.1:{port}", url],
        capture_output=True,
        text=True,
        timeout=40,
    )


async def _wait_serving(proc: asyncio.subprocess.Process, pty: Pty) -> dict[str, int]:
    """The ports egressd reports on its terminal once it serves (it bound port 0: none picked here)."""
    deadline = time.monotonic() + 15
    while (ports := serve_ports(pty.output.replace("\r\n", "\n"))) is None:
        if proc.returncode is not None:
            raise AssertionError(f"egressd exited: {pty.output}")
        if time.monotonic() > deadline:
            raise AssertionError(f"egressd did not start: {pty.output}")
        await asyncio.sleep(0.05)
    return ports


async def test_serve_with_a_terminal_approver_is_answered_by_typing_and_by_egressd_allow_deny(
    tmp_path: Path, dns: FakeDns, http_origin: HttpOrigin
) -> None:
    require(have("curl"), "curl is not installed")
    require(have("setsid"), "setsid (util-linux) is not installed")
    pty = Pty()
    audit_path = tmp_path / "audit.jsonl"
    env = _env(tmp_path)
    # setsid -c: a new session whose controlling terminal is the pty on stdin, as in a real shell.
    proc = await asyncio.create_subprocess_exec(
        *[
            "setsid",
            "-c",
            EGRESSD,
            "serve",
            "--approver",
            "terminal",
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--control-token",
            TOKEN,
            "--upstream-dns",
            f"127.0.0.1:{dns.address[1]}",
            "--audit-log",
            str(audit_path),
            "--allow-private",
            ORIGIN_RANGE,
        ],
        stdin=pty.slave,
        stdout=pty.slave,
        stderr=pty.slave,
        env=env,
    )
    try:
        ports = await _wait_serving(proc, pty)
        port = ports["proxy"]
        control_args = ("--control", f"127.0.0.1:{ports['control']}", "--control-token", TOKEN)
        # 1. answered by typing at the prompt
        curl = asyncio.create_task(asyncio.to_thread(_curl, port, f"http://origin.test:{http_origin.port}/typed"))
        await pty.shows(f"allow or deny origin.test:{http_origin.port}?", timeout_s=15)
        assert "Domain: origin.test" in pty.output
        pty.type("allow\r")
        result = await curl
        assert result.returncode == 0 and "hello from origin: GET /typed" in result.stdout, (
            result.stdout + result.stderr
        )
        await pty.shows("allowed for this run")

        # 2. answered from another process: egressd pending, then egressd deny ID
        # (a name on a registered domain of its own: the denial covers it for the run)
        curl = asyncio.create_task(asyncio.to_thread(_curl, port, f"http://leak.test:{http_origin.port}/denied"))
        await pty.shows(f"allow or deny leak.test:{http_origin.port}?", timeout_s=15)
        listed = await asyncio.to_thread(_run, "pending", "--json", *control_args, env=env)
        assert listed.returncode == 0, listed.stderr
        [pending] = json.loads(listed.stdout)
        assert pending["host"] == "leak.test"
        table = await asyncio.to_thread(_run, "pending", *control_args, env=env)
        assert pending["id"] in table.stdout and "leak.test" in table.stdout
        denied = await asyncio.to_thread(_run, "deny", pending["id"], "--by", "dave", *control_args, env=env)
        assert denied.returncode == 0 and f"{pending['id']}: denied by dave" in denied.stdout, denied.stderr
        result = await curl
        assert "403" in result.stdout.splitlines()[0] and "X-Egress-Reason: denied" in result.stdout
        await pty.shows("denied by dave via control")  # the prompt was withdrawn
        again = await asyncio.to_thread(_run, "allow", pending["id"], *control_args, env=env)
        assert again.returncode == 1 and "already settled" in again.stderr

        # 3. egressd allow ID, from another process
        curl = asyncio.create_task(
            asyncio.to_thread(_curl, port, f"http://sub.example.test:{http_origin.port}/allowed")
        )
        await pty.shows(f"allow or deny sub.example.test:{http_origin.port}?", timeout_s=15)
        [pending] = json.loads((await asyncio.to_thread(_run, "pending", "--json", *control_args, env=env)).stdout)
        allowed = await asyncio.to_thread(_run, "allow", pending["id"], *control_args, env=env)
        assert allowed.returncode == 0 and "allowed (this run only)" in allowed.stdout
        result = await curl
        assert "hello from origin: GET /allowed" in result.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
        pty.close()
    assert proc.returncode == 0
    logged = [json.loads(line) for line in audit_path.read_text().splitlines()]
    decided = [r for r in logged if r["event"] == "approval.decided"]
    assert [(d["decision"], d["channel"]) for d in decided] == [
        ("allow", "terminal"),
        ("deny", "control"),
        ("allow", "control"),
    ]
    assert len([r for r in logged if r["event"] == "approval.requested"]) == 3
    assert [r["approval"]["channel"] for r in logged if r["event"] == "egress"] == ["terminal", "control", "control"]


async def test_serve_without_a_terminal_has_no_terminal_approver(tmp_path: Path, dns: FakeDns) -> None:
    require(have("curl"), "curl is not installed")
    early: list[str] = []  # stderr read while waiting for the ports
    proc = await asyncio.create_subprocess_exec(
        *[
            EGRESSD,
            "serve",
            "--approver",
            "terminal",
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--control-token",
            TOKEN,
            "--upstream-dns",
            f"127.0.0.1:{dns.address[1]}",
            "--audit-log",
            str(tmp_path / "audit.jsonl"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(tmp_path),
        start_new_session=True,  # no controlling terminal
    )
    try:
        assert proc.stderr is not None
        port = (await aserve_ports(proc.stderr, read=early))["proxy"]
        result = await asyncio.to_thread(_curl, port, "http://origin.test/")
        assert "X-Egress-Reason: no_approver" in result.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert "approval channel terminal not attached: no controlling terminal" in "".join(early) + stderr.decode()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--approver", "webhook", "--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret", "hunter2"],
            "bad setting webhook_secret: must start with whsec_",
        ),
        (["--approver", "webhook", "--webhook-url", "not a url"], "bad setting webhook_url"),
        (
            [
                "--approver",
                "slack",
                "--slack-bot-token",
                "xoxb-1",
                "--slack-channel",
                "C1",
                "--slack-approvers",
                "U1X",
                "--slack-app-token",
                "xapp-1",
                "--slack-api-url",
                "http://127.0.0.1:9/api/",
            ],
            "bad setting slack_api_url",
        ),
        (["--approver", "deny", "--approver", "slack"], "bad setting approver"),
    ],
)
def test_a_channel_that_cannot_work_stops_serve_with_one_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run(
        [
            EGRESSD,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--control-token",
            TOKEN,
            "--audit-log",
            str(tmp_path / "a.jsonl"),
            *args,
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


async def test_a_slack_token_that_auth_test_rejects_stops_start_up(
    egressd: Callable[..., Any], fake_slack: FakeSlack
) -> None:
    with pytest.raises(StartupError, match=r"bad setting slack_bot_token: Slack refused it \(invalid_auth\)"):
        await egressd(**slack_settings(fake_slack, slack_bot_token="xoxb-revoked"))


def test_pending_without_a_running_egressd_says_so(tmp_path: Path) -> None:
    with refused_port() as port:
        result = _run("pending", "--control", f"127.0.0.1:{port}", env=_env(tmp_path))
        assert result.returncode == 2 and "no control token" in result.stderr
        result = _run("allow", "a-x", "--control", f"127.0.0.1:{port}", "--control-token", "t", env=_env(tmp_path))
    assert result.returncode == 2 and "cannot reach egressd's control API" in result.stderr


async def test_pending_and_allow_find_a_unix_control_socket_and_its_token_file(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    sink = MemoryAuditSink()
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink)
    await broker.start()
    socket_path = tmp_path / "ctl.sock"
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "control": f"unix:{socket_path}",
            "upstream_dns": f"{dns.address[0]}:{dns.address[1]}",
            "allow_private": [ORIGIN_RANGE],
            "audit_log": str(tmp_path / "audit.jsonl"),
        }
    )
    async with EgressService(settings, approver=broker, audit=sink) as svc:
        assert Path(f"{socket_path}.token").exists()  # noqa: ASYNC240 - test check
        env = _env(tmp_path)
        listed = await asyncio.to_thread(_run, "pending", "--control", f"unix:{socket_path}", env=env)
        assert listed.returncode == 0 and "nothing is waiting" in listed.stdout, listed.stderr
        held = asyncio.create_task(connect_via(svc, f"origin.test:{echo_origin.port}"))
        await wait_until(lambda: channel.delivered)
        approval_id = channel.delivered[0].id
        allowed = await asyncio.to_thread(_run, "allow", approval_id, "--control", f"unix:{socket_path}", env=env)
        assert allowed.returncode == 0, allowed.stderr
        status, _, _, reader, writer = await held
        assert status == 200 and await echo_through(reader, writer) == b"ping"
    await broker.close()


async def test_egressd_allow_and_deny_find_the_approval_by_a_prefix_and_say_who_settled_it(
    tmp_path: Path, dns: FakeDns, http_origin: HttpOrigin
) -> None:
    """Issue 29, with no --control (the registry finds the egressd): an unambiguous prefix of the id is
    enough, and an approval settled already says how and by whom, as with --control."""
    require(have("curl"), "curl is not installed")
    require(have("setsid"), "setsid (util-linux) is not installed")
    pty = Pty()
    env = _env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        "setsid", "-c", EGRESSD, "serve", "--approver", "terminal", "--listen", "127.0.0.1:0",
        "--control", "127.0.0.1:0", "--upstream-dns", f"127.0.0.1:{dns.address[1]}",
        "--audit-log", str(tmp_path / "audit.jsonl"), "--allow-private", ORIGIN_RANGE,
        stdin=pty.slave, stdout=pty.slave, stderr=pty.slave, env=env,
    )  # fmt: skip
    try:
        port = (await _wait_serving(proc, pty))["proxy"]
        curl = asyncio.create_task(asyncio.to_thread(_curl, port, f"http://origin.test:{http_origin.port}/p"))
        await pty.shows(f"allow or deny origin.test:{http_origin.port}?", timeout_s=15)
        listed = await asyncio.to_thread(_run, "pending", "--json", env=env)
        [pending] = json.loads(listed.stdout)
        denied = await asyncio.to_thread(_run, "deny", pending["id"][:8], "--by", "erin", env=env)
        assert denied.returncode == 0 and f"{pending['id']}: denied by erin" in denied.stdout, denied.stderr
        result = await curl
        assert "X-Egress-Reason: denied" in result.stdout
        again = await asyncio.to_thread(_run, "allow", pending["id"], env=env)
        assert again.returncode == 1 and "already settled" in again.stderr and "erin" in again.stderr, again.stderr
        unknown = await asyncio.to_thread(_run, "allow", "a-nothing-like-it", env=env)
        assert unknown.returncode == 1 and "holds approval a-nothing-like-it" in unknown.stderr, unknown.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
        pty.close()
