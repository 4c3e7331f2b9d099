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
import os
import subprocess
from pathlib import Path

import aiohttp

from tests.conftest import Listener
from tests.fakes.dns import FakeDns
from tests.integration.fleet.instances import EGRESSD, TOKEN, connect, fleet, listed, migrated
from tests.postgres import Postgres, running_postgres


async def test_a_request_held_on_one_instance_is_answered_on_another_and_let_through_there(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str, postgres: Postgres, database: str
) -> None:
    target = f"origin.test:{echo_origin.port}"
    async with fleet(tmp_path, dns, dsn) as (a, b, c):
        held = asyncio.create_task(connect(a.ports["proxy"], target))
        approval = await listed(b, holder=a)
        assert (await listed(c, holder=a))["id"] == approval["id"]  # every instance lists it
        mine = await listed(a)
        assert set(approval) == set(mine) | {"instance"}, (approval, mine)  # as the holder lists it, and where
        assert approval["host"] == "origin.test" and not held.done()
        shown = await asyncio.to_thread(
            subprocess.run, [EGRESSD, "pending", "--control", f"127.0.0.1:{b.ports['control']}"],
            capture_output=True, text=True, timeout=60, env=os.environ | {"EGRESSD_CONTROL_TOKEN": TOKEN},
        )  # fmt: skip
        assert approval["id"] in shown.stdout and f"(held on {a.id})" in shown.stdout, shown
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
        held = asyncio.create_task(connect(a.ports["proxy"], target))
        approval = await listed(b, holder=a)
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
        held = asyncio.create_task(connect(a.ports["proxy"], target))
        approval = await listed(b, holder=a)
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
        held = asyncio.create_task(connect(a.ports["proxy"], target))  # the default run's request, on a
        approval = await listed(b, holder=a)
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
        await migrated(dsn)
        target = f"origin.test:{echo_origin.port}"
        async with fleet(tmp_path, dns, dsn, count=2, extra=("--approval-timeout", "12")) as (a, b):
            held = asyncio.create_task(connect(a.ports["proxy"], target))
            approval = await listed(b, holder=a)
            await asyncio.to_thread(own.stop)
            # An answer given now decides nothing, and says so.
            status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"by": "ops"})
            assert status == 503 and "nothing was decided" in str(body["error"]), body
            # A new request that only the fleet could answer cannot be listed: refused at once, no_approver.
            code, headers, _, writer = await connect(a.ports["proxy"], f"example.test:{echo_origin.port}")
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
            again = asyncio.create_task(connect(a.ports["proxy"], target))
            second = await listed(b, holder=a)
            status, body = await b.control("POST", f"/approvals/{second['id']}/allow", {"by": "ops"})
            assert status == 200, body
            code, _, _, writer = await again
            writer.close()
            assert code == 200
            decided = {r["id"]: r for r in a.records("approval.decided")}
            assert decided[approval["id"]]["reason"] == "approval_timeout"  # decided once, by its deadline
            assert decided[second["id"]]["decision"] == "allow"
