"""``egressd run --state``: a sandboxed command's egressd joins the fleet, and a request it holds is answered on
another instance.

A real bubblewrap sandbox and a real ``egressd serve --state`` on the
session's PostgreSQL: the run's egressd has no approver of its own (no
terminal here), so the fleet is its one channel. Nothing reaches the origin
before the answer; the run's audit log says who answered and where; once
the run ends, its egressd is listed as stopped. The database's URI, given
in egressd's environment, is not in the sandbox's.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from tests.conftest import HttpOrigin
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN_RANGE
from tests.integration.fleet.instances import EGRESSD, listed, migrated, serve
from tests.integration.sandbox.test_sandbox import _needs_root_and_tools, assert_no_leftovers  # noqa: F401 (autouse)
from tests.postgres import Postgres


async def test_a_request_held_by_a_runs_egressd_is_answered_on_another_instance_of_the_fleet(
    tmp_path: Path, dns: FakeDns, http_origin: HttpOrigin, postgres: Postgres, database: str
) -> None:
    dsn = postgres.dsn(database)
    await migrated(dsn)
    # The URI in egressd's environment (the riskier way in): the sandbox must not inherit it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path),
                                                                                    "EGRESSD_STATE": dsn}
    async with serve(tmp_path / "b", dns, dsn) as b:
        proc = await asyncio.create_subprocess_exec(
            EGRESSD, "run", "--upstream-dns", f"127.0.0.1:{dns.address[1]}", "--allow-private", ORIGIN_RANGE,
            "--audit-log", str(tmp_path / "audit.jsonl"), "--task", "fetch",
            "--", "sh", "-c", f"env; curl -fsS -m 30 http://origin.test:{http_origin.port}/held",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            approval = await listed(b)
            assert approval["host"] == "origin.test" and approval["task"] == "fetch", approval
            assert http_origin.requests == []  # held: nothing went out yet
            status, body = await b.control("POST", f"/approvals/{approval['id']}/allow", {"by": "ops"})
            assert status == 200, body
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err
    assert b"hello from origin: GET /held" in out
    assert b"EGRESSD_STATE" not in out and b"postgresql" not in out, out
    records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    decided = [r for r in records if r.get("event") == "approval.decided"]
    assert len(decided) == 1 and decided[0]["channel"] == f"control@{b.id}", decided
    stopped = postgres.psql("SELECT count(*) FROM egressd_instances WHERE serving LIKE 'egressd run %' "
                            "AND stopped_at IS NOT NULL", database)  # fmt: skip
    assert stopped == "1", stopped
    await assert_no_leftovers()
