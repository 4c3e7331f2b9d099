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
import hashlib
import json
import logging
import os
import stat
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from egressd.audit import line
from egressd.config.trusted import UntrustedFile, check_descriptor, open_directory

__all__ = ["STDOUT", "AuditError", "AuditSink", "JsonlAuditSink", "MemoryAuditSink"]

logger = logging.getLogger("egressd.audit")

# Owner read/write only: the log names every host the sandbox tried and
# every command it ran.
_FILE_MODE = 0o600
# O_RDWR rather than O_WRONLY only so opening can read the last line (to end a
# torn one, and to chain onto it); writes all go through O_APPEND. O_NOFOLLOW: the log's own
# name is never followed (a planted link would have our records, or a model's
# text in them, appended to whatever it points at). O_CLOEXEC keeps the
# descriptor out of sandboxes we spawn.
# A FIFO at the name opens at once even so (O_RDWR never waits for the other end on Linux) and is then refused.
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


# The path that means standard output (``--audit-log -``).
STDOUT = "-"

# The most a line's ``"prev":"<64 hex>"}`` and newline add to its head: a batch whose heads and
# these fit under ``max_bytes`` is chained and written whole, with no rotation to look for.
_PREV_BYTES = len('"prev":""}\n') + 64

# How much is read at a time when finding and hashing the last line to chain onto.
_CHUNK_BYTES = 64 * 1024


class AuditError(Exception):
    """A record could not be written, or the sink could not be opened."""


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
    their runs of records. Character devices such as ``/dev/full`` are
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
    ) -> None:
        if max_bytes < 0 or keep < 1:
            raise ValueError("max_bytes must be >= 0 and keep >= 1")
        self._path = os.fspath(path)
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
            self._fd, self._size, last = _take_stdout(), 0, None
            self._fsync = fsync and stat.S_ISREG(os.fstat(self._fd).st_mode)  # a pipe or tty has no fsync
        else:
            self._fd, self._size, last = _open_chained(self._path)
        # Only a regular file is rotated: renaming /dev/null or a FIFO would be someone else's business.
        # Standard output is never rotated, whatever it is: its name is not ours.
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode) and not self._stdout
        if last is None and self._size == 0 and self._regular:
            last = _last_line_hash_of(self._path + ".1")
        self._prev = last

    @property
    def prev(self) -> str | None:
        """The ``prev`` the next line written will carry (lines still queued come first)."""
        return self._prev

    @property
    def path(self) -> str:
        """The file this sink appends to."""
        return self._path

    @property
    def healthy(self) -> bool:
        """False once a write has failed or the sink is closed."""
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
        if self._failure is not None:
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
        try:
            fd, size, last = _open_chained(self._path, same_as=self._fd)
        except AuditError as exc:
            logger.error("audit log %s not reopened (%s); records still go to the file open before", self._path, exc)
            return
        if fd == self._fd:
            return
        os.close(self._fd)
        self._fd, self._size = fd, size
        if last is not None:  # someone else's records there: chain onto what is actually before ours
            self._prev = last
        logger.info("audit log %s reopened", self._path)

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
        try:
            dir_fd = open_directory(parent or ".", for_file=self._path)
            try:
                for n in range(self._keep - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(f"{name}.{n}", f"{name}.{n + 1}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.rename(name, f"{name}.1", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            fd, size, last = _open_chained(self._path)
        except (OSError, AuditError, UntrustedFile) as exc:
            self._fail(f"rotation failed: {exc}")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        os.close(self._fd)
        self._fd, self._size = fd, size
        if last is not None:
            self._prev = last

    def _fail(self, reason: str) -> None:
        self._failure = reason
        logger.error(
            "audit log %s failed: %s; no further records will be written and egress is refused",
            self._path,
            reason,
        )


def _take_stdout() -> int:
    """A private, blocking, close-on-exec duplicate of descriptor 1; descriptor 1 then points at stderr.

    The audit records are then the only bytes written to what was standard
    output: a ``print``, a library's warning or a child's output goes to
    standard error instead.
    """
    try:
        fd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError as exc:
        raise AuditError(f"cannot write the audit log to standard output: {exc.strerror}") from None
    try:
        # A line is written whole or the sink fails: never EAGAIN halfway through a batch.
        os.set_blocking(fd, True)
        os.dup2(2, 1)
    except OSError as exc:
        os.close(fd)
        raise AuditError(f"cannot write the audit log to standard output: {exc.strerror}") from None
    return fd


def _open_chained(path: str, *, same_as: int | None = None) -> tuple[int, int, str | None]:
    """Open the log for appending: (descriptor, size, SHA-256 of its last line, or None if empty).

    Refuses a file with a second name and one another egressd holds; ends a
    torn last line. With ``same_as``, a ``path`` that is still the file open
    on that descriptor returns ``same_as`` itself (locking it twice would fail).
    """
    fd = _open_log(path)
    try:
        info = os.fstat(fd)
        if same_as is not None:
            old = os.fstat(same_as)
            if (info.st_dev, info.st_ino) == (old.st_dev, old.st_ino):
                os.close(fd)
                return same_as, info.st_size, None
        if not stat.S_ISREG(info.st_mode):
            return fd, 0, None  # /dev/full and the like: nothing to chain onto
        if info.st_nlink > 1:
            # Another name for the same file may be anyone's file (a hard link made to it).
            raise AuditError(f"audit log {path} has more than one name (a hard link); not appended to")
        _lock(fd, path)
        size = _end_torn_line(fd, path, info.st_size)
        return fd, size, _last_line_hash(fd, size, path)
    except BaseException:
        os.close(fd)
        raise


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise AuditError(
            f"another egressd is writing the audit log {path}; give each instance its own --audit-log"
        ) from exc
    except OSError as exc:
        raise AuditError(f"cannot lock audit log {path}: {exc.strerror}") from exc


def _end_torn_line(fd: int, path: str, size: int) -> int:
    # A crash mid-write can leave a last line without its newline; our
    # first record would then be glued onto it and lost to readers.
    if size == 0:
        return 0
    try:
        last = os.pread(fd, 1, size - 1)
        if last != b"\n":
            logger.warning("audit log %s ended in a torn line; ending it", path)
            if os.write(fd, b"\n") != 1:
                raise AuditError(f"cannot end the torn last line of {path}")
            return size + 1
    except OSError as exc:
        raise AuditError(f"cannot prepare audit log {path}: {exc.strerror}") from exc
    return size


def _last_line_hash(fd: int, size: int, path: str) -> str | None:
    """SHA-256 (hex) of the last line (newline included) of a file that ends in one; None if empty.

    Reads back from the end a chunk at a time to the newline before it, then
    hashes forward, so no line is too long to chain onto.
    """
    if size == 0:
        return None
    try:
        start = 0
        end = size - 1  # the last line's own newline is not its start
        while end > 0:
            begin = max(0, end - _CHUNK_BYTES)
            cut = os.pread(fd, end - begin, begin).rfind(b"\n")
            if cut >= 0:
                start = begin + cut + 1
                break
            end = begin
        digest = hashlib.sha256()
        offset = start
        while offset < size:
            chunk = os.pread(fd, min(_CHUNK_BYTES, size - offset), offset)
            if not chunk:
                raise AuditError(f"audit log {path} shrank while its last record was read")
            digest.update(chunk)
            offset += len(chunk)
    except OSError as exc:
        raise AuditError(f"cannot read the last record of {path}: {exc.strerror}") from exc
    return digest.hexdigest()


def _last_line_hash_of(path: str) -> str | None:
    """The last line's hash of a rotated log (``PATH.1``), if it is a regular file that ends in a newline."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return None
        if os.pread(fd, 1, info.st_size - 1) != b"\n":
            return None  # a torn tail: its chain cannot be continued honestly; start afresh
        return _last_line_hash(fd, info.st_size, path)
    except (OSError, AuditError):
        return None
    finally:
        os.close(fd)


def _open_log(path: str) -> int:
    """The log's descriptor: ``path`` opened if it exists, else made; no link followed, on the way or at the name.

    A regular file must be ours or root's and not writable by anyone else
    (``egressd.config.trusted.check_descriptor``): the log is evidence, and
    ``egressd audit suggest`` turns it into allowlists. A character device
    (``/dev/full``, ``/dev/null``) is taken as it is; anything else (a FIFO,
    a socket, a directory) is refused.
    """
    parent, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise AuditError(f"cannot open audit log {path}: it names a directory")
    try:
        dir_fd = open_directory(parent or ".", for_file=path)
    except FileNotFoundError:
        directory = os.path.dirname(os.path.abspath(path))
        raise AuditError(f"cannot open audit log {path}: directory {directory} does not exist") from None
    except UntrustedFile as exc:
        raise AuditError(f"audit log {exc}") from None
    try:
        fd = _open_in(dir_fd, name, path)
    finally:
        os.close(dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISCHR(mode):
            check_descriptor(fd, path)
    except UntrustedFile as exc:
        os.close(fd)
        raise AuditError(f"audit log {exc}") from None
    return fd


def _open_in(dir_fd: int, name: str, path: str) -> int:
    try:
        # Two turns: a file that appears between "not there" and O_EXCL is opened as an existing one.
        for _ in range(2):
            try:
                return os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            try:
                return os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, _FILE_MODE, dir_fd=dir_fd)
            except FileExistsError:
                continue
        raise AuditError(f"cannot open audit log {path}: it keeps appearing and disappearing")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AuditError(f"audit log {path} is a link, and the audit log is never opened through one") from None
        raise AuditError(f"cannot open audit log {path}: {exc.strerror}") from None


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
