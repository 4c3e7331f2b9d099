"""Reading the audit log back: filter, follow and print it (``egressd audit``).

Flow: ``read_records`` (or ``read_records_from`` with an offset) reads what
is already in the file; ``follow_records`` then yields what is appended, from
the offset the read ended at, so nothing is lost or shown twice between the
two; ``format_table`` or ``format_json`` turn records into lines to print.
``join_ends`` (pure) shows an allowed connection as one record: its
``egress`` record (written before the dial) with its ``egress.end`` record
folded in, or ``end: "open"`` while there is none yet. ``verify_chain``
(pure) checks the hash chain over lines given in order and
``verify_files`` feeds it the lines of files (``egressd audit verify``).

The log is written by egressd, but its fields carry what a sandboxed process
asked for (host names, commands), so everything printed for a terminal is
escaped: a record cannot move the cursor or repaint the screen. A line that
is not a JSON object (a torn last write, damage) is skipped and reported
through ``on_bad_line(offset, reason)``, where ``offset`` is the byte offset
of the line's start in the file.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import json
import os
import re
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from egressd.names.shown import ascii_escaped

__all__ = [
    "AuditFilter",
    "ChainLine",
    "ChainReport",
    "OnBadLine",
    "follow_records",
    "format_json",
    "format_table",
    "join_ends",
    "parse_since",
    "read_records",
    "read_records_from",
    "verify_chain",
    "verify_files",
]

OnBadLine = Callable[[int, str], None]

# How much one follow poll reads per pread; a poll still reads up to the
# size the file had when the poll began, this only bounds one buffer.
_CHUNK_BYTES = 64 * 1024

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[smhdw])")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
# --since words: days back from today's midnight UTC.
_DAYS_BACK = {"today": 0, "yesterday": 1}

# A command longer than this is cut in the table (``--json`` shows it all);
# host names are never cut, since a cut could hide the domain that matters.
_MAX_TEXT = 80


@dataclass(frozen=True)
class AuditFilter:
    """Which records ``egressd audit`` shows; every field given must match.

    - ``run``: the record's run id, exactly;
    - ``decision``: ``"allow"`` or ``"deny"`` (records without a decision,
      such as ``run.start``, do not match);
    - ``host``: ``example.com`` matches that host only, ``*.example.com`` any
      subdomain but not the apex (as in the allowlist); case-insensitive,
      one trailing dot ignored;
    - ``since``: epoch seconds; records at or after it (see ``parse_since``);
    - ``events``: event names to keep (``egress``, ``run.start``, ...);
      ``None`` keeps all.

    Raises ``ValueError`` for an unknown decision or a host pattern with a
    ``*`` anywhere but a leading ``*.``.
    """

    run: str | None = None
    decision: str | None = None
    host: str | None = None
    since: float | None = None
    events: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.decision is not None and self.decision not in ("allow", "deny"):
            raise ValueError(f"decision must be allow or deny, not {self.decision!r}")
        if self.host is not None:
            rest = self.host[2:] if self.host.startswith("*.") else self.host
            if "*" in rest or not _normal_host(rest):
                raise ValueError(f"host filter must be a name or *.name (one leading wildcard), not {self.host!r}")

    def matches(self, record: Mapping[str, object]) -> bool:
        """Return True if ``record`` passes every condition given."""
        if self.events is not None and record.get("event") not in self.events:
            return False
        if self.run is not None and record.get("run") != self.run:
            return False
        if self.decision is not None and record.get("decision") != self.decision:
            return False
        if self.host is not None and not _host_matches(self.host, record.get("host")):
            return False
        if self.since is not None:
            when = _record_time(record)
            # A record without a readable time cannot be shown to be recent.
            if when is None or when < self.since:
                return False
        return True


# What an ``egress.end`` record adds to its ``egress`` record; the rest of it
# (``event``, ``id``, ``ts``, ``run``, ``prev``) belongs to the end itself.
_END_OWN = frozenset({"event", "id", "ts", "run", "prev"})
# Ends that are not a refusal (egressd.audit.records.ENDS; the query side does not import the builders).
_NORMAL_ENDS = frozenset({"closed", "idle_timeout", "shutdown"})
OPEN = "open"


def join_ends(records: Iterable[Mapping[str, object]]) -> list[dict[str, object]]:
    """Fold each ``egress.end`` record into its allowed ``egress`` record; keep everything else in order.

    The joined record takes the end's bytes, duration, address, ``end`` and
    extra fields (``status``, ``detail``, ...); an ``end`` that is a reason
    code (``sni_mismatch``, ``upstream_unreachable``: cut or failed after
    the dial was recorded) makes it ``decision: deny`` with that reason. An
    allowed connection with no end yet gets ``end: "open"`` (a DNS query is
    answered, not dialled: its one record is final). An end whose
    ``egress`` record is not among ``records`` (it is in an older, rotated
    file) is kept as it is.
    """
    items = [dict(record) for record in records]
    ends: dict[object, dict[str, object]] = {}
    for record in items:
        if record.get("event") == "egress.end" and record.get("id") is not None:
            ends[record["id"]] = record
    joined: list[dict[str, object]] = []
    used: set[int] = set()
    for record in items:
        event = record.get("event")
        if event == "egress" and record.get("decision") == "allow" and record.get("kind") != "dns":
            end = ends.get(record.get("id"))
            if end is None:
                record["end"] = OPEN
            else:
                used.add(id(end))
                _fold(record, end)
        elif event == "egress.end" and id(record) in used:
            continue
        joined.append(record)
    return joined


def _fold(record: dict[str, object], end: Mapping[str, object]) -> None:
    for key, value in end.items():
        if key not in _END_OWN:
            record[key] = value
    how = end.get("end")
    if isinstance(how, str) and how not in _NORMAL_ENDS:
        record["decision"] = "deny"
        record["reason"] = how


def parse_since(text: str, now: float) -> float:
    """Turn a ``--since`` value into epoch seconds.

    Accepts an RFC 3339 time (``2026-11-29T10:00:00Z``, ``...+01:00``; a
    time without an offset is read as UTC, like the log), a date
    (``2026-11-29``, midnight UTC), ``today`` or ``yesterday`` (midnight
    UTC), or a duration back from ``now`` (``90s``, ``15m``, ``2h``, ``1d``,
    ``1w``). Case does not matter. Raises ``ValueError`` otherwise.
    """
    value = text.strip().lower()
    duration = _DURATION.fullmatch(value)
    if duration is not None:
        return now - float(duration["number"]) * _UNIT_SECONDS[duration["unit"]]
    days_back = _DAYS_BACK.get(value)
    if days_back is not None:
        midnight = _dt.datetime.fromtimestamp(now, _dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        return (midnight - _dt.timedelta(days=days_back)).timestamp()
    try:
        # upper(): RFC 3339 §5.6 allows a lowercase "t" and "z"; fromisoformat does not.
        moment = _dt.datetime.fromisoformat(value.upper())
    except ValueError:
        raise ValueError(
            f"cannot read since={text!r}: give an RFC 3339 time (2026-11-29T10:00:00Z), "
            "a date (2026-11-29), today, yesterday, or a duration (90s, 15m, 2h, 1d, 1w)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.UTC)
    return moment.timestamp()


def read_records(
    path: str | os.PathLike[str],
    flt: AuditFilter,
    *,
    on_bad_line: OnBadLine | None = None,
) -> Iterator[dict[str, object]]:
    """Yield the records in the file at ``path`` that ``flt`` matches.

    Streams: the file is read line by line and closed when the iterator is
    exhausted or closed. Bad lines, including an unterminated last line,
    are skipped and reported. ``OSError`` (e.g. a missing file) propagates.
    """
    with open(path, "rb") as file:
        offset = 0
        for line in file:
            start = offset
            offset += len(line)
            if not line.endswith(b"\n"):
                _report(on_bad_line, start, "unterminated last line (torn write?)")
                return
            record = _parse_line(line, start, on_bad_line)
            if record is not None and flt.matches(record):
                yield record


def read_records_from(
    path: str | os.PathLike[str],
    flt: AuditFilter,
    offset: int = 0,
    *,
    on_bad_line: OnBadLine | None = None,
) -> tuple[list[dict[str, object]], int]:
    """Read the complete lines from byte ``offset`` on; return matches and the new offset.

    The new offset is the end of the last complete line, so an unfinished
    last line is neither reported nor lost: pass the offset to
    ``follow_records`` and it is read once it is complete. A missing file
    reads as empty (offset 0); an ``offset`` past the end of the file means
    it was truncated since, and reading starts again from 0.
    """
    try:
        file = open(path, "rb")  # closed by the with below
    except FileNotFoundError:
        return [], 0
    records: list[dict[str, object]] = []
    with file:
        if offset > os.fstat(file.fileno()).st_size:
            offset = 0
        file.seek(offset)
        for line in file:
            if not line.endswith(b"\n"):
                break
            start = offset
            offset += len(line)
            record = _parse_line(line, start, on_bad_line)
            if record is not None and flt.matches(record):
                records.append(record)
    return records, offset


@dataclass(frozen=True)
class ChainLine:
    """One line of a log for ``verify_chain``: where it is, and its bytes as stored (newline included)."""

    file: str
    number: int  # 1-based, within ``file``
    raw: bytes


@dataclass(frozen=True)
class ChainReport:
    """What ``verify_chain`` found.

    ``records``: the records checked and found chained before any problem;
    ``problem``: None if the chain is intact, else a sentence naming the
    first record edited, removed, inserted or cut short; ``notes``: what
    the check could not cover (a first record that continues a chain from
    a file not given).
    """

    records: int
    problem: str | None
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.problem is None


def verify_chain(lines: Iterable[ChainLine]) -> ChainReport:
    """Check that each record's ``prev`` is the SHA-256 (hex) of the line before it, as stored.

    The lines are the log's, oldest first, across rotated files. The first
    record may carry ``prev: null`` (a fresh log) or a hash (its chain began
    in a file not given; noted, since what came before cannot be checked).
    At the first break it names what the bytes show: a line whose record
    carries the same ``prev`` as the line before it, or one the next record
    skips over, was inserted; otherwise the line before the break was
    edited or records were removed just before the break (an unkeyed chain
    cannot tell those two apart, so both are named). A last line without
    its newline is a truncated tail; a line that is not a JSON object with
    a ``prev`` is named as damaged. Stops at the first problem.
    """
    it = iter(lines)
    notes: list[str] = []
    count = 0
    previous: ChainLine | None = None
    previous_prev: object = None  # the prev the previous record carried
    current = next(it, None)
    while current is not None:
        following = next(it, None)
        where = _where(current)
        if not current.raw.endswith(b"\n"):
            if following is None:
                tail = f"truncated tail: {where} is cut short (the file ends mid-record)"
                return ChainReport(count, tail, tuple(notes))
            return ChainReport(count, f"{where} is cut short (a torn write, or an edit)", tuple(notes))
        record = _chain_record(current.raw)
        if record is None:
            return ChainReport(count, f"{where} is not a chained JSON record (edited or damaged)", tuple(notes))
        prev = record["prev"]
        if previous is None:
            if prev is not None:
                notes.append(f"{where} continues a chain from a file not given; records before it are not checked")
        else:
            expected = hashlib.sha256(previous.raw).hexdigest()
            if prev != expected:
                here = f"{where} ({_describe(record)})"
                before = _chain_record(previous.raw) or {}
                there = f"{_where(previous)} ({_describe(before)})"
                if prev == previous_prev:
                    problem = f"{there} was inserted: {here} chains past it"
                elif following is not None and (_chain_record(following.raw) or {}).get("prev") == expected:
                    problem = f"{here} was inserted: the record after it chains past it"
                else:
                    problem = (
                        f"chain broken at {here}: {there} was edited, or records were removed between it and {where}"
                    )
                return ChainReport(count, problem, tuple(notes))
        count += 1
        previous, previous_prev, current = current, prev, following
    return ChainReport(count, None, tuple(notes))


def verify_files(paths: Iterable[str | os.PathLike[str]]) -> ChainReport:
    """``verify_chain`` over the lines of ``paths``, oldest first, read as a stream.

    ``OSError`` (a missing or unreadable file) propagates.
    """

    def lines() -> Iterator[ChainLine]:
        for path in paths:
            name = os.fspath(path)
            with open(name, "rb") as file:
                for number, raw in enumerate(file, 1):
                    yield ChainLine(name, number, raw)

    return verify_chain(lines())


def _where(line: ChainLine) -> str:
    return f"line {line.number} of {_safe(line.file)}"


def _chain_record(raw: bytes) -> dict[str, object] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or "prev" not in record:
        return None
    if record["prev"] is not None and not isinstance(record["prev"], str):
        return None
    return record


def _describe(record: Mapping[str, object]) -> str:
    parts = [f"{key} {_safe(record[key])}" for key in ("id", "event", "run") if record.get(key) is not None]
    return ", ".join(parts) or "no id"


async def follow_records(
    path: str | os.PathLike[str],
    flt: AuditFilter,
    *,
    offset: int | None = None,
    poll_s: float = 0.2,
    stop: asyncio.Event | None = None,
    on_bad_line: OnBadLine | None = None,
) -> AsyncGenerator[dict[str, object], None]:
    """Yield matching records as they are appended, like ``tail -F``.

    ``offset=None`` starts at the current end of the file (skipping the rest
    of a line in progress); an int starts there, normally the offset
    ``read_records_from`` returned. Polls every ``poll_s`` seconds. Waits
    for a file that does not exist yet, and for the newline of a partly
    written line. A file that shrinks (truncated) is read again from 0; a
    file replaced at ``path`` (rotated) is read to its end, then the new one
    from 0. Runs until cancelled, or until ``stop`` is set: then it reads
    once more, yields what it found and returns. Use it inside
    ``contextlib.aclosing`` so the file is closed when the loop is left.
    """
    follower = _Follower(os.fspath(path), flt, offset, on_bad_line)
    try:
        while True:
            # Checked before the read so the last read sees everything
            # written before stop was set.
            stopping = stop is not None and stop.is_set()
            for record in follower.poll():
                yield record
            if stopping:
                return
            if stop is None:
                await asyncio.sleep(poll_s)
            else:
                try:
                    async with asyncio.timeout(poll_s):
                        await stop.wait()
                except TimeoutError:
                    pass
    finally:
        follower.close()


def format_json(record: Mapping[str, object]) -> str:
    """Return ``record`` as one compact JSON line (no newline).

    ASCII-only, so control characters, C1 controls and look-alike letters
    arrive on the terminal as ``\\uXXXX`` escapes, never raw.
    """
    return json.dumps(record, separators=(",", ":"), ensure_ascii=True)


_COLUMNS: tuple[tuple[str, int, bool], ...] = (
    # (title, width, right-aligned)
    ("TIME (UTC)", 19, False),
    ("RUN", 12, False),
    ("KIND", 7, False),
    ("DECISION", 8, False),
    ("REASON", 18, False),
    ("DESTINATION", 30, False),
    ("ADDRESS", 15, False),
    ("UP", 9, True),
    ("DOWN", 9, True),
    ("DURATION", 8, True),
    ("BY", 0, False),
)


def format_table(records: Iterable[Mapping[str, object]]) -> Iterator[str]:
    """Yield a header line, then one fixed-width line per record (no newlines).

    Egress records show time (UTC), run, kind, ALLOW/DENY, reason,
    host:port, address, bytes up/down, duration and the approver; run and
    approval events get a one-line summary in the same time and run
    columns. A value wider than its column pushes the rest of the line right
    rather than being cut. Every value from the record is escaped: control
    characters, backslashes and non-ASCII characters appear as ``\\x1b``,
    ``\\\\``, ``\\u0430`` and so on.
    """
    yield _row([title for title, _, _ in _COLUMNS])
    for record in records:
        if record.get("event") == "egress":
            yield _egress_row(record)
        else:
            yield _event_row(record)


class _Follower:
    """The synchronous core of ``follow_records``: one ``poll`` per tick.

    Reads are local, bounded by the file's size at the start of the poll,
    and done with ``pread``; they do not block the event loop in any way
    that matters for a command that does nothing else while following.
    """

    def __init__(
        self,
        path: str,
        flt: AuditFilter,
        offset: int | None,
        on_bad_line: OnBadLine | None,
    ) -> None:
        self._path = path
        self._flt = flt
        self._on_bad_line = on_bad_line
        self._fd: int | None = None
        self._identity: tuple[int, int] = (0, 0)
        # Bytes of the file consumed so far, including _pending.
        self._offset = 0
        self._pending = b""
        # True while the first line seen is the tail of one begun before we
        # started; it is dropped up to its newline.
        self._skip_partial = False
        if self._open() and self._fd is not None:
            size = os.fstat(self._fd).st_size
            if offset is None:
                self._offset = size
                self._skip_partial = size > 0 and os.pread(self._fd, 1, size - 1) != b"\n"
            elif offset <= size:
                self._offset = offset

    def poll(self) -> list[dict[str, object]]:
        """Return the matching records completed since the last poll."""
        records: list[dict[str, object]] = []
        try:
            info: os.stat_result | None = os.stat(self._path)
        except FileNotFoundError:
            info = None
        if self._fd is not None and (info is None or _identity(info) != self._identity):
            # Rotated or removed: first finish what was written to the old
            # file, then move to the new one (if there is one yet).
            records.extend(self._drain())
            if info is not None:
                self._close_fd()
        if self._fd is None and info is not None:
            self._open()
        if self._fd is not None:
            records.extend(self._drain())
        return records

    def close(self) -> None:
        """Close the file being followed."""
        self._close_fd()

    def _open(self) -> bool:
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        self._fd = fd
        self._identity = _identity(os.fstat(fd))
        self._offset = 0
        self._pending = b""
        self._skip_partial = False
        return True

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _drain(self) -> list[dict[str, object]]:
        if self._fd is None:
            return []
        size = os.fstat(self._fd).st_size
        if size < self._offset:
            # Truncated (copytruncate rotation, or emptied by hand).
            self._offset = 0
            self._pending = b""
            self._skip_partial = False
        records: list[dict[str, object]] = []
        while self._offset < size:
            chunk = os.pread(self._fd, min(_CHUNK_BYTES, size - self._offset), self._offset)
            if not chunk:
                break
            self._offset += len(chunk)
            records.extend(self._take_lines(chunk))
        return records

    def _take_lines(self, chunk: bytes) -> list[dict[str, object]]:
        data = self._pending + chunk
        start = self._offset - len(data)
        lines = data.split(b"\n")
        self._pending = lines.pop()
        records: list[dict[str, object]] = []
        for line in lines:
            line_start = start
            start += len(line) + 1
            if self._skip_partial:
                self._skip_partial = False
                continue
            record = _parse_line(line, line_start, self._on_bad_line)
            if record is not None and self._flt.matches(record):
                records.append(record)
        return records


def _identity(info: os.stat_result) -> tuple[int, int]:
    return (info.st_dev, info.st_ino)


def _report(on_bad_line: OnBadLine | None, offset: int, reason: str) -> None:
    if on_bad_line is not None:
        on_bad_line(offset, reason)


def _parse_line(line: bytes, offset: int, on_bad_line: OnBadLine | None) -> dict[str, object] | None:
    try:
        value = json.loads(line)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        _report(on_bad_line, offset, f"not JSON: {exc}")
        return None
    if not isinstance(value, dict):
        _report(on_bad_line, offset, f"not a JSON object but {type(value).__name__}")
        return None
    return value


def _normal_host(host: str) -> str:
    host = host.lower()
    return host[:-1] if host.endswith(".") else host


def _host_matches(pattern: str, host: object) -> bool:
    if not isinstance(host, str):
        return False
    name = _normal_host(host)
    if pattern.startswith("*."):
        suffix = "." + _normal_host(pattern[2:])
        return name.endswith(suffix) and len(name) > len(suffix)
    return name == _normal_host(pattern)


def _record_time(record: Mapping[str, object]) -> float | None:
    moment = _record_datetime(record)
    return None if moment is None else moment.timestamp()


def _record_datetime(record: Mapping[str, object]) -> _dt.datetime | None:
    ts = record.get("ts")
    if not isinstance(ts, str):
        return None
    try:
        moment = _dt.datetime.fromisoformat(ts)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.UTC)
    return moment.astimezone(_dt.UTC)


def _safe(value: object) -> str:
    """Render a value from a record so it prints as itself and nothing else.

    Printable ASCII stays; a backslash is doubled so an escape cannot be
    forged; everything else (C0/C1 controls, DEL, any non-ASCII letter that
    could pose as another) becomes a Python-style escape (``egressd.names.shown.ascii_escaped``).
    """
    return ascii_escaped(value if isinstance(value, str) else str(value))


def _text(value: object, limit: int | None = None) -> str:
    if value is None:
        return "-"
    text = _safe(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def _time(record: Mapping[str, object]) -> str:
    moment = _record_datetime(record)
    if moment is None:
        return _text(record.get("ts"), 19)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _destination(host: object, port: object) -> str:
    if host is None:
        return "-"
    name = _safe(host)
    if ":" in name:
        name = f"[{name}]"  # an IPv6 literal, as in a URL (RFC 3986 §3.2.2)
    return name if port is None else f"{name}:{_safe(port)}"


def _bytes(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _text(value, 9)
    amount = float(value)
    if amount < 1024:
        return f"{amount:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        amount /= 1024
        if amount < 1024 or unit == "TiB":
            break
    return f"{amount:.1f} {unit}"


def _duration(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return _text(value, 8)
    seconds = float(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _row(cells: list[str]) -> str:
    parts: list[str] = []
    for (_, width, right), cell in zip(_COLUMNS, cells, strict=True):
        parts.append(cell.rjust(width) if right else cell.ljust(width))
    return "  ".join(parts).rstrip()


def _egress_row(record: Mapping[str, object]) -> str:
    approval = record.get("approval")
    by = "-"
    if isinstance(approval, Mapping):
        by = _text(approval.get("by")) if approval.get("by") is not None else "(no answer)"
    decision = record.get("decision")
    reason = record.get("reason")
    if reason is None and record.get("end") not in (None, "closed"):
        reason = record.get("end")  # open, idle_timeout, shutdown
    return _row(
        [
            _time(record),
            _text(record.get("run")),
            _text(record.get("kind")),
            _text(decision.upper() if isinstance(decision, str) else decision),
            _text(reason),
            _destination(record.get("host"), record.get("port")),
            _text(record.get("address")),
            _bytes(record.get("bytes_up")),
            _bytes(record.get("bytes_down")),
            _duration(record.get("duration_s")),
            by,
        ]
    )


def _event_row(record: Mapping[str, object]) -> str:
    event = record.get("event")
    if event == "approval.requested":
        channels = record.get("channels")
        via = ",".join(_safe(c) for c in channels) if isinstance(channels, list) else "-"
        summary = (
            f"APPROVAL ASKED    {_text(record.get('id'))}  "
            f"{_destination(record.get('host'), record.get('port'))}  via {via}  "
            f"command: {_text(record.get('command'), _MAX_TEXT)}"
        )
    elif event == "approval.decided":
        decision = record.get("decision")
        verdict = _text(decision.upper() if isinstance(decision, str) else decision)
        who = (
            f"by {_text(record.get('by'))} via {_text(record.get('channel'))}"
            if record.get("by") is not None
            else "nobody answered"
        )
        reason = record.get("reason")
        because = f" ({_text(reason)})" if reason is not None else ""
        summary = (
            f"APPROVAL {verdict:<8} {_text(record.get('id'))}  {who}{because}"
            f"  after {_duration(record.get('waited_s'))}"
        )
    else:
        label = _text(event).upper().replace(".", " ")
        fields = "  ".join(
            f"{_safe(key)}: {_field(value)}" for key, value in record.items() if key not in ("event", "ts", "run")
        )
        summary = f"{label:<17} {fields}".rstrip()
    return f"{_time(record):<19}  {_text(record.get('run')):<12}  {summary}"


def _field(value: object) -> str:
    if isinstance(value, list):
        return ",".join(_text(item, _MAX_TEXT) for item in value) or "-"
    if isinstance(value, Mapping):
        return _text(json.dumps(value, separators=(",", ":"), ensure_ascii=True), _MAX_TEXT)
    return _text(value, _MAX_TEXT)
