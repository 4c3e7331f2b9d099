"""``egressd state`` and ``serve --state`` against a real PostgreSQL (tests/postgres.py).

The schema is migrated only when asked, once however many ask at once;
serve refuses a database it cannot use before it listens, and says why
(unreachable, refused credentials, not migrated, migrated by a newer
egressd) without ever printing the password; once serving it is listed
with a heartbeat and marked stopped when it stops.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from egressd.fleet.schema import LATEST, MIGRATIONS
from egressd.fleet.store import Store
from tests.harness import aserve_ports, wait_until
from tests.postgres import PASSWORD, Postgres

EGRESSD = str(Path(sys.executable).with_name("egressd"))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


def state(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EGRESSD, "state", *args], capture_output=True, text=True, timeout=60, env=_env(tmp_path))


def test_migrate_takes_a_new_database_to_the_latest_version_once(
    tmp_path: Path, postgres: Postgres, database: str
) -> None:
    dsn = postgres.dsn(database)
    before = state(tmp_path, "status", "--state", dsn)
    assert before.returncode == 1 and f"schema version 0 (this egressd needs {LATEST}" in before.stdout, before
    first = state(tmp_path, "migrate", "--state", dsn)
    assert first.returncode == 0 and f"migrated from schema version 0 to {LATEST}" in first.stdout, first
    again = state(tmp_path, "migrate", "--state", dsn)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again
    after = state(tmp_path, "status", "--state", dsn)
    assert after.returncode == 0 and "no instances" in after.stdout, after
    rows = postgres.psql("SELECT version FROM egressd_schema ORDER BY version", database)
    assert rows.split() == [str(m.version) for m in MIGRATIONS]


async def test_migrations_started_together_apply_each_migration_once(postgres: Postgres, database: str) -> None:
    stores = [await Store.open(postgres.dsn(database)) for _ in range(4)]
    try:
        results = await asyncio.gather(*(store.migrate() for store in stores))
    finally:
        for store in stores:
            await store.close()
    assert sorted(results) == [(0, LATEST)] + [(LATEST, LATEST)] * 3
    assert postgres.psql("SELECT count(*) FROM egressd_schema", database) == str(len(MIGRATIONS))


async def _serve(tmp_path: Path, *args: str) -> tuple[asyncio.subprocess.Process, str]:
    """``egressd serve`` with ``args``; (the process, its standard error so far: up to "serving:" or its end)."""
    proc = await asyncio.create_subprocess_exec(
        EGRESSD, "serve", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0", "--control-token", "fleet-token",
        "--audit-log", str(tmp_path / "audit.jsonl"), "--workers", "1", *args,
        env=_env(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        await aserve_ports(proc.stderr, read=seen)
    except AssertionError:
        await asyncio.wait_for(proc.wait(), 30)
    return proc, "".join(seen)


async def _refused(tmp_path: Path, *args: str) -> str:
    """serve's standard error when it refuses to start: exit 2 (a start-up refusal), having listened on nothing."""
    proc, said = await _serve(tmp_path, *args)
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"egressd served: {said}")
    assert proc.returncode == 2 and "serving:" not in said, said
    return said


async def test_serve_refuses_a_database_it_cannot_use_and_says_why(
    tmp_path: Path, postgres: Postgres, database: str
) -> None:
    not_migrated = await _refused(tmp_path, "--state", postgres.dsn(database))
    assert "run `egressd state migrate` first" in not_migrated
    stores = await Store.open(postgres.dsn(database))
    try:
        await stores.migrate()
    finally:
        await stores.close()
    postgres.psql("INSERT INTO egressd_schema (version, summary) VALUES (999, 'from the future')", database)
    newer = await _refused(tmp_path, "--state", postgres.dsn(database))
    assert "schema version 999, newer than this egressd knows" in newer
    nobody = await _refused(tmp_path, "--state", f"postgresql://egressd@/{database}?host={tmp_path}")
    assert "cannot reach the state database" in nobody
    no_password = await _refused(tmp_path, "--state", postgres.dsn(database, user="secret"))
    assert "refused egressd's credentials" in no_password or "password" in no_password, no_password
    wrong = await _refused(tmp_path, "--state", postgres.dsn(database, user="secret", password="not-" + PASSWORD))
    assert "refused egressd's credentials" in wrong and "not-" + PASSWORD not in wrong, wrong
    missing = await _refused(tmp_path, "--state", postgres.dsn("no_such_database"))
    assert "no_such_database" in missing and "create it first" in missing


async def test_serve_is_listed_while_it_serves_and_marked_stopped_after(
    tmp_path: Path, postgres: Postgres, database: str
) -> None:
    # The URI and its password from a file (mode 600): off the command line, and never printed.
    uri = tmp_path / "state.uri"
    uri.write_text(postgres.dsn(database, user="secret", password=PASSWORD) + "\n")
    uri.chmod(0o600)
    migrated = state(tmp_path, "migrate", "--state-file", str(uri))
    assert migrated.returncode == 0 and PASSWORD not in migrated.stdout + migrated.stderr, migrated
    proc, said = await _serve(tmp_path, "--state-file", str(uri))
    try:
        assert proc.returncode is None, said
        assert "fleet: state database postgresql://secret:***@/" in said and PASSWORD not in said, said
        status = state(tmp_path, "status", "--state-file", str(uri))
        assert status.returncode == 0 and "1 instance:" in status.stdout, status
        assert f"pid {proc.pid}" in status.stdout and "serving, last heartbeat" in status.stdout, status.stdout
        assert PASSWORD not in status.stdout
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0
    stopped = state(tmp_path, "status", "--state-file", str(uri))
    assert stopped.returncode == 0 and f"pid {proc.pid}" in stopped.stdout and "stopped" in stopped.stdout, stopped


async def test_a_heartbeat_that_fails_is_said_and_the_instance_is_listed_again(
    postgres: Postgres, database: str
) -> None:
    from egressd.cli.wiring import fleet as wiring

    store = await Store.open(postgres.dsn(database))
    await store.migrate()
    presence = wiring.FleetPresence(store, postgres.dsn(database))
    instance = await presence.join("proxy 127.0.0.1:1, control 127.0.0.1:2")
    try:
        # The database loses every connection (a restart, a failover) and the row: the next beat fails,
        # the one after connects again and lists the instance again.
        postgres.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")
        postgres.psql(f"DELETE FROM egressd_instances WHERE id = '{instance.id}'", database)
        await presence._heartbeat()  # noqa: SLF001 (one beat, now, instead of waiting ten seconds)
        assert presence._failing  # noqa: SLF001
        await presence._heartbeat()  # noqa: SLF001
        assert not presence._failing  # noqa: SLF001
        listed = f"SELECT count(*) FROM egressd_instances WHERE id = '{instance.id}' AND stopped_at IS NULL"
        await wait_until(lambda: postgres.psql(listed, database) == "1")
    finally:
        await presence.leave()
    checker = await asyncpg.connect(postgres.dsn(database))
    try:
        assert await checker.fetchval("SELECT stopped_at IS NOT NULL FROM egressd_instances WHERE id = $1",
                                      instance.id)  # fmt: skip
    finally:
        await checker.close()
