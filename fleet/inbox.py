"""The fleet's approvals in PostgreSQL: the rows of held requests, and answers posted to their holders.

The instance that holds a request is the only one that decides it (its own
ledger, exactly once). It lists the request (``publish``) and, once it is
decided, how (``settled``). An answer given on another instance is a letter
to the holder (``post``: a row in ``egressd_answers`` and a ``NOTIFY``); the
holder takes it (``take``: claimed once), applies it, and replies
(``reply``, another ``NOTIFY``). An answerer that gives up waiting withdraws
its letter, and a withdrawn letter is never taken. So an answer is either
applied and reported, or reported as not applied. Notifications can be
missed (a reconnect), so the holder also sweeps for letters
(``posted_to_me``).

Values cross as JSON objects the callers make; this module knows rows, not
approvals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from .store import StateError, asyncpg_module, close_quietly

ANSWERS = "egressd_answers"  # payload: "HOLDER SEQ"
# An instance without a heartbeat for this long is not listed as holding anything (three 10 s beats).
SILENT_S = 30.0
REPLIES = "egressd_replies"  # payload: "SEQ"


class NotSent(StateError):
    """The answer never reached the database: nothing was decided."""


class OutcomeUnknown(StateError):
    """The database went away after the answer was posted: the holder may or may not have applied it."""


@dataclass(frozen=True)
class Listed:
    """An open approval held by another instance."""

    id: str
    instance: str
    run: str
    listing: dict[str, Any]


@dataclass(frozen=True)
class Letter:
    """An answer posted to this instance for one of its approvals."""

    seq: int
    approval: str
    given: dict[str, Any]
    from_instance: str


def _when(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


class FleetInbox:
    """One instance's side of the fleet's approvals: a pool for queries, a connection that listens."""

    def __init__(self, dsn: str, instance: str, on_letter: Callable[[int], None]) -> None:
        self._dsn = dsn
        self.instance = instance
        self._on_letter = on_letter  # a letter's seq, as its notification arrives (the caller takes it)
        self._pool: Any = None
        self._listener: Any = None
        self._replies: dict[int, asyncio.Future[None]] = {}

    async def open(self, timeout_s: float = 10.0) -> None:
        asyncpg = asyncpg_module()
        try:
            self._pool = await asyncpg.create_pool(self._dsn, min_size=1, max_size=4, timeout=timeout_s)
            await self.listen()
        except Exception as exc:
            await self.close()
            raise StateError(f"the fleet's approvals: {exc}") from None

    async def listen(self) -> None:
        """(Re)connect the listening connection; true once it listens."""
        asyncpg = asyncpg_module()
        if self._listener is not None and not self._listener.is_closed():
            return
        listener = await asyncpg.connect(self._dsn, timeout=10)
        await listener.add_listener(ANSWERS, self._notified)
        await listener.add_listener(REPLIES, self._notified)
        self._listener = listener

    @property
    def listening(self) -> bool:
        return self._listener is not None and not self._listener.is_closed()

    def _notified(self, _connection: Any, _pid: int, channel: str, payload: str) -> None:
        words = payload.split()
        if channel == ANSWERS and len(words) == 2 and words[0] == self.instance and words[1].isdigit():
            self._on_letter(int(words[1]))
        elif channel == REPLIES and len(words) == 1 and words[0].isdigit():
            waiting = self._replies.get(int(words[0]))
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    async def close(self) -> None:
        listener, self._listener, pool, self._pool = self._listener, None, self._pool, None
        await close_quietly(listener, pool)

    # -- the holder ---------------------------------------------------------------

    async def publish(self, approval: str, run: str, listing: dict[str, Any], expires_at: float) -> None:
        await self._pool.execute(
            "INSERT INTO egressd_approvals (id, instance, run, listing, expires_at) VALUES ($1, $2, $3, $4, $5)",
            approval, self.instance, run, json.dumps(listing), _when(expires_at),
        )  # fmt: skip

    async def settled(self, approval: str, settlement: dict[str, Any]) -> None:
        await self._pool.execute(
            "UPDATE egressd_approvals SET settled_at = now(), settlement = $2 WHERE id = $1 AND instance = $3",
            approval, json.dumps(settlement), self.instance,
        )  # fmt: skip

    async def take(self, seq: int) -> Letter | None:
        """Claim a letter posted to this instance; None when it was taken, withdrawn or is not ours."""
        row = await self._pool.fetchrow(
            "UPDATE egressd_answers SET state = 'taken' WHERE seq = $1 AND holder = $2 AND state IS NULL "
            "RETURNING seq, approval, given, from_instance",
            seq, self.instance,
        )  # fmt: skip
        if row is None:
            return None
        return Letter(row["seq"], row["approval"], json.loads(row["given"]), row["from_instance"])

    async def reply(self, seq: int, reply: dict[str, Any]) -> None:
        async with self._pool.acquire() as db, db.transaction():
            await db.execute("UPDATE egressd_answers SET state = 'replied', reply = $2 WHERE seq = $1",
                             seq, json.dumps(reply))  # fmt: skip
            await db.execute("SELECT pg_notify($1, $2)", REPLIES, str(seq))

    async def posted_to_me(self) -> list[int]:
        """Letters posted to this instance and not taken: what a missed notification left."""
        rows = await self._pool.fetch(
            "SELECT seq FROM egressd_answers WHERE holder = $1 AND state IS NULL ORDER BY seq", self.instance
        )
        return [row["seq"] for row in rows]

    async def withdraw_mine(self) -> None:
        """At the end: every open approval this instance listed is marked settled by its leaving."""
        await self._pool.execute(
            "UPDATE egressd_approvals SET settled_at = now(), settlement = $2 "
            "WHERE instance = $1 AND settled_at IS NULL",
            self.instance, json.dumps({"answer": "shutting_down"}),
        )  # fmt: skip

    # -- any instance ---------------------------------------------------------------

    async def open_elsewhere(self) -> list[Listed]:
        """The approvals other instances hold, open and not expired, oldest first.

        Not those of an instance listed as stopped or silent for three heartbeats (killed, cut off):
        nobody there could take an answer.
        """
        rows = await self._pool.fetch(
            "SELECT a.id, a.instance, a.run, a.listing FROM egressd_approvals a WHERE a.settled_at IS NULL "
            "AND a.expires_at > now() AND a.instance <> $1 AND NOT EXISTS (SELECT 1 FROM egressd_instances i "
            "WHERE i.id = a.instance AND (i.stopped_at IS NOT NULL OR i.heartbeat_at < now() - $2::interval)) "
            "ORDER BY a.created_at, a.id",
            self.instance, timedelta(seconds=SILENT_S),
        )  # fmt: skip
        return [Listed(row["id"], row["instance"], row["run"], json.loads(row["listing"])) for row in rows]

    async def runs_elsewhere(self) -> list[tuple[str, dict[str, Any]]]:
        """(instance, run) of the other serving instances' live runs, as their last heartbeat listed them."""
        rows = await self._pool.fetch(
            "SELECT id, runs FROM egressd_instances WHERE id <> $1 AND stopped_at IS NULL "
            "AND heartbeat_at >= now() - $2::interval ORDER BY started_at, id",
            self.instance, timedelta(seconds=SILENT_S),
        )  # fmt: skip
        return [(row["id"], run) for row in rows for run in json.loads(row["runs"]) if isinstance(run, dict)]

    async def find(self, approval: str) -> tuple[Listed, dict[str, Any] | None] | None:
        """Another instance's approval by id: (it, how it was settled or None while open); None if unknown."""
        row = await self._pool.fetchrow(
            "SELECT id, instance, run, listing, settlement, settled_at IS NULL AND expires_at <= now() AS lapsed "
            "FROM egressd_approvals WHERE id = $1 AND instance <> $2",
            approval, self.instance,
        )  # fmt: skip
        if row is None:
            return None
        settlement = json.loads(row["settlement"]) if row["settlement"] is not None else None
        if settlement is None and row["lapsed"]:
            settlement = {"answer": "timeout"}  # its holder's deadline passed: it expired, or will at once
        return Listed(row["id"], row["instance"], row["run"], json.loads(row["listing"])), settlement

    async def post(self, approval: Listed, given: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
        """Post ``given`` to ``approval``'s holder and wait for its reply; None when it was not applied.

        Not applied: the holder did not take it within ``wait_s`` (it is
        withdrawn, so it never will be). The reply says what became of it.
        """
        waiting: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq = None
        try:
            async with self._pool.acquire() as db, db.transaction():
                seq = await db.fetchval(
                    "INSERT INTO egressd_answers (approval, holder, given, from_instance) VALUES ($1, $2, $3, $4) "
                    "RETURNING seq",
                    approval.id, approval.instance, json.dumps(given), self.instance,
                )  # fmt: skip
                self._replies[seq] = waiting  # before the commit: a reply cannot come sooner
                await db.execute("SELECT pg_notify($1, $2)", ANSWERS, f"{approval.instance} {seq}")
        except Exception as exc:  # noqa: BLE001 (not committed: the holder never sees it)
            self._replies.pop(seq or 0, None)
            raise NotSent(str(exc) or type(exc).__name__) from None
        try:
            return await self._outcome(seq, waiting, wait_s)
        except Exception as exc:  # noqa: BLE001 (posted: it may have been taken)
            raise OutcomeUnknown(str(exc) or type(exc).__name__) from None
        finally:
            self._replies.pop(seq, None)

    async def _outcome(self, seq: int, waiting: asyncio.Future[None], wait_s: float) -> dict[str, Any] | None:
        """The holder's reply to letter ``seq``; None once it is withdrawn untaken."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._replied(seq, waiting), wait_s)
        withdrawn = await self._pool.fetchval(
            "UPDATE egressd_answers SET state = 'withdrawn' WHERE seq = $1 AND state IS NULL RETURNING seq", seq
        )
        if withdrawn is not None:
            return None
        reply = await self._pool.fetchval("SELECT reply FROM egressd_answers WHERE seq = $1", seq)
        if reply is None:  # taken and not replied to yet: the holder is applying it now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._replied(seq, waiting), wait_s)
            reply = await self._pool.fetchval("SELECT reply FROM egressd_answers WHERE seq = $1", seq)
        return json.loads(reply) if reply is not None else {"result": "taken"}

    async def _replied(self, seq: int, waiting: asyncio.Future[None]) -> None:
        """Until the reply's notification, or (a notification can be missed) the row says replied."""
        while not waiting.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiting), 0.5)
            if waiting.done():
                return
            if await self._pool.fetchval("SELECT state = 'replied' FROM egressd_answers WHERE seq = $1", seq):
                return
