"""``egressd audit``: print the audit log, filtered, as a table or JSON Lines; ``audit verify``: check its chain;
``audit suggest``: allowlist entries from what a run did (``egressd.audit.suggest``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from egressd.audit.chain import verify_files
from egressd.audit.display import format_json, format_table
from egressd.audit.log import STDOUT
from egressd.audit.query import (
    AuditFilter,
    follow_records,
    join_ends,
    parse_since,
    read_records,
    read_records_from,
)
from egressd.config.settings import Settings, SettingsError
from egressd.proxy.core.suggest import SuggestError, render, suggest


def _printer(as_json: bool) -> Callable[[Iterable[Mapping[str, object]]], None]:
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


def _refuse_stdout(path: Path) -> None:
    """``--audit-log -`` names where ``serve`` writes, not a file to read back: one clear line."""
    if str(path) == STDOUT:
        raise SettingsError(
            "bad setting audit_log: - is egressd serve's standard output, not a file to read: save what it wrote "
            "(e.g. kubectl logs POD -c egressd > audit.jsonl) and name that file"
        )


def run_audit(args: argparse.Namespace, settings: Settings) -> int:
    try:
        since = parse_since(args.since, time.time()) if args.since else None
        flt = AuditFilter(run=args.run, decision=args.decision, host=args.host, since=since)
    except ValueError as exc:
        raise SettingsError(f"bad argument: {exc}") from None
    path = settings.audit_path
    _refuse_stdout(path)
    if not path.exists() and not args.follow:
        print(
            f"egressd: no audit log at {path} (nothing recorded yet, or --audit-log names another file)",
            file=sys.stderr,
        )
        return 1
    bad: list[int] = []
    # The rotated files first (oldest first), so a connection and its end join across a rotation;
    # joined before filtering: an egress.end carries no host or decision of its own.
    everything: list[dict[str, object]] = []
    for older in log_files(path)[:-1]:
        records, _ = read_records_from(older, AuditFilter(), on_bad_line=lambda off, why: bad.append(off))
        everything += records
    current, offset = read_records_from(path, AuditFilter(), on_bad_line=lambda off, why: bad.append(off))
    everything += current
    joined = join_ends(everything)
    emit = _printer(args.json)
    emit(record for record in joined if flt.matches(record))
    if bad:
        print(f"egressd: skipped {len(bad)} unreadable line(s) in {path}", file=sys.stderr)
    if not args.follow:
        return 0
    # Connections still open: their end, when it comes, is shown joined to them (a second line).
    still_open = {r.get("id"): r for r in joined if r.get("event") == "egress" and r.get("end") == "open"}

    async def follow() -> int:
        stream = follow_records(path, AuditFilter(), offset=offset)
        async with contextlib.aclosing(stream):
            async for record in stream:
                if record.get("event") == "egress.end" and record.get("id") in still_open:
                    record = join_ends([still_open.pop(record.get("id")), record])[0]
                else:
                    record = join_ends([record])[0]
                    if record.get("end") == "open":
                        still_open[record.get("id")] = record
                if flt.matches(record):
                    emit([record])
        return 0

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(follow())
    return 0


def log_files(path: Path) -> list[Path]:
    """The log at ``path`` and its rotated files, oldest first: ``PATH.N``, ..., ``PATH.1``, ``PATH``.

    Rotated files are taken while their numbers run on without a gap.
    """
    rotated: list[Path] = []
    while (candidate := path.with_name(f"{path.name}.{len(rotated) + 1}")).exists():
        rotated.append(candidate)
    return [*reversed(rotated), path]


def run_verify(args: argparse.Namespace, settings: Settings) -> int:
    """Check the hash chain over FILE... (oldest first) or the configured log; 0 intact, 1 not, 2 unreadable."""
    files = [Path(name) for name in args.files] if args.files else log_files(settings.audit_path)
    for name in files:
        _refuse_stdout(name)
    try:
        report = verify_files(files, head=args.head)
    except OSError as exc:
        print(f"egressd: cannot read {exc.filename or 'the audit log'}: {exc.strerror}", file=sys.stderr)
        return 2
    for note in report.notes:
        print(f"note: {note}")
    if report.problem is not None:
        print(f"audit chain NOT intact: {report.problem} ({report.records} records verified before it)")
        return 1
    anchored = ", the head given among them" if args.head else ""
    print(f"audit chain intact: {report.records} records in {len(files)} file(s){anchored}")
    return 0


def run_suggest(args: argparse.Namespace, settings: Settings) -> int:
    """Print the allowlist a run's records suggest, as TOML: 0 done, 1 no audit log, 2 unknown run or bad file."""
    files = [Path(name) for name in args.files] if args.files else log_files(settings.audit_path)
    for name in files:
        _refuse_stdout(name)
    if not args.files:
        if not files[-1].exists():
            print(
                f"egressd: no audit log at {files[-1]} (nothing recorded yet, or --audit-log names another file)",
                file=sys.stderr,
            )
            return 1
    bad: list[int] = []
    records: list[dict[str, object]] = []
    for path in files:
        try:
            records += read_records(path, AuditFilter(), on_bad_line=lambda off, why: bad.append(off))
        except OSError as exc:
            print(f"egressd: cannot read {exc.filename or path}: {exc.strerror}", file=sys.stderr)
            return 2
    if bad:
        print(f"egressd: skipped {len(bad)} unreadable line(s)", file=sys.stderr)
    try:
        suggestion = suggest(records, args.suggest_run or args.run, include_dns=args.include_dns)
    except SuggestError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(suggestion))
    return 0
