"""Audit sinks: where records go, and what happens when they cannot.

The proxy writes one record per egress attempt through an ``AuditSink``. A
sink that cannot write raises ``AuditError`` and reports ``healthy == False``
from then on; the proxy refuses new egress while its sink is unhealthy, so
no connection ever goes unrecorded (fail closed).

``JsonlAuditSink`` appends to a JSON Lines file, chains its records (each
carries ``prev``, the SHA-256 of the line before it as written), rotates it
by size and reopens it on request; given ``-`` (``STDOUT``) it writes the same
lines to standard output, for a cluster's log collector; ``MemoryAuditSink`` keeps records in a
list for tests (unchained: the chain is a property of the file's bytes).

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from egressd.audit import line, logfile
from egressd.audit.logfile import AuditError
from egressd.audit.shared import Position, SharedChain
from egressd.config.trusted import UntrustedFile, open_directory

__all__ = ["STDOUT", "AuditError", "AuditSink", "JsonlAuditSink", "MemoryAuditSink"]

logger = logging.getLogger("egressd.audit")

# The path that means standard output (``--audit-log -``).
STDOUT = "-"

# The most a line's ``"prev":"<64 hex>"}`` and newline add to its head: a batch whose heads and
# these fit under ``max_bytes`` is chained and written whole, with no rotation to look for.
_PREV_BYTES = len('"prev":""}\n') + 64


@runtime_checkable
class AuditSink(Protocol):
    """Where audit records go.

    ``write_ahead`` returns only once the record is as durable as the sink
    promises; otherwise it raises ``AuditError`` and the caller must refuse
    the egress it was recording: it is what comes before a dial. ``write``
    may queue the record for a write at the end of the loop turn (a final
    record: what it records has happened or been refused already).
    """

    def write(self, record: Mapping[str, object]) -> None:
        """Append one record (perhaps queued); raise ``AuditError`` if the sink cannot take it."""
        ...

    def write_ahead(self, record: Mapping[str, object]) -> None:
        """Append one record now, with anything queued before it; raise ``AuditError`` if it was not stored."""
        ...

    def flush(self) -> None:
        """Store every queued record now; raise ``AuditError`` if that failed."""
        ...

    @property
    def healthy(self) -> bool:
        """False once a write has failed (or the sink is closed)."""
        ...

    def close(self) -> None:
        """Release the sink; further writes raise ``AuditError``."""
        ...


class JsonlAuditSink:
    """Append records to a JSON Lines file in batches, chained.

    Each record is one compact, ASCII-only JSON line. Final records
    (``write``) queued in one event-loop turn go out by a single ``os.write``
    on an ``O_APPEND`` descriptor when it ends; a record written ahead of a
    dial (``write_ahead``) goes out at once, with whatever was queued before
    it. A line is never split by another of our lines, and a crash leaves at
    most one torn last line (readers skip it; the next sink opened on the
    file ends it first).

    Not thread-safe by design: egressd's event loop is the only writer in the
    process. Across processes an exclusive ``flock`` on the file keeps a
    second egressd out (``AuditError``), since two writers would interleave
    their runs of records. The processes of one egressd (``--workers``) write
    one chain together through a ``SharedChain`` (``shared``): each batch is
    written under its lock, from the position it holds; every one of them
    holds a shared ``flock`` on the file instead (the founder takes it
    exclusive first), so another egressd is kept out all the same. Character devices such as ``/dev/full`` are
    accepted but not locked; a FIFO, socket or directory is refused.

    The file is opened relative to its directory's descriptor and never
    through a link (DESIGN.md, "Secrets"): a link at its name (including
    ``/dev/stderr``, which is one) or on the way to it, a regular file with a
    second name (a hard link), and one of another user or writable by others
    (``egressd.config.trusted``) are refused with ``AuditError``; an existing
    regular file is appended to; a missing one is made with ``O_EXCL``, mode
    0600.

    The first failed write (``ENOSPC``, ``EIO``, a short write whose rest cannot be written, ...) is
    logged once on the ``egressd.audit`` logger and makes the sink unhealthy
    for good: a log with a hole in it is not trusted to carry on. With
    ``fsync=True`` every write is followed by ``fsync`` (slower; survives a
    machine crash, not only a process crash).

    The chain: every record is written with ``prev`` set to the SHA-256 (hex)
    of the previous line's bytes as written, newline included; the writer
    sets it (a ``prev`` in the record given is replaced), at the moment of
    writing, so the chain follows write order. The first record of a log
    with nothing before it has ``prev: null``. On opening, the chain goes on
    from the file's last line (a torn one included, once ended); an empty
    file goes on from the last line of ``PATH.1`` if there is one, so a log
    moved away while egressd was stopped does not restart the chain.

    Rotation: with ``max_bytes > 0``, a record that would take the file past
    ``max_bytes`` first moves ``PATH`` to ``PATH.1`` (``PATH.1`` to
    ``PATH.2``, ..., dropping what would become ``PATH.{keep+1}``) and opens
    a fresh ``PATH``, so rotation happens between two records and no record
    is split; the fresh file's first ``prev`` is the hash of the moved
    file's last line. A record longer than ``max_bytes`` still goes whole
    into a file of its own. ``reopen()`` (``SIGUSR1``) opens ``PATH`` anew
    after logrotate moved it; records written in between went to the moved
    file, so none is lost.

    Standard output (``path == "-"``): the same lines and chain (starting at
    ``prev: null``: a stream has no last line to read back), one write per
    batch, to a private duplicate of descriptor 1, after which descriptor 1
    is pointed at standard error, so nothing else this process (or a child)
    prints can land between or inside the records. No lock, no rotation, and
    ``reopen`` does nothing; ``fsync`` only where the descriptor is a regular
    file. A reader that went away (``EPIPE``) fails the sink as a full disk
    does: unhealthy, and egress is refused (``audit_unavailable``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        max_bytes: int = 0,
        keep: int = 5,
        shared: SharedChain | None = None,
    ) -> None:
        if max_bytes < 0 or keep < 1:
            raise ValueError("max_bytes must be >= 0 and keep >= 1")
        self._path = os.fspath(path)
        self._shared = shared
        # The shared chain's generation this process's descriptor belongs to (rotation and reopen raise it).
        self._generation = 0
        self._fsync = fsync
        self._max_bytes = max_bytes
        self._keep = keep
        self._failure: str | None = None
        self._closed = False
        self._prev: str | None = None
        # Lines queued in this loop turn, each without ``prev`` and its closing brace (``line.head``),
        # and the flush scheduled for the turn's end.
        self._heads: list[str] = []
        self._flush_handle: asyncio.Handle | None = None
        self._stdout = self._path == STDOUT
        if self._stdout:
            # Every process of an egressd takes its own: a worker's standard output is the founder's stream.
            self._fd, self._size, last = logfile.take_stdout(), 0, None
            self._fsync = fsync and stat.S_ISREG(os.fstat(self._fd).st_mode)  # a pipe or tty has no fsync
        elif shared is None or shared.founder:
            self._fd, self._size, last = logfile.open_chained(self._path)
            if shared is not None and stat.S_ISREG(os.fstat(self._fd).st_mode):
                fcntl.flock(self._fd, fcntl.LOCK_SH)  # exclusive proved no other egressd; now its own may join
        else:
            with shared:  # the others may be writing: a last line is torn only if its writer died
                self._fd, self._size, last = logfile.open_chained(self._path, joining=True)
                self._generation = shared.read().generation
        # Only a regular file is rotated: renaming /dev/null or a FIFO would be someone else's business.
        # Standard output is never rotated, whatever it is: its name is not ours.
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode) and not self._stdout
        if last is None and self._size == 0 and self._regular:
            last = logfile.last_line_hash_of(self._path + ".1")
        self._prev = last
        if shared is not None and shared.founder:
            with shared:
                shared.store(Position(0, self._size, last))

    @property
    def prev(self) -> str | None:
        """The ``prev`` the next line written will carry (lines still queued come first)."""
        return self._prev

    @property
    def descriptor(self) -> int:
        """The descriptor written to (for standard output: the stream a worker is given as its own)."""
        return self._fd

    @property
    def path(self) -> str:
        """The file this sink appends to."""
        return self._path

    @property
    def healthy(self) -> bool:
        """False once a write has failed or the sink is closed."""
        if self._shared is not None and self._failure is None and self._shared.failed:
            self._fail("another process of this egressd could not write it")
        return self._failure is None and not self._closed

    def write(self, record: Mapping[str, object]) -> None:
        """Append ``record`` as one JSON line.

        Inside a running event loop the line is queued and written, with
        every other line queued in the same loop iteration, by one
        ``os.write`` when the iteration ends (``flush``); outside one it is
        written at once. Raises ``AuditError`` when the sink is closed or
        unhealthy, when an immediate write fails (which makes it unhealthy),
        or when the record does not serialise to JSON (a caller's bug; the
        sink stays healthy). A queued line whose write fails later is
        reported by the flush (logged; the sink turns unhealthy).
        """
        self._queue(record)
        if self._flush_handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush_handle = loop.call_soon(self._flush_soon)

    def write_ahead(self, record: Mapping[str, object]) -> None:
        """Append ``record`` now: what comes before a dial.

        Written at once, in one write with whatever this loop turn queued
        before it (a dial never waits for the turn to end: measured, the two
        extra loop turns cost more than the write they would share). Raises
        ``AuditError`` as ``write`` does, and when the write fails.
        """
        self._queue(record)
        self.flush()

    def flush(self) -> None:
        """Write every queued line now, one ``os.write`` per file (rotation splits a batch between lines).

        Raises ``AuditError`` if that fails; the sink is then unhealthy and
        the queued lines are lost (final records: what they record has
        happened; a ``write_ahead`` caller is told, so its dial never happens).
        """
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        heads, self._heads = self._heads, []
        if heads:
            self._write_lines(heads)

    def _flush_soon(self) -> None:
        self._flush_handle = None
        with contextlib.suppress(AuditError):  # _fail has logged it; write_ahead's callers get it
            self.flush()

    def _queue(self, record: Mapping[str, object]) -> None:
        if self._closed:
            raise AuditError(f"audit log {self._path} is closed")
        if self._failure is not None or (self._shared is not None and not self.healthy):
            raise AuditError(f"audit log {self._path} failed earlier: {self._failure}")
        try:
            # ensure_ascii: the line cannot hold a raw newline or a byte that
            # fails to encode (lone surrogates from hostile input), and a
            # terminal reading the file sees no raw control characters.
            # allow_nan=False: NaN is not JSON, and strict readers reject it.
            # ``prev`` is added when the line is written (it depends on the line before).
            if "prev" in record:  # the writer's field: one a caller set is dropped
                record = {key: value for key, value in record.items() if key != "prev"}
            head = line.head(record)
        except (TypeError, ValueError) as exc:
            raise AuditError(f"audit record does not serialise to JSON: {exc}") from exc
        self._heads.append(head)

    def _write_lines(self, heads: list[str]) -> None:
        """Chain ``heads`` and write them; with a shared chain, under its lock and from where it stands."""
        shared = self._shared
        if shared is None:
            self._write_chained(heads)
            return
        with shared:
            self._catch_up(shared.read())
            try:
                self._write_chained(heads)
            finally:
                # Stored on failure too: what this process knows; a next writer checks it against the file.
                shared.store(Position(self._generation, self._size, self._prev))

    def _catch_up(self, position: Position) -> None:
        """Take the shared chain's position: the file another process rotated to, and the last line written."""
        if position.generation != self._generation:
            self._follow(position.generation)
        if not position.torn or not self._regular:  # a stream or device has nothing to read back
            self._size, self._prev = position.size, position.prev
            return
        # A writer died mid-batch, or before it stored what it wrote: the file is the truth.
        try:
            size = os.fstat(self._fd).st_size
        except OSError as exc:
            self._fail(f"cannot read the audit log's size: {exc.strerror}")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        self._size = logfile.end_torn_line(self._fd, self._path, size)
        self._prev = logfile.last_line_hash(self._fd, self._size, self._path) if self._size else position.prev

    def _follow(self, generation: int) -> None:
        """Open ``PATH`` anew: another process of this egressd rotated or reopened the log."""
        self._generation = generation
        if self._stdout:
            return
        try:
            fd, _, _ = logfile.open_chained(self._path, same_as=self._fd, joining=True)
        except AuditError as exc:
            self._fail(f"cannot follow the log another process reopened: {exc}")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        if fd != self._fd:
            os.close(self._fd)
            self._fd = fd

    def _write_chained(self, heads: list[str]) -> None:
        """Chain ``heads`` and write them, one ``os.write`` per run of lines that fits the current file."""
        rotating = self._max_bytes and self._regular
        if not rotating or self._size + sum(map(len, heads)) + _PREV_BYTES * len(heads) <= self._max_bytes:
            data, last = line.chain(heads, self._prev)  # no rotation can fall inside this batch
            self._write_batch([data], len(data), last)
            return
        batch: list[bytes] = []
        batch_size = 0
        prev = self._prev
        for head in heads:
            data, following = line.chain((head,), prev)
            if (self._size or batch) and self._size + batch_size + len(data) > self._max_bytes:
                if batch:
                    self._write_batch(batch, batch_size, prev)
                    batch, batch_size = [], 0
                if self._size:
                    self._rotate()
            batch.append(data)
            batch_size += len(data)
            prev = following
        self._write_batch(batch, batch_size, prev)

    def _write_batch(self, batch: list[bytes], size: int, last_hash: str | None) -> None:
        if not batch:
            return
        data = batch[0] if len(batch) == 1 else b"".join(batch)
        written = 0
        try:
            # A short write is followed by one for the rest (the single writer's O_APPEND puts it
            # right after): it completes the batch, or fails with the reason (ENOSPC, EDQUOT, EIO).
            while written < size:
                n = os.write(self._fd, data[written:] if written else data)
                if n <= 0:
                    raise OSError(errno.EIO, "the file took no bytes")
                written += n
            if self._fsync:
                os.fsync(self._fd)
        except OSError as exc:
            why = exc.strerror or str(exc)
            self._fail(why if not written else f"{why} (after {written} of {size} bytes)")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        self._size += written
        self._prev = last_hash

    def reopen(self) -> None:
        """Open ``PATH`` anew (after logrotate moved it) and go on with the chain there.

        If ``PATH`` is still the file being written, nothing changes. If it
        cannot be opened, the error is logged and records keep going to the
        file already open: a reopen that failed loses nothing.
        """
        if self._closed or self._failure is not None or self._stdout:
            return
        with contextlib.suppress(AuditError):  # logged by _fail; the lines queued belong to the old file
            self.flush()
        if self._failure is not None:
            return
        shared = self._shared
        if shared is None:
            self._reopen_file()
            return
        with shared:  # the others follow at their next batch: the generation tells them
            try:
                self._catch_up(shared.read())
            except AuditError:
                return  # logged by _fail
            if self._reopen_file():
                self._generation += 1
            shared.store(Position(self._generation, self._size, self._prev))

    def _reopen_file(self) -> bool:
        """``reopen``'s work: True if ``PATH`` was another file, now the one written."""
        try:
            fd, size, last = logfile.open_chained(self._path, same_as=self._fd, joining=self._shared is not None)
        except AuditError as exc:
            logger.error("audit log %s not reopened (%s); records still go to the file open before", self._path, exc)
            return False
        if fd == self._fd:
            return False
        os.close(self._fd)
        self._fd, self._size = fd, size
        if last is not None:  # someone else's records there: chain onto what is actually before ours
            self._prev = last
        logger.info("audit log %s reopened", self._path)
        return True

    def close(self) -> None:
        """Write what is queued, close the file and release the lock; safe to call twice."""
        if self._closed:
            return
        if self._failure is None:
            with contextlib.suppress(AuditError):  # logged by _fail
                self.flush()
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _rotate(self) -> None:
        # Between two records, in the single writer: PATH.{keep-1} -> PATH.{keep}, ..., PATH -> PATH.1.
        # The moves are renames inside the log's directory (a rename never follows the name it moves).
        parent, name = os.path.split(self._path)
        if self._shared is not None:
            # Told before the moves: a rotation cut short by this process's death still sends the others to PATH.
            self._generation += 1
            self._shared.store(Position(self._generation, self._size, self._prev))
        try:
            dir_fd = open_directory(parent or ".", for_file=self._path)
            try:
                for n in range(self._keep - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(f"{name}.{n}", f"{name}.{n + 1}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.rename(name, f"{name}.1", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            fd, size, last = logfile.open_chained(self._path, joining=self._shared is not None)
        except (OSError, AuditError, UntrustedFile) as exc:
            self._fail(f"rotation failed: {exc}")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        os.close(self._fd)
        self._fd, self._size = fd, size
        if last is not None:
            self._prev = last

    def _fail(self, reason: str) -> None:
        self._failure = reason
        if self._shared is not None:
            self._shared.fail()
        logger.error(
            "audit log %s failed: %s; no further records will be written and egress is refused",
            self._path,
            reason,
        )


class MemoryAuditSink:
    """Keep records in ``records`` (a list), for tests.

    Each record is copied through JSON, so a record the file sink could not
    serialise fails here too. ``fail_after=N`` stores N records, then fails
    the next write like a full disk: unhealthy, ``AuditError`` from then on.
    """

    def __init__(self, *, fail_after: int | None = None) -> None:
        self.records: list[dict[str, object]] = []
        self._fail_after = fail_after
        self._failed = False
        self._closed = False

    @property
    def healthy(self) -> bool:
        """False once a (simulated) write has failed or the sink is closed."""
        return not self._failed and not self._closed

    def write(self, record: Mapping[str, object]) -> None:
        """Store a JSON copy of ``record``; raise ``AuditError`` like the file sink."""
        if self._closed:
            raise AuditError("memory audit sink is closed")
        if self._failed:
            raise AuditError("memory audit sink failed earlier")
        if self._fail_after is not None and len(self.records) >= self._fail_after:
            self._failed = True
            raise AuditError(f"memory audit sink fails after {self._fail_after} records")
        try:
            copy = json.loads(json.dumps(record, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise AuditError(f"audit record does not serialise to JSON: {exc}") from exc
        self.records.append(copy)

    def write_ahead(self, record: Mapping[str, object]) -> None:
        """``write``: a memory sink stores at once."""
        self.write(record)

    def flush(self) -> None:
        """Nothing is queued in memory."""

    def close(self) -> None:
        """Refuse further writes; the stored records stay readable."""
        self._closed = True
