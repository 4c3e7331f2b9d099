"""A fleet's lasting rules: an *always* answer given for one instance is applied by every instance; a revocation
on any instance takes it back everywhere.

Three real ``egressd serve --state`` processes on one PostgreSQL, none with
an allow file: the rule lives in the database (``egressd_rules``), and
each instance applies it from its next request on (a ``policy.reloaded``
record says so in its own audit log).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

from tests.conftest import Listener
from tests.fakes.dns import FakeDns
from tests.integration.approvals.webclient import PageClient
from tests.integration.fleet.instances import (
    EGRESSD,
    TOKEN,
    Instance,
    connect,
    fleet,
    listed,
    migrated,
    serve,
    settled_everywhere,
)
from tests.postgres import Postgres, running_postgres


async def _always(instance: Instance) -> list[str]:
    status, body = await instance.control("GET", "/always")
    assert status == 200, body
    return [str(a["entry"]) for a in body["always"]]  # type: ignore[union-attr]


async def _until(check: object, what: str, timeout_s: float = 15.0) -> None:
    """Until the coroutine function ``check`` returns true (a rule reaches every instance at its notification)."""
    for _ in range(int(timeout_s / 0.1)):
        if await check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s: {what}")


async def _through(instance: Instance, target: str) -> int:
    """A CONNECT through ``instance`` that no person is asked about: its status."""
    code, _, reader, writer = await asyncio.wait_for(connect(instance.ports["proxy"], target), 10)
    if code == 200:
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
    writer.close()
    return code


async def test_always_on_one_instance_is_applied_by_the_others_and_a_revoke_anywhere_undoes_it_everywhere(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener, dsn: str, postgres: Postgres, database: str
) -> None:
    target = f"origin.test:{echo_origin.port}"
    # B serves with two processes: a rule reaches its worker too.
    async with fleet(tmp_path, dns, dsn, count=2) as (a, c), serve(tmp_path / "b", dns, dsn, ("--workers", "2")) as b:
        held = asyncio.create_task(connect(a.ports["proxy"], target))
        approval = await listed(b, holder=a)
        status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"by": "ops", "scope": "always"})
        assert status == 200 and body["scope"] == "always" and body["entry"] == target, body
        code, _, _, writer = await held
        writer.close()
        assert code == 200

        # Every instance lists it and lets the next request through without asking anyone.
        for instance in (a, b, c):
            await _until(lambda i=instance: _always_has(i, target), f"{target} always on {instance.id}")
        for _ in range(4):  # connections land on either of B's processes
            assert await _through(b, target) == 200
        assert await _through(c, target) == 200
        for instance in (b, c):
            assert instance.records("approval.requested") == []
            reloads = instance.records("policy.reloaded")
            assert any(target in r["added"]["allow"] for r in reloads if r["ok"]), reloads  # type: ignore[index]
        row = postgres.psql(f"SELECT entry, instance, channel, by FROM egressd_rules WHERE approval = "
                            f"'{approval['id']}' AND revoked_at IS NULL", database)  # fmt: skip
        assert row.split("|") == [target, a.id, f"control@{b.id}", "ops"], row

        # Revoked on C: gone from every instance's policy, the holder's run's own approval too.
        status, body = await c.control("PATCH", "/runs/default", {"revoke": [target]})
        assert status == 200, body
        for instance in (a, b, c):
            await _until(lambda i=instance: _always_lacks(i, target), f"{target} revoked on {instance.id}")
        before = echo_origin.connections
        for instance in (a, b):
            await settled_everywhere(a, b, c)  # the approval answered before is no longer listed
            again = asyncio.create_task(connect(instance.ports["proxy"], target))
            asked = await listed(c, holder=instance)  # held for a person again: nothing let through
            status, body = await c.control("POST", f"/approvals/{asked['id']}/deny", {"by": "ops"})
            assert status == 200, body
            code, headers, _, writer = await again
            writer.close()
            assert code == 403 and headers["x-egress-reason"] == "denied", headers
        assert echo_origin.connections == before
        changed = c.records("run.changed")
        assert changed and changed[-1]["always_revoked"] == [target], changed
    revoked = postgres.psql(f"SELECT revoked_on, revoked_at IS NOT NULL FROM egressd_rules WHERE approval = "
                            f"'{approval['id']}'", database)  # fmt: skip
    assert revoked.split("|") == [c.id, "t"], revoked


async def test_with_the_database_gone_always_is_for_the_run_only_and_a_revoke_is_refused(
    tmp_path: Path, dns: FakeDns, echo_origin: Listener
) -> None:
    with running_postgres() as own:  # a server of this test's own: it is stopped in the middle
        own.psql("CREATE DATABASE rules")
        dsn = own.dsn("rules")
        await migrated(dsn)
        standing, other = f"origin.test:{echo_origin.port}", f"example.test:{echo_origin.port}"
        async with fleet(tmp_path, dns, dsn, count=2, extra=("--approval-timeout", "60")) as (a, b):
            held = asyncio.create_task(connect(a.ports["proxy"], standing))
            approval = await listed(b, holder=a)
            status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"scope": "always"})
            assert status == 200 and body["scope"] == "always", body
            (await held)[3].close()
            await _until(lambda: _always_has(b, standing), f"{standing} always on b")
            held = asyncio.create_task(connect(a.ports["proxy"], other))
            approval = await listed(b, holder=a)
            await asyncio.to_thread(own.stop)
            await _until(lambda: _said(a, "always answers here are for the run only"), "the outage noticed on a")
            await _until(lambda: _said(b, "always answers here are for the run only"), "the outage noticed on b")
            # Answered on its holder: allowed, for the run only, and the answerer is told why.
            status, body = await a.control("POST", f"/approvals/{approval['id']}/allow", {"scope": "always"})
            assert status == 200 and body["scope"] == "run", body
            assert "cannot be reached" in str(body["scope_error"]), body
            code, _, _, writer = await held
            writer.close()
            assert code == 200
            # A revocation cannot reach the other instances: refused, nothing taken back anywhere.
            status, body = await b.control("PATCH", "/runs/default", {"revoke": [standing]})
            assert status == 500 and "not revoked" in str(body["error"]), body
            assert await _always(b) == [standing] and await _always(a) == [standing]
            assert await _through(b, standing) == 200
            await asyncio.to_thread(own.start)
            await _until(lambda: _said(a, "the fleet's rules are followed again"), "the database back on a")
            assert await _always(a) == [standing] and await _always(b) == [standing]
            # The outage and the recovery are in the audit log, once each, and the database's URI is not.
            states = [(r["reachable"], r["instance"]) for r in a.records("fleet.state")]
            assert states == [(False, a.id), (True, a.id)], states
            assert a.records("fleet.state")[0]["error"] and dsn not in a.log.read_text()
        rows = own.psql("SELECT entry FROM egressd_rules WHERE revoked_at IS NULL", "rules")
        assert rows.split() == [standing], rows


async def _said(instance: Instance, text: str) -> bool:
    return any(text in line for line in instance.said)


async def _always_has(instance: Instance, entry: str) -> bool:
    return entry in await _always(instance)


async def _always_lacks(instance: Instance, entry: str) -> bool:
    return entry not in await _always(instance)


async def test_the_fleets_runs_are_listed_on_any_instances_page_and_by_state_status(
    tmp_path: Path, dns: FakeDns, dsn: str
) -> None:
    async with fleet(tmp_path, dns, dsn, count=1, extra=("--approver", "web")) as (a,), \
            serve(tmp_path / "b", dns, dsn) as b:  # fmt: skip
        status, run = await b.control("POST", "/runs", {"task": "build the docs"})
        assert status == 201, run
        page = next(line for line in a.said if "approvals page: " in line).split("approvals page: ")[1].split()[0]
        base, prefix = page.rstrip("/").split("/web", 1)
        async with PageClient(base, "/web" + prefix) as browser:
            await browser.sign_in(token=TOKEN)

            async def listed_on_the_page() -> bool:
                return f"{run['id']} <span class=\"instance\">on {b.id}</span>" in (await browser.get())[2]

            await _until(listed_on_the_page, "B's run on A's page")
            html = (await browser.get())[2]
            row = html.split(f'data-run="{run["id"]}"')[1].split("</tr>")[0]
            assert "build the docs" in row and "Revoke" not in row  # shown, not revoked there: B's own
            shown = await asyncio.to_thread(
                subprocess.run, [EGRESSD, "state", "status"], capture_output=True, text=True, timeout=60,
                env=os.environ | {"EGRESSD_STATE": dsn},
            )  # fmt: skip
            assert f"    run {run['id']}  task build the docs" in shown.stdout, shown
            assert shown.stdout.index(b.id) < shown.stdout.index(f"run {run['id']}"), shown.stdout
            status, _ = await b.control("DELETE", f"/runs/{run['id']}")
            assert status in (200, 204)

            async def gone_from_the_page() -> bool:
                return f'data-run="{run["id"]}"' not in (await browser.get())[2]

            await _until(gone_from_the_page, "B's ended run gone from A's page")
