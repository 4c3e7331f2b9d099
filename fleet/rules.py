"""The fleet's lasting rules in PostgreSQL: *always* answers and shared denials as rows every instance applies.

A row is written by the instance whose person answered *always*, keyed by
the approval's id, so writing it again (a retry after a lost reply) changes
nothing. A revocation marks the standing rows for an entry; the row stays,
as an allow file's ``[[approved]]`` table stays after its ``[[revoked]]``.
A shared denial (``share_denials`` task or group) is a row too, standing for
``DENIAL_HOURS`` unless lifted (``egressd state lift``).
Every write is followed, in its transaction, by a ``NOTIFY`` on ``RULES``:
each instance reads the standing rules again and applies them. A missed
notification is caught by the instance's next periodic read.

Values cross as plain fields; this module knows rows, not policies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .store import StateError, asyncpg_module, close_quietly

RULES = "egressd_rules"  # payload: what changed ("kept", "revoked", "denied" or "lifted")
# How long a shared denial stands: a denial for a run ends with it; one shared with a task or group needs an end.
DENIAL_HOURS = 24


@dataclass(frozen=True, slots=True)
class Rule:
    """One standing *always* answer of the fleet."""

    approval: str
    entry: str
    at: str  # RFC 3339 time of the answer
    instance: str  # where it was answered and held
    run: str | None = None
    by: str | None = None
    channel: str | None = None
    auth: str | None = None


@dataclass(frozen=True, slots=True)
class Revocation:
    """Standing rules for ``entries`` taken back, and by whom (``on``: the instance it was done on)."""

    entries: tuple[str, ...]
    on: str
    by: str | None = None
    channel: str | None = None
    auth: str | None = None


@dataclass(frozen=True, slots=True)
class Denial:
    """A person's denial shared beyond its run: ``host``'s registered domain for ``reach`` (task, group) ``key``."""

    approval: str
    reach: str
    key: str
    host: str
    at: str  # RFC 3339 time of the answer
    instance: str
    run: str | None = None
    by: str | None = None
    channel: str | None = None


class FleetRules:
    """The rules table through a small pool, and a connection that listens for changes."""

    def __init__(self, dsn: str, on_change: Callable[[], None] | None) -> None:
        self._dsn = dsn
        self._on_change = on_change  # called as a notification arrives (the caller reads the rules again); None:
        # not listening (``egressd state``)
        self._pool: Any = None
        self._listener: Any = None

    async def open(self, timeout_s: float = 10.0) -> None:
        asyncpg = asyncpg_module()
        try:
            self._pool = await asyncpg.create_pool(self._dsn, min_size=1, max_size=2, timeout=timeout_s)
            if self._on_change is not None:
                await self.listen()
        except Exception as exc:
            await self.close()
            raise StateError(f"the fleet's rules: {exc}") from None

    async def listen(self) -> None:
        """(Re)connect the listening connection, if it is not listening."""
        if self._on_change is None or (self._listener is not None and not self._listener.is_closed()):
            return
        listener = await asyncpg_module().connect(self._dsn, timeout=10)
        await listener.add_listener(RULES, self._notified)
        self._listener = listener

    def _notified(self, _connection: Any, _pid: int, _channel: str, _payload: str) -> None:
        if self._on_change is not None:
            self._on_change()

    async def close(self) -> None:
        listener, self._listener, pool, self._pool = self._listener, None, self._pool, None
        await close_quietly(listener, pool)

    async def standing(self) -> list[Rule]:
        """Every rule no revocation took back, oldest first."""
        rows = await self._pool.fetch(
            "SELECT approval, entry, at, instance, run, by, channel, auth FROM egressd_rules "
            "WHERE revoked_at IS NULL ORDER BY kept_at, approval"
        )
        return [Rule(**dict(row)) for row in rows]

    async def keep(self, rule: Rule) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute(
                "INSERT INTO egressd_rules (approval, entry, at, instance, run, by, channel, auth) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (approval) DO NOTHING",
                rule.approval, rule.entry, rule.at, rule.instance, rule.run, rule.by, rule.channel, rule.auth,
            )  # fmt: skip
            await db.execute("SELECT pg_notify($1, 'kept')", RULES)

    async def revoke(self, revocation: Revocation) -> Sequence[str]:
        """Mark the standing rules for the entries revoked; the entries that had one."""
        async with self._pool.acquire() as db, db.transaction():
            rows = await db.fetch(
                "UPDATE egressd_rules SET revoked_at = now(), revoked_by = $2, revoked_channel = $3, "
                "revoked_auth = $4, revoked_on = $5 WHERE entry = ANY($1::text[]) AND revoked_at IS NULL "
                "RETURNING entry",
                list(revocation.entries), revocation.by, revocation.channel, revocation.auth, revocation.on,
            )  # fmt: skip
            await db.execute("SELECT pg_notify($1, 'revoked')", RULES)
        return sorted({row["entry"] for row in rows})

    async def denials(self) -> list[Denial]:
        """Every shared denial standing now (not lifted, younger than ``DENIAL_HOURS``), oldest first."""
        rows = await self._pool.fetch(
            "SELECT approval, reach, key, host, at, instance, run, by, channel FROM egressd_denials "
            "WHERE lifted_at IS NULL AND denied_at > now() - make_interval(hours => $1) ORDER BY denied_at, approval",
            DENIAL_HOURS,
        )  # fmt: skip
        return [Denial(**dict(row)) for row in rows]

    async def deny(self, denial: Denial) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute(
                "INSERT INTO egressd_denials (approval, reach, key, host, at, instance, run, by, channel) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (approval) DO NOTHING",
                denial.approval, denial.reach, denial.key, denial.host, denial.at, denial.instance, denial.run,
                denial.by, denial.channel,
            )  # fmt: skip
            await db.execute("SELECT pg_notify($1, 'denied')", RULES)

    async def lift(self, hosts: Sequence[str], by: str | None) -> list[Denial]:
        """Lift the standing denials for ``hosts`` (as denied); the denials lifted."""
        async with self._pool.acquire() as db, db.transaction():
            rows = await db.fetch(
                "UPDATE egressd_denials SET lifted_at = now(), lifted_by = $2 WHERE host = ANY($1::text[]) "
                "AND lifted_at IS NULL RETURNING approval, reach, key, host, at, instance, run, by, channel",
                list(hosts), by,
            )  # fmt: skip
            await db.execute("SELECT pg_notify($1, 'lifted')", RULES)
        return [Denial(**dict(row)) for row in rows]
