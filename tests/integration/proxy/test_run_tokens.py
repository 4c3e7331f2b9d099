"""Per-run control tokens: a token handed to one run's user acts on that run alone.

The attack: the holder of run A's control token (an ``egressd run --connect``
user, or whatever reads that user's memory) reaches for run B — reads it,
rewrites the command B's approver is shown, ends it, lists or answers its
approvals — or for the whole service (creates runs, lists them, reads the
metrics). Each is refused with 403 and B is left as it was: same command, its
approval still pending. A's token does work on A, dies with A, never reaches
the audit log or egressd's log output; the global token keeps full power; and
``egressd pending|allow`` given A's token see and answer A's approvals only.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.audit.log import JsonlAuditSink
from egressd.cli.wiring.control_client import ControlClient
from egressd.cli.wiring.docker_session import DockerSession
from egressd.cli.wiring.service import EgressService
from egressd.config.settings import load_settings
from tests.conftest import Listener
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE, connect_via, wait_until
from tests.integration.approvals.test_broker import RecordingChannel

EGRESSD = str(Path(sys.executable).with_name("egressd"))
GLOBAL = "test-token"


async def call(svc: Any, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession(trust_env=False) as http:
        async with http.request(method, svc.control_address + path, json=body, headers=headers) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if resp.content_type == "application/json" else text


@dataclass
class Bed:
    svc: Any
    channel: RecordingChannel
    audit_path: Path
    allow_file: Path
    runs: dict[str, dict[str, Any]]  # name -> POST /runs answer
    held: list[asyncio.Task[Any]]

    def approval_of(self, name: str) -> str:
        [approval] = [a for a in self.channel.delivered if a.request.run_id == self.runs[name]["id"]]
        return approval.id


@pytest.fixture
async def bed(dns: FakeDns, echo_origin: Listener, tmp_path: Path) -> AsyncIterator[Bed]:
    """An egressd (audit log in a file) with runs A and B, each with one request held for approval."""
    audit_path = tmp_path / "audit.jsonl"
    sink = JsonlAuditSink(audit_path)
    channel = RecordingChannel()
    broker = ApprovalBroker([channel], audit=sink, allow_file=tmp_path / "allow.toml")
    await broker.start()
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "control": "127.0.0.1:0",
            "control_token": GLOBAL,
            "require_auth": True,
            "upstream_dns": f"{dns.address[0]}:{dns.address[1]}",
            "allow_private": [ORIGIN_RANGE],
            "audit_log": str(audit_path),
            "log_level": "debug",
        }
    )
    svc = EgressService(settings, approver=broker, audit=sink)
    await svc.start()
    runs: dict[str, dict[str, Any]] = {}
    held: list[asyncio.Task[Any]] = []
    for name in ("A", "B"):
        status, created = await call(svc, "POST", "/runs", GLOBAL, {"task": f"task {name}", "allow": []})
        assert status == 201, created
        runs[name] = created
        status, _ = await call(svc, "PUT", f"/runs/{created['id']}/command", GLOBAL, {"command": f"cmd {name}"})
        assert status == 200
        creds = base64.b64encode(f"{created['id']}:{created['token']}".encode()).decode()
        held.append(
            asyncio.ensure_future(
                connect_via(svc, f"origin.test:{echo_origin.port}", f"Proxy-Authorization: Basic {creds}\r\n")
            )
        )
    await wait_until(lambda: len({a.request.run_id for a in channel.delivered}) == 2)
    yield Bed(svc, channel, audit_path, tmp_path / "allow.toml", runs, held)
    await broker.close()  # settles what is still held
    await svc.close(grace_s=0)
    for result in await asyncio.gather(*held, return_exceptions=True):
        if isinstance(result, tuple):
            result[4].close()


def control_token(bed: Bed, name: str) -> str:
    token = bed.runs[name].get("control_token")
    assert isinstance(token, str) and len(token) >= 43, bed.runs[name]  # 256 bits, urlsafe base64
    return token


async def test_post_runs_returns_a_distinct_run_token(bed: Bed) -> None:
    a, b = control_token(bed, "A"), control_token(bed, "B")
    assert len({a, b, GLOBAL, bed.runs["A"]["token"], bed.runs["B"]["token"]}) == 5


async def test_a_run_token_cannot_touch_another_run(bed: Bed) -> None:
    svc, a = bed.svc, control_token(bed, "A")
    b_id = bed.runs["B"]["id"]
    b_approval = bed.approval_of("B")
    attempts = [
        ("GET", f"/runs/{b_id}", None),
        ("PUT", f"/runs/{b_id}/command", {"command": "harmless, allow it"}),
        ("GET", f"/runs/{b_id}/events", None),
        ("DELETE", f"/runs/{b_id}", None),
        ("POST", f"/approvals/{b_approval}/allow", {"by": "mallory"}),
        ("POST", f"/approvals/{b_approval}/deny", {"by": "mallory"}),
        ("POST", "/runs", {"task": "mine", "allow": ["*"]}),
        ("GET", "/runs", None),
        ("GET", "/metrics", None),
        ("GET", "/runs/no-such-run", None),
    ]
    for method, path, body in attempts:
        status, answer = await call(svc, method, path, a, body)
        assert status == 403, (method, path, status, answer)
        assert isinstance(answer, dict) and "run" in answer["error"], (method, path, answer)
    # An approval that is nobody's pending one is unknown, as to the global token.
    assert (await call(svc, "POST", "/approvals/a-nope/allow", a))[0] == 404
    # B is as it was: its command, its run, its approval still waiting.
    run_b = svc.runs.get(b_id)
    assert run_b is not None and run_b.command == "cmd B" and not run_b.ended
    assert b_approval in [p.id for p in bed.svc.path.approver.pending()]
    assert len(svc.runs) == 2
    # A's view of the approvals holds A's alone.
    status, listed = await call(svc, "GET", "/approvals", a)
    assert status == 200 and [p["run"] for p in listed["approvals"]] == [bed.runs["A"]["id"]]


async def test_a_run_token_works_on_its_own_run_and_dies_with_it(bed: Bed) -> None:
    svc, a = bed.svc, control_token(bed, "A")
    a_id = bed.runs["A"]["id"]
    status, described = await call(svc, "GET", f"/runs/{a_id}", a)
    assert status == 200 and described["command"] == "cmd A"
    assert (await call(svc, "PUT", f"/runs/{a_id}/command", a, {"command": "next"}))[0] == 200
    assert svc.runs.get(a_id).command == "next"
    assert (await call(svc, "GET", f"/runs/{a_id}/events?cursor=0", a))[0] == 200
    status, answer = await call(svc, "POST", f"/approvals/{bed.approval_of('A')}/deny", a, {"by": "alice"})
    assert (status, answer["decision"]) == (200, "deny")
    assert (await call(svc, "DELETE", f"/runs/{a_id}", a))[0] == 200
    # Ended: the token is dead, on A and everywhere else.
    for method, path in [("GET", f"/runs/{a_id}"), ("GET", "/approvals"), ("GET", f"/runs/{bed.runs['B']['id']}")]:
        assert (await call(svc, method, path, a))[0] == 401, (method, path)


async def test_ending_a_run_with_the_global_token_revokes_its_token(bed: Bed) -> None:
    a = control_token(bed, "A")
    assert (await call(bed.svc, "DELETE", f"/runs/{bed.runs['A']['id']}", GLOBAL))[0] == 200
    assert (await call(bed.svc, "GET", "/approvals", a))[0] == 401


async def test_the_global_token_keeps_full_power(bed: Bed) -> None:
    svc = bed.svc
    status, listed = await call(svc, "GET", "/approvals", GLOBAL)
    assert status == 200 and len(listed["approvals"]) == 2
    status, runs = await call(svc, "GET", "/runs", GLOBAL)
    assert status == 200 and len(runs["runs"]) == 2
    assert (await call(svc, "GET", "/metrics", GLOBAL))[0] == 200
    b_id = bed.runs["B"]["id"]
    assert (await call(svc, "PUT", f"/runs/{b_id}/command", GLOBAL, {"command": "by the operator"}))[0] == 200
    status, answer = await call(svc, "POST", f"/approvals/{bed.approval_of('B')}/allow", GLOBAL, {"by": "op"})
    assert (status, answer["decision"]) == (200, "allow")
    assert (await call(svc, "DELETE", f"/runs/{b_id}", GLOBAL))[0] == 200


def decided_records(bed: Bed) -> list[dict[str, Any]]:
    lines = bed.audit_path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "approval.decided"]


async def test_a_run_token_cannot_answer_always_nor_pass_for_the_operator(bed: Bed) -> None:
    """*always* outlives the run: only the global token may; ``by`` is free text, ``auth`` says who it was."""
    svc, a = bed.svc, control_token(bed, "A")
    a_approval = bed.approval_of("A")
    status, answer = await call(
        svc, "POST", f"/approvals/{a_approval}/allow", a, {"scope": "always", "by": "alice (operator)"}
    )
    assert status == 403 and "global control token" in answer["error"], (status, answer)
    await asyncio.sleep(0.05)
    assert a_approval in [p.id for p in svc.path.approver.pending()]  # nothing decided
    assert not bed.allow_file.exists() or "[[approved]]" not in bed.allow_file.read_text()
    assert not decided_records(bed)
    # For its own run it may allow; the record names the run's token, whatever ``by`` claims.
    status, answer = await call(svc, "POST", f"/approvals/{a_approval}/allow", a, {"by": "alice (operator)"})
    assert (status, answer["scope"]) == (200, "run"), answer
    [record] = decided_records(bed)
    assert record["by"] == "alice (operator)" and record["auth"] == f"run token of {bed.runs['A']['id']}"
    # The global token may answer *always*; its record says so.
    b_approval = bed.approval_of("B")
    status, answer = await call(svc, "POST", f"/approvals/{b_approval}/allow", GLOBAL, {"scope": "always"})
    assert (status, answer["scope"]) == (200, "always"), answer
    assert decided_records(bed)[-1]["auth"] == "global token"
    assert "[[approved]]" in bed.allow_file.read_text()
    assert 'auth = "global token"' in bed.allow_file.read_text()  # the lasting table names the credential too


async def test_run_tokens_are_never_in_the_audit_log_nor_the_log_output(
    bed: Bed, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tokens = [control_token(bed, "A"), control_token(bed, "B")]
    a_id = bed.runs["A"]["id"]
    await call(bed.svc, "GET", f"/runs/{bed.runs['B']['id']}", tokens[0])  # a refusal, which may be logged
    await call(bed.svc, "POST", f"/approvals/{bed.approval_of('A')}/allow", tokens[0], {"by": "alice"})
    await call(bed.svc, "DELETE", f"/runs/{a_id}", tokens[0])
    await call(bed.svc, "GET", "/approvals", tokens[0])  # a dead token, which may be logged
    text = bed.audit_path.read_text()
    assert '"run.start"' in text and '"run.end"' in text and '"approval.decided"' in text  # the file is the log
    for token in tokens:
        assert token not in text
        assert token not in caplog.text
    assert tokens[0] not in repr(bed.svc.runs.get(bed.runs["B"]["id"]))
    assert tokens[1] not in repr(bed.svc.runs.get(bed.runs["B"]["id"]))


async def egressd_cli(svc: Any, token: str, *args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["EGRESSD_CONTROL_TOKEN"] = token
    control = svc.control_address.removeprefix("http://")
    proc = await asyncio.create_subprocess_exec(
        EGRESSD,
        *args,
        "--control",
        control,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_egressd_pending_and_allow_with_a_run_token_see_and_answer_that_run_only(bed: Bed) -> None:
    a = control_token(bed, "A")
    a_id, b_id = bed.runs["A"]["id"], bed.runs["B"]["id"]
    code, out, err = await egressd_cli(bed.svc, a, "pending")
    assert code == 0, err
    assert bed.approval_of("A") in out and a_id in out
    assert bed.approval_of("B") not in out and b_id not in out
    code, out, err = await egressd_cli(bed.svc, a, "allow", bed.approval_of("B"))
    assert code != 0 and "run" in err
    assert bed.approval_of("B") in [p.id for p in bed.svc.path.approver.pending()]
    code, out, err = await egressd_cli(bed.svc, a, "allow", bed.approval_of("A"))
    assert code == 0 and "allowed" in out, err
    assert [p.id for p in bed.svc.path.approver.pending()] == [bed.approval_of("B")]


async def test_the_docker_session_uses_the_run_token_after_registering(bed: Bed, tmp_path: Path) -> None:
    """``--connect``: the global token creates the run, the run's own token does everything after."""
    settings = load_settings({"control_token": GLOBAL, "audit_log": str(tmp_path / "client-audit.jsonl")})
    session = DockerSession(settings, workdir=None, task="connect task")
    global_client = ControlClient.for_url(bed.svc.control_address, GLOBAL)
    try:
        await session._register_with(global_client, ipaddress.ip_address("127.0.0.77"))
        assert session.control is not None and session.control is not global_client
        assert global_client._http.closed and global_client._token == ""  # the global token is not kept
        run_id = session.run_id
        assert run_id is not None
        run = bed.svc.runs.get(run_id)
        assert session.control._token == run.control_token != GLOBAL
        session.set_command("make test")
        await session.flush_command()
        assert run.command == "make test"
        await session.poll()
    finally:
        await session._stack.aclose()
    assert bed.svc.runs.get(run_id) is None  # ended with its own token
    await global_client.close()
