"""A real PostgreSQL for the fleet tests, from Debian's package: a server of the tests' own.

initdb in a fresh temporary directory, the server on a unix socket there and
no TCP port (``listen_addresses = ''``), so nothing else on the machine can
reach it and it reaches nothing. As root it runs as the ``postgres`` user the
package made (the server refuses root). Each test gets a database of its
own, dropped after it. Roles: ``egressd`` (trusted on the socket) and
``secret`` (its password asked, scram-sha-256).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import require

PASSWORD = "fleet-test-" + secrets.token_hex(8)


@dataclass(frozen=True)
class Postgres:
    bindir: Path
    socket_dir: Path
    run_as: dict[str, object]  # subprocess's user/group for the server's tools

    def psql(self, sql: str, database: str = "postgres") -> str:
        done = subprocess.run(
            [str(self.bindir / "psql"), "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-h", str(self.socket_dir),
             "-U", "egressd", "-d", database, "-c", sql],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def dsn(self, database: str, user: str = "egressd", password: str | None = None) -> str:
        auth = f"{user}:{password}" if password else user
        return f"postgresql://{auth}@/{database}?host={self.socket_dir}"


def _bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    bindir = _bindir()
    require(bindir is not None, "PostgreSQL's server is not installed (apt-get install postgresql)")
    assert bindir is not None
    run_as: dict[str, object] = {}
    base = Path(tempfile.mkdtemp(prefix="egressd-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base)
            require(False, "no postgres user to run the server as (apt-get install postgresql makes one)")
            raise
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        os.chown(base, user.pw_uid, user.pw_gid)
    data = base / "data"
    server = None
    stack = contextlib.ExitStack()
    try:
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", "egressd", "--auth-local=trust", "--auth-host=reject",
             "-E", "UTF8", "--no-sync", "--locale=C"],
            capture_output=True, text=True, timeout=120, check=True, **run_as,  # type: ignore[arg-type]
        )  # fmt: skip
        # The `secret` role is asked its password; every other role is trusted on this private socket.
        (data / "pg_hba.conf").write_text("local all secret scram-sha-256\nlocal all all trust\n")
        log = stack.enter_context((base / "server.log").open("wb"))  # a pipe nobody reads would fill and stop it
        server = subprocess.Popen(
            [str(bindir / "postgres"), "-D", str(data), "-k", str(base), "-c", "listen_addresses=",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
            stdout=subprocess.DEVNULL, stderr=log, **run_as,  # type: ignore[arg-type]
        )  # fmt: skip
        found = Postgres(bindir, base, run_as)
        deadline = time.monotonic() + 30
        while not (base / ".s.PGSQL.5432").exists() or _not_ready(found):
            if server.poll() is not None or time.monotonic() > deadline:
                said = (base / "server.log").read_text(errors="replace")
                raise AssertionError(f"PostgreSQL did not start: {said[-2000:]}")
            time.sleep(0.1)
        found.psql(f"CREATE ROLE secret LOGIN PASSWORD '{PASSWORD}'")
        yield found
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(2)  # SIGINT: the fast shutdown
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        stack.close()
        shutil.rmtree(base, ignore_errors=True)


def _not_ready(pg: Postgres) -> bool:
    done = subprocess.run([str(pg.bindir / "pg_isready"), "-q", "-h", str(pg.socket_dir)], timeout=10, check=False)
    return done.returncode != 0


@pytest.fixture
def database(postgres: Postgres) -> Iterator[str]:
    """A fresh database, owned by ``egressd`` (``secret`` may use it too), dropped after the test."""
    name = "t_" + secrets.token_hex(6)
    postgres.psql(f"CREATE DATABASE {name}")
    postgres.psql(f"GRANT ALL ON DATABASE {name} TO secret; GRANT ALL ON SCHEMA public TO secret", name)
    try:
        yield name
    finally:
        with contextlib.suppress(AssertionError):
            postgres.psql(f"DROP DATABASE {name} WITH (FORCE)")
