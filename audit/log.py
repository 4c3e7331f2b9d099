"""Audit sinks: where records go, and what happens when they cannot.

The proxy writes one record per egress attempt through an ``AuditSink``. A
sink that cannot write raises ``AuditError`` and reports ``healthy == False``
from then on; the proxy refuses new egress while its sink is unhealthy, so
no connection ever goes unrecorded (fail closed).

``JsonlAuditSink`` appends to a JSON Lines file; ``MemoryAuditSink`` keeps
records in a list for tests.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

__all__ = ["AuditError", "AuditSink", "JsonlAuditSink", "MemoryAuditSink"]

logger = logging.getLogger("egressd.audit")

# Owner read/write only: the log names every host the sandbox tried and
# every command it ran.
_FILE_MODE = 0o600
# O_RDWR rather than O_WRONLY only so __init__ can read the last byte (see
# _end_torn_line); writes all go through O_APPEND. O_NOFOLLOW: the log's own
# name is never followed (a planted link would have our records, or a model's
# text in them, appended to whatever it points at). O_CLOEXEC keeps the
# descriptor out of sandboxes we spawn.
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


# One encoder for every line: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


class AuditError(Exception):
    """A record could not be written, or the sink could not be opened."""


@runtime_checkable
class AuditSink(Protocol):
    """Where audit records go.

    ``write`` returns only once the record is as durable as the sink
    promises; otherwise it raises ``AuditError`` and the caller must refuse
    the egress it was recording.
    """

    def write(self, record: Mapping[str, object]) -> None:
        """Append one record; raise ``AuditError`` if it was not stored."""
        ...

    @property
    def healthy(self) -> bool:
        """False once a write has failed (or the sink is closed)."""
        ...

    def close(self) -> None:
        """Release the sink; further writes raise ``AuditError``."""
        ...


class JsonlAuditSink:
    """Append records to a JSON Lines file, one ``os.write`` per record.

    Each record is one compact, ASCII-only JSON line written by a single
    ``os.write`` on an ``O_APPEND`` descriptor, so a line is never split by
    another of our lines, and a crash leaves at most one torn last line
    (readers skip it; the next sink opened on the file ends it first).

    Not thread-safe by design: egressd's event loop is the only writer in the
    process. Across processes an exclusive ``flock`` on the file keeps a
    second egressd out (``AuditError``), since two writers would interleave
    their runs of records. Device files such as ``/dev/full`` are accepted
    but not locked.

    The file is opened relative to its directory's descriptor and never
    through a link (DESIGN.md, "Secrets"): a link at its name (including
    ``/dev/stderr``, which is one) and a regular file with a second name (a
    hard link) are refused with ``AuditError``; an existing regular file is
    appended to; a missing one is made with ``O_EXCL``, mode 0600. The
    directories above the last component are the operator's own and are
    resolved as usual.

    The first failed write (``ENOSPC``, ``EIO``, a short write, ...) is
    logged once on the ``egressd.audit`` logger and makes the sink unhealthy
    for good: a log with a hole in it is not trusted to carry on. With
    ``fsync=True`` every write is followed by ``fsync`` (slower; survives a
    machine crash, not only a process crash).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self._path = os.fspath(path)
        self._fsync = fsync
        self._failure: str | None = None
        self._closed = False
        self._fd = _open_log(self._path)
        try:
            info = os.fstat(self._fd)
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                # Another name for the same file may be anyone's file (a hard link made to it).
                raise AuditError(f"audit log {self._path} has more than one name (a hard link); not appended to")
            if stat.S_ISREG(info.st_mode):
                self._lock()
                self._end_torn_line(info.st_size)
        except BaseException:
            os.close(self._fd)
            raise

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

        Raises ``AuditError`` when the sink is closed or unhealthy, when the
        write fails (which makes it unhealthy), or when the record does not
        serialise to JSON (a caller's bug; the sink stays healthy).
        """
        if self._closed:
            raise AuditError(f"audit log {self._path} is closed")
        if self._failure is not None:
            raise AuditError(f"audit log {self._path} failed earlier: {self._failure}")
        try:
            # ensure_ascii: the line cannot hold a raw newline or a byte that
            # fails to encode (lone surrogates from hostile input), and a
            # terminal reading the file sees no raw control characters.
            # allow_nan=False: NaN is not JSON, and strict readers reject it.
            line = _ENCODER.encode(record)
        except (TypeError, ValueError) as exc:
            raise AuditError(f"audit record does not serialise to JSON: {exc}") from exc
        data = line.encode("ascii") + b"\n"
        try:
            written = os.write(self._fd, data)
            if self._fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._fail(exc.strerror or str(exc))
            raise AuditError(f"audit log {self._path} write failed: {self._failure}") from exc
        if written != len(data):
            self._fail(f"short write ({written} of {len(data)} bytes)")
            raise AuditError(f"audit log {self._path} write failed: {self._failure}")

    def close(self) -> None:
        """Close the file and release the lock; safe to call twice."""
        if self._closed:
            return
        self._closed = True
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

    def _lock(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise AuditError(
                f"another egressd is writing the audit log {self._path}; "
                "give each instance its own --audit-log"
            ) from exc
        except OSError as exc:
            raise AuditError(f"cannot lock audit log {self._path}: {exc.strerror}") from exc

    def _end_torn_line(self, size: int) -> None:
        # A crash mid-write can leave a last line without its newline; our
        # first record would then be glued onto it and lost to readers.
        if size == 0:
            return
        try:
            last = os.pread(self._fd, 1, size - 1)
            if last != b"\n":
                logger.warning("audit log %s ended in a torn line; ending it", self._path)
                if os.write(self._fd, b"\n") != 1:
                    raise AuditError(f"cannot end the torn last line of {self._path}")
        except OSError as exc:
            raise AuditError(f"cannot prepare audit log {self._path}: {exc.strerror}") from exc

    def _fail(self, reason: str) -> None:
        self._failure = reason
        logger.error(
            "audit log %s failed: %s; no further records will be written and egress is refused",
            self._path,
            reason,
        )


def _open_log(path: str) -> int:
    """The log's descriptor: ``path`` opened if it exists, else made, its last component never followed."""
    parent, name = os.path.split(path)
    if not name:
        raise AuditError(f"cannot open audit log {path}: it names a directory")
    try:
        dir_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        directory = os.path.dirname(os.path.abspath(path))
        raise AuditError(f"cannot open audit log {path}: directory {directory} does not exist") from None
    except OSError as exc:
        raise AuditError(f"cannot open audit log {path}: {exc.strerror}") from None
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
    finally:
        os.close(dir_fd)


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

    def close(self) -> None:
        """Refuse further writes; the stored records stay readable."""
        self._closed = True
