"""``egressd state migrate|status|denials|lift``: a fleet's database, its schema, its instances, its shared
denials."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime

from egressd.config.settings import Settings
from egressd.fleet.rules import DENIAL_HOURS, FleetRules
from egressd.fleet.schema import LATEST
from egressd.fleet.store import InstanceRow, StateError, Store
from egressd.names.shown import logged

from ..wiring.fleet import HEARTBEAT_S


def run_state(args: argparse.Namespace, settings: Settings) -> int:
    """0: done (migrate, denials, lift) or at this egressd's version (status); 1: the database cannot be used, or
    nothing to lift; 2: no database."""
    if settings.state is None:
        print("egressd state: name the database: --state postgresql://USER@HOST/DATABASE "
              "(or --state-file, EGRESSD_STATE, state in the config file)", file=sys.stderr)  # fmt: skip
        return 2
    dsn = settings.state.get_secret_value()
    actions = {"migrate": _migrate, "status": _status, "denials": _denials}
    try:
        if args.state_action == "lift":
            return asyncio.run(_lift(dsn, args.hosts, args.by))
        return asyncio.run(actions[args.state_action](dsn))
    except StateError as exc:
        print(f"egressd state: {exc}", file=sys.stderr)
        return 1


async def _migrate(dsn: str) -> int:
    store = await Store.open(dsn)
    try:
        before, after = await store.migrate()
    finally:
        await store.close()
    if before == after:
        print(f"{store.shown}: at schema version {after}, the latest this egressd knows; nothing to do")
    else:
        print(f"{store.shown}: migrated from schema version {before} to {after}")
    return 0


async def _status(dsn: str) -> int:
    store = await Store.open(dsn)
    try:
        current = await store.version()
        rows = await store.instances(with_runs=current >= 3) if current >= 1 else []
    finally:
        await store.close()
    verdict = (
        "this egressd's" if current == LATEST
        else f"this egressd needs {LATEST}: run egressd state migrate" if current < LATEST
        else f"newer than this egressd ({LATEST})"
    )  # fmt: skip
    print(f"{store.shown}: schema version {current} ({verdict})")
    now = datetime.now(UTC)
    for line in describe(rows, now):
        print(line)
    return 0 if current == LATEST else 1


def describe(rows: list[InstanceRow], now: datetime) -> list[str]:
    """The instances, one line each: serving (a heartbeat within three beats), silent, or stopped; under a
    serving one, its live runs at its last heartbeat."""
    if not rows:
        return ["no instances"]
    lines = [f"{len(rows)} instance{'s' if len(rows) != 1 else ''}:"]
    for row in rows:
        i = row.instance
        beat = (now - row.heartbeat_at).total_seconds()
        if row.stopped_at is not None:
            state = f"stopped {row.stopped_at:%Y-%m-%d %H:%M:%S}Z"
        elif beat <= 3 * HEARTBEAT_S:
            state = f"serving, last heartbeat {beat:.0f}s ago"
        else:
            state = f"SILENT for {beat:.0f}s (gone without stopping?)"
        lines.append(f"  {i.id}  {i.host} pid {i.pid}  egressd {i.egressd_version}  {i.serving}  {state}")
        if row.stopped_at is None and beat <= 3 * HEARTBEAT_S:
            for run in row.runs:
                task = f"  task {logged(str(run['task']), 80)}" if run.get("task") else ""
                command = f"  running {logged(str(run['command']), 80)}" if run.get("command") else ""
                lines.append(f"    run {logged(str(run.get('id')), 40)}{task}{command}")
    return lines


async def _usable(dsn: str) -> FleetRules:
    """The rules of a database at this egressd's schema version (StateError otherwise), not listening."""
    store = await Store.open(dsn)
    try:
        await store.require_latest()
    finally:
        await store.close()
    rules = FleetRules(dsn, None)
    await rules.open()
    return rules


async def _denials(dsn: str) -> int:
    rules = await _usable(dsn)
    try:
        standing = await rules.denials()
    finally:
        await rules.close()
    if not standing:
        print(f"no shared denial standing (each stands for {DENIAL_HOURS} hours unless lifted)")
    for d in standing:
        print(f"{d.host}  {d.reach} {d.key!r}  denied {d.at} by {d.by or '-'} via {d.channel or '-'} on {d.instance}"
              f"  (approval {d.approval})")
    return 0


async def _lift(dsn: str, hosts: list[str], by: str | None) -> int:
    rules = await _usable(dsn)
    try:
        lifted = await rules.lift(hosts, by)
    finally:
        await rules.close()
    for d in lifted:
        print(f"lifted: {d.host} ({d.reach} {d.key!r}, approval {d.approval}): runs that start from now on are "
              "asked again")
    missing = sorted(set(hosts) - {d.host for d in lifted})
    for host in missing:
        print(f"egressd state: no standing shared denial of {host}", file=sys.stderr)
    return 1 if missing else 0
