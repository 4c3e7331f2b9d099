"""A fleet's approvals: three ``egressd serve --state`` on one PostgreSQL, a request held on one answered on another.

Each instance is a real ``egressd serve`` subprocess with no approver of its
own (a sidecar's layout): the fleet is its one channel. The holder decides
every answer, whichever instance it was given on, exactly once; the
answerer is told what became of it (the winner, when another answer came
first), and when the holder cannot take it in time, that nothing was
decided. Who answered, on which channel and instance, is in the holder's
audit log and the approval's row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from egressd.fleet.store import Store
from tests.conftest import Listener
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE, aserve_ports
from tests.postgres import Postgres, running_postgres

EGRESSD = str(Path(sys.executable).with_name("egressd"))
TOKEN = "fleet-test-token"


@dataclass
class Instance:
    proc: asyncio.subprocess.Process
    ports: dict[str, int]
    log: Path
    said: list[str]

    @property
    def id(self) -> str:
        """Its id in the fleet, from its start-up line."""
        for line in "".join(self.said).splitlines():
            if "this egressd listed as " in line:
                return line.rsplit("listed as ", 1)[1].strip()
        raise AssertionError(f"no fleet line: {self.said}")

    def records(self, event: str) -> list[dict[str, object]]:
        lines = self.log.read_bytes().splitlines() if self.log.exists() else []
        return [r for r in map(json.loads, lines) if r["event"] == event]

    async def control(self, method: str, path: str, body: object = None) -> tuple[int, dict[str, object]]:
        url = f"http://127.0.0.1:{self.ports['control']}{path}"
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.request(method, url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                return r.status, await r.json(content_type=None)

    async def pending(self) -> list[dict[str, object]]:
        status, body = await self.control("GET", "/approvals")
        assert status == 200, body
        return body["approvals"]  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def fleet(
    tmp_path: Path, dns: FakeDns, dsn: str, count: int = 3, extra: tuple[str, ...] = ()
) -> AsyncIterator[list[Instance]]:
    async with contextlib.AsyncExitStack() as stack:
        started = await asyncio.gather(*(stack.enter_async_context(_serve(tmp_path / f"i{n}", dns, dsn, extra))
                                         for n in range(count)))  # fmt: skip
        yield list(started)


@contextlib.asynccontextmanager
async def _serve(home: Path, dns: FakeDns, dsn: str, extra: tuple[str, ...] = ()) -> AsyncIterator[Instance]:
    await asyncio.to_thread(home.mkdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env |= {"XDG_STATE_HOME": str(home / "state"), "EGRESSD_CONTROL_TOKEN": TOKEN, "EGRESSD_STATE": dsn}
    log = home / "audit.jsonl"
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--workers", "1", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0",
        "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE, "--audit-log", str(log),
        *extra,
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []
    drain = None
    try:
        ports = await aserve_ports(proc.stderr, read=said)
        drain = asyncio.create_task(_drain(proc.stderr, said))
        yield Instance(proc, ports, log, said)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
        await proc.wait()
        if drain is not None:
            await asyncio.wait_for(drain, 10)


async def _drain(stream: asyncio.StreamReader, said: list[str]) -> None:
    while line := await stream.readline():
        said.append(line.decode(errors="replace"))


async def _connect(port: int, target: str) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    # Held for as long as a person takes (read_response gives a head 5 s): the head, then the rest.
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, reader, writer


@pytest.fixture
async def dsn(postgres: Postgres, database: str) -> str:
    """A fresh database of the session's server, migrated: the fleet's."""
    uri = postgres.dsn(database)
    await _migrated(uri)
    return uri


async def _migrated(dsn: str) -> None:
    store = await Store.open(dsn)
    try:
        await store.migrate()
    finally:
        await store.close()


async def _listed(instance: Instance, holder: Instance | None = None) -> dict[str, object]:
    """The one approval ``instance`` lists (held by ``holder``, when given), once it does."""
    listed: list[dict[str, object]] = []
    for _ in range(150):
        listed = await instance.pending()
        if listed:
            break
        await asyncio.sleep(0.1)
    assert len(listed) == 1, (listed, "".join(holder.said) if holder else "")
    if holder is not None:
        assert listed[0].get("instance") == holder.id, listed
    return listed[0]


async def test_a_request_held_on_one_instance_is_answered_on_another_and_let_through_there(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str, postgres: Postgres, database: str
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with fleet(tmp_path, dns, dsn) as (a, b, c):
        held = asyncio.create_task(_connect(a.ports["proxy"], target))
        approval = await _listed(b, holder=a)
        assert (await _listed(c, holder=a))["id"] == approval["id"]  # every instance lists it
        mine = await _listed(a)
        assert set(approval) == set(mine) | {"instance"}, (approval, mine)  # as the holder lists it, and where
        assert approval["host"] == "origin.test" and not held.done()
        listed = await asyncio.to_thread(
            subprocess.run, [EGRESSD, "pending", "--control", f"127.0.0.1:{b.ports['control']}"],
            capture_output=True, text=True, timeout=60, env=os.environ | {"EGRESSD_CONTROL_TOKEN": TOKEN},
        )  # fmt: skip
        assert approval["id"] in listed.stdout and f"(held on {a.id})" in listed.stdout, listed
        arrived = echo_origin.connections
        assert arrived == 0  # held: nothing went out
        status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"by": "ops", "scope": "run"})
        assert status == 200 and body["decision"] == "allow" and body["scope"] == "run", body
        code, _, reader, writer = await held
        assert code == 200
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
        writer.close()
        assert await a.pending() == [] and await b.pending() == [] and await c.pending() == []
        decided = a.records("approval.decided")
        assert len(decided) == 1, decided
        assert decided[0]["channel"] == f"control@{b.id}" and decided[0]["by"] == "ops", decided
        assert decided[0]["auth"] == "global token" and decided[0]["decision"] == "allow"
        assert b.records("approval.decided") == [] and c.records("approval.decided") == []
    row = postgres.psql(f"SELECT settlement->>'channel' FROM egressd_approvals WHERE id = '{approval['id']}'",
                        database)  # fmt: skip
    assert row == f"control@{b.id}"


async def test_two_answers_racing_on_two_instances_decide_once_and_the_loser_is_told_who_won(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with fleet(tmp_path, dns, dsn) as (a, b, c):
        held = asyncio.create_task(_connect(a.ports["proxy"], target))
        approval = await _listed(b, holder=a)
        path = f"/approvals/{approval['id']}"
        (allow_status, allowed), (deny_status, denied) = await asyncio.gather(
            b.control("POST", f"{path}/allow", {"by": "alice"}), c.control("POST", f"{path}/deny", {"by": "bob"})
        )
        assert sorted([allow_status, deny_status]) == [200, 409], (allowed, denied)
        code, headers, _, writer = await held
        writer.close()
        decided = a.records("approval.decided")
        assert len(decided) == 1, decided
        if allow_status == 200:
            assert code == 200 and decided[0]["by"] == "alice"
            assert f"allowed by alice via control@{b.id}" in str(denied["error"]), denied
        else:
            assert code == 403 and headers["x-egress-reason"] == "denied" and decided[0]["by"] == "bob"
            assert f"denied by bob via control@{c.id}" in str(allowed["error"]), allowed
        late_status, late = await c.control("POST", f"{path}/allow", {"by": "carol"})
        assert late_status == 409 and "already settled" in str(late["error"]), late
    assert len(a.records("approval.decided")) == 1


async def test_an_answer_the_holder_cannot_take_is_reported_as_not_applied(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str, postgres: Postgres, database: str
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with fleet(tmp_path, dns, dsn, count=2) as (a, b):
        held = asyncio.create_task(_connect(a.ports["proxy"], target))
        approval = await _listed(b, holder=a)
        a.proc.send_signal(19)  # SIGSTOP: the holder is there but takes nothing (a blip, a stall)
        try:
            status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"by": "ops"})
            assert status == 503 and "nothing was decided" in str(body["error"]), body
            # Silent for three heartbeats (as if 30 s had passed): nobody there could take an answer, so
            # the others stop listing what it holds.
            postgres.psql(f"UPDATE egressd_instances SET heartbeat_at = now() - interval '31 seconds' "
                          f"WHERE id = '{a.id}'", database)  # fmt: skip
            assert await b.pending() == []
            postgres.psql(f"UPDATE egressd_instances SET heartbeat_at = now() WHERE id = '{a.id}'", database)
            assert [x["id"] for x in await b.pending()] == [approval["id"]]
        finally:
            a.proc.send_signal(18)  # SIGCONT
        # Withdrawn: the holder, running again, does not apply it; the request stays held until answered.
        await asyncio.sleep(3)
        assert not held.done() and a.records("approval.decided") == []
        status, body = await b.control("POST", f"/approvals/{approval['id']}/deny", {"by": "ops"})
        assert status == 200 and body["decision"] == "deny", body
        code, _, _, writer = await held
        writer.close()
        assert code == 403 and echo_origin.connections == 0
    withdrawn = postgres.psql("SELECT state FROM egressd_answers ORDER BY seq", database).split()
    assert withdrawn == ["withdrawn", "replied"]


async def test_a_run_token_acts_on_its_own_run_only_across_the_fleet(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with fleet(tmp_path, dns, dsn, count=2) as (a, b):
        status, run = await b.control("POST", "/runs", {"task": "another run"})
        assert status == 201, run
        held = asyncio.create_task(_connect(a.ports["proxy"], target))  # the default run's request, on a
        approval = await _listed(b, holder=a)
        url = f"http://127.0.0.1:{b.ports['control']}"
        headers = {"Authorization": f"Bearer {run['control_token']}"}
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.get(f"{url}/approvals", headers=headers) as resp:
                assert resp.status == 200 and (await resp.json())["approvals"] == []  # not its run's: not shown
            for answer in ("allow", "deny"):
                async with session.post(f"{url}/approvals/{approval['id']}/{answer}", headers=headers) as resp:
                    refused = await resp.json()
                    assert resp.status == 403 and "acts on its own run only" in refused["error"], refused
        assert not held.done() and a.records("approval.decided") == []
        status, body = await b.control("POST", f"/approvals/{approval['id']}/deny", {"by": "ops"})
        assert status == 200, body
        code, _, _, writer = await held
        writer.close()
        assert code == 403 and echo_origin.connections == 0


async def test_the_database_stopped_mid_approval_fails_closed_and_the_fleet_recovers_when_it_returns(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    with running_postgres() as own:  # a server of this test's own: it is stopped in the middle
        own.psql("CREATE DATABASE outage")
        dsn = own.dsn("outage")
        await _migrated(dsn)
        target = f"origin.test:{echo_origin.port}"
        async with fleet(tmp_path, dns, dsn, count=2, extra=("--approval-timeout", "12")) as (a, b):
            held = asyncio.create_task(_connect(a.ports["proxy"], target))
            approval = await _listed(b, holder=a)
            await asyncio.to_thread(own.stop)
            # An answer given now decides nothing, and says so.
            status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"by": "ops"})
            assert status == 503 and "nothing was decided" in str(body["error"]), body
            # A new request that only the fleet could answer cannot be listed: refused at once, no_approver.
            code, headers, _, writer = await _connect(a.ports["proxy"], f"example.test:{echo_origin.port}")
            writer.close()
            assert code == 403 and headers["x-egress-reason"] == "no_approver", headers
            # The one held before stays with its holder's deadline and fails closed: approval_timeout.
            code, headers, _, writer = await held
            writer.close()
            assert code == 403 and headers["x-egress-reason"] == "approval_timeout", headers
            assert echo_origin.connections == 0
            await asyncio.to_thread(own.start)
            # Back: the holder says so, and a new request is held, answered elsewhere and let through.
            for _ in range(100):
                if any("the state database is back" in line for line in a.said):
                    break
                await asyncio.sleep(0.1)
            assert any("the state database is back" in line for line in a.said), a.said
            again = asyncio.create_task(_connect(a.ports["proxy"], target))
            second = await _listed(b, holder=a)
            status, body = await b.control("POST", f"/approvals/{second['id']}/allow", {"by": "ops"})
            assert status == 200, body
            code, _, _, writer = await again
            writer.close()
            assert code == 200
            decided = {r["id"]: r for r in a.records("approval.decided")}
            assert decided[approval["id"]]["reason"] == "approval_timeout"  # decided once, by its deadline
            assert decided[second["id"]]["decision"] == "allow"
