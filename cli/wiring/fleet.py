"""``serve --state``: this egressd in its fleet's list of instances, with a heartbeat, until it stops.

The database is checked before anything listens (unreachable, refused, or
not at this egressd's schema version: egressd does not start, and says
which). Once serving, the instance is registered, beats every
``HEARTBEAT_S``, and is marked stopped when it stops. A heartbeat that
fails is said once as a warning, and the connection is made again at the
next beat; its recovery is said too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from egressd.approvals.webview import RUN_FIELDS
from egressd.config.settings import Settings
from egressd.fleet.store import Instance, StateError, Store

from .errors import StartupError

log = logging.getLogger("egressd.fleet")

HEARTBEAT_S = 10.0
# How often the live runs are looked at: a change is written at once, not at the next heartbeat.
RUNS_S = 1.0


def _egressd_version() -> str:
    try:
        return version("egressd")
    except PackageNotFoundError:
        return "unknown"


def instance_id() -> str:
    """This process's name in the fleet: the host (a pod's name on Kubernetes), the pid and a random part."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class FleetPresence:
    """This egressd in its fleet's database: opened and checked before serving, listed while it serves."""

    def __init__(self, store: Store, dsn: str) -> None:
        self._store: Store | None = store
        self._dsn = dsn
        self.shown = store.shown
        self.id = instance_id()  # known before serving: the approvals this egressd lists carry it
        self.instance: Instance | None = None
        self._beats: asyncio.Task[None] | None = None
        self._failing = False
        # This egressd's live runs as the fleet lists them (set once serving); written with each beat.
        self.runs: Callable[[], list[dict[str, Any]]] = list
        self._written: list[dict[str, Any]] | None = None

    @classmethod
    async def open(cls, settings: Settings) -> FleetPresence | None:
        """None without ``state``; StartupError when the database cannot be used as it is."""
        if settings.state is None:
            return None
        dsn = settings.state.get_secret_value()
        try:
            store = await Store.open(dsn)
        except StateError as exc:
            raise StartupError(str(exc)) from None
        try:
            await store.require_latest()
        except StateError as exc:
            await store.close()
            raise StartupError(str(exc)) from None
        return cls(store, dsn)

    async def join(self, serving: str) -> Instance:
        """List this egressd as serving ``serving``, then beat every ``HEARTBEAT_S``."""
        instance = Instance(self.id, socket.gethostname(), os.getpid(), _egressd_version(), serving)
        assert self._store is not None
        try:
            await self._store.register(instance)
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many; each one means it is not listed)
            raise StartupError(f"cannot list this egressd in the state database at {self.shown}: {exc}") from None
        self.instance = instance
        self._beats = asyncio.get_running_loop().create_task(self._beat())
        return instance

    async def _beat(self) -> None:
        waited = 0.0
        while True:
            await asyncio.sleep(RUNS_S)
            waited += RUNS_S
            # While the database is away, tried again at each heartbeat only.
            if waited >= HEARTBEAT_S or (not self._failing and self._runs_now() != self._written):
                waited = 0.0
                await self._heartbeat()

    def _runs_now(self) -> list[dict[str, Any]] | None:
        try:
            # What the fleet is told of each run: the fields the approvals page shows (never a token).
            return [{name: run.get(name) for name in RUN_FIELDS} for run in self.runs()]
        except Exception:  # the beat goes on without them; said
            log.exception("fleet: this egressd's runs could not be listed")
            return None

    async def _heartbeat(self) -> None:
        assert self.instance is not None
        try:
            if self._store is None:
                self._store = await Store.open(self._dsn)
                await self._store.register(self.instance)  # listed again: the database may have been restored
            runs = self._runs_now()
            await self._store.heartbeat(self.instance.id, runs)
            self._written = runs
        except Exception as exc:  # noqa: BLE001 (asyncpg's errors are many; every one means "not now")
            if not self._failing:
                log.warning("state database %s: heartbeat failed (%s); trying again every %.0fs", self.shown,
                            exc, HEARTBEAT_S)  # fmt: skip
            self._failing = True
            await self._drop()
            return
        if self._failing:
            log.warning("state database %s: back; this egressd is listed again", self.shown)
            self._failing = False

    async def _drop(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(Exception):
                await store.close()

    async def leave(self) -> None:
        """Marked stopped (when the database answers), the connection closed."""
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        if self.instance is not None and self._store is not None:
            try:
                await asyncio.wait_for(self._store.stopped(self.instance.id), 5.0)
            except Exception as exc:  # noqa: BLE001 (stopping: said, not raised)
                log.warning("state database %s: could not mark this egressd stopped: %s", self.shown, exc)
        await self._drop()
