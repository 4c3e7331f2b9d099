"""``egressd audit``: print the audit log, filtered, as a table or JSON Lines."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Iterable, Mapping

from audit.query import AuditFilter, follow_records, format_json, format_table, parse_since, read_records_from
from config.settings import Settings, SettingsError


def _printer(as_json: bool):  # type: ignore[no-untyped-def]
    header_done = False

    def emit(records: Iterable[Mapping[str, object]]) -> None:
        nonlocal header_done
        if as_json:
            for record in records:
                print(format_json(record))
        else:
            lines = format_table(records)
            first = next(lines, None)  # the header
            if first is not None and not header_done:
                print(first)
                header_done = True
            for line in lines:
                print(line)
        sys.stdout.flush()

    return emit


def run_audit(args: argparse.Namespace, settings: Settings) -> int:
    try:
        since = parse_since(args.since, time.time()) if args.since else None
        flt = AuditFilter(run=args.run, decision=args.decision, host=args.host, since=since)
    except ValueError as exc:
        raise SettingsError(f"bad argument: {exc}") from None
    path = settings.audit_path
    if not path.exists() and not args.follow:
        print(
            f"egressd: no audit log at {path} (nothing recorded yet, or --audit-log names another file)",
            file=sys.stderr,
        )
        return 1
    bad: list[int] = []
    records, offset = read_records_from(path, flt, on_bad_line=lambda off, why: bad.append(off))
    emit = _printer(args.json)
    emit(records)
    if bad:
        print(f"egressd: skipped {len(bad)} unreadable line(s) in {path}", file=sys.stderr)
    if not args.follow:
        return 0

    async def follow() -> int:
        stream = follow_records(path, flt, offset=offset)
        async with contextlib.aclosing(stream):
            async for record in stream:
                emit([record])
        return 0

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follow())
    return 0
