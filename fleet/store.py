"""The fleet's database, through asyncpg: its schema version, the migrations, and the instances' rows.

One connection per store. Every failure is a ``StateError`` whose message
says what to do and never holds the password (the URI is shown by
``dsn.shown``; asyncpg's own messages do not repeat it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import dsn as dsns
from .schema import BOOKKEEPING, LATEST, MIGRATION_LOCK, pending


class StateError(Exception):
    """The state database cannot be used: unreachable, refused, at the wrong schema version, or asyncpg missing."""


@dataclass(frozen=True)
class Instance:
    """An egressd as its fleet lists it."""

    id: str
    host: str
    pid: int
    egressd_version: str
    serving: str  # what it listens on, as its start-up line says


@dataclass(frozen=True)
class InstanceRow:
    instance: Instance
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    runs: list[dict[str, Any]] = field(default_factory=list)  # its live runs at its last heartbeat


async def close_quietly(listener: Any, pool: Any) -> None:
    """Close a listening connection and a pool (either may be None); an error closing them is no one's concern,
    and a pool gets 5 s to give its connections back."""
    if listener is not None:
        with contextlib.suppress(Exception):
            await listener.close()
    if pool is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pool.close(), 5)


def asyncpg_module() -> Any:
    try:
        import asyncpg
    except ImportError:
        raise StateError("the state database needs asyncpg: pip install 'egressd[fleet]'") from None
    return asyncpg


class Store:
    """One connection to the fleet's database."""

    def __init__(self, connection: Any, shown: str) -> None:
        self._db = connection
        self.shown = shown  # the URI without its password, for messages

    @classmethod
    async def open(cls, dsn: str, *, timeout_s: float = 10.0) -> Store:
        asyncpg = asyncpg_module()
        shown = dsns.shown(dsn)
        try:
            connection = await asyncpg.connect(dsns.check(dsn), timeout=timeout_s)
        except ValueError as exc:
            raise StateError(f"state {shown}: {exc}") from None
        except TimeoutError:
            raise StateError(f"the state database at {shown} did not answer within {timeout_s:g} s") from None
        except OSError as exc:
            raise StateError(f"cannot reach the state database at {shown}: {exc.strerror or exc}") from None
        except asyncpg.InvalidAuthorizationSpecificationError as exc:
            raise StateError(f"the state database at {shown} refused egressd's credentials: {exc}") from None
        except asyncpg.InvalidCatalogNameError as exc:
            raise StateError(f"the state database at {shown}: {exc} (create it first)") from None
        except asyncpg.PostgresError as exc:
            raise StateError(f"the state database at {shown}: {exc}") from None
        return cls(connection, shown)

    async def close(self) -> None:
        await self._db.close()

    async def version(self) -> int:
        """The database's schema version: 0 for a database egressd never migrated."""
        if await self._db.fetchval("SELECT to_regclass('egressd_schema')") is None:
            return 0
        return int(await self._db.fetchval("SELECT coalesce(max(version), 0) FROM egressd_schema"))

    async def migrate(self) -> tuple[int, int]:
        """Apply every migration the database lacks, in one transaction; (version before, version after).

        Taken one at a time across the fleet (an advisory lock): a second
        ``migrate`` started together waits, then finds nothing to do.
        """
        async with self._db.transaction():
            await self._db.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            await self._db.execute(BOOKKEEPING)
            before = await self.version()
            self._refuse_newer(before)
            for migration in pending(before):
                for statement in migration.statements:
                    await self._db.execute(statement)
                await self._db.execute(
                    "INSERT INTO egressd_schema (version, summary) VALUES ($1, $2)",
                    migration.version, migration.summary,
                )  # fmt: skip
        return before, max(before, LATEST)

    async def require_latest(self) -> None:
        """StateError unless the database is at exactly this egressd's schema version."""
        current = await self.version()
        self._refuse_newer(current)
        if current < LATEST:
            raise StateError(
                f"the state database at {self.shown} is at schema version {current}, this egressd needs {LATEST}: "
                "run `egressd state migrate` first"
            )

    def _refuse_newer(self, current: int) -> None:
        if current > LATEST:
            raise StateError(
                f"the state database at {self.shown} is at schema version {current}, newer than this egressd "
                f"knows ({LATEST}): run the egressd that migrated it, or a newer one"
            )

    async def register(self, instance: Instance) -> None:
        """List ``instance`` as serving (again, if its id was listed before)."""
        await self._db.execute(
            """
            INSERT INTO egressd_instances (id, host, pid, egressd_version, serving)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (id) DO UPDATE SET host = $2, pid = $3, egressd_version = $4, serving = $5,
                started_at = now(), heartbeat_at = now(), stopped_at = NULL
            """,
            instance.id, instance.host, instance.pid, instance.egressd_version, instance.serving,
        )  # fmt: skip

    async def heartbeat(self, instance_id: str, runs: list[dict[str, Any]] | None = None) -> None:
        """Alive now; with ``runs``, its live runs as they are now (each as ``GET /runs`` lists it)."""
        if runs is None:
            await self._db.execute("UPDATE egressd_instances SET heartbeat_at = now() WHERE id = $1", instance_id)
        else:
            await self._db.execute("UPDATE egressd_instances SET heartbeat_at = now(), runs = $2 WHERE id = $1",
                                   instance_id, json.dumps(runs))  # fmt: skip

    async def stopped(self, instance_id: str) -> None:
        await self._db.execute(
            "UPDATE egressd_instances SET stopped_at = now(), heartbeat_at = now(), runs = '[]' WHERE id = $1",
            instance_id,
        )

    async def instances(self, *, with_runs: bool = True) -> list[InstanceRow]:
        """Every instance ever registered, the latest started first (``with_runs``: schema version 3 on)."""
        runs = "runs" if with_runs else "'[]'::jsonb"
        rows = await self._db.fetch(
            "SELECT id, host, pid, egressd_version, serving, started_at, heartbeat_at, stopped_at, "
            f"{runs} AS runs FROM egressd_instances ORDER BY started_at DESC, id"
        )
        return [
            InstanceRow(
                Instance(row["id"], row["host"], row["pid"], row["egressd_version"], row["serving"]),
                row["started_at"], row["heartbeat_at"], row["stopped_at"], json.loads(row["runs"]),
            )  # fmt: skip
            for row in rows
        ]
