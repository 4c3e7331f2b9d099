"""A real PostgreSQL for the tests, from Debian's package: a server of the tests' own.

initdb in a fresh temporary directory, the server on a unix socket there and
no TCP port (``listen_addresses = ''``), so nothing else on the machine can
reach it and it reaches nothing. As root it runs as the ``postgres`` user the
package made (the server refuses root). ``postgres`` is one server per test
session; ``database`` a fresh database for each test, dropped after it;
``running_postgres`` a server of a test's own (stopped and started again:
an outage). Roles: ``egressd`` (trusted on the socket) and ``secret`` (its
password asked, scram-sha-256). Used by tests/integration/fleet and the
approval channels' conformance suite.
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
from pathlib import Path

import pytest

from tests.harness import require

PASSWORD = "fleet-test-" + secrets.token_hex(8)


class Postgres:
    """A PostgreSQL server of the tests' own, in ``base``: stopped and started again at will (an outage)."""

    def __init__(self, bindir: Path, base: Path, run_as: dict[str, object]) -> None:
        self.bindir = bindir
        self.socket_dir = base
        self.run_as = run_as  # subprocess's user/group for the server and its tools
        self._server: subprocess.Popen[bytes] | None = None
        self._logs = contextlib.ExitStack()

    def init(self) -> None:
        subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(self.socket_dir / "data"), "-U", "egressd",
             "--auth-local=trust", "--auth-host=reject", "-E", "UTF8", "--no-sync", "--locale=C"],
            capture_output=True, text=True, timeout=120, check=True, **self.run_as,  # type: ignore[arg-type]
        )  # fmt: skip
        # The `secret` role is asked its password; every other role is trusted on this private socket.
        (self.socket_dir / "data" / "pg_hba.conf").write_text("local all secret scram-sha-256\nlocal all all trust\n")

    def start(self) -> None:
        log = self._logs.enter_context((self.socket_dir / "server.log").open("ab"))  # a pipe nobody reads would fill
        self._server = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(self.socket_dir / "data"), "-k", str(self.socket_dir),
             "-c", "listen_addresses=", "-c", "fsync=off", "-c", "synchronous_commit=off",
             "-c", "full_page_writes=off"],
            stdout=subprocess.DEVNULL, stderr=log, **self.run_as,  # type: ignore[arg-type]
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not (self.socket_dir / ".s.PGSQL.5432").exists() or self._not_ready():
            if self._server.poll() is not None or time.monotonic() > deadline:
                said = (self.socket_dir / "server.log").read_text(errors="replace")
                raise AssertionError(f"PostgreSQL did not start: {said[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None and server.poll() is None:
            server.send_signal(2)  # SIGINT: the fast shutdown (every session cut)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self._logs.close()

    def _not_ready(self) -> bool:
        done = subprocess.run([str(self.bindir / "pg_isready"), "-q", "-h", str(self.socket_dir)], timeout=10,
                              check=False)  # fmt: skip
        return done.returncode != 0

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


@contextlib.contextmanager
def running_postgres() -> Iterator[Postgres]:
    """A fresh server in a temporary directory, removed after."""
    bindir = _bindir()
    require(bindir is not None, "PostgreSQL's server is not installed (apt-get install postgresql)")
    assert bindir is not None
    run_as: dict[str, object] = {}
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            require(False, "no postgres user to run the server as (apt-get install postgresql makes one)")
            raise
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    base = Path(tempfile.mkdtemp(prefix="egressd-pg-"))
    if run_as:
        os.chown(base, int(run_as["user"]), int(run_as["group"]))  # type: ignore[call-overload]
    server = Postgres(bindir, base, run_as)
    try:
        server.init()
        server.start()
        server.psql(f"CREATE ROLE secret LOGIN PASSWORD '{PASSWORD}'")
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    with running_postgres() as server:
        yield server


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
