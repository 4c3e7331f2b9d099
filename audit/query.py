"""Reading the audit log back: read, filter and follow it (``egressd audit``).

Flow: ``read_records`` (or ``read_records_from`` with an offset) reads what
is already in the file; ``follow_records`` then yields what is appended, from
the offset the read ended at, so nothing is lost or shown twice between the
two; ``egressd.audit.display`` turns records into lines to print.
``join_ends`` (pure) shows an allowed connection as one record: its
``egress`` record (written before the dial) with its ``egress.end`` record
folded in, or ``end: "open"`` while there is none yet. The hash chain is
checked by ``egressd.audit.chain`` (``egressd audit verify``).

A line that is not a JSON object (a torn last write, damage) is skipped and
reported through ``on_bad_line(offset, reason)``, where ``offset`` is the byte
offset of the line's start in the file.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import re
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from egressd.vocabulary.egress import End

__all__ = [
    "AuditFilter",
    "OnBadLine",
    "follow_records",
    "join_ends",
    "parse_since",
    "read_records",
    "read_records_from",
    "record_datetime",
]

OnBadLine = Callable[[int, str], None]

# How much one follow poll reads per pread; a poll still reads up to the
# size the file had when the poll began, this only bounds one buffer.
_CHUNK_BYTES = 64 * 1024

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[smhdw])")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
# --since words: days back from today's midnight UTC.
_DAYS_BACK = {"today": 0, "yesterday": 1}


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
# Ends that are not a refusal.
_NORMAL_ENDS = frozenset(End)
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
    moment = record_datetime(record)
    return None if moment is None else moment.timestamp()


def record_datetime(record: Mapping[str, object]) -> _dt.datetime | None:
    """The record's ``ts`` as a UTC time (naive text read as UTC); None when it has none or it does not parse."""
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


